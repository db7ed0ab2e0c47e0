"""Another inference engine is one class of the InferenceServer shape: LocalBackend serves with it.

``Endpoint`` is not a VLLMServer: an OpenAI-compatible server that already runs (here a scripted
one), as a remote engine would be. Through ``LocalBackend(engine=...)`` a request reaches it via
the real router and gateway and is recorded, and a trained step's adapter is loaded into it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import journeyman as jm
from journeyman.backend import LocalBackend
from journeyman.backend.serving.engine import ENGINES, engine
from journeyman.backend.serving.vllm import VLLMConfig
from tests.scripted_upstream import Reply, ScriptedUpstream, serve


class Endpoint:
    """An inference server that is already running at ``url``: nothing to start or stop."""

    def __init__(self, url: str, config: VLLMConfig, *, log_path: Path) -> None:
        self.url, self.config, self.log_path = url, config, log_path
        self.loaded: list[tuple[str, Path]] = []
        self.stopped = False

    @property
    def base_url(self) -> str:
        return self.url

    @property
    def pids(self) -> tuple[int | None, ...]:
        return (None,)

    def url_for(self, rollout_id: str | None) -> str:
        return self.url

    def launch(self) -> None:
        self.stopped = False

    def wait_healthy(self, timeout: float | None = None) -> None:
        httpx.post(f"{self.url}/v1/chat/completions", json={}, timeout=5)  # it answers: healthy

    def is_running(self) -> bool:
        return not self.stopped

    def exit_code(self) -> int | None:
        return None

    def stop(self, timeout: float = 30.0) -> None:
        self.stopped = True

    async def load_adapter(self, name: str, path: Path, client: httpx.AsyncClient | None = None) -> None:
        self.loaded.append((name, Path(path)))

    async def unload_adapter(self, name: str, client: httpx.AsyncClient | None = None) -> None:
        self.loaded = [(n, p) for n, p in self.loaded if n != name]

    async def reload_weights(self, folder: Path, client: httpx.AsyncClient | None = None) -> None:
        raise NotImplementedError("this engine serves adapters only")


def _completion(completion_id: str, model: str) -> dict[str, Any]:
    return {
        "id": completion_id, "object": "chat.completion", "model": model, "prompt_token_ids": [1, 2],
        "choices": [{
            "index": 0, "message": {"role": "assistant", "content": "7"}, "finish_reason": "stop",
            "token_ids": [3], "logprobs": {"content": [{"token": "7", "logprob": -0.1}]},
        }],
    }  # fmt: skip


async def test_local_backend_serves_through_another_engine(tmp_path: Path) -> None:
    upstream = ScriptedUpstream(replies=[Reply(body={})])  # the health probe's answer
    thread = serve(upstream.app())
    made: list[Endpoint] = []

    def make(config: VLLMConfig, *, log_path: Path) -> Endpoint:
        made.append(Endpoint(thread.base_url, config, log_path=log_path))
        return made[-1]

    try:
        async with LocalBackend(root=tmp_path, engine=make, watch_interval=60) as backend:
            model = jm.TrainableModel(name="agent", project="seam", base_model="smollm2-135m", root=tmp_path)
            await model.register(backend)
            (server,) = made
            assert backend.server is server and server.config.served_name

            upstream.replies.append(Reply(body=_completion("cmpl-base", server.config.served_name)))
            question = [{"role": "user", "content": "What is 3+4?"}]
            reply = await model.openai_client().chat.completions.create(model="agent", messages=question)
            assert upstream.received[-1]["model"] == server.config.served_name  # step 0: the base model
            assert backend.records is not None and backend.records.get(reply.id) is not None

            assert backend.router is not None
            adapter = tmp_path / "adapter"
            adapter.mkdir()
            await backend.router.deploy("agent", adapter, 1)
            assert server.loaded == [("agent@1", adapter)]
            upstream.replies.append(Reply(body=_completion("cmpl-step1", "agent@1")))
            await model.openai_client().chat.completions.create(model="agent", messages=question)
            assert upstream.received[-1]["model"] == "agent@1"
        assert server.stopped
    finally:
        thread.stop()


async def test_the_backends_dtype_reaches_the_policys_server_and_each_judges(tmp_path: Path) -> None:
    upstream = ScriptedUpstream(replies=[Reply(body={}), Reply(body={})])  # two health probes
    thread = serve(upstream.app())
    made: list[Endpoint] = []

    def make(config: VLLMConfig, *, log_path: Path) -> Endpoint:
        made.append(Endpoint(thread.base_url, config, log_path=log_path))
        return made[-1]

    judge_folder = tmp_path / "judge-model"
    judge_folder.mkdir()
    (judge_folder / "config.json").write_text("{}")
    try:
        async with LocalBackend(root=tmp_path, engine=make, watch_interval=60, dtype="float32") as backend:
            model = jm.TrainableModel(name="agent", project="seam", base_model="smollm2-135m", root=tmp_path)
            await model.register(backend)
            await backend.start_judge(str(judge_folder))
        assert [server.config.dtype for server in made] == ["float32", "float32"]
        assert made[1].config.model == judge_folder and not made[1].config.enable_lora
    finally:
        thread.stop()


def test_engines_are_found_by_name_and_an_unknown_one_is_a_clear_error() -> None:
    assert engine("vllm") is ENGINES["vllm"]
    assert engine(Endpoint) is Endpoint  # an engine given as itself
    with pytest.raises(jm.ConfigError, match="no inference engine named 'sglang'; the engines are vllm"):
        engine("sglang")


class Dying(Endpoint):
    """An endpoint whose process can die (``code``) and comes back when launched again."""

    def __init__(self, url: str, config: VLLMConfig, *, log_path: Path) -> None:
        super().__init__(url, config, log_path=log_path)
        self.code: int | None = None
        self.launches = 0

    def launch(self) -> None:
        super().launch()
        self.code, self.launches = None, self.launches + 1

    def exit_code(self) -> int | None:
        return self.code


@contextlib.asynccontextmanager
async def _backend_of_dying_engines(tmp_path: Path) -> AsyncIterator[tuple[LocalBackend, list[Dying]]]:
    """A LocalBackend whose servers are :class:`Dying` endpoints on one scripted upstream that
    answers a start's and a restart's health probes; the endpoints it made, in order."""
    upstream = ScriptedUpstream(replies=[Reply(body={}), Reply(body={})])
    thread = serve(upstream.app())
    made: list[Dying] = []

    def make(config: VLLMConfig, *, log_path: Path) -> Dying:
        made.append(Dying(thread.base_url, config, log_path=log_path))
        return made[-1]

    try:
        async with LocalBackend(root=tmp_path, engine=make, watch_interval=0.05) as backend:
            yield backend, made
    finally:
        thread.stop()


async def test_wait_serving_holds_callers_until_the_watchdog_has_the_server_back(tmp_path: Path) -> None:
    """What the demo waits on before sampling a step again after vLLM died under it."""
    async with _backend_of_dying_engines(tmp_path) as (backend, made):
        model = jm.TrainableModel(name="agent", project="seam", base_model="smollm2-135m", root=tmp_path)
        await model.register(backend)
        (server,) = made
        assert not backend.policy_down()
        server.code = -9  # killed
        assert backend.policy_down()
        await asyncio.wait_for(backend.wait_serving(), 10)
        assert not backend.policy_down() and backend.restarts == 1 and server.launches == 2


async def test_wait_serving_judges_holds_callers_until_the_judges_server_is_back(tmp_path: Path) -> None:
    """What the demo waits on before judging groups again whose judge died under them."""
    judge_dir = tmp_path / "judge-model"
    judge_dir.mkdir()
    (judge_dir / "config.json").write_text("{}")
    async with _backend_of_dying_engines(tmp_path) as (backend, made):
        judge = await backend.start_judge(str(judge_dir))
        (server,) = made
        assert judge.model == "judge-model" and not backend.judge_down()
        # Its answers are cached under the backend's root, not the working directory's (a run
        # there would answer from an earlier run's cache, and its judge would never be asked).
        assert judge.cache_dir == backend.root / "judge_cache"
        server.code = -9  # killed
        assert backend.judge_down() and not backend.policy_down()
        await asyncio.wait_for(backend.wait_serving(judges=True), 10)
        assert not backend.judge_down() and backend.judge_restarts == 1 and server.launches == 2
