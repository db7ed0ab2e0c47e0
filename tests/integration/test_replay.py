"""Training from production traffic: a LangGraph agent serves questions with Langfuse's own
``CallbackHandler`` tracing it (to the faithful test server) and users' feedback scores on some
traces; replay imports the traces, runs the same agent 4 times on each input against the trainable
model, trains two steps, and every group names the trace it came from."""

from __future__ import annotations

import asyncio
from pathlib import Path

from langchain.agents import create_agent
from langchain_core.messages import convert_to_messages
from langchain_openai import ChatOpenAI
from langfuse import Langfuse

import journeyman as jm
from journeyman.backend import LocalBackend
from journeyman.integrations.langfuse import import_trajectories
from journeyman.integrations.langgraph import TrajectoryTracer
from tests.langfuse_server import LangfuseServer
from tests.unit import test_langfuse_langgraph as scripted
from tests.unit.test_langfuse_langgraph import add_and_finish, run_traced

server, client = scripted.server, scripted.client  # the fixtures: a test server, and a client of it

QUESTIONS = {"What is 12 plus 30?": 42, "What is 7 plus 8?": 15, "What is 20 plus 22?": 42}


def _agent(model: jm.TrainableModel, temperature: float) -> object:
    chat = ChatOpenAI(
        model=model.inference_name, base_url=model.inference_base_url, api_key="local",
        temperature=temperature, max_tokens=48,
    )  # fmt: skip
    system = "Use the add_and_finish tool to add the two numbers in the question."
    return create_agent(chat, [add_and_finish], system_prompt=system)


async def test_production_traces_replayed_as_groups_train_and_link_back(
    tmp_path: Path, server: LangfuseServer, client: Langfuse
) -> None:
    async with LocalBackend(root=tmp_path) as backend:
        model = jm.TrainableModel(name="prod", project="test", base_model="smollm2-135m", root=tmp_path)
        await model.register(backend)

        # Production: the agent answers users, traced by Langfuse alone; two users leave feedback.
        production = _agent(model, temperature=0)
        for question in [*QUESTIONS, "What is 12 plus 30?"]:  # one question asked twice
            await asyncio.to_thread(run_traced, production, question, server, "prod")
        client.flush()
        traces = import_trajectories(client, tags=["prod"])
        assert len(traces) == 4
        for trace, value in zip(traces[:2], (1.0, 0.0), strict=True):
            client.create_score(trace_id=trace.id, name="user-feedback", value=value)
        client.flush()
        traces = import_trajectories(client, tags=["prod"], reward_score="user-feedback")

        scenarios = jm.scenarios_from_trajectories(traces)
        assert len(scenarios) == 3  # the repeated question is one scenario
        assert {s.prompt for s in scenarios} == set(QUESTIONS)
        assert {s.source for s in scenarios} <= {t.id for t in traces}
        assert sorted(s.score for s in scenarios if s.score is not None) == [0.0, 1.0]

        replayed = _agent(model, temperature=1.0)

        async def attempt(scenario: jm.Scenario) -> jm.Trajectory:
            tracer = TrajectoryTracer()
            state = await replayed.ainvoke(  # type: ignore[attr-defined]
                {"messages": convert_to_messages([m for m in scenario.messages if m["role"] != "system"])},
                config={"callbacks": [tracer], "recursion_limit": 6},
            )
            trajectory = tracer.trajectory
            tool_results = [m.content for m in state["messages"] if m.type == "tool"]
            trajectory.reward = 1.0 if str(QUESTIONS[scenario.prompt]) in tool_results else 0.0
            return trajectory

        for step in (1, 2):
            groups = await jm.replay(scenarios, attempt, n=4, max_exceptions=0.25, progress=False)
            assert len(groups) == 3
            for group, scenario in zip(groups, scenarios, strict=True):
                assert group.metadata["source_trace"] == scenario.source
                assert all(t.metadata["source_trace"] == scenario.source for t in group)
                assert all(t.metrics["token_exact_calls"] >= 1 for t in group)  # captured token-exact
            result = await model.train(groups, jm.TrainConfig(learning_rate=1e-4))
            assert result.step == step

    stored = model.store.load_groups("train", 1)
    assert {g.metadata["source_trace"] for g in stored} == {s.source for s in scenarios}
