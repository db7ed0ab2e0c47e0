"""Gated promotion through LocalBackend with the real vLLM server: a rewarded answer becomes more
likely in vLLM after the redeploy, so the better step is promoted; a worse one is served as
``name@step`` while production keeps the promoted step, a rollback moves the plain name back while a
running request finishes on its version, and a restart serves the promoted step."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx

import journeyman as jm
from journeyman.backend import LocalBackend
from journeyman.backend.serving.engine import Engine
from journeyman.gate import promote_if_better
from tests.waits import until

QUESTION = [{"role": "user", "content": "Name a colour."}]


async def test_a_gate_promotes_the_better_step_holds_the_worse_and_a_rollback_goes_back(
    tmp_path: Path, shared_engine: Engine
) -> None:
    # The session's server until the restart at the end, which starts one of its own.
    async with (
        LocalBackend(root=tmp_path, engine=shared_engine) as backend,
        httpx.AsyncClient(timeout=120) as http,
    ):
        model = jm.TrainableModel(name="gated", project="test", base_model="smollm2-135m", root=tmp_path)
        await model.register(backend)
        assert backend.server is not None and backend.router is not None and backend.records is not None
        base = backend.server.config.served_name
        client = model.openai_client()

        async def sample() -> jm.Trajectory:
            response = await client.chat.completions.create(
                model=model.name, messages=QUESTION, max_tokens=8, temperature=1.0, seed=None
            )
            record = backend.records.get(response.id)  # type: ignore[union-attr]
            assert record is not None
            return jm.Trajectory(conversation=[*QUESTION, record.model_turn()])

        trajectories = [await sample() for _ in range(8)]
        answers = [tuple(t.model_turns[-1].completion_token_ids or []) for t in trajectories]
        assert len(set(answers)) > 1, "eight samples at temperature 1 were all the same"
        target, prompt = answers[0], list(trajectories[0].model_turns[-1].prompt_token_ids or [])

        async def vllm_logprob(name: str, answer: tuple[int, ...]) -> float:
            """log p(answer | prompt) under what vLLM serves for ``name`` now."""
            served, _ = backend.router.resolve(name)  # type: ignore[union-attr]
            body = {"model": served, "prompt": prompt + list(answer), "max_tokens": 1, "prompt_logprobs": 0}
            reply = await http.post(f"{backend.server.base_url}/v1/completions", json=body)  # type: ignore[union-attr]
            reply.raise_for_status()
            positions = reply.json()["choices"][0]["prompt_logprobs"][len(prompt) :]
            return sum(next(iter(p.values()))["logprob"] for p in positions)

        async def evaluate(name: str) -> list[jm.Trajectory]:
            """The held-out check: log p(target answer) under what ``name`` is served as now."""
            return [jm.Trajectory(conversation=QUESTION, reward=await vllm_logprob(name, target))]

        def rewarded(sign: float) -> list[jm.TrajectoryGroup]:
            for trajectory, answer in zip(trajectories, answers, strict=True):
                trajectory.reward = sign * (1.0 if answer == target else 0.0)
            return [jm.TrajectoryGroup(trajectories)]

        others = sorted({a for a in answers if a != target})
        before = [await vllm_logprob("gated", a) for a in others]
        # The read-back (a prefill) is the sampler's own number (a decode), up to their numeric noise.
        sampled = sum(lp or 0.0 for lp in trajectories[0].model_turns[-1].logprobs or [])
        read_back = await vllm_logprob("gated", target)
        assert abs(read_back - sampled) < 0.05 * max(1.0, abs(sampled)), (read_back, sampled)

        # Step 1 rewards the target answer: served as gated@1 only, then promoted by the gate, as
        # vLLM now gives the target a higher probability, and the answers rewarded 0 a lower one.
        step1 = await model.train(rewarded(+1), jm.TrainConfig(learning_rate=1e-3), promote=False)
        assert backend.router.resolve("gated") == (base, 0)
        assert backend.router.resolve("gated@1") == ("gated@1", 1)
        better = await promote_if_better(model, step1.step, evaluate)
        assert better.promoted and better.candidate > better.incumbent, better
        after = [await vllm_logprob("gated", a) for a in others]
        assert sum(after) < sum(before), (before, after)
        assert backend.router.resolve("gated") == ("gated@1", 1) and await model.promoted_step() == 1

        # Step 2 punishes it: worse on the check, so it is served by name and production stays.
        step2 = await model.train(rewarded(-1), jm.TrainConfig(learning_rate=1e-3), promote=False)
        worse = await promote_if_better(model, step2.step, evaluate)
        assert not worse.promoted and worse.candidate < worse.incumbent, worse
        assert backend.router.resolve("gated") == ("gated@1", 1)
        reply = await client.chat.completions.create(model="gated@2", messages=QUESTION, max_tokens=2)
        assert backend.records.get(reply.id).served_model == "gated@2"  # type: ignore[union-attr]

        # A canary: 30% of rollouts (by rollout id, each whole) go to step 2, the rest to step 1.
        await model.canary(step2.step, 0.3)
        gateway = backend.gateway.base_url  # type: ignore[union-attr]
        limit = asyncio.Semaphore(8)

        async def served_for(rollout: str) -> str:
            async with limit:
                body = {"model": "gated", "messages": QUESTION, "max_tokens": 1}
                reply = await http.post(f"{gateway}/r/{rollout}/v1/chat/completions", json=body)
                reply.raise_for_status()
                return backend.records.get(reply.json()["id"]).served_model  # type: ignore[union-attr]

        rollouts = [f"canary-{i}" for i in range(200)]
        first = await asyncio.gather(*(served_for(r) for r in rollouts))
        assert set(first) == {"gated@1", "gated@2"}
        assert 0.2 < first.count("gated@2") / 200 < 0.4, first.count("gated@2")  # binomial sd 0.032
        again = await asyncio.gather(*(served_for(r) for r in rollouts[:40]))
        assert again == first[:40]  # a rollout keeps its version
        await model.canary(step2.step, 0)
        assert await served_for("after-the-canary") == "gated@1"

        # A rollback while a request runs: it finishes on the version it started with. It runs its
        # 48 tokens whatever it samples (no end-of-sequence to stop at), seconds on this machine.
        running = asyncio.create_task(
            client.chat.completions.create(
                model="gated", messages=QUESTION, max_tokens=48, temperature=1.0,
                extra_body={"min_tokens": 48, "ignore_eos": True},
            )
        )  # fmt: skip
        await until(lambda: backend.router.in_flight("gated@1") == 1, "the request to run on gated@1")  # type: ignore[union-attr]
        assert await model.rollback() == 0
        assert not running.done()  # the rollback came while it ran
        finished = await running
        assert backend.records.get(finished.id).served_model == "gated@1"  # type: ignore[union-attr]
        assert backend.router.resolve("gated") == (base, 0)
        await model.canary(step2.step, 0.5)  # left running: a restart takes it up again

    moves = [(row["action"], row["step"], row["by"]) for row in model.store.read_promotions()]
    assert moves[:3] == [("promote", 0, "train"), ("promote", 1, "gate"), ("hold", 2, "gate")]
    assert [(m[0], m[1]) for m in moves[3:]] == [("canary", 2), ("canary", 2), ("rollback", 0), ("canary", 2)]
    assert [row.get("share") for row in model.store.read_promotions()[3:5]] == [0.3, 0]
    assert model.store.read_promotions()[2]["gate"]["candidate"] == worse.candidate

    # A restart serves the promoted step to production and keeps the latest by its name.
    async with LocalBackend(root=tmp_path) as again:
        resumed = jm.TrainableModel(name="gated", project="test", base_model="smollm2-135m", root=tmp_path)
        await resumed.register(again)
        assert await resumed.get_step() == 2 and await resumed.promoted_step() == 0
        assert again.router.resolve("gated") == ("base", 0)  # type: ignore[union-attr]
        assert again.router.canaries == {"gated": ("gated@2", 2, 0.5)}  # type: ignore[union-attr]
        reply = await resumed.openai_client().chat.completions.create(
            model="gated@2", messages=QUESTION, max_tokens=2
        )
        assert again.records.get(reply.id).served_model == "gated@2"  # type: ignore[union-attr]
