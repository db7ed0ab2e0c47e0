"""Properties of the trajectory schema: any input is either a valid trajectory or one clear error."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import journeyman as jm
from journeyman.errors import InvalidDataError
from journeyman.store import ModelStore
from journeyman.trajectory import load_group, load_trajectory
from tests.strategies import groups, items, trajectories

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)
KEYS = ["conversation", "tools", "reward", "metrics", "metadata", "logs", "id", "additional_histories",
        "started_at", "timings", "role", "content", "type", "message", "tool_calls"]  # fmt: skip
# Dicts whose keys are mostly the schema's own, so the values get checked rather than only the keys.
near_trajectories = st.dictionaries(st.sampled_from(KEYS), json_values, max_size=5)


@settings(max_examples=300, deadline=None)
@given(st.one_of(json_values, near_trajectories))
def test_any_json_is_a_trajectory_or_an_invalid_data_error(data: Any) -> None:
    for given_as in (data, json.dumps(data)):
        try:
            trajectory = load_trajectory(given_as)
        except InvalidDataError as error:
            assert str(error).startswith("invalid trajectory: ")
            assert "problem(s)" in str(error)
        else:
            assert load_trajectory(trajectory.model_dump_json()) == trajectory


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=60) | st.text(max_size=60))
def test_any_bytes_are_a_group_or_an_invalid_data_error(raw: bytes | str) -> None:
    try:
        group = load_group(raw)
    except InvalidDataError as error:
        assert "invalid trajectory group" in str(error)
    else:
        assert load_group(group.model_dump_json()) == group


@settings(max_examples=150, deadline=None)
@given(
    trajectories(), st.sampled_from(["reward", "metrics", "conversation", "logs", "started_at"]), json_values
)
def test_a_wrong_value_in_a_valid_trajectory_is_named(
    trajectory: jm.Trajectory, field: str, value: Any
) -> None:
    data = trajectory.model_dump(mode="json") | {field: value}
    try:
        loaded = load_trajectory(data)
    except InvalidDataError as error:
        assert f"\n  {field}" in str(error)  # the path of each problem starts at the bad field
    else:  # the value happened to be valid there: it is kept, and round-trips
        assert load_trajectory(loaded.model_dump_json()) == loaded


@settings(max_examples=100, deadline=None)
@given(st.lists(items(), max_size=5), items())
def test_added_items_validate_like_loaded_ones(
    conversation: list[dict[str, Any]], item: dict[str, Any]
) -> None:
    history = jm.Trajectory(conversation=conversation)
    history.add(item)
    assert load_trajectory(history.model_dump_json()).conversation[-1] == history.conversation[-1]


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(groups(), min_size=1, max_size=3))
def test_stored_groups_come_back_equal_with_their_failures(
    tmp_path: Path, stored: list[jm.TrajectoryGroup]
) -> None:
    store = ModelStore("p", "m", root=tmp_path)
    step = len(store.steps("train"))
    store.save_groups(stored, "train", step)
    assert store.load_groups("train", step) == stored


@pytest.mark.parametrize("reward", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_rewards_are_refused_everywhere(reward: float) -> None:
    with pytest.raises(InvalidDataError, match="finite number"):
        load_trajectory({"reward": reward})
    trajectory = jm.Trajectory()
    with pytest.raises(ValueError, match="finite number"):
        trajectory.reward = reward
    assert trajectory.reward is None


def test_line_separators_inside_text_survive_the_store(tmp_path: Path) -> None:
    # JSON leaves U+0085, U+2028 and U+2029 unescaped; str.splitlines() would cut a stored line there.
    store = ModelStore("p", "m", root=tmp_path)
    group = jm.TrajectoryGroup(
        [jm.Trajectory(conversation=[{"role": "user", "content": "a\x85b\u2028c\u2029d\x1ce"}])]
    )
    store.save_groups([group], "train", 0)
    assert store.load_groups("train", 0) == [group]
