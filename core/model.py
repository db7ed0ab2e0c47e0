"""The models a user's rollout code talks to.

``jm.Model`` is any OpenAI-compatible endpoint (a prompted baseline, an external API);
``jm.TrainableModel`` is trained by a backend and served by it. Both give the same
``openai_client()`` and ``inference_name``, so the same rollout code evaluates a base model, a
trained one and an external one::

    model = jm.TrainableModel(name="calc-agent", project="demo", base_model="smollm2-135m")
    await model.register(LocalBackend())
    client = model.openai_client()
    groups = await jm.gather_trajectory_groups(...)
    result = await model.train(groups, config=jm.TrainConfig(learning_rate=5e-5))
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator

from journeyman import plugins
from journeyman.config import LoRAConfig, SFTConfig, TrainConfig
from journeyman.errors import ConfigError
from journeyman.store import ModelStore, validate_name
from journeyman.trajectory import Trajectory, TrajectoryGroup

if TYPE_CHECKING:
    from openai import AsyncOpenAI, OpenAI

__all__ = ["Backend", "Model", "Registration", "ServingState", "TrainResult", "TrainableModel"]


@dataclass
class Registration:
    """What a backend tells a model when it registers."""

    base_url: str
    """The OpenAI-compatible base URL (``.../v1``) of the backend's gateway."""
    api_key: str
    step: int


@dataclass
class TrainResult:
    """What a training step did."""

    step: int
    """The model's step after it (the checkpoint it wrote)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """The step's ``train`` row of the history (docs: Reference > Metrics)."""


@dataclass(frozen=True)
class ServingState:
    """What a training loop needs to know of a backend's servers to recover from their deaths."""

    policy_restarts: int = 0
    """How many times the policy's inference server was restarted after it died."""
    judge_restarts: int = 0
    """How many times a judge's server that the backend started was restarted."""
    policy_down: bool = False
    """The policy's server is dead or being restarted: its requests fail meanwhile."""
    judge_down: bool = False
    """A judge's server is dead or being restarted."""


class Backend(Protocol):
    """Serves and trains models: :class:`journeyman.backend.LocalBackend` or a remote one."""

    async def register(self, model: TrainableModel) -> Registration: ...

    async def get_step(self, model: TrainableModel) -> int: ...

    async def train(
        self,
        model: TrainableModel,
        groups: Sequence[TrajectoryGroup],
        config: TrainConfig,
        *,
        promote: bool = True,
    ) -> TrainResult: ...

    async def train_sft(
        self,
        model: TrainableModel,
        trajectories: Sequence[Trajectory],
        config: SFTConfig,
        *,
        evaluation: Sequence[Trajectory] | None = None,
        promote: bool = True,
    ) -> TrainResult: ...

    async def promote(
        self,
        model: TrainableModel,
        step: int,
        *,
        action: str,
        by: str,
        gate: dict[str, Any] | None,
        share: float | None = None,
    ) -> int: ...

    async def promoted_step(self, model: TrainableModel) -> int: ...

    async def list_checkpoints(self, model: TrainableModel) -> list[int]: ...

    async def delete_checkpoints(
        self, model: TrainableModel, best_metric: str | None, *, higher_is_better: bool = True
    ) -> list[int]: ...

    async def serving_state(self) -> ServingState:
        """Restarts of the servers so far and whether they are down now (a loop samples a step
        again, or judges its groups again, when a server died under them)."""
        ...

    async def wait_serving(self, timeout: float = 900.0, *, judges: bool = False) -> None:
        """Until the policy's server (``judges``: the judges' servers) answers again."""
        ...

    def viewer_url(self, model: TrainableModel) -> str | None:
        """Where the run viewer shows ``model``'s run, when this backend serves a viewer."""
        ...


