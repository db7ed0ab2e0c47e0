"""Made-up answers as probes for a judge: built from a success, judged beside its group, counted."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

import journeyman as jm
from journeyman.backend.app.cli import app
from journeyman.judge import Judge, calibrate_judge
from journeyman.judge_probes import as_text, made_up_answers, probes, without_the_answer, without_the_work
from journeyman.store import ModelStore
from tests.scripted_judge import Reply, ScriptedJudge, running
from tests.unit.test_ruler import calling, verdict

SYSTEM = {"role": "system", "content": "You add numbers with the add tool."}
QUESTION = {"role": "user", "content": "What is 2+3?"}
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
WORKED = [  # a worked example before the question: its call and result stay in the probe
    {"role": "user", "content": "What is 1+1?"},
    calling("w1", "add", '{"a": 1, "b": 1}'),
    {"role": "tool", "tool_call_id": "w1", "content": "2"},
    {"role": "assistant", "content": "It is 2."},
]


def attempt(*messages: dict[str, Any], reward: float | None = None) -> jm.Trajectory:
    return jm.Trajectory(conversation=[SYSTEM, *WORKED, QUESTION, *messages], tools=TOOLS, reward=reward)


ADDED = [calling("c1", "add", '{"a": 2, "b": 3}'), {"role": "tool", "tool_call_id": "c1", "content": "5"}]


def test_the_probe_keeps_the_request_and_the_final_answer_and_leaves_out_the_work() -> None:
    success = attempt(*ADDED, {"role": "assistant", "content": "It is 5."}, reward=1.0)
    probe = without_the_work(success)
    assert probe is not None and probe.id == f"{success.id}~probe" and probe.reward is None
    assert probe.openai_messages() == [
        SYSTEM,
        *success.openai_messages()[1:6],
        {"role": "assistant", "content": "It is 5."},
    ]
    assert probe.tools == success.tools

    # An agent that answers through a tool keeps that call, now made without looking anything up.
    answered = attempt(*ADDED, calling("c2", "answer", '{"text": "5"}'))
    probe = without_the_work(answered)
    assert probe is not None
    assert probe.openai_messages()[-1]["tool_calls"] == calling("c2", "answer", '{"text": "5"}')["tool_calls"]
    assert probe.openai_messages()[-2] == QUESTION

    # Nothing to leave out: no call after the request, or no answer at all.
    assert without_the_work(attempt({"role": "assistant", "content": "It is 5."})) is None
    assert without_the_work(attempt(calling("c2", "answer", '{"text": "5"}'))) is None
    assert without_the_work(attempt(*ADDED)) is None
    assert without_the_work(jm.Trajectory(conversation=[SYSTEM])) is None


def test_an_answer_given_through_a_tool_is_also_probed_as_text() -> None:
    answered = attempt(*ADDED, calling("c2", "answer", '{"text": "5", "email_id": 3}'), reward=1.0)
    call_form, text_form = made_up_answers(answered)
    assert call_form.openai_messages()[-1]["tool_calls"][0]["function"]["name"] == "answer"
    assert text_form.openai_messages()[-1] == {"role": "assistant", "content": "5"}
    assert text_form.openai_messages()[:-1] == call_form.openai_messages()[:-1]
    assert text_form.id == f"{answered.id}~probe~text"
    # A prose answer has no other form; a call without a string argument has no text to write.
    prose = attempt(*ADDED, {"role": "assistant", "content": "It is 5."})
    assert [p.openai_messages()[-1]["content"] for p in made_up_answers(prose)] == ["It is 5."]
    no_text = without_the_work(attempt(*ADDED, calling("c2", "answer", '{"email_id": 3}')))
    assert no_text is not None and as_text(no_text) is None
    assert made_up_answers(attempt({"role": "assistant", "content": "It is 5."})) == []


def test_the_work_without_the_answer_keeps_every_call_and_ends_with_an_empty_reply() -> None:
    answered = attempt(*ADDED, calling("c2", "answer", '{"text": "5"}'), reward=1.0)
    probe = without_the_answer(answered)
    assert probe is not None and probe.id == f"{answered.id}~unanswered" and probe.reward is None
    assert probe.openai_messages() == [*answered.openai_messages()[:-1], {"role": "assistant", "content": ""}]
    prose = attempt(*ADDED, {"role": "assistant", "content": "It is 5."})
    assert without_the_answer(prose).openai_messages()[-2] == ADDED[1]  # type: ignore[union-attr]
    # No answer to leave out: an empty last reply, or no reply after the request.
    assert without_the_answer(attempt(*ADDED, {"role": "assistant", "content": " "})) is None
    assert without_the_answer(attempt()) is None
    assert [p.id.split("~", 1)[1] for p in probes(answered)] == ["probe", "probe~text", "unanswered"]


def group() -> jm.TrajectoryGroup:
    return jm.TrajectoryGroup(
        [
            attempt(*ADDED, {"role": "assistant", "content": "It is 5."}, reward=1.0),
            attempt(*ADDED, {"role": "assistant", "content": "It is 4."}, reward=0.0),
            attempt({"role": "assistant", "content": "It is 4."}, reward=0.0),
        ],
        id="probed",
    )


def reads_the_work(request: dict[str, Any]) -> Reply:
    """Yes only for an answer of 5 after the tool's result 5."""
    prompt = request["messages"][-1]["content"]
    return (
        verdict(0.9, 0.1) if "-> 5" in prompt and "final message: It is 5." in prompt else verdict(0.1, 0.9)
    )


