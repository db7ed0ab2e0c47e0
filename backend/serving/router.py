"""Which served name answers a model name, and moving it to new adapter versions.

A trainable model ``calc-agent`` is served as versioned LoRA adapters ``calc-agent@0``,
``calc-agent@1``, ... The plain name is an alias for the promoted version; a versioned name asks
for that version exactly. :meth:`Router.deploy` loads a new version and, unless told not to
(``promote=False``: a candidate a gate decides on), moves the alias to it once the load
succeeded; :meth:`Router.promote` moves the alias to any step (a rollback too), loading it again
if it was unloaded. Versions beyond the ones kept are unloaded, never the promoted one, each only
once no request through the gateway still uses it: a request runs to its end on the version it
started with.

With ``VLLMConfig(merge_adapters=True)`` the server runs without LoRA: a deploy merges the adapter
into the base weights (``backend/serving/merge.py``), holds new requests at the gateway, waits for the
running ones to finish, reloads the weights in place and lets requests through again. Then one
model is trained per server and only its current version is served.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import tempfile
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

from journeyman.errors import AdapterError, ConfigError, ModelUnavailableError
from journeyman.store import validate_name

from .engine import InferenceServer
from .merge import merge_adapter

__all__ = ["Deployment", "ModelUnavailableError", "Router"]

logger = logging.getLogger(__name__)


@dataclass
class Deployment:
    """The served versions of one model name."""

    name: str
    step: int
    """The current version's training step."""
    served_name: str
    """What the plain name resolves to now: ``name@step``, or the base model at step 0."""
    adapter_dir: Path | None
    loaded: list[tuple[int, str, Path]] = field(default_factory=list)
    """Adapters loaded in vLLM, oldest first: (step, served name, folder)."""