class Model(BaseModel):
    """A model behind any OpenAI-compatible endpoint."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    name: str
    project: str
    inference_base_url: str | None = None
    """Base URL of the OpenAI-compatible API, e.g. ``https://api.openai.com/v1``."""
    inference_api_key: str | None = None
    inference_model_name: str | None = None
    """The model name to send; defaults to ``name``."""
    root: Path | None = None
    """Where runs are stored (default: ``$JOURNEYMAN_ROOT`` or ``./.journeyman``)."""
    _client: Any = PrivateAttr(default=None)

    @field_validator("name", "project")
    @classmethod
    def _safe(cls, value: str) -> str:
        return validate_name(value)

    @property
    def inference_name(self) -> str:
        return self.inference_model_name or self.name

    @property
    def store(self) -> ModelStore:
        return ModelStore(self.project, self.name, root=self.root)

    def openai_client(self) -> AsyncOpenAI:
        """An ``AsyncOpenAI`` client for this model's endpoint (made once, then reused)."""
        if self._client is None:
            self._client = self._new_client(sync=False)
        client: AsyncOpenAI = self._client
        return client

    def sync_openai_client(self) -> OpenAI:
        """A new sync ``OpenAI`` client for this model's endpoint (for agents that are not async)."""
        client: OpenAI = self._new_client(sync=True)
        return client

    def _new_client(self, *, sync: bool) -> Any:
        if self.inference_base_url is None:
            raise ConfigError(
                f"model {self.name!r} has no inference_base_url: give one, or register a TrainableModel with a backend"
            )
        import httpx
        import openai

        # An explicit httpx client: the SDK's default one closes itself from __del__ when dropped
        # unclosed, and that late close can unregister sockets whose descriptor numbers were
        # already reused, losing live responses (openai-python #2440).
        if sync:
            make: Any = openai.OpenAI
            http: Any = httpx.Client(timeout=1200)
        else:
            make = openai.AsyncOpenAI
            limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
            http = httpx.AsyncClient(timeout=1200, limits=limits)
        return make(
            base_url=self.inference_base_url,
            api_key=self.inference_api_key or "unused",
            timeout=1200,
            max_retries=2,
            http_client=http,
        )

    async def get_step(self) -> int:
        return 0

    async def _export(
        self, groups: Sequence[TrajectoryGroup], langfuse: Any, *, split: str, step: int
    ) -> None:
        exporter = plugins.exporter("langfuse", langfuse, project=self.project, model=self.name, split=split)
        await plugins.export_groups(exporter, groups, step=step)

    async def log(
        self,
        groups: Sequence[TrajectoryGroup],
        split: str = "val",
        *,
        step: int | None = None,
        metrics: dict[str, float] | None = None,
        langfuse: Any = False,
    ) -> dict[str, Any]:
        """Store the groups under ``split`` and append their averaged metrics to the history.

        ``langfuse`` (True, a ``langfuse.Langfuse`` client or a ``LangfuseExporter``) also exports
        them, tagged with this model, its project, ``step`` and ``split``.
        """
        step = await self.get_step() if step is None else step
        if langfuse:
            await self._export(groups, langfuse, split=split, step=step)
        self.store.save_groups(groups, split, step)
        row: dict[str, Any] = {
            "step": step,
            "split": split,
            **summarize(groups, prefix=f"{split}/"),
            **(metrics or {}),
        }
        return self.store.append_history(row)


