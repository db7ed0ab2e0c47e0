"""RULER with a real judge: the embedded model behind the real vLLM server, and a training run on it.

A 135M judge is not expected to judge well; it is expected to answer validly every time, which
structured output (a JSON schema with one required key per trajectory id) guarantees.
"""

from __future__ import annotations

import functools
import json
import os
import signal
from pathlib import Path

import pytest

import journeyman as jm
from journeyman.backend import LocalBackend
from journeyman.backend.serving.engine import Engine
from journeyman.backend.serving.gateway import GatewayThread
from journeyman.judge import Judge, judge_group, judge_trajectories
from tests.integration.conftest import SERVED_BASE
from tests.waits import until

QUESTION = [
    {"role": "system", "content": "You are a helpful assistant. Answer briefly."},
    {"role": "user", "content": "What is 2+3?"},
]
ANSWERS = ["5", "2 + 3 = 5.", "It is 6.", "I like turtles."]


async def test_the_local_model_judges_a_group_of_4_with_structured_output(
    gateway: GatewayThread, tmp_path: Path
) -> None:
    group = jm.TrajectoryGroup(
        jm.Trajectory(conversation=[*QUESTION, {"role": "assistant", "content": answer}], reward=1.0)
        for answer in ANSWERS
    )
    async with Judge(
        SERVED_BASE,
        base_url=f"{gateway.base_url}/v1",
        explanation_max_chars=120,
        timeout=300,
        cache_dir=tmp_path / "cache",
        temperature=0.0,  # the same answer whatever else the session's server served before
    ) as judge:
        judgement = await judge_trajectories(group.trajectories, judge=judge, method="scores")
        assert judgement.attempts == 1 and not judgement.retries and not judgement.cached
        assert judge.uses_schema  # "auto": vLLM accepted the JSON schema
        # The answer is exactly the schema's shape: bare JSON, one entry per id, in order.
        assert judgement.answer is not None
        answer = json.loads(judgement.answer)
        assert list(answer) == ["1", "2", "3", "4"]
        for entry in answer.values():
            assert set(entry) == {"explanation", "score"}
            assert 0 <= entry["score"] <= 1 and len(entry["explanation"]) <= 120
        assert [s.raw_score for s in judgement.scores] == [answer[i]["score"] for i in "1234"]
        assert judgement.clamped == 0

        # The group is scored from the same judgement, now on disk: no second call.
        scored = await judge_group(group, judge=judge, method="scores", reward_from="score")
        assert judge.calls == 1 and scored.metrics["judge/cached"] is True
        assert not scored.failures
        assert [t.reward for t in scored] == [s.score for s in judgement.scores]
        assert all(t.metrics["programmatic_reward"] == 1.0 for t in scored)
        assert all(t.logs and t.logs[-1].startswith(f"RULER ({SERVED_BASE}) score") for t in scored)


TASKS = ["Name a fruit. Answer with one word.", "What is 3+4? Answer with a number."]


async def test_training_steps_with_ruler_as_the_only_reward(tmp_path: Path, shared_engine: Engine) -> None:
    async with LocalBackend(root=tmp_path, engine=shared_engine) as backend:  # the session's server
        model = jm.TrainableModel(name="ruled", project="test", base_model="smollm2-135m", root=tmp_path)
        await model.register(backend)
        assert backend.router is not None and backend.records is not None
        records = backend.records
        client = model.openai_client()
        # The judge: the base model on a vLLM server of its own, beside the policy's (`ruled@<step>`).
        judge = await backend.start_judge(
            "smollm2-135m", explanation_max_chars=100, max_concurrency=2, timeout=300,
            cache_dir=tmp_path / "judge_cache",
        )  # fmt: skip
        assert judge.name == "smollm2-135m"  # served under its own name, which keys the judge's cache
        judge_server = backend.judge_servers["smollm2-135m"]
        assert (
            judge.base_url == f"{judge_server.base_url}/v1"
            and judge_server.base_url != backend.server.base_url
        )
        assert await backend.start_judge("smollm2-135m") is not judge  # the same server, a new client
        assert len(backend.judge_servers) == 1

        async def rollout(task: str) -> jm.Trajectory:
            messages = [{"role": "user", "content": task}]
            response = await client.chat.completions.create(
                model=model.inference_name,
                messages=messages,  # type: ignore[arg-type]
                max_tokens=12,
                temperature=1.0,
            )
            record = records.get(response.id)
            assert record is not None
            return jm.Trajectory(conversation=[*messages, record.model_turn()])  # no reward of its own

        for step in range(2):
            # The defaults: verdicts (vLLM returns logprobs), read with nothing to parse, so every
            # group is judged (the scores method's parse failures and retries are tested with a
            # scripted judge); 1 for each group's best attempts, 0 for the rest.
            groups = await jm.gather_trajectory_groups(
                (jm.TrajectoryGroup(rollout(task) for _ in range(4)) for task in TASKS),
                after_each=functools.partial(judge_group, judge=judge),
                progress=False,
            )
            assert len(groups) == 2
            for group in groups:
                assert group.metrics["judge/failed"] == 0 and not group.failures, group.failures
                for trajectory in group:
                    assert "programmatic_reward" not in trajectory.metrics
                    assert trajectory.reward == trajectory.metrics["ruler_best"]
                    assert 0 <= trajectory.metrics["ruler_score"] <= 1
                assert max(t.reward for t in group) == 1.0 and judge.gives_logprobs is True
            result = await model.train(groups, jm.TrainConfig(learning_rate=1e-4))
            assert result.step == step + 1
            rewards = [t.reward for g in groups for t in g if t.reward is not None]
            assert result.metrics["reward/mean"] == pytest.approx(sum(rewards) / len(rewards), abs=1e-6)
        assert await model.get_step() == 2
        assert await model.list_checkpoints() == [0, 1, 2]
        assert len(records) == 2 * len(TASKS) * 4  # the rollouts' calls only: judging is not recorded

        # A judge server that dies (the kernel's OOM killer picks the biggest process) is restarted
        # by the backend's watchdog, as the policy's is, and judges again.
        assert judge_server.pid is not None
        os.kill(judge_server.pid, signal.SIGKILL)
        await until(lambda: backend.judge_restarts > 0, "the watchdog to restart the judge", timeout=600)
        assert judge_server.is_running()
        group = jm.TrajectoryGroup([await rollout(TASKS[1]) for _ in range(4)])
        again = await judge_group(group, judge=judge, method="verdict")  # no answer to parse
        assert again.metrics["judge/failed"] == 0 and all(t.reward is not None for t in again)
        await judge.aclose()
    assert not judge_server.is_running() and not backend.judge_servers  # stopped with the backend
