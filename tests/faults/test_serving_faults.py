"""Serving faults against the real vLLM server, through LocalBackend (one server for the module).

The gateway is killed mid-load and restarted; bad requests reach the real server; vLLM is killed
mid-gather. Heavy: run under the lock.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import journeyman as jm
from journeyman.backend import LocalBackend
from journeyman.backend.serving.vllm import free_port
from journeyman.errors import RolloutError
from tests.waits import serving, until

REPO = Path(__file__).resolve().parents[2]
# A gateway in a process of its own, in front of the module's vLLM server, so it can be SIGKILLed.
GATEWAY = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    import uvicorn
    from journeyman.backend.serving.gateway import Gateway, RecordLog
    from journeyman.backend.serving.router import Router
    from tests.scripted_upstream import ScriptedServer

    upstream, records, port = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    router = Router(ScriptedServer(upstream, log_dir=records.parent))  # an already running server
    uvicorn.run(Gateway(router, RecordLog(records)).app, host="127.0.0.1", port=port, log_level="warning")
    """
)


@pytest.fixture(scope="module")
async def served(
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[tuple[LocalBackend, jm.TrainableModel]]:
    root = tmp_path_factory.mktemp("serving-faults")
    async with LocalBackend(root=root, watch_interval=0.5) as backend:
        model = jm.TrainableModel(name="agent", project="faults", base_model="smollm2-135m", root=root)
        await model.register(backend)
        yield backend, model


def _start_gateway(upstream: str, records: Path, port: int) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    process = subprocess.Popen([sys.executable, "-c", GATEWAY, upstream, str(records), str(port)], env=env)
    if serving(f"http://127.0.0.1:{port}", 60, interval=0.1, request_timeout=1):
        return process
    process.kill()
    raise AssertionError("the gateway process did not start")


LONG = 23
"""The request of :func:`_complete` that writes 1024 tokens: the others write 8 to 54."""


async def _complete(http: httpx.AsyncClient, model: str, index: int) -> str | None:
    """One completion, streamed or not; its id if the client received all of it, else None."""
    body = {"model": model, "messages": [{"role": "user", "content": f"Count to {index + 3}."}],
            "max_tokens": 8 + 2 * index, "temperature": 1.0, "stream": index % 2 == 1}  # fmt: skip
    if index == LONG:  # still generating when the gateway is killed, however fast the machine
        body |= {"max_tokens": 1024, "min_tokens": 1024}
    try:
        if not body["stream"]:
            response = await http.post("/v1/chat/completions", json=body)
            return str(response.json()["id"]) if response.status_code == 200 else None
        completion_id, done = None, False
        async with http.stream("POST", "/v1/chat/completions", json=body) as response:
            async for line in response.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: {"):
                    completion_id = completion_id or json.loads(line[6:]).get("id")
        return completion_id if done and response.status_code == 200 else None
    except httpx.HTTPError:
        return None


async def test_gateway_killed_mid_load_loses_no_completion_a_client_received(
    served: tuple[LocalBackend, jm.TrainableModel], tmp_path: Path
) -> None:
    backend, _ = served
    assert backend.server is not None and backend.router is not None
    records, port = tmp_path / "completions.jsonl", free_port()
    gateway = _start_gateway(backend.server.base_url, records, port)
    base = backend.router.base_name
    received: list[str] = []
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=120) as http:
        tasks = [asyncio.create_task(_complete(http, base, i)) for i in range(24)]
        for finished in asyncio.as_completed(tasks):
            if (completion_id := await finished) is not None:
                received.append(completion_id)
            if len(received) == 6 and gateway.poll() is None:
                gateway.send_signal(signal.SIGKILL)  # mid-load: the others are in flight
        assert gateway.wait(10) == -signal.SIGKILL
        assert len(received) >= 6 and tasks[LONG].result() is None  # the long one was cut off

    gateway = _start_gateway(backend.server.base_url, records, port)  # same file, same port
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=120) as http:
            again = await asyncio.gather(*(_complete(http, base, i) for i in range(4)))
    finally:
        gateway.kill()
        gateway.wait()
    assert None not in again
    lines = records.read_text().splitlines()
    recorded = [json.loads(line)["completion_id"] for line in lines]  # every line whole
    assert len(recorded) == len(set(recorded))
    missing = set(received + list(again)) - set(recorded)  # type: ignore[arg-type]
    assert missing == set()


