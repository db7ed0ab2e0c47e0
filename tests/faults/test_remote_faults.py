"""`journeyman serve` killed -9 while a RemoteBackend waits on ``train``: the client gets a clear
error, the step's data is on the server's disk, and a restarted server trains the retried step
once, from where it stopped."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

import journeyman as jm
from journeyman.backend.serving.vllm import free_port
from journeyman.errors import BackendError
from journeyman.store import ModelStore
from tests.integration.test_local_backend import QUESTIONS
from tests.integration.test_remote_backend import rollout
from tests.waits import until

TOKEN = "test-token-456"


async def start_serve(root: Path, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    command = [sys.executable, "-m", "journeyman.backend", "serve", "--port", str(port), "--root", str(root)]
    with open(log, "ab") as out:
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "JOURNEYMAN_TOKEN": TOKEN},
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        assert process.poll() is None, log.read_text()[-3000:]
        try:
            return httpx.get(f"{url}/health").status_code == 200
        except httpx.HTTPError:
            return False

    await until(healthy, "journeyman serve to answer /health")
    return process, url


def stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
    process.wait(60)


async def test_serve_killed_during_train_fails_clearly_and_the_retry_trains_once(tmp_path: Path) -> None:
    root, log = tmp_path / "server", tmp_path / "serve.log"
    store = ModelStore("test", "remote", root=root)
    process, url = await start_serve(root, log)
    try:
        async with jm.RemoteBackend(url, token=TOKEN) as backend:
            model = jm.TrainableModel(
                name="remote", project="test", base_model="smollm2-135m", root=tmp_path / "c"
            )
            await model.register(backend)
            records = httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"})

            groups = await jm.gather_trajectory_groups(
                (jm.TrajectoryGroup(rollout(model, records, q, a) for _ in range(6)) for q, a in QUESTIONS),
                progress=False,
            )
            await records.aclose()
            training = asyncio.create_task(model.train(groups, jm.TrainConfig(learning_rate=1e-4)))
            # The server stores a step's groups before it trains on them: kill it then.
            await until(lambda: store.steps("train") == [0], "the server to store the step's groups")
            stop(process)
            with pytest.raises(BackendError, match=r"broke during training|closed the training stream"):
                await training
        assert store.checkpoint_steps() == [0] and store.read_history() == []  # no step was counted

        process, url = await start_serve(root, log)
        async with jm.RemoteBackend(url, token=TOKEN) as backend:
            model = jm.TrainableModel(
                name="remote", project="test", base_model="smollm2-135m", root=tmp_path / "c"
            )
            await model.register(backend)
            assert await model.get_step() == 0
            result = await model.train(groups, jm.TrainConfig(learning_rate=1e-4))  # the retry
            assert result.step == 1 and await model.list_checkpoints() == [0, 1]
        assert [r["step"] for r in store.read_history()] == [1]
        assert store.load_groups("train", 0) == groups  # stored once, though sent twice
    finally:
        stop(process)
