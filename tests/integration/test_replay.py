"""Training from production traffic: a LangGraph agent serves questions with Langfuse's own
``CallbackHandler`` tracing it (to the faithful test server) and users' feedback scores on some
traces; replay imports the traces, runs the same agent 4 times on each input against the trainable
model, trains two steps, and every group names the trace it came from."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from langchain.agents import create_agent
from langchain_core.messages import convert_to_messages
from langchain_openai import ChatOpenAI
from langfuse import Langfuse

import journeyman as jm
from journeyman.backend import LocalBackend
from journeyman.backend.serving.engine import Engine
from journeyman.integrations.langfuse import import_trajectories
from journeyman.integrations.langgraph import TrajectoryTracer
from journeyman.replay import Scenario, read_scenarios, replay, scenarios_from_trajectories
from journeyman.store import ModelStore
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
    tmp_path: Path, server: LangfuseServer, client: Langfuse, shared_engine: Engine
) -> None:
    async with LocalBackend(root=tmp_path, engine=shared_engine) as backend:  # the session's server
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

        scenarios = scenarios_from_trajectories(traces)
        assert len(scenarios) == 3  # the repeated question is one scenario
        assert {s.prompt for s in scenarios} == set(QUESTIONS)
        assert {s.source for s in scenarios} <= {t.id for t in traces}
        assert sorted(s.score for s in scenarios if s.score is not None) == [0.0, 1.0]

        replayed = _agent(model, temperature=1.0)

        async def attempt(scenario: Scenario) -> jm.Trajectory:
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
            groups = await replay(scenarios, attempt, n=4, max_exceptions=0.25, progress=False)
            assert len(groups) == 3
            for group, scenario in zip(groups, scenarios, strict=True):
                assert group.metadata["source_trace"] == scenario.source
                assert all(t.metadata["source_trace"] == scenario.source for t in group)
                assert all(t.metrics["token_exact_calls"] >= 1 for t in group)  # captured token-exact
            result = await model.train(groups, jm.TrainConfig(learning_rate=1e-4))
            assert result.step == step

    stored = model.store.load_groups("train", 1)
    assert {g.metadata["source_trace"] for g in stored} == {s.source for s in scenarios}


AGENT = '''
import journeyman as jm


async def attempt(scenario, model):
    """The production agent: one chat call; reward 1 when the reply holds the expected number."""

    @jm.trainable(model)
    async def run(s, client):
        reply = await client.chat.completions.create(messages=list(s.messages), max_tokens=8, temperature=1.0)
        return 1.0 if s.metadata["answer"] in (reply.choices[0].message.content or "") else 0.0

    return await run(scenario)
'''


def test_the_replay_command_trains_gated_steps_from_a_scenario_file_and_resumes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from typer.testing import CliRunner

    from journeyman.backend.app.cli import app

    monkeypatch.chdir(tmp_path)
    (tmp_path / "prod_agent.py").write_text(AGENT)
    rows = [(f"What is {a} plus {b}? Answer with a number.", str(a + b)) for a, b in ((2, 2), (3, 4), (5, 5))]
    lines = [
        json.dumps({"prompt": q, "source": f"trace-{i}", "metadata": {"answer": answer}})
        for i, (q, answer) in enumerate(rows)
    ]
    (tmp_path / "scenarios.jsonl").write_text("\n".join([*lines, lines[0]]) + "\n")  # one line repeated
    args = [
        "replay", "test", "cli", "--agent", "prod_agent:attempt", "--scenarios", "scenarios.jsonl",
        "--n", "4", "--per-step", "2", "--steps", "2", "--held-out", "0.34", "--gate", "--min-delta", "-1",
        "--learning-rate", "1e-4", "--root", str(tmp_path / "root"),
    ]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output + repr(result.exception)
    assert "3 scenarios: 2 to train on, 1 held out" in result.output
    assert "step 1:" in result.output and "step 2:" in result.output and "promoted" in result.output
    store = ModelStore("test", "cli", root=tmp_path / "root")
    assert store.checkpoint_steps()[-1] == 2
    gated = [(r["action"], r["step"]) for r in store.read_promotions() if r["by"] == "gate"]
    assert gated == [("promote", 1), ("promote", 2)]  # min delta -1: any reward in [0, 1] passes
    held = {s.source for s in read_scenarios(store.path / "replay-held-out.jsonl")}
    trained = {g.metadata["source_trace"] for step in (0, 1) for g in store.load_groups("train", step)}
    assert len(held) == 1 and trained == {"trace-0", "trace-1", "trace-2"} - held

    # Run again on the same root: one more step, the next batch of the same order, the same held-out
    # set, and a gate no step can pass: held-out rewards lie in [0, 1], so a gain is at most 1 < 1.5
    # (at exactly 1 a candidate scoring 1 against 0 would still be promoted).
    again_args = [*args[: args.index("--steps")], "--steps", "1", *args[args.index("--steps") + 2 :]]
    again_args[again_args.index("--min-delta") + 1] = "1.5"
    again = CliRunner().invoke(app, again_args)
    assert again.exit_code == 0, again.output + repr(again.exception)
    assert "step 3:" in again.output and "step 1:" not in again.output
    assert "held (step 2 stays)" in again.output and "promoted" not in again.output
    assert store.checkpoint_steps()[-1] == 3
    hold = [r for r in store.read_promotions() if r["by"] == "gate"][2:]
    assert [(r["action"], r["step"], r["from_step"]) for r in hold] == [("hold", 3, 2)]
    assert hold[0]["gate"]["promoted"] is False and hold[0]["gate"]["min_delta"] == 1.5
    assert store.promoted_step() == 2  # production keeps the step the first run promoted
    assert {s.source for s in read_scenarios(store.path / "replay-held-out.jsonl")} == held
    train = read_scenarios(store.path / "replay-train.jsonl")
    order = jm.iterate_dataset(train, per_step=2, epochs=3)
    expected = [[s.source for s in batch.items] for batch in order]
    for step in (0, 1, 2):  # each group keeps its scenario's place in the batch
        assert [g.metadata["source_trace"] for g in store.load_groups("train", step)] == expected[step]
