"""The seam between journeyman and an inference engine.

The router, the gateway and :class:`~journeyman.backend.LocalBackend` use an inference server only
through :class:`InferenceServer`. :class:`~journeyman.backend.serving.vllm.VLLMServer` runs one
vLLM process; :class:`~journeyman.backend.serving.replicas.Replicas` puts several behind one face.
Another engine (SGLang, a remote endpoint) is one new module with a class of this shape, named in
:data:`ENGINES` and chosen with ``LocalBackend(engine=...)``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import httpx

from journeyman.errors import ConfigError

from .vllm import VLLMServer

__all__ = ["ENGINES", "Engine", "InferenceServer", "ServedModel", "engine"]


class ServedModel(Protocol):
    """What the router reads of a server's configuration."""

    @property
    def model(self) -> Path | str: ...  # the base weights (a merge starts from them)
    @property
    def served_name(self) -> str: ...  # the name the base model answers to
    @property
    def merge_adapters(self) -> bool: ...  # adapters merged into the weights instead of loaded


class InferenceServer(Protocol):
    """One OpenAI-compatible inference server (or a pool acting as one) that serves LoRA adapters."""

    @property
    def config(self) -> ServedModel: ...
    @property
    def base_url(self) -> str: ...
    @property
    def pids(self) -> tuple[int | None, ...]: ...  # a restart changes them
    @property
    def log_path(self) -> Path: ...  # where its output goes (a pool: the folder of its servers' logs)

    def url_for(self, rollout_id: str | None) -> str:
        """Where a rollout's requests go (a pool keeps every turn of a rollout on one server)."""
        ...

    def launch(self) -> None: ...
    def wait_healthy(self, timeout: float | None = None) -> None: ...
    def is_running(self) -> bool: ...
    def exit_code(self) -> int | None: ...
    def stop(self, timeout: float = 30.0) -> None: ...
    async def load_adapter(self, name: str, path: Path, client: httpx.AsyncClient | None = None) -> None: ...
    async def unload_adapter(self, name: str, client: httpx.AsyncClient | None = None) -> None: ...
    async def reload_weights(self, folder: Path, client: httpx.AsyncClient | None = None) -> None: ...


Engine = Callable[..., InferenceServer]
"""Makes one server: ``engine(config, log_path=...)``."""

ENGINES: dict[str, Engine] = {"vllm": VLLMServer}


def engine(name: str | Engine) -> Engine:
    """The engine of this name in :data:`ENGINES`; an engine given as itself is returned as is."""
    if not isinstance(name, str):
        return name
    if name not in ENGINES:
        raise ConfigError(f"no inference engine named {name!r}; the engines are {', '.join(sorted(ENGINES))}")
    return ENGINES[name]
