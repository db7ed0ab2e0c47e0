"""Replay: production traces become scenarios (deduplicated, a stable held-out slice), and each
scenario a group of attempts that names the trace it came from."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

import journeyman as jm
from journeyman.errors import InvalidDataError
from journeyman.replay import (
    Scenario,
    read_scenarios,
    replay,
    scenarios_from_trajectories,
    split_held_out,
    write_scenarios,
)

TOOL = {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}


def _production(question: str, trace: str, score: float | None = None) -> jm.Trajectory:
    """A production trace as imported: system, user, the model's call, its result, the answer."""
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{}"}}
    return jm.Trajectory(
        conversation=[
            {"role": "system", "content": "You add numbers."},
            {"role": "user", "content": question},
            {"role": "assistant", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "42"},
            {"role": "assistant", "content": "42"},
        ],
        tools=[TOOL],
        reward=score,
        metadata={"langfuse_trace_id": trace},
    )


def test_scenarios_are_the_openings_of_traces_without_repeats() -> None:
    traces = [
        _production("What is 12 plus 30?", "t1", 1.0),
        _production("What is 2 plus 2?", "t2"),
        _production("What is 12 plus 30?", "t3", 0.0),  # the same input again
        jm.Trajectory(conversation=[{"role": "assistant", "content": "hi"}]),  # no user turn: skipped
    ]
    scenarios = scenarios_from_trajectories(traces)
    assert [s.source for s in scenarios] == ["t1", "t2"]
    first = scenarios[0]
    assert [m["role"] for m in first.messages] == ["system", "user"]  # up to the first model reply
    assert first.prompt == "What is 12 plus 30?" and first.score == 1.0
    assert first.tools is not None and first.tools[0]["function"]["name"] == "add"
    assert first.metadata["duplicates"] == 1
    assert first.id == scenarios_from_trajectories([traces[2]])[0].id  # same input, same id
    with pytest.raises(InvalidDataError, match="no user turn"):
        scenarios_from_trajectories(traces[3:], skip_invalid=False)


def test_scenarios_read_from_jsonl_and_written_back(tmp_path: Path) -> None:
    path = tmp_path / "scenarios.jsonl"
    path.write_text(
        json.dumps({"prompt": "What is 1 plus 1?", "source": "s1", "score": 0.5})
        + "\n\n"
        + json.dumps({"messages": [{"role": "user", "content": "What is 1 plus 1?"}]})  # a repeat
        + "\n"
        + json.dumps({"messages": [{"role": "user", "content": "Hi"}], "tools": [TOOL]})
        + "\n"
    )
    scenarios = read_scenarios(path)
    assert [(s.prompt, s.source, s.score) for s in scenarios] == [
        ("What is 1 plus 1?", "s1", 0.5),
        ("Hi", None, None),
    ]
    again = read_scenarios(write_scenarios(tmp_path / "again.jsonl", scenarios))
    assert [s.id for s in again] == [s.id for s in scenarios] and again[1].tools == (TOOL,)
    path.write_text(json.dumps({"prompt": "ok"}) + "\n" + json.dumps({"messages": "not a list"}) + "\n")
    with pytest.raises(InvalidDataError, match=r"scenarios\.jsonl, line 2: expected"):
        read_scenarios(path)


def test_the_held_out_slice_is_stable_and_apart() -> None:
    scenarios = [Scenario(({"role": "user", "content": f"q{i}"},)) for i in range(200)]
    train, held = split_held_out(scenarios, share=0.1)
    assert len(held) == 20 and len(train) == 180 and not {s.id for s in train} & {s.id for s in held}
    assert split_held_out(list(reversed(scenarios)), share=0.1)[1] == list(reversed(held))  # order-free
    assert split_held_out(scenarios, share=0.1, seed=1)[1] != held
    with pytest.raises(InvalidDataError, match="held-out share"):
        split_held_out(scenarios, share=1.0)


def test_replay_runs_the_agent_n_times_per_scenario_and_links_each_group_to_its_trace() -> None:
    scenarios = scenarios_from_trajectories(
        [_production("What is 12 plus 30?", "t1", 1.0), _production("What is 2 plus 2?", "t2")]
    )
    calls: list[str] = []

    async def agent(scenario: Scenario) -> jm.Trajectory:
        calls.append(scenario.prompt)
        if scenario.prompt.startswith("What is 2") and calls.count(scenario.prompt) == 2:
            raise RuntimeError("the tool timed out")  # a failure is recorded, the group goes on
        answer = {"role": "assistant", "content": "42"}
        return jm.Trajectory(conversation=[*scenario.messages, answer], reward=float(len(calls) % 2))

    judged: list[str] = []

    async def judge(group: jm.TrajectoryGroup) -> jm.TrajectoryGroup:
        judged.append(str(group.metadata["source_trace"]))
        return group

    groups = asyncio.run(replay(scenarios, agent, n=4, after_each=judge, max_exceptions=0.5, progress=False))
    assert sorted(calls) == ["What is 12 plus 30?"] * 4 + ["What is 2 plus 2?"] * 4
    assert [g.metadata["source_trace"] for g in groups] == ["t1", "t2"] and sorted(judged) == ["t1", "t2"]
    assert [len(g.trajectories) for g in groups] == [4, 3] and len(groups[1].failures) == 1
    assert groups[1].failures[0].message == "the tool timed out"
    first = groups[0].trajectories[0]
    assert first.metadata["source_trace"] == "t1" and first.metadata["production_score"] == 1.0
    assert first.metadata["scenario_id"] == scenarios[0].id == groups[0].metadata["scenario_id"]
    with pytest.raises(InvalidDataError, match="at least 1"):
        asyncio.run(replay(scenarios, agent, n=0))