def reads_the_claim(request: dict[str, Any]) -> Reply:
    """Yes for any answer of 5, however it was come by."""
    prompt = request["messages"][-1]["content"]
    return verdict(0.9, 0.1) if "final message: It is 5." in prompt else verdict(0.1, 0.9)


async def test_a_judge_that_reads_the_work_scores_the_made_up_answer_below_its_success(
    script: ScriptedJudge, judge: Judge
) -> None:
    script.respond = reads_the_work
    report = await calibrate_judge([group()], judge, method="verdict", probes=True)
    (calibrated,) = report.groups
    assert (calibrated.probes, calibrated.probes_below, calibrated.probes_tied) == (2, 2, 0)
    assert calibrated.probe_scores == [(pytest.approx(0.9), pytest.approx(0.1))] * 2
    assert report.probe_accuracy == 1.0 and report.to_dict()["summary"]["probe_accuracy"] == 1.0
    assert "or its calls without the answer): 2 of 2 scored below" in report.table()
    # The group's own pairs are counted as without probes: the probe is not one of its trajectories.
    assert (report.pairs, report.correct) == (2, 2) and calibrated.trajectories == 3


async def test_a_judge_that_reads_the_claim_is_caught_by_the_probe_though_it_ranks_the_group_right(
    script: ScriptedJudge, judge: Judge
) -> None:
    script.respond = reads_the_claim
    report = await calibrate_judge([group()], judge, method="verdict", probes=True)
    assert report.pairwise_accuracy == 1.0  # the group alone cannot tell the two judges apart
    assert report.probe_accuracy == 0.75 and report.groups[0].probes_tied == 1  # the made-up answer
    assert "1 of 2 scored below their success, 1 tied" in report.table()


async def test_a_judge_that_rewards_the_work_without_the_answer_is_caught_by_its_probe(
    script: ScriptedJudge, judge: Judge
) -> None:
    """Yes for any attempt that got the tool's result 5, answered or not: the hack the email policy
    learned next (read the right email, then end with an empty reply)."""
    script.respond = lambda request: (
        verdict(0.9, 0.1) if "-> 5" in request["messages"][-1]["content"] else verdict(0.1, 0.9)
    )
    report = await calibrate_judge([group()], judge, method="verdict", probes=True)
    (calibrated,) = report.groups
    assert calibrated.probe_scores == [(pytest.approx(0.9), pytest.approx(0.1)), (pytest.approx(0.9),) * 2]
    assert report.probe_accuracy == 0.75


async def test_the_text_form_catches_a_judge_that_believes_a_written_answer(
    script: ScriptedJudge, judge: Judge
) -> None:
    """An agent that answers through a tool: the judge refuses the answer call made without the
    search, but says yes to the same answer written as text, as the 1.5B did on the email task."""

    def believes_text(request: dict[str, Any]) -> Reply:
        prompt = request["messages"][-1]["content"]
        worked = "-> 5" in prompt and '<call>answer {"text": "5"}</call>' in prompt
        return verdict(0.9, 0.1) if worked or "final message: 5" in prompt else verdict(0.1, 0.9)

    script.respond = believes_text
    answers = jm.TrajectoryGroup(
        [
            attempt(*ADDED, calling("c2", "answer", '{"text": "5"}'), reward=1.0),
            attempt(
                calling("c1", "add", '{"a": 2, "b": 2}'),
                {"role": "tool", "tool_call_id": "c1", "content": "4"},
                calling("c2", "answer", '{"text": "4"}'),
                reward=0.0,
            ),
        ],
        id="answers",  # the attempts differ from their first call: the outcome shows each one's calls
    )
    report = await calibrate_judge([answers], judge, method="verdict", probes=True)
    (calibrated,) = report.groups
    assert report.pairwise_accuracy == 1.0
    assert (calibrated.probes, calibrated.probes_below, calibrated.probes_tied) == (3, 2, 1)


async def test_without_probes_nothing_more_is_judged(script: ScriptedJudge, judge: Judge) -> None:
    script.respond = reads_the_work
    report = await calibrate_judge([group()], judge, method="verdict")
    assert report.probe_accuracy is None and "made-up answers" not in report.table()
    assert len(script.received) == 3  # one verdict per trajectory, no fourth for a probe


def test_judge_calibrate_probes_through_the_cli(script: ScriptedJudge, tmp_path: Path) -> None:
    script.respond = reads_the_work
    ModelStore("demo", "agent", root=tmp_path).save_groups([group()], "train", 1)
    with running(script) as url:
        result = CliRunner().invoke(
            app,
            ["judge", "calibrate", "demo", "agent", "--judge-model", "judge", "--judge-base-url", url,
             "--method", "verdict", "--probes", "--out", str(tmp_path / "r.json"), "--root", str(tmp_path)],
        )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "2 of 2 scored below their success" in result.output
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["summary"]["probe_accuracy"] == 1.0 and report["groups"][0]["probes_below"] == 2