async def test_bad_requests_to_the_real_server_are_recorded_failures(
    served: tuple[LocalBackend, jm.TrainableModel],
) -> None:
    _, model = served
    client = model.openai_client().with_options(max_retries=0)

    async def ask(content: str, name: str = model.inference_name) -> jm.Trajectory:
        messages = [{"role": "user", "content": content}]
        response = await client.chat.completions.create(model=name, messages=messages, max_tokens=4)  # type: ignore[arg-type]
        answer = {"role": "assistant", "content": response.choices[0].message.content}
        return jm.Trajectory(conversation=[*messages, answer], reward=1.0)

    groups = await jm.gather_trajectory_groups(
        [
            jm.TrajectoryGroup([ask("Say hi."), ask("word " * 5000)]),  # longer than the context
            jm.TrajectoryGroup([ask("Say hi.", name="no-such-model")]),
        ],
        max_exceptions=2,
        progress=False,
    )
    assert [len(g) for g in groups] == [1, 0]
    (overlong,), (unknown,) = groups[0].failures, groups[1].failures
    assert overlong.type == "BadRequestError" and "maximum context length" in overlong.message
    assert unknown.type == "NotFoundError" and "no-such-model" in unknown.message

    with pytest.raises(RolloutError, match="BadRequestError"):  # beyond the allowed share: stop
        await jm.gather_trajectory_groups([jm.TrajectoryGroup([ask("word " * 5000)])], progress=False)


async def _rollout(
    model: jm.TrainableModel, backend: LocalBackend, max_tokens: int, *, at_least: int = 0
) -> jm.Trajectory:
    messages = [{"role": "user", "content": "What is 3+4? Answer with a number."}]
    response = await model.openai_client().chat.completions.create(
        model=model.inference_name,
        messages=messages,
        max_tokens=max_tokens,
        temperature=1.0,  # type: ignore[arg-type]
        extra_body={"min_tokens": at_least},
    )
    assert backend.records is not None
    record = backend.records.get(response.id)
    assert record is not None
    reward = float("7" in (response.choices[0].message.content or "")) + 0.01 * len(
        record.choices[0].completion_token_ids or []
    )
    return jm.Trajectory(conversation=[*messages, record.model_turn()], reward=reward)


async def _kill_when_generating(server: Any) -> None:
    """Kill vLLM once it is generating (its /metrics count running requests), not after a sleep
    that a slower or faster machine would get wrong."""
    async with httpx.AsyncClient(timeout=10) as http:
        for _ in range(600):
            metrics = (await http.get(f"{server.base_url}/metrics")).text
            running = [line for line in metrics.splitlines() if line.startswith("vllm:num_requests_running")]
            if any(float(line.rsplit(" ", 1)[1]) > 0 for line in running):
                os.killpg(server.pid, signal.SIGKILL)
                return
            await asyncio.sleep(0.1)
    raise AssertionError("vLLM never reported a running request in 60 s of polling")


async def _greedy(model: jm.TrainableModel, backend: LocalBackend) -> tuple[str, Any]:
    response = await model.openai_client().chat.completions.create(
        model=model.inference_name, messages=[{"role": "user", "content": "Name a colour."}], max_tokens=12,
        temperature=0.0,
    )  # fmt: skip
    assert backend.records is not None
    return response.choices[0].message.content or "", backend.records.get(response.id)


async def test_vllm_killed_mid_gather_fails_rollouts_as_data_then_restarts_with_the_adapter(
    served: tuple[LocalBackend, jm.TrainableModel],
) -> None:
    backend, model = served
    groups = await jm.gather_trajectory_groups(
        [jm.TrajectoryGroup(_rollout(model, backend, 16) for _ in range(4)) for _ in range(2)], progress=False
    )
    assert (await model.train(groups, jm.TrainConfig(learning_rate=1e-3))).step == 1
    before, record = await _greedy(model, backend)
    assert record.served_model == "agent@1"

    server = backend.server
    assert server is not None and server.pid is not None

    killer = asyncio.create_task(_kill_when_generating(server))
    broken = await asyncio.wait_for(  # never a hang
        jm.gather_trajectory_groups(
            # long enough to still be running when vLLM is killed, on a fast machine too
            [
                jm.TrajectoryGroup(_rollout(model, backend, 400, at_least=400) for _ in range(4))
                for _ in range(2)
            ],
            max_exceptions=8,
            progress=False,
        ),
        timeout=120,
    )
    await killer
    failures = [f for g in broken for f in g.failures]
    assert sum(len(g) for g in broken) + len(failures) == 8  # each rollout kept or recorded
    assert failures and all(f.stage == "rollout" and f.traceback for f in failures)
    assert {f.type for f in failures} <= {"InternalServerError", "APIConnectionError", "APIError"}

    deadline = time.monotonic() + 300
    while backend.restarts == 0:
        assert time.monotonic() < deadline, "the backend did not restart vLLM"
        await asyncio.sleep(0.5)
    assert backend.server is server and server.exit_code() is None
    after, record = await _greedy(model, backend)
    assert record.served_model == "agent@1" and record.policy_version == 1  # the adapter came back
    assert after == before
    again = await jm.gather_trajectory_groups(
        [jm.TrajectoryGroup(_rollout(model, backend, 8) for _ in range(2))], progress=False
    )
    assert len(again[0]) == 2 and again[0].failures == []


