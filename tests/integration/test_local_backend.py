"""A two-step training loop through LocalBackend, as a user writes it."""

from __future__ import annotations

import re
from pathlib import Path

import httpx

import journeyman as jm
from journeyman.backend import LocalBackend

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


async def test_two_training_steps_through_local_backend(tmp_path: Path) -> None:
    async with LocalBackend(root=tmp_path) as backend:
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
    assert (tmp_path / "logs" / "vllm.log").is_file()

    # A new backend resumes where training stopped and serves the latest adapter.
    async with LocalBackend(root=tmp_path) as again:
        resumed = jm.TrainableModel(name="tiny", project="test", base_model="smollm2-135m", root=tmp_path)
        await resumed.register(again)
        assert await resumed.get_step() == 2
        assert again.router.resolve("tiny") == ("tiny@2", 2)  # type: ignore[union-attr]


async def test_a_rewarded_answer_becomes_more_likely_in_vllm_after_the_redeploy(tmp_path: Path) -> None:
    """The whole loop's direction: vLLM samples a group, the best answer is rewarded, one step is
    trained and deployed, and vLLM itself (read back with prompt logprobs) now gives that answer
    a higher probability, and the answers rewarded 0 a lower one on average."""
    async with LocalBackend(root=tmp_path) as backend, httpx.AsyncClient(timeout=120) as http:
        model = jm.TrainableModel(name="direction", project="test", base_model="smollm2-135m", root=tmp_path)
        await model.register(backend)
        assert backend.server is not None and backend.router is not None and backend.records is not None
        question = [{"role": "user", "content": "Name a colour."}]

        async def sample() -> jm.Trajectory:
            response = await model.openai_client().chat.completions.create(
                model=model.inference_name, messages=question, max_tokens=8, temperature=1.0, seed=None
            )
            record = backend.records.get(response.id)  # type: ignore[union-attr]
            assert record is not None
            return jm.Trajectory(conversation=[*question, record.model_turn()])

        trajectories = [await sample() for _ in range(8)]
        answers = [tuple(t.model_turns[-1].completion_token_ids or []) for t in trajectories]
        assert len(set(answers)) > 1, "eight samples at temperature 1 were all the same"
        for trajectory, answer in zip(trajectories, answers, strict=True):
            trajectory.reward = 1.0 if answer == answers[0] else 0.0
        prompt = list(trajectories[0].model_turns[-1].prompt_token_ids or [])

        async def vllm_logprob(answer: tuple[int, ...]) -> float:
            """log p(answer | prompt) under what vLLM serves for the model now."""
            served, _ = backend.router.resolve(model.inference_name)  # type: ignore[union-attr]
            reply = await http.post(
                f"{backend.server.base_url}/v1/completions",  # type: ignore[union-attr]
                json={
                    "model": served,
                    "prompt": prompt + list(answer),
                    "max_tokens": 1,
                    "prompt_logprobs": 0,
                },
            )
            reply.raise_for_status()
            positions = reply.json()["choices"][0]["prompt_logprobs"][len(prompt) :]
            return sum(next(iter(p.values()))["logprob"] for p in positions)

        others = sorted({a for a in answers if a != answers[0]})
        before = [await vllm_logprob(answers[0]), *[await vllm_logprob(a) for a in others]]
        # The read-back is the sampler's own number, up to vLLM's batch-to-batch noise.
        sampled = sum(lp or 0.0 for lp in trajectories[0].model_turns[-1].logprobs or [])
        assert abs(before[0] - sampled) < 0.05 * max(1.0, abs(sampled)), (before[0], sampled)

        result = await model.train([jm.TrajectoryGroup(trajectories)], jm.TrainConfig(learning_rate=1e-3))
        assert result.step == 1 and backend.router.resolve(model.inference_name)[1] == 1  # type: ignore[union-attr]
        after = [await vllm_logprob(answers[0]), *[await vllm_logprob(a) for a in others]]
        assert after[0] > before[0], (before, after)
        assert sum(after[1:]) < sum(before[1:]), (before, after)