class Router:
    """Resolves model names for the gateway and deploys adapters to the vLLM server."""

    def __init__(
        self, server: InferenceServer, *, keep_versions: int = 2, drain_timeout: float = 600.0
    ) -> None:
        if keep_versions < 1:
            raise ConfigError(f"keep_versions must be at least 1 (the current version), got {keep_versions}")
        self.server = server
        self.keep_versions = keep_versions
        self.drain_timeout = drain_timeout
        self.deployments: dict[str, Deployment] = {}
        self._in_flight: Counter[str] = Counter()
        self._in_flight_lock = threading.Lock()  # the gateway counts on its own thread
        self._deploy_lock = asyncio.Lock()
        self._up = asyncio.Event()  # cleared while restart_server brings a dead server back
        self._up.set()
        self._reloading = False
        """True while merged weights are reloaded: the gateway holds new requests."""
        self._merged_from: Path | None = None
        """The adapter merged into the served weights (merge_adapters=True)."""
        self.canaries: dict[str, tuple[str, int, float]] = {}
        """name -> (candidate's served name, its step, the share of rollouts it answers)."""

    @property
    def merged(self) -> bool:
        """Adapters are merged into the served weights (``VLLMConfig.merge_adapters``)."""
        return self.server.config.merge_adapters

    @property
    def reloading(self) -> bool:
        """Merged weights are being reloaded (from the drain of running requests to the reload's
        end): new requests wait at the gateway meanwhile."""
        return self._reloading

    @property
    def base_name(self) -> str:
        return self.server.config.served_name

    def resolve(self, requested: str, rollout_id: str | None = None) -> tuple[str, int | None]:
        """(served name, policy version) for a requested model name; unknown names pass through.

        With a canary on the name, a rollout whose id falls in the canary's share gets the
        candidate, on every call (the share is a hash of the id, so a rollout never switches)."""
        if deployment := self.deployments.get(requested):
            canary = self.canaries.get(requested)
            if canary is not None and rollout_id is not None and _bucket(requested, rollout_id) < canary[2]:
                return canary[0], canary[1]
            return deployment.served_name, deployment.step
        name, at, step = requested.rpartition("@")
        if at and step.isdigit() and (deployment := self.deployments.get(name)):
            if self.merged and int(step) == deployment.step:
                return deployment.served_name, deployment.step  # merged: only the current version
            return requested, int(step)
        return requested, None

    def unavailable(self, requested: str) -> str | None:
        """Why a request for ``requested`` would get other weights than its name says, else None.

        With merged serving the server's own name answers with the merged weights, which are
        no longer the base model: asking it would silently get the trained policy.
        """
        if self.merged and requested == self.base_name and self._merged_from is not None:
            owner = next(iter(self.deployments), "a model")
            return (
                f"the base model {requested!r} is not served: this server merges {owner}'s adapter into its "
                f"weights. Ask for {owner!r}, or serve with merge_adapters=False (--no-merge-adapters) to keep "
                "the base model next to the adapters, e.g. for a local judge"
            )
        return None

    def served_names(self) -> list[str]:
        names = [] if self.unavailable(self.base_name) else [self.base_name]
        for deployment in self.deployments.values():
            names += [deployment.name, *(served for _, served, _ in deployment.loaded)]
        return names

    # In-flight requests (the gateway counts them) ---------------------------------------------

    async def admit(self, requested: str, rollout_id: str | None = None) -> tuple[str, int | None]:
        """Resolve a request's model name and count it in, as one step; while merged weights are
        being reloaded, wait for them first (so the version is the one that will answer)."""
        while True:
            with self._in_flight_lock:
                if not self._reloading:
                    if problem := self.unavailable(requested):
                        raise ModelUnavailableError(problem)
                    served, version = self.resolve(requested, rollout_id)
                    self._in_flight[served] += 1
                    return served, version
            await asyncio.sleep(0.01)

    def end(self, served_name: str) -> None:
        with self._in_flight_lock:
            self._in_flight[served_name] -= 1
            if self._in_flight[served_name] <= 0:
                del self._in_flight[served_name]

    def in_flight(self, served_name: str) -> int:
        with self._in_flight_lock:
            return self._in_flight.get(served_name, 0)

    # Deploying ---------------------------------------------------------------------------------

    async def deploy(self, name: str, adapter_dir: Path | None, step: int, *, promote: bool = True) -> str:
        """Serve ``adapter_dir`` as ``name@step`` and point ``name`` at it; return the served name.

        ``adapter_dir=None`` (only at step 0) serves the base model under ``name``. If the load
        fails, :class:`AdapterError` is raised and ``name`` keeps answering with its old version;
        if it failed because vLLM died, ``name`` points at the new version, which the server's
        restart loads. ``promote=False`` serves ``name@step`` only and leaves ``name`` where it is
        (a model's first deploy names it all the same).
        """
        validate_name(name, "model name")
        async with self._deploying():
            processes = self.server.pids
            deployment = self.deployments.get(name)
            if adapter_dir is None and step != 0:
                raise AdapterError(
                    f"only step 0 can serve the base model; step {step} needs an adapter folder"
                )
            if self.merged and not promote and deployment is not None:
                raise ConfigError(
                    f"{name}@{step} cannot be served beside {name}'s promoted step: this vLLM server merges "
                    "adapters into its weights and so holds one version at a time. Gate promotions with "
                    "adapters served as LoRA (merge_adapters=False, --no-merge-adapters)"
                )
            if self.merged:
                if deployment is None and self.deployments:
                    raise ConfigError(
                        f"this vLLM server merges {next(iter(self.deployments))}'s adapters into its weights; "
                        f"{name} needs a server of its own (or merge_adapters=False to serve both as adapters)"
                    )
                served = self.base_name
                try:
                    await self._reload(adapter_dir, then=lambda: self._point(name, served, adapter_dir, step))
                except AdapterError:
                    if not self._died_since(processes):
                        raise
                    self._died_while("reloading its weights for", f"{name}@{step}")
                    self._point(name, served, adapter_dir, step)
                    self._merged_from = None  # the restarted server starts from the base weights
            else:
                if adapter_dir is None:
                    served = self.base_name
                else:
                    served = f"{name}@{step}"
                    if deployment and any(served == loaded for _, loaded, _ in deployment.loaded):
                        raise AdapterError(
                            f"{served} is already loaded; deploy each training step once (a same-name reload "
                            "can serve stale weights in vLLM)"
                        )
                    try:
                        await self.server.load_adapter(served, adapter_dir)
                    except AdapterError:
                        if not self._died_since(processes):
                            raise
                        self._died_while("loading", served)
                if promote or deployment is None:
                    deployment = self._point(name, served, adapter_dir, step)
                    self.canaries.pop(name, None)
                if adapter_dir is not None:
                    deployment.loaded.append((step, served, Path(adapter_dir)))
                await self._unload_old(deployment, also=served)
            current = self.deployments[name].served_name
            if self.merged and adapter_dir is not None:  # the server's own name, with the step merged in
                logger.info("%s now answers with step %d merged into %s's weights", name, step, served)
            elif current == served:
                logger.info("%s now answers as %s", name, served)
            else:
                logger.info("%s is served; %s still answers as %s", served, name, current)
            return served

    async def promote(self, name: str, step: int, adapter_dir: Path | None) -> str:
        """Point ``name`` at its step ``step`` (``adapter_dir``: that step's adapter, None for step 0's
        base model), loading it first if it is not loaded; return the served name. Requests already
        running finish on the version they started with. With merged serving the weights are reloaded."""
        async with self._deploying():
            deployment = self.deployments.get(name)
            if deployment is None:
                raise ConfigError(f"{name} is not served here; register it first")
            if adapter_dir is None and step != 0:
                raise AdapterError(f"only step 0 is the base model; step {step} needs an adapter folder")
            if self.merged:
                served = self.base_name
                await self._reload(adapter_dir, then=lambda: self._point(name, served, adapter_dir, step))
            else:
                served = self.base_name if adapter_dir is None else f"{name}@{step}"
                if adapter_dir is not None and not any(
                    loaded == served for _, loaded, _ in deployment.loaded
                ):
                    await self.server.load_adapter(served, adapter_dir)
                    deployment.loaded.append((step, served, Path(adapter_dir)))
                self._point(name, served, adapter_dir, step)
                await self._unload_old(deployment)
            self.canaries.pop(name, None)
            logger.info("%s promoted to step %d (%s)", name, step, served)
            return served

    async def set_canary(self, name: str, step: int, adapter_dir: Path, share: float) -> str:
        """Send ``share`` of ``name``'s rollouts (by rollout id) to its step ``step``, loading it if
        needed; ``share=0`` ends the canary. Returns the candidate's served name."""
        if not 0 <= share <= 1:
            raise ConfigError(f"a canary share is between 0 and 1, got {share}")
        async with self._deploying():
            deployment = self.deployments.get(name)
            if deployment is None:
                raise ConfigError(f"{name} is not served here; register it first")
            if self.merged:
                raise ConfigError(
                    "a canary serves two versions at once; this vLLM server merges adapters into its weights "
                    "and holds one. Serve adapters as LoRA (merge_adapters=False, --no-merge-adapters)"
                )
            served = f"{name}@{step}"
            if share == 0:
                self.canaries.pop(name, None)
                return served
            if not any(loaded == served for _, loaded, _ in deployment.loaded):
                await self.server.load_adapter(served, adapter_dir)
                deployment.loaded.append((step, served, Path(adapter_dir)))
            self.canaries[name] = (served, step, share)
            await self._unload_old(deployment)
            logger.info("%s: %.0f%% of rollouts go to %s", name, 100 * share, served)
            return served

    def _point(self, name: str, served: str, adapter_dir: Path | None, step: int) -> Deployment:
        """Make ``name`` answer as ``served`` at ``step``."""
        deployment = self.deployments.get(name)
        if deployment is None:
            deployment = self.deployments[name] = Deployment(name, step, served, adapter_dir)
        deployment.step, deployment.served_name, deployment.adapter_dir = step, served, adapter_dir
        return deployment

    def _pinned(self, deployment: Deployment) -> set[str]:
        """Versions never unloaded: the promoted one and a canary's candidate."""
        canary = self.canaries.get(deployment.name)
        return {deployment.served_name, *([canary[0]] if canary else [])}

    @contextlib.asynccontextmanager
    async def _deploying(self) -> AsyncIterator[None]:
        """Deploys one at a time, each after a restart under way has loaded the kept versions (a
        load sent to a server still starting would fail, and the step was not lost)."""
        await self._up.wait()
        async with self._deploy_lock:
            yield

    def _died_since(self, processes: tuple[int | None, ...]) -> bool:
        """A server process died (or was already replaced by the watchdog) since ``processes``."""
        return self.server.exit_code() is not None or self.server.pids != processes

    def _died_while(self, doing: str, served: str) -> None:
        """vLLM died under a deploy: the step is kept, and the restart (LocalBackend's watchdog, or
        :meth:`restart_server`) serves it with the other kept versions. Nothing is lost, so the
        deploy does not fail; requests meanwhile get the gateway's "not running" answer."""
        logger.warning(
            "vLLM died while %s %s (exit code %s); %s is served once vLLM is restarted",
            doing, served, self.server.exit_code(), served,
        )  # fmt: skip

    async def _unload_old(self, deployment: Deployment, also: str | None = None) -> None:
        """Unload the oldest versions beyond ``keep_versions``, but never the promoted one, a
        canary's candidate, or ``also`` (the version just deployed)."""
        if self.server.exit_code() is not None:
            return  # a dead server holds nothing; its restart loads only what is kept
        pinned = self._pinned(deployment) | ({also} if also else set())
        while len(deployment.loaded) > self.keep_versions:
            oldest = next((i for i, (_, s, _) in enumerate(deployment.loaded) if s not in pinned), None)
            if oldest is None:
                break
            _, served, _ = deployment.loaded[oldest]
            deadline = time.monotonic() + self.drain_timeout
            while self.in_flight(served) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)  # requests already running keep their adapter
            if self.in_flight(served):
                logger.warning(
                    "%s still has requests after %.0f s; unloading it anyway", served, self.drain_timeout
                )
            await self.server.unload_adapter(served)
            deployment.loaded.pop(oldest)
            logger.info("unloaded %s", served)

    async def _reload(self, adapter_dir: Path | None, then: Callable[[], object] = lambda: None) -> None:
        """Serve the base weights merged with ``adapter_dir`` (None: the base weights alone).

        New requests wait at the gateway and running ones finish first, so every request is
        answered by one set of weights; ``then`` runs before requests are let through again.
        """
        if adapter_dir is None and self._merged_from is None:
            then()  # the server still has the base weights
            return
        with tempfile.TemporaryDirectory(prefix="journeyman-merged-") as tmp:
            folder = Path(self.server.config.model) if adapter_dir is None else Path(tmp)
            if adapter_dir is not None:
                await asyncio.to_thread(
                    merge_adapter, Path(self.server.config.model), Path(adapter_dir), folder
                )
            with self._in_flight_lock:
                self._reloading = True
            try:
                deadline = time.monotonic() + self.drain_timeout
                while self._in_flight and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)  # running requests finish on the weights they started with
                if self._in_flight:
                    logger.warning(
                        "requests still running after %.0f s; reloading anyway", self.drain_timeout
                    )
                await self.server.reload_weights(folder)
                self._merged_from = adapter_dir
                then()
            finally:
                with self._in_flight_lock:
                    self._reloading = False

    async def redeploy(self) -> None:
        """Load every kept adapter again (after the vLLM server was restarted)."""
        async with self._deploy_lock:
            for deployment in self.deployments.values():
                if self.merged:
                    self._merged_from = None  # a restarted server loads the base weights
                    await self._reload(deployment.adapter_dir)
                # more than kept if a deploy met a dead server
                deployment.loaded = _kept(deployment, self.keep_versions, self._pinned(deployment))
                for _, served, folder in deployment.loaded:
                    await self.server.load_adapter(served, folder)

    async def restart_server(self) -> None:
        """Restart a vLLM server that died and load the kept adapters again."""
        code = self.server.exit_code()
        logger.warning("vLLM is down (exit code %s); restarting it", code)
        self._up.clear()
        try:
            self.server.stop()
            self.server.launch()  # from this thread: the server lives as long as the caller's thread
            await asyncio.to_thread(self.server.wait_healthy)
            await self.redeploy()
        finally:
            self._up.set()


def _kept(deployment: Deployment, keep: int, pinned: set[str]) -> list[tuple[int, str, Path]]:
    """The loaded versions less the oldest ones beyond ``keep``, never a pinned one."""
    others = [v for v in deployment.loaded if v[1] not in pinned]
    dropped = others[: max(len(deployment.loaded) - keep, 0)]
    return [v for v in deployment.loaded if v not in dropped]


def _bucket(name: str, rollout_id: str) -> float:
    """Where a rollout falls in [0, 1): the same for every call of the rollout."""
    digest = hashlib.sha256(f"{name}\0{rollout_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64
