from __future__ import annotations

import math

import pytest
from hypothesis import given, settings

import journeyman as jm
from journeyman.errors import InvalidDataError
from journeyman.messages import AssistantMessage
from journeyman.trajectory import load_group, load_trajectory
from tests.strategies import groups, trajectories


@settings(max_examples=150, deadline=None)
@given(groups())
def test_group_json_round_trip_is_exact(group: jm.TrajectoryGroup) -> None:
    text = group.model_dump_json()
    again = jm.TrajectoryGroup.model_validate_json(text)
    assert again == group
    assert again.model_dump_json() == text
    assert jm.TrajectoryGroup.model_validate(group.model_dump()) == group


@settings(max_examples=100, deadline=None)
@given(trajectories())
def test_trajectory_round_trip_through_load(trajectory: jm.Trajectory) -> None:
    assert load_trajectory(trajectory.model_dump_json()) == trajectory
    assert load_trajectory(trajectory.model_dump(mode="json")) == trajectory


def _conversation() -> list[dict[str, object]]:
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
    return [
        {"role": "user", "content": "What is 2+3?"},
        {
            "type": "model_turn",
            "message": {"role": "assistant", "tool_calls": [call]},
            "completion_token_ids": [7],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "5"},
        {"type": "model_turn", "message": {"role": "assistant", "content": "5"}},
    ]


def test_messages_and_model_turns_views() -> None:
    trajectory = jm.Trajectory(conversation=_conversation())
    assert [m.role for m in trajectory.messages] == ["user", "assistant", "tool", "assistant"]
    assert len(trajectory.model_turns) == 2
    sent = trajectory.openai_messages()
    assert sent[1] == {
        "role": "assistant",
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
        ],
    }
    assert sent[3] == {"role": "assistant", "content": "5"}


def test_add_validates_and_reports_bad_items() -> None:
    trajectory = jm.Trajectory()
    trajectory.add({"role": "user", "content": "hi"})
    trajectory.add(AssistantMessage(content="hello"))
    assert [m.role for m in trajectory.messages] == ["user", "assistant"]
    with pytest.raises(InvalidDataError, match="needs a 'role'"):
        trajectory.add({"role": "wizard", "content": "?"})
    assert len(trajectory.conversation) == 2  # nothing half-added


def test_histories_put_the_main_conversation_first() -> None:
    trajectory = jm.Trajectory(conversation=_conversation(), additional_histories=[{"name": "helper"}])
    histories = trajectory.histories
    assert [h.name for h in histories] == [None, "helper"]
    assert histories[0].conversation == trajectory.conversation


@pytest.mark.parametrize("reward", [math.nan, math.inf, -math.inf])
def test_reward_must_be_finite(reward: float) -> None:
    with pytest.raises(InvalidDataError, match=r"reward: .*finite number"):
        load_trajectory({"reward": reward})
    trajectory = jm.Trajectory(reward=1.0)
    with pytest.raises(ValueError, match="finite"):
        trajectory.reward = reward  # assignment is validated too
    assert trajectory.reward == 1.0


def test_load_errors_list_every_bad_field() -> None:
    with pytest.raises(InvalidDataError) as caught:
        load_group({"trajectories": [{"reward": "high"}, {"conversation": [{"role": "user"}]}], "colour": 1})
    text = str(caught.value)
    assert "3 problem(s)" in text
    assert "trajectories.0.reward: Input should be a valid number" in text
    assert "trajectories.1.conversation.0.user.content: Field required" in text
    assert "colour: Extra inputs are not permitted" in text


def test_load_rejects_malformed_json_with_a_clear_error() -> None:
    with pytest.raises(InvalidDataError, match="invalid trajectory group"):
        load_group('{"trajectories": [')


def test_group_reward_statistics_skip_unscored() -> None:
    group = jm.TrajectoryGroup([jm.Trajectory(reward=1.0), jm.Trajectory(reward=0.0), jm.Trajectory()])
    assert len(group) == 3
    assert group.rewards == [1.0, 0.0]
    assert group.reward == 0.5
    assert group.reward_std == 0.5
    assert jm.TrajectoryGroup().reward is None


def test_group_takes_trajectories_positionally_or_by_name_not_both() -> None:
    one = jm.Trajectory(reward=1.0)
    assert jm.TrajectoryGroup([one]).trajectories == jm.TrajectoryGroup(trajectories=[one]).trajectories
    assert list(jm.TrajectoryGroup(t for t in [one])) == [one]
    with pytest.raises(TypeError, match="not both"):
        jm.TrajectoryGroup([one], trajectories=[one])


def test_failures_are_kept_with_type_message_and_traceback() -> None:
    group = jm.TrajectoryGroup()
    try:
        raise TimeoutError("tool took too long")
    except TimeoutError as error:
        failure = group.record_failure(error, stage="tool", trajectory_id="t1")
    assert group.failures == [failure]
    assert (failure.type, failure.message, failure.stage, failure.trajectory_id) == (
        "TimeoutError",
        "tool took too long",
        "tool",
        "t1",
    )
    assert failure.traceback is not None and "raise TimeoutError" in failure.traceback
    assert load_group(group.model_dump_json()).failures == [failure]


def test_finish_track_and_log() -> None:
    trajectory = jm.Trajectory()
    assert trajectory.duration is None
    with trajectory.track("tool"):
        pass
    with trajectory.track("tool"):
        pass
    trajectory.log("judge: good")
    trajectory.finish()
    assert trajectory.timings["tool"] >= 0
    assert trajectory.duration is not None and trajectory.duration >= 0
    assert trajectory.logs == ["judge: good"]
