"""A deploy that fails: on a live server the name keeps its old version; when vLLM died under it,
the step is kept and the server's restart serves it."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from journeyman.backend.serving.router import Router
from journeyman.errors import AdapterError
from tests.scripted_upstream import ScriptedServer


class FailingServer(ScriptedServer):
    """Adapter loads fail while ``failing``; with ``dies``, the process dies under the load."""

    def __init__(self, tmp_path: Path, *, dies: bool) -> None:
        super().__init__("http://127.0.0.1:9", log_dir=tmp_path)
        self.dies, self.failing, self.code = dies, True, None
        self.loaded: list[str] = []

    async def load_adapter(self, name: str, path: Path, client: Any = None) -> None:
        if self.failing:
            if self.dies:
                self.code = -9
            raise AdapterError(f"could not load adapter {name!r}: vLLM did not answer")
        self.loaded.append(name)

    def exit_code(self) -> int | None:
        return self.code


def test_a_load_vllm_died_under_is_served_after_the_restart(tmp_path: Path) -> None:
    server = FailingServer(tmp_path, dies=True)
    router = Router(server)

    async def scenario() -> None:
        await router.deploy("agent", None, 0)
        assert await router.deploy("agent", tmp_path / "step1", 1) == "agent@1"  # no error: nothing lost
        assert router.resolve("agent") == ("agent@1", 1)
        server.failing, server.code = False, None  # restarted
        await router.redeploy()
        assert server.loaded == ["agent@1"]

    asyncio.run(scenario())


def test_a_load_a_live_server_refuses_keeps_the_old_version(tmp_path: Path) -> None:
    server = FailingServer(tmp_path, dies=False)
    router = Router(server)

    async def scenario() -> None:
        await router.deploy("agent", None, 0)
        with pytest.raises(AdapterError, match="could not load adapter 'agent@1'"):
            await router.deploy("agent", tmp_path / "step1", 1)
        assert router.resolve("agent") == ("base", 0)

    asyncio.run(scenario())
