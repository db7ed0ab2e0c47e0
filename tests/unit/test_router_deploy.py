"""A deploy that fails: on a live server the name keeps its old version; when vLLM died under it,
the step is kept and the server's restart serves it; a deploy while the server restarts waits for it."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest

from journeyman.backend.serving.router import Router
from journeyman.errors import AdapterError
from tests.scripted_upstream import ScriptedServer
from tests.waits import until


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


class RestartingServer(FailingServer):
    """Dead until restarted; its restart waits on ``healthy``, and loads fail until it is set."""

    def __init__(self, tmp_path: Path) -> None:
        super().__init__(tmp_path, dies=False)
        self.failing, self.code = False, -9
        self.healthy = threading.Event()
        self.refused: list[str] = []
        """Loads sent while it was starting."""

    def stop(self) -> None:
        self.failing, self.code = True, None  # a new process that does not answer yet

    def launch(self) -> None:
        pass

    def wait_healthy(self, timeout: float = 10.0) -> None:
        assert self.healthy.wait(timeout)
        self.failing = False

    async def load_adapter(self, name: str, path: Path, client: Any = None) -> None:
        if self.failing:
            self.refused.append(name)
        await super().load_adapter(name, path, client)


def test_a_deploy_while_vllm_restarts_waits_and_is_served_after_the_kept_versions(tmp_path: Path) -> None:
    server = RestartingServer(tmp_path)
    router = Router(server)

    async def scenario() -> None:
        server.code = None
        await router.deploy("agent", None, 0)
        await router.deploy("agent", tmp_path / "step1", 1)
        server.code = -9  # killed during the next training step
        restart = asyncio.create_task(router.restart_server())
        await until(lambda: server.failing, "the restart to stop the dead server")
        deploy = asyncio.create_task(router.deploy("agent", tmp_path / "step2", 2))
        await asyncio.sleep(0)  # its first step: a deploy that did not wait for the restart loads in it
        assert not deploy.done()
        server.healthy.set()
        await restart
        assert await deploy == "agent@2"
        assert server.refused == []  # it sent no load the starting server would refuse
        assert server.loaded == ["agent@1", "agent@1", "agent@2"]  # the kept version again, then the new
        assert router.resolve("agent") == ("agent@2", 2)

    asyncio.run(scenario())
