"""A two-step training loop through LocalBackend, as a user writes it. (That a rewarded answer becomes
more likely in vLLM after the redeploy is shown in test_promotion.py, where the gate relies on it.)"""

from __future__ import annotations

import re
from pathlib import Path

import journeyman as jm
from journeyman.backend import LocalBackend
from journeyman.backend.serving.engine import Engine

QUESTIONS = [("What is 3+4? Answer with a number.", "7"), ("What is 5+5? Answer with a number.", "10")]


async def ask(
    model: jm.TrainableModel, question: str, answer: str
) -> tuple[list[dict[str, str]], str, float]:
    """Ask the model through its client; (messages, completion id, reward with some spread)."""
    messages = [{"role": "user", "content": question}]
    response = await model.openai_client().chat.completions.create(
        model=model.inference_name,
        messages=messages,
        max_tokens=12,
        temperature=1.0,  # type: ignore[arg-type]
    )
    numbers = re.findall(r"\d+", response.choices[0].message.content or "")
    return messages, response.id, 1.0 if answer in numbers else 0.1 * min(len(numbers), 5)


async def test_two_training_steps_through_local_backend(tmp_path: Path, shared_engine: Engine) -> None:
    async with LocalBackend(root=tmp_path, engine=shared_engine) as backend:  # the session's server
        model = jm.TrainableModel(name="tiny", project="test", base_model="smollm2-135m", root=tmp_path)
        await model.register(backend)
        assert await model.get_step() == 0
        assert model.inference_base_url == f"{backend.gateway.base_url}/v1"  # type: ignore[union-attr]
        client = model.openai_client()

        async def rollout(question: str, answer: str) -> jm.Trajectory:
            messages, completion_id, reward = await ask(model, question, answer)
            record = backend.records.get(completion_id)  # type: ignore[union-attr]
            assert record is not None
            return jm.Trajectory(conversation=[*messages, record.model_turn()], reward=reward)

        for step in range(2):
            groups = await jm.gather_trajectory_groups(
                (jm.TrajectoryGroup(rollout(q, a) for _ in range(6)) for q, a in QUESTIONS), progress=False
            )
            result = await model.train(groups, jm.TrainConfig(learning_rate=1e-4))
            assert result.step == step + 1
            assert "train/loss" in result.metrics and "time/deploy" in result.metrics

        assert await model.get_step() == 2
        assert backend.router.resolve("tiny") == ("tiny@2", 2)  # type: ignore[union-attr]
        response = await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        record = backend.records.get(response.id)  # type: ignore[union-attr]
        assert record is not None and record.served_model == "tiny@2" and record.policy_version == 2

        assert await model.list_checkpoints() == [0, 1, 2]
        val = await jm.gather_trajectory_groups(
            [jm.TrajectoryGroup([rollout(*QUESTIONS[0])])], progress=False
        )
        row = await model.log(val, split="val")
        assert row["step"] == 2 and "val/reward" in row

    store = model.store
    assert store.checkpoint_steps() == [0, 1, 2]
    assert store.steps("train") == [0, 1] and store.steps("val") == [2]
    assert [(r["step"], r["split"]) for r in store.read_history()] == [(1, "train"), (2, "train"), (2, "val")]

    # A new backend, with a vLLM server of its own, resumes where training stopped and serves the
    # latest adapter.
    async with LocalBackend(root=tmp_path) as again:
        resumed = jm.TrainableModel(name="tiny", project="test", base_model="smollm2-135m", root=tmp_path)
        await resumed.register(again)
        assert await resumed.get_step() == 2
        assert again.router.resolve("tiny") == ("tiny@2", 2)  # type: ignore[union-attr]
    assert (tmp_path / "logs" / "vllm.log").is_file()  # its log under the backend's root
