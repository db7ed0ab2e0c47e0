"""Beyond one machine: several vLLM replicas behind one gateway, and adapters pushed to
inference machines by a trainer elsewhere.

Separate trainer and inference machines: the trainer pushes each new adapter to remote gateways.

A ``journeyman serve`` on an inference machine accepts an adapter over its authenticated API::

    PUT /api/deployments/{name}/{step}?base_model=...    body: a tar of the peft adapter folder

It stores the folder under ``<root>/deployments/<name>/<step>``, starts vLLM on ``base_model``
if it is not serving yet, and points ``name`` at ``name@step`` (the same :meth:`Router.deploy`
as a local step). On the trainer, :class:`AdapterPush` is the ``deploy`` callback that sends it.

Only the files of a peft adapter travel (``adapter_config.json``, ``adapter_model.safetensors``,
``README.md``): no pickle, no paths, no links.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import itertools
import logging
import shutil
import tarfile
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from journeyman.errors import AdapterError, ConfigError, InvalidDataError
from journeyman.store import atomic_dir, validate_name

from .vllm import VLLMConfig, VLLMServer

if TYPE_CHECKING:
    from .local import LocalBackend

__all__ = ["ADAPTER_FILES", "AdapterPush", "Replicas", "deployment_route", "pack_adapter", "unpack_adapter"]

logger = logging.getLogger(__name__)

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "README.md")
REQUIRED_FILES = ("adapter_config.json", "adapter_model.safetensors")


def pack_adapter(folder: Path) -> bytes:
    """The adapter folder as an uncompressed tar (safetensors do not compress)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name in ADAPTER_FILES:
            if (folder / name).is_file():
                tar.add(folder / name, arcname=name)
    missing = [name for name in REQUIRED_FILES if not (folder / name).is_file()]
    if missing:
        raise AdapterError(f"{folder} is not a peft adapter folder: {', '.join(missing)} missing")
    return buffer.getvalue()


def unpack_adapter(data: bytes, folder: Path) -> None:
    """Write the adapter files of a tar into ``folder``; refuse anything else."""
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
            members = tar.getmembers()
            for member in members:
                if member.name not in ADAPTER_FILES or not member.isfile():
                    raise InvalidDataError(
                        f"the adapter upload holds {member.name!r}; only the files "
                        f"{', '.join(ADAPTER_FILES)} of a peft adapter folder are accepted"
                    )
            names = {member.name for member in members}
            missing = [name for name in REQUIRED_FILES if name not in names]
            if missing:
                raise InvalidDataError(f"the adapter upload lacks {', '.join(missing)}")
            for member in members:
                source = tar.extractfile(member)
                assert source is not None  # a regular file
                (folder / member.name).write_bytes(source.read())
    except tarfile.TarError as error:
        raise InvalidDataError(f"the adapter upload is not a tar archive: {error}") from error


def deployment_route(backend: LocalBackend) -> Route:
    """``PUT /api/deployments/{name}/{step}`` for ``journeyman serve`` (behind its token check)."""

    async def receive(request: Request) -> Response:
        try:
            name = validate_name(request.path_params["name"], "model name")
            step = _step(request.path_params["step"])
            base_model = request.query_params.get("base_model")
            if not base_model:
                raise InvalidDataError("add ?base_model=<the adapter's base model> to the URL")
            folder = backend.root / "deployments" / name / f"{step:04d}"
            if folder.exists():
                raise AdapterError(f"{name}@{step} was deployed here already; push each step once")
            data = await request.body()
            with atomic_dir(folder) as staging:
                unpack_adapter(data, staging)
        except (ConfigError, InvalidDataError) as error:
            return _error(400, str(error), "invalid_request")
        except AdapterError as error:
            return _error(409, str(error), "conflict")
        try:
            served = await backend.deploy_adapter(name, base_model, folder, step)
        except AdapterError as error:
            shutil.rmtree(folder, ignore_errors=True)  # a later push of this step may succeed
            return _error(502, str(error), "adapter_error")
        return JSONResponse({"served_name": served, "step": step})

    return Route("/api/deployments/{name}/{step}", receive, methods=["PUT"])


def _step(text: str) -> int:
    if not text.isdigit():
        raise InvalidDataError(f"the step must be a whole number, got {text!r}")
    return int(text)


def _error(status: int, message: str, kind: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind}}, status_code=status)


