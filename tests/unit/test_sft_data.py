"""journeyman.sft's data, without a model: JSONL in and out, the best of groups, the held-out draw,
turns put under another prompt, and the learning-rate schedule."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

import journeyman as jm
from journeyman.backend.training.sft import learning_rate_at
from journeyman.errors import InvalidDataError
from journeyman.messages import AssistantMessage, ModelTurn
from journeyman.sft import (
    as_text,
    best_trajectories,
    check_conversations,
    read_chat_jsonl,
    split_eval,
    with_context,
    write_chat_jsonl,
)

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
LINE = {
    "messages": [
        {"role": "system", "content": "Use the tools."},
        {"role": "user", "content": "1+1?"},
        {"role": "assistant", "content": "2", "weight": 0},
        {"role": "user", "content": "2+3?"},
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{\"a\": 2}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "5"},
        {"role": "assistant", "content": "5"},
    ],
    "tools": TOOLS,
}  # fmt: skip


def test_a_jsonl_line_becomes_a_trajectory_whose_weighted_turns_train_and_it_writes_back_the_same(
    tmp_path: Path,
) -> None:
    path = tmp_path / "in.jsonl"
    path.write_text(json.dumps(LINE) + "\n\n")
    (trajectory,) = read_chat_jsonl(path)
    assert trajectory.metadata["source"] == "in.jsonl line 1"
    assert [type(item).__name__ for item in trajectory.conversation] == [
        "SystemPrompt", "UserMessage", "AssistantMessage", "UserMessage", "ModelTurn", "ToolResult", "ModelTurn",
    ]  # fmt: skip
    assert trajectory.tools is not None and trajectory.tools[0].function.name == "add"
    out = write_chat_jsonl([trajectory], tmp_path / "out.jsonl")
    assert json.loads(out.read_text()) == LINE


def test_each_bad_line_is_named_with_what_is_wrong(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    lines = ['{"messages": [{"role": "wizard", "content": "x"}]}', '{"functions": [], "messages": []}', "[1]",
             '{"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y", "weight": 2}]}']  # fmt: skip
    path.write_text("\n".join(lines))
    with pytest.raises(InvalidDataError) as caught:
        read_chat_jsonl(path)
    text = str(caught.value)
    assert text.startswith("4 problem(s) in") and "nothing was trained" in text
    assert "bad.jsonl line 1: message 1 (wizard)" in text
    assert 'bad.jsonl line 2: "functions" is the older format' in text
    assert 'bad.jsonl line 3: a line is one JSON object with a "messages" list' in text
    assert "bad.jsonl line 4: message 2: weight is 0 or 1, got 2" in text
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(InvalidDataError, match="holds no conversations"):
        read_chat_jsonl(tmp_path / "empty.jsonl")
    with pytest.raises(InvalidDataError, match="cannot read"):
        read_chat_jsonl(tmp_path / "nowhere.jsonl")
    with pytest.raises(InvalidDataError, match="takes a list of trajectories"):
        check_conversations(jm.Trajectory())  # type: ignore[arg-type]
    with pytest.raises(InvalidDataError, match=r"item 0 is a dict, not a journeyman Trajectory"):
        check_conversations([{"messages": []}])  # type: ignore[list-item]


def _scored(*rewards: float | None) -> jm.TrajectoryGroup:
    group = jm.TrajectoryGroup([jm.Trajectory(metadata={"n": i}) for i in range(len(rewards))])
    for trajectory, reward in zip(group, rewards, strict=True):
        trajectory.reward = reward
    return group


def test_the_best_of_each_group_by_reward_and_threshold() -> None:
    groups = [_scored(0.2, 0.9, None, 0.9), _scored(0.1, 0.0)]
    assert [t.metadata["n"] for t in best_trajectories(groups)] == [1, 0]  # ties keep the group's order
    assert [t.metadata["n"] for t in best_trajectories(groups, per_group=2)] == [1, 3, 0, 1]
    assert [t.metadata["n"] for t in best_trajectories(groups, per_group=None, min_reward=0.2)] == [1, 3, 0]
    chosen = best_trajectories(groups)
    chosen[0].reward = 5.0
    assert groups[0].trajectories[1].reward == 0.9  # copies


def test_the_held_out_draw_is_seeded_and_never_empties_either_side() -> None:
    items = [jm.Trajectory(metadata={"n": i}) for i in range(10)]
    train, held = split_eval(items, 0.2, seed=3)
    assert len(held) == 2 and len(train) == 8
    assert [t.metadata["n"] for t in held] == [t.metadata["n"] for t in split_eval(items, 0.2, seed=3)[1]]
    assert {t.metadata["n"] for t in train} | {t.metadata["n"] for t in held} == set(range(10))
    assert [len(part) for part in split_eval(items[:2], 0.01)] == [1, 1]
    assert [len(part) for part in split_eval(items[:1], 0.5)] == [1, 0]
    assert split_eval(items, 0.0) == (items, [])


def test_another_prompt_replaces_what_came_before_the_task() -> None:
    (trajectory,) = read_chat_jsonl_text(LINE)
    turn = trajectory.conversation[4]
    assert isinstance(turn, ModelTurn)
    trajectory.conversation[4] = turn.model_copy(
        update={"prompt_token_ids": [1, 2], "completion_token_ids": [3]}
    )
    zero_shot = with_context(trajectory, [{"role": "system", "content": "No examples."}], tools=[])
    assert [m["role"] for m in zero_shot.openai_messages()] == [
        "system",
        "user",
        "assistant",
        "tool",
        "assistant",
    ]
    moved = zero_shot.conversation[2]
    assert (
        isinstance(moved, ModelTurn) and moved.prompt_token_ids is None and moved.completion_token_ids == [3]
    )
    assert zero_shot.tools == [] and zero_shot.metadata["context"] == "rewritten"
    with pytest.raises(InvalidDataError, match="no model turn"):
        with_context(jm.Trajectory(conversation=[{"role": "user", "content": "x"}]), [])
    with pytest.raises(InvalidDataError, match="no user message before its first model turn"):
        with_context(jm.Trajectory(conversation=[ModelTurn(message=AssistantMessage(content="x"))]), [])
    with pytest.raises(InvalidDataError, match="holds a model turn"):
        with_context(trajectory, [{"type": "model_turn", "message": {"role": "assistant", "content": "x"}}])


def read_chat_jsonl_text(line: dict[str, object]) -> list[jm.Trajectory]:
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "one.jsonl"
        path.write_text(json.dumps(line))
        return read_chat_jsonl(path)


@pytest.mark.parametrize(
    ("schedule", "after"),
    [
        ("constant", [1.0, 1.0, 1.0, 1.0]),
        ("linear", [1.0, 0.75, 0.5, 0.25]),
        ("cosine", [1.0, 0.5 * (1 + math.cos(math.pi / 4)), 0.5, 0.5 * (1 + math.cos(3 * math.pi / 4))]),
    ],
)
def test_the_schedule_warms_up_then_holds_or_falls(schedule: str, after: list[float]) -> None:
    config = jm.SFTConfig(learning_rate=1.0, schedule=schedule, warmup_ratio=0.4)  # type: ignore[arg-type]
    # 2 of 6 batches warm up (1/2, 2/2), then 4 from the peak towards 0
    assert [learning_rate_at(config, i, 6) for i in range(6)] == pytest.approx([0.5, 1.0, *after])


def test_a_teachers_turns_as_text_carry_no_token_ids() -> None:
    turn = {"type": "model_turn", "message": {"role": "assistant", "content": "5"},
            "prompt_token_ids": [1, 2], "completion_token_ids": [3], "logprobs": [-0.5]}  # fmt: skip
    teacher = jm.Trajectory(
        conversation=[{"role": "user", "content": "2+3?"}, turn],
        additional_histories=[jm.trajectory.History(conversation=[{"role": "user", "content": "x"}, turn])],
    )
    text = as_text(teacher)
    turns = [t for h in text.histories for t in h.model_turns]
    assert len(turns) == 2 and all(
        t.completion_token_ids is None and t.prompt_token_ids is None for t in turns
    )
    assert all(t.logprobs is None and t.message.content == "5" for t in turns)
    assert teacher.model_turns[0].completion_token_ids == [3]  # a copy
