"""jm.TrainingLoop against real servers: rollouts overlapping training on the session's vLLM server,
and a user's loop over RemoteBackend that resumes after `journeyman serve` was killed and restarted.
(The loop's recovery from a killed vLLM, judge or process is the chaos test's, through the demo.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

import journeyman as jm
from journeyman.backend import LocalBackend
from journeyman.backend.app.cli import app
from journeyman.backend.serving.engine import Engine
from journeyman.backend.serving.vllm import free_port
from journeyman.records import CompletionRecord
from journeyman.store import ModelStore
from tests.integration.test_local_backend import QUESTIONS, ask
from tests.waits import serving

TOKEN = "loop-token-123"


async def test_overlapped_rollouts_are_at_most_one_version_behind_and_check_says_so(
    tmp_path: Path, shared_engine: Engine
) -> None:
    async with LocalBackend(root=tmp_path, engine=shared_engine) as backend:
        model = jm.TrainableModel(name="overlap", project="test", base_model="smollm2-135m", root=tmp_path)
        await model.register(backend)

        async def rollout(model: jm.TrainableModel, scenario: tuple[str, str]) -> jm.Trajectory:
            messages, completion_id, reward = await ask(model, *scenario)
            record = backend.records.get(completion_id)  # type: ignore[union-attr]
            assert record is not None
            return jm.Trajectory(conversation=[*messages, record.model_turn()], reward=reward)

        result = await jm.TrainingLoop(
            model, rollout, QUESTIONS * 2, group_size=3, scenarios_per_step=2, steps=3,
            config=jm.TrainConfig(learning_rate=1e-4), max_steps_off_policy=1, progress=False,
        ).run()  # fmt: skip
    assert result.step == 3
    rows = [r for r in model.store.read_history() if r["split"] == "rollouts"]
    assert [r["step"] for r in rows] == [0, 1, 2]
    # Step 2's rollouts were sampled by step 0's adapter while step 1 trained: one version behind.
    assert rows[1]["rollouts/off_policy_max"] == 1 and all(r["rollouts/off_policy_max"] <= 1 for r in rows)
    for step in range(3):
        versions = {t.policy_versions[0] for g in model.store.load_groups("train", step) for t in g}
        assert versions <= {max(0, step - 1), step}
    trained = [r for r in model.store.read_history() if r["split"] == "train"]
    assert all(r["mismatch/max_ratio"] > 0 for r in trained)  # sampling logprobs known: importance-weighted
    runner = CliRunner()
    assert runner.invoke(app, ["check", str(model.store.path), "--max-off-policy", "1"]).exit_code == 0
    on_policy = runner.invoke(app, ["check", str(model.store.path), "--on-policy"])
    assert on_policy.exit_code != 0 and "behind" in on_policy.output


@contextmanager
def serve(root: Path, port: int, log: Path) -> Iterator[subprocess.Popen[bytes]]:
    command = [sys.executable, "-m", "journeyman.backend", "serve", "--port", str(port), "--root", str(root)]
    with open(log, "ab") as out:
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "JOURNEYMAN_TOKEN": TOKEN}
        )
        try:
            if not serving(f"http://127.0.0.1:{port}", 120):
                pytest.fail(log.read_text()[-3000:])
            yield process
        finally:
            if process.poll() is None:
                process.send_signal(signal.SIGINT)
                try:
                    process.wait(60)
                except subprocess.TimeoutExpired:
                    process.kill()


async def test_a_loop_over_remote_backend_resumes_after_serve_was_killed(tmp_path: Path) -> None:
    port, log = free_port(), tmp_path / "serve.log"
    url = f"http://127.0.0.1:{port}"
    evals = [jm.EvalSet("val", QUESTIONS[:1], samples=2)]

    async def part(steps: int) -> tuple[jm.loop.LoopResult, list[tuple[str, str]]]:
        asked: list[tuple[str, str]] = []
        async with (
            jm.RemoteBackend(url, token=TOKEN) as backend,
            httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}) as records,
        ):
            model = jm.TrainableModel(
                name="remote-loop", project="test", base_model="smollm2-135m", root=tmp_path
            )
            await model.register(backend)

            async def rollout(model: jm.TrainableModel, scenario: tuple[str, str]) -> jm.Trajectory:
                info = jm.rollout_info()
                if info is not None and info.split == "train":
                    asked.append((f"step {info.step}", scenario[0]))
                messages, completion_id, reward = await ask(model, *scenario)
                answer = await records.get(f"/records/{completion_id}")
                record = CompletionRecord.model_validate_json(answer.text)
                return jm.Trajectory(conversation=[*messages, record.model_turn()], reward=reward)

            result = await jm.TrainingLoop(
                model, rollout, QUESTIONS * 2, group_size=2, scenarios_per_step=1, steps=steps, evals=evals,
                config=jm.TrainConfig(learning_rate=1e-4), shuffle=False, progress=False,
            ).run()  # fmt: skip
            assert backend.viewer_url(model) == f"{url}/ui/runs/test/remote-loop"
        return result, asked

    with serve(tmp_path / "server", port, log) as process:
        first, asked_first = await part(steps=1)
        process.kill()  # as a crash would: no clean shutdown
        process.wait(30)
    with serve(tmp_path / "server", port, log):
        second, asked_second = await part(steps=2)
    assert (first.step, second.step, second.started_step, second.steps_this_part) == (1, 2, 0, 1)
    # The resumed part drew the step the whole run would have drawn, and kept the first evaluation.
    assert (
        asked_first == [("step 0", QUESTIONS[0][0])] * 2 and asked_second == [("step 1", QUESTIONS[1][0])] * 2
    )
    assert sorted(second.evaluations) == [0, 1, 2] and second.before == first.before
    # The server's run holds the client's rows beside its train rows (its trackers follow it).
    server = ModelStore("test", "remote-loop", root=tmp_path / "server")
    assert [(r["split"], r["step"]) for r in server.read_history()] == [
        ("val", 0), ("train", 1), ("rollouts", 0), ("val", 1), ("train", 2), ("rollouts", 1), ("val", 2),
    ]  # fmt: skip
    assert len(server.load_groups("val", 2)[0]) == 2