class AdapterPush:
    """Pushes adapters to the ``journeyman serve`` of each inference machine.

    ``AdapterPush(["http://10.0.0.2:8000"], token).deployer("agent", base_model)`` is a
    trainer ``deploy`` callback: each new step is served by every gateway before the step is
    reported done; a gateway that refuses it raises :class:`AdapterError` naming it.
    """

    def __init__(self, urls: Sequence[str], token: str | None = None, *, timeout: float = 300.0) -> None:
        if not urls:
            raise ConfigError("AdapterPush needs at least one gateway URL, e.g. http://10.0.0.2:8000")
        self.urls = [url.rstrip("/") for url in urls]
        self.token = token
        self.timeout = timeout

    async def push(
        self, name: str, base_model: str, folder: Path, step: int, *, existing_ok: bool = False
    ) -> list[str]:
        """Send ``folder`` as ``name@step`` to every gateway at once; their served names.

        ``existing_ok``: a gateway that already serves this step (409) counts as done.
        """
        data = await asyncio.to_thread(pack_adapter, Path(folder))
        headers = {"content-type": "application/x-tar"}
        if self.token:
            headers["authorization"] = f"Bearer {self.token}"
        async with httpx.AsyncClient(timeout=self.timeout) as client:

            async def one(url: str) -> str:
                try:
                    response = await client.put(
                        f"{url}/api/deployments/{name}/{step}",
                        params={"base_model": base_model},
                        content=data,
                        headers=headers,
                    )
                except httpx.HTTPError as error:
                    raise AdapterError(f"could not push {name}@{step} to {url}: {error!r}") from error
                if response.status_code == 409 and existing_ok:
                    return f"{name}@{step}"
                if response.status_code != 200:
                    raise AdapterError(
                        f"{url} refused {name}@{step} ({response.status_code}): {_message(response)}"
                    )
                return str(response.json()["served_name"])

            return list(await asyncio.gather(*(one(url) for url in self.urls)))

    def deployer(self, name: str, base_model: str) -> Callable[[Path, int], Awaitable[Any]]:
        async def deploy(folder: Path, step: int) -> list[str]:
            return await self.push(name, base_model, folder, step)

        return deploy


def _message(response: httpx.Response) -> str:
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return response.text[:300]


class Replicas:
    """Several vLLM servers of the same base model, used by a :class:`Router` as one server.

    Adapters are loaded on every replica; each request goes to one, chosen by its rollout id
    (a stable hash), so all turns of a rollout reach the replica whose prefix cache holds its
    conversation. Requests without a rollout id take turns. A replica that is down is skipped.
    ``Router(Replicas([VLLMServer(...), VLLMServer(...)]))`` behind one :class:`Gateway`.
    """

    def __init__(self, servers: Sequence[VLLMServer]) -> None:
        if not servers:
            raise ConfigError("Replicas needs at least one VLLMServer")
        names = {server.config.served_name for server in servers}
        if len(names) != 1:
            raise ConfigError(f"replicas must serve the base model under one name, got {sorted(names)}")
        self.servers = list(servers)
        self._turn = itertools.count()

    @property
    def config(self) -> VLLMConfig:
        return self.servers[0].config

    @property
    def base_url(self) -> str:
        return self.servers[0].base_url

    def url_for(self, rollout_id: str | None) -> str:
        """The replica for this rollout: the same one for every turn while it is up."""
        n = len(self.servers)
        if rollout_id is None:
            first = next(self._turn) % n
        else:
            first = int.from_bytes(hashlib.blake2b(rollout_id.encode(), digest_size=8).digest(), "big") % n
        for offset in range(n):
            server = self.servers[(first + offset) % n]
            if server.is_running():
                return server.url_for(rollout_id)
        return self.servers[first].url_for(rollout_id)

    def start(self, timeout: float | None = None) -> Replicas:
        for server in self.servers:
            server.launch()
        try:
            for server in self.servers:
                server.wait_healthy(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def launch(self) -> None:
        for server in self.servers:
            if not server.is_running():
                server.launch()

    def wait_healthy(self, timeout: float | None = None) -> None:
        for server in self.servers:
            server.wait_healthy(timeout)

    def is_running(self) -> bool:
        """True while at least one replica can answer."""
        return any(server.is_running() for server in self.servers)

    def exit_code(self) -> int | None:
        return next((code for s in self.servers if (code := s.exit_code()) is not None), None)

    def stop(self, timeout: float = 30.0) -> None:
        for server in self.servers:
            server.stop(timeout)

    async def load_adapter(self, name: str, path: Path, client: httpx.AsyncClient | None = None) -> None:
        await asyncio.gather(*(s.load_adapter(name, path, client) for s in self.servers))

    async def unload_adapter(self, name: str, client: httpx.AsyncClient | None = None) -> None:
        await asyncio.gather(*(s.unload_adapter(name, client) for s in self.servers))

    async def reload_weights(self, folder: Path, client: httpx.AsyncClient | None = None) -> None:
        await asyncio.gather(*(s.reload_weights(folder, client) for s in self.servers))
