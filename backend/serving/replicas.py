"""Several vLLM servers of the same base model behind one gateway, used as one
:class:`~journeyman.backend.serving.engine.InferenceServer`."""

from __future__ import annotations

import asyncio
import hashlib
import itertools
from collections.abc import Sequence
from pathlib import Path

import httpx

from journeyman.errors import ConfigError

from .engine import InferenceServer, ServedModel

__all__ = ["Replicas"]


class Replicas:
    """Several vLLM servers of the same base model, used by a :class:`Router` as one server.

    Adapters are loaded on every replica; each request goes to one, chosen by its rollout id
    (a stable hash), so all turns of a rollout reach the replica whose prefix cache holds its
    conversation. Requests without a rollout id take turns. A replica that is down is skipped.
    ``Router(Replicas([VLLMServer(...), VLLMServer(...)]))`` behind one :class:`Gateway`.
    """

    def __init__(self, servers: Sequence[InferenceServer]) -> None:
        if not servers:
            raise ConfigError("Replicas needs at least one server (a VLLMServer, say)")
        names = {server.config.served_name for server in servers}
        if len(names) != 1:
            raise ConfigError(f"replicas must serve the base model under one name, got {sorted(names)}")
        self.servers = list(servers)
        self._turn = itertools.count()

    @property
    def config(self) -> ServedModel:
        return self.servers[0].config

    @property
    def base_url(self) -> str:
        return self.servers[0].base_url

    @property
    def log_path(self) -> Path:
        return self.servers[0].log_path.parent

    @property
    def pids(self) -> tuple[int | None, ...]:
        return tuple(pid for server in self.servers for pid in server.pids)

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
