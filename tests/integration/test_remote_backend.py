"""The same two-step loop through RemoteBackend against `journeyman serve` on loopback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

import journeyman as jm
from journeyman.backend.app.cli import app
from journeyman.backend.serving.vllm import free_port
from journeyman.records import CompletionRecord
from journeyman.store import ModelStore
from tests.integration.test_local_backend import QUESTIONS, ask
from tests.waits import serving

TOKEN = "test-token-123"


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[str]:
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "journeyman.backend",
        "serve",
        "--port",
        str(port),
        "--root",
        str(tmp_path / "server"),
    ]
    log = open(tmp_path / "serve.log", "wb")  # noqa: SIM115
    process = subprocess.Popen(
        command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "JOURNEYMAN_TOKEN": TOKEN}
    )
    url = f"http://127.0.0.1:{port}"
    if not serving(url, 60):
        process.kill()
        pytest.fail((tmp_path / "serve.log").read_text()[-3000:])
    yield url
    process.send_signal(signal.SIGINT)
    try:
        process.wait(60)
    except subprocess.TimeoutExpired:
        process.kill()
    log.close()


async def rollout(
    model: jm.TrainableModel, records: httpx.AsyncClient, question: str, answer: str
) -> jm.Trajectory:
    """One question through the remote server, its trajectory read back from the server's ``/records``."""
    messages, completion_id, reward = await ask(model, question, answer)
    record = CompletionRecord.model_validate_json((await records.get(f"/records/{completion_id}")).text)
    return jm.Trajectory(conversation=[*messages, record.model_turn()], reward=reward)


async def test_two_training_steps_through_remote_backend(serve: str, tmp_path: Path) -> None:
    async with jm.RemoteBackend(serve, token=TOKEN) as backend:
        model = jm.TrainableModel(
            name="remote", project="test", base_model="smollm2-135m", root=tmp_path / "client"
        )
        await model.register(backend)
        assert model.inference_base_url == f"{serve}/v1"
        assert await model.get_step() == 0
        client = model.openai_client()  # sends the token as its API key
        records = httpx.AsyncClient(base_url=serve, headers={"Authorization": f"Bearer {TOKEN}"})

        for step in range(2):
            groups = await jm.gather_trajectory_groups(
                (jm.TrajectoryGroup(rollout(model, records, q, a) for _ in range(6)) for q, a in QUESTIONS),
                progress=False,
            )
            result = await model.train(groups, jm.TrainConfig(learning_rate=1e-4), promote=step == 0)
            assert result.step == step + 1 and "train/loss" in result.metrics

        async def served_as(name: str) -> str:
            response = await client.chat.completions.create(
                model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )
            record = CompletionRecord.model_validate_json((await records.get(f"/records/{response.id}")).text)
            return record.served_model

        assert await model.get_step() == 2
        assert await model.promoted_step() == 1  # step 2 was trained with promote=False
        assert await served_as("remote") == "remote@1" and await served_as("remote@2") == "remote@2"
        promoted = CliRunner().invoke(
            app, ["promote", "test", "remote", "2", "--url", serve, "--token", TOKEN]
        )
        assert promoted.exit_code == 0, promoted.output
        assert await model.promoted_step() == 2 and await served_as("remote") == "remote@2"
        canary = ["canary", "test", "remote", "1", "--url", serve, "--token", TOKEN, "--share"]
        started = CliRunner().invoke(app, [*canary, "1"])
        assert started.exit_code == 0 and "100% of remote's rollouts go to step 1" in started.output
        body = {"model": "remote", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        reply = (await records.post("/r/canary-1/v1/chat/completions", json=body)).json()
        record = CompletionRecord.model_validate_json((await records.get(f"/records/{reply['id']}")).text)
        assert record.served_model == "remote@1"  # a rollout in the canary's share (all of them)
        assert CliRunner().invoke(app, [*canary, "0"]).exit_code == 0
        assert await model.list_checkpoints() == [0, 1, 2]
        assert await model.delete_checkpoints(best_metric=None) == [0, 1]
        assert await model.list_checkpoints() == [2]
        await records.aclose()

    server_store = ModelStore("test", "remote", root=tmp_path / "server")
    assert server_store.checkpoint_steps() == [2]
    assert server_store.steps("train") == [0, 1]
    assert [r["step"] for r in server_store.read_history()] == [1, 2]