async def test_vllm_killed_as_an_adapter_load_starts_serves_that_step_after_the_restart(
    served: tuple[LocalBackend, jm.TrainableModel], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The step's checkpoint is on disk when its adapter is loaded: vLLM dying then loses nothing.
    The step is reported trained, and the watchdog's restart serves it."""
    backend, model = served
    server = backend.server
    assert server is not None and server.pid is not None
    groups = await jm.gather_trajectory_groups(
        [jm.TrajectoryGroup(_rollout(model, backend, 5 + i) for i in range(4))], progress=False
    )
    # something to learn, so a deploy: caps of 5 to 8 tokens give different lengths (and rewards)
    # unless every attempt stops early at the same length
    assert len(set(groups[0].rewards)) > 1, groups[0].rewards
    restarts, step = backend.restarts, await model.get_step()
    load, process = server.load_adapter, server._process
    assert process is not None

    async def killed_first(name: str, path: Path, client: Any = None) -> None:
        os.killpg(process.pid, signal.SIGKILL)
        await asyncio.to_thread(process.wait)  # dead (the watchdog may be restarting it already)
        await load(name, path, client)  # the real request, to a server that is gone

    monkeypatch.setattr(server, "load_adapter", killed_first)
    result = await model.train(groups, jm.TrainConfig(learning_rate=1e-4))
    monkeypatch.undo()
    assert result.step == step + 1 and await model.get_step() == step + 1
    assert result.step in await model.list_checkpoints()
    await until(lambda: backend.restarts > restarts, "the watchdog to restart vLLM", timeout=600)
    _, record = await _greedy(model, backend)
    assert record.served_model == f"agent@{result.step}" and record.policy_version == result.step


async def test_vllm_killed_as_a_merged_reload_starts_serves_that_step_after_the_restart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same with merged serving: the restarted server starts from the base weights, and the
    restart merges the step's adapter in."""
    async with LocalBackend(root=tmp_path, watch_interval=0.5, merge_adapters=True) as backend:
        model = jm.TrainableModel(name="agent", project="faults", base_model="smollm2-135m", root=tmp_path)
        await model.register(backend)
        server = backend.server
        assert server is not None and server.config.merge_adapters
        groups = await jm.gather_trajectory_groups(
            [jm.TrajectoryGroup(_rollout(model, backend, 5 + i) for i in range(4))], progress=False
        )
        assert len(set(groups[0].rewards)) > 1, groups[0].rewards
        reload, process = server.reload_weights, server._process
        assert process is not None

        async def killed_first(folder: Path, client: Any = None) -> None:
            os.killpg(process.pid, signal.SIGKILL)
            await asyncio.to_thread(process.wait)
            await reload(folder, client)  # the real request, to a server that is gone

        reloaded: list[Path] = []

        async def recorded(folder: Path, client: Any = None) -> None:
            reloaded.append(Path(folder))
            await reload(folder, client)

        monkeypatch.setattr(server, "reload_weights", killed_first)
        result = await model.train(groups, jm.TrainConfig(learning_rate=1e-4))
        monkeypatch.setattr(server, "reload_weights", recorded)
        assert result.step == 1 and await model.list_checkpoints() == [0, 1]
        await until(lambda: backend.restarts > 0, "the watchdog to restart vLLM", timeout=600)
        assert len(reloaded) == 1  # the restart merged step 1's adapter into the fresh base weights
        _, record = await _greedy(model, backend)
        assert record.served_model == server.config.served_name and record.policy_version == 1
