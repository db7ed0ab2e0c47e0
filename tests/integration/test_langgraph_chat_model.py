"""A LangGraph agent whose chat model comes from ``chat_model``, against the real vLLM server and
gateway: each rollout's calls are recorded under its id, a canary sends a share of whole rollouts to
the candidate, the tracer's trajectories carry the version that answered, and the gate decides the
canary on them, with nothing set by hand."""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from pathlib import Path

from langchain.agents import create_agent
from langchain_core.tools import tool
from langgraph.errors import GraphRecursionError

import journeyman as jm
from journeyman.backend import LocalBackend
from journeyman.backend.serving.engine import Engine
from journeyman.gate import Gate, promote_canary_if_better
from journeyman.integrations.langgraph import TrajectoryTracer, chat_model
from journeyman.records import ROLLOUT_HEADER

QUESTION = [{"role": "user", "content": "Name a colour."}]


@tool
def add(a: int, b: int) -> int:
    """Add two whole numbers."""
    return a + b


async def test_a_canary_splits_whole_rollouts_of_a_langgraph_agent_and_the_gate_decides_on_them(
    tmp_path: Path, shared_engine: Engine
) -> None:
    async with LocalBackend(root=tmp_path, engine=shared_engine) as backend:
        model = jm.TrainableModel(name="canaried", project="test", base_model="smollm2-135m", root=tmp_path)
        await model.register(backend)
        assert backend.records is not None
        client = model.openai_client()

        async def group() -> list[jm.TrajectoryGroup]:  # a step's worth of token-exact samples
            replies = [
                await client.chat.completions.create(
                    model=model.name, messages=QUESTION, max_tokens=6, temperature=1.0
                )
                for _ in range(4)
            ]
            turns = [backend.records.get(r.id).model_turn() for r in replies]  # type: ignore[union-attr]
            return [
                jm.TrajectoryGroup(
                    jm.Trajectory(conversation=[*QUESTION, turn], reward=float(i % 2))
                    for i, turn in enumerate(turns)
                )
            ]

        await model.train(await group(), jm.TrainConfig(learning_rate=1e-4))  # step 1, promoted
        candidate = await model.train(await group(), jm.TrainConfig(learning_rate=1e-4), promote=False)
        await model.canary(candidate.step, 0.5)

        async def rollout(index: int) -> tuple[str, jm.Trajectory]:
            llm = chat_model(model, max_tokens=12, temperature=1.0)
            agent = create_agent(llm, [add])
            tracer = TrajectoryTracer()
            with contextlib.suppress(GraphRecursionError):  # it kept calling tools: still a rollout
                await agent.ainvoke(
                    {"messages": [("user", f"What is {index} plus 2?")]},
                    config={"callbacks": [tracer], "recursion_limit": 4},
                )
            return llm.model_kwargs["extra_headers"][ROLLOUT_HEADER], tracer.trajectory

        done = await asyncio.gather(*(rollout(i) for i in range(24)))
        versions = Counter(t.final_policy_version for _, t in done)
        assert set(versions) == {1, 2} and min(versions.values()) >= 3, versions  # binomial(24, 0.5)
        for rollout_id, trajectory in done:
            records = backend.records.for_rollout(rollout_id)
            assert records and {r.policy_version for r in records} == {trajectory.final_policy_version}
            assert len(records) == len(trajectory.model_turns)
            trajectory.reward = 1.0 if trajectory.final_policy_version == candidate.step else 0.0

        decision = await promote_canary_if_better(
            model, candidate.step, [t for _, t in done], Gate(min_delta=0.5)
        )
        assert decision.promoted and decision.samples == (versions[2], versions[1])
        assert await model.promoted_step() == candidate.step