class TrainableModel(Model):
    """A model whose LoRA adapter a backend trains and serves."""

    base_model: str
    """An alias (``smollm2-135m``), a local Hugging Face folder, or a hub name where hubs are reachable."""
    lora: LoRAConfig = Field(default_factory=LoRAConfig)
    _backend: Backend | None = PrivateAttr(default=None)

    @property
    def backend(self) -> Backend:
        if self._backend is None:
            raise ConfigError(
                f"model {self.name!r} is not registered: call `await model.register(backend)` first"
            )
        return self._backend

    async def register(self, backend: Backend) -> None:
        """Let ``backend`` serve and train this model; points ``openai_client()`` at it."""
        registration = await backend.register(self)
        self._backend = backend
        self._client = None
        self.inference_base_url = registration.base_url
        self.inference_api_key = registration.api_key
        self.inference_model_name = self.name

    async def get_step(self) -> int:
        return await self.backend.get_step(self)

    async def train(
        self,
        groups: Sequence[TrajectoryGroup],
        config: TrainConfig | None = None,
        *,
        langfuse: Any = False,
        promote: bool = True,
    ) -> TrainResult:
        """One training step on ``groups``; returns when the new adapter is being served.

        The new step is served as ``name@step``, and the plain name (what production calls) moves
        to it, unless ``promote=False``: then it stays on the promoted step until :meth:`promote`
        or :func:`journeyman.promote_if_better` moves it (adapters served as LoRA only).

        ``langfuse`` (True, a ``langfuse.Langfuse`` client or a ``LangfuseExporter``) first exports
        the groups, tagged with this model, its project, the step they were sampled at and split
        ``train``, in session ``project/name``; an export failure is recorded on its group.
        """
        groups = list(groups)
        if langfuse:
            await self._export(groups, langfuse, split="train", step=await self.get_step())
        if promote:  # a backend written before gated promotion takes no such argument
            return await self.backend.train(self, groups, config or TrainConfig())
        return await self.backend.train(self, groups, config or TrainConfig(), promote=False)

    async def train_sft(
        self,
        trajectories: Sequence[Trajectory],
        config: SFTConfig | None = None,
        *,
        evaluation: Sequence[Trajectory] | None = None,
        promote: bool = True,
    ) -> TrainResult:
        """A supervised run on the adapter: cross-entropy on the trajectories' model turns (each
        other token is context), in batches over epochs (:class:`~journeyman.SFTConfig`), saved as
        the next step and served like an RL step; an RL step after it starts from this adapter.

        ``trajectories``: the best of a run's groups, a JSONL in OpenAI's fine-tuning format, a
        teacher's rollouts (:mod:`journeyman.sft` says where each comes from). ``evaluation``:
        conversations for the validation loss and early stopping (default: drawn by
        ``config.eval_fraction``). The history gets a row per batch (split ``sft_batch``) and the
        step's row (split ``sft``), which is the result's ``metrics``. Data that cannot be trained
        raises :class:`~journeyman.errors.InvalidDataError` naming each conversation and what is
        wrong, before anything trains; a run that fails deploys nothing.
        """
        from journeyman.sft import check_conversations

        trajectories = list(trajectories)
        check_conversations(trajectories)
        if evaluation is not None:
            evaluation = list(evaluation)
            check_conversations(evaluation, "the evaluation conversations")
        return await self.backend.train_sft(
            self, trajectories, config or SFTConfig(), evaluation=evaluation, promote=promote
        )

    async def promote(self, step: int, *, by: str | None = None, gate: dict[str, Any] | None = None) -> None:
        """Point the plain name at ``step`` (any checkpointed step; requests already running finish on
        their version) and record it in ``promotions.jsonl`` with ``by`` (default: user@host) and the
        ``gate``'s numbers."""
        await self.backend.promote(self, step, action="promote", by=by or who(), gate=gate)

    async def rollback(self, step: int | None = None, *, by: str | None = None) -> int:
        """Point the plain name back at ``step``, by default the step promoted before the current
        one; recorded like a promotion. Returns the step now served."""
        return await self.backend.promote(
            self, -1 if step is None else step, action="rollback", by=by or who(), gate=None
        )

    async def canary(self, step: int, share: float, *, by: str | None = None) -> None:
        """Send ``share`` (0-1) of the plain name's rollouts to ``step``, each rollout whole (by its
        rollout id: the gateway's ``/r/{id}/v1`` or the tracers' header); ``share=0`` ends it, and so
        does a promotion. :func:`journeyman.promote_canary_if_better` compares the two and decides."""
        await self.backend.promote(self, step, action="canary", by=by or who(), gate=None, share=share)

    async def promoted_step(self) -> int:
        """The step the plain name serves."""
        return await self.backend.promoted_step(self)

    async def list_checkpoints(self) -> list[int]:
        """Steps with a complete checkpoint on the backend."""
        return await self.backend.list_checkpoints(self)

    async def delete_checkpoints(
        self, best_metric: str | None = "val/reward", *, higher_is_better: bool = True
    ) -> list[int]:
        """Delete every checkpoint but the latest and the best by ``best_metric`` (the highest, or
        with ``higher_is_better=False`` the lowest); return the deleted steps."""
        return await self.backend.delete_checkpoints(self, best_metric, higher_is_better=higher_is_better)


def who() -> str:
    """``user@host``: who moved a model's plain name, for promotions.jsonl."""
    import getpass
    import socket

    try:
        user = getpass.getuser()
    except (OSError, KeyError):  # no login name (a container without a passwd entry)
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


def summarize(groups: Sequence[TrajectoryGroup], prefix: str = "") -> dict[str, float]:
    """Averages over the groups' scored trajectories: reward, its std, metrics, failure counts."""
    trajectories: list[Trajectory] = [t for g in groups for t in g]
    rewards = [t.reward for t in trajectories if t.reward is not None]
    failures = sum(len(g.failures) for g in groups)
    row = {
        f"{prefix}trajectories": float(len(trajectories)),
        f"{prefix}failures": float(failures),
        f"{prefix}failure_rate": failures / max(1, failures + len(trajectories)),
    }
    if rewards:
        row[f"{prefix}reward"] = statistics.fmean(rewards)
        row[f"{prefix}reward_std"] = statistics.pstdev(rewards)
    keys = sorted({k for t in trajectories for k in t.metrics})
    for key in keys:
        values = [float(t.metrics[key]) for t in trajectories if key in t.metrics]
        row[f"{prefix}{key}"] = statistics.fmean(values)
    return row
