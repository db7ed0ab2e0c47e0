"""Bad input gets a clear error that names what is wrong, and loses nothing already stored.

Prompts longer than the context and unknown served model names need the real server: they are
in test_serving_faults.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import journeyman as jm
from journeyman.errors import InvalidDataError, ModelPreparationError
from journeyman.messages import FunctionCall
from journeyman.store import ModelStore
from journeyman.trajectory import load_group, load_trajectory

GOOD = {"conversation": [{"role": "user", "content": "hi"}], "reward": 1.0}


@pytest.mark.parametrize(
    ("data", "where", "why"),
    [
        ({"conversation": "hi"}, "conversation", "valid list"),
        (
            {"conversation": [{"role": "robot", "content": "x"}]},
            "conversation.0",
            "a 'role' of system, developer",
        ),
        ({"conversation": [{"content": "x"}]}, "conversation.0", "needs a 'role'"),
        ({"conversation": [{"role": "user"}]}, "conversation.0.user.content", "Field required"),
        ({"conversation": [{"role": "system"}]}, "conversation.0.system.content", "Field required"),
        ({"conversation": [{"role": "tool", "content": "3"}]}, "tool_call_id", "Field required"),
        ({"conversation": [{"type": "model_turn"}]}, "message", "Field required"),
        ({"reward": "high"}, "reward", "valid number"),
        ({"reward": float("nan")}, "reward", "finite number"),
        ({"metrics": {"x": "fast"}}, "metrics.x", "valid number"),
        ({"metadata": {"x": [1]}}, "metadata.x", "valid string (got [1])"),  # the first scalar it may be
        ({"colour": "red"}, "colour", "Extra inputs"),
        (
            {
                "conversation": [
                    {
                        "type": "model_turn",
                        "message": {"role": "assistant", "content": "a"},
                        "completion_token_ids": [1, 2],
                        "logprobs": [-0.1],
                    }
                ]
            },
            "conversation.0",
            "has 2 tokens",
        ),
    ],
)
def test_malformed_trajectories_name_the_field_and_why(data: dict[str, Any], where: str, why: str) -> None:
    with pytest.raises(InvalidDataError) as caught:
        load_trajectory({**GOOD, **data})
    assert where in str(caught.value) and why in str(caught.value)
    with pytest.raises(InvalidDataError, match=r"trajectories\.0"):
        load_group({"trajectories": [{**GOOD, **data}]})


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ('{"trajectories": [', "Invalid JSON"),
        ("[]", "should be an object"),
        ('{"trajectories": {}}', "valid array"),
        ('{"failures": [{"type": "E"}]}', "failures.0.message"),
        ('{"failures": [{"type": "E", "message": "m", "stage": "lunch"}]}', "failures.0.stage"),
    ],
)
def test_malformed_groups_name_the_field_and_why(text: str, why: str) -> None:
    with pytest.raises(InvalidDataError, match="invalid trajectory group") as caught:
        load_group(text)
    assert why in str(caught.value)


def test_adding_a_bad_message_changes_nothing() -> None:
    trajectory = jm.Trajectory(conversation=[{"role": "user", "content": "hi"}])
    for bad in ({"role": "user"}, {"role": "wizard", "content": "x"}, "hi", None):
        with pytest.raises(InvalidDataError, match="invalid conversation item"):
            trajectory.add(bad)  # type: ignore[arg-type]
    assert len(trajectory.conversation) == 1


@pytest.mark.parametrize(
    ("arguments", "why"),
    [
        ('{"a": 1', "not valid JSON"),
        ("{a: 1}", "not valid JSON"),
        ("", "not valid JSON"),
        ("[1, 2]", "not an object"),
    ],
)
def test_tool_calls_with_invalid_json_arguments_are_kept_verbatim_and_explained(
    arguments: str, why: str
) -> None:
    turn = {"type": "model_turn", "message": {"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "add", "arguments": arguments}}]}}  # fmt: skip
    trajectory = jm.Trajectory(conversation=[{"role": "user", "content": "add"}, turn], reward=0.0)
    again = load_trajectory(trajectory.model_dump_json())  # what the model wrote is training data
    call = again.model_turns[0].message.tool_calls[0].function  # type: ignore[index]
    assert call.arguments == arguments
    with pytest.raises(InvalidDataError, match=f"tool call 'add' has arguments that .*{why}"):
        call.parsed_arguments()
    assert FunctionCall(name="add", arguments={"a": 1}).parsed_arguments() == {"a": 1}  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (lambda: jm.TrainConfig(learning_rate="fast"), "learning_rate"),
        (lambda: jm.TrainConfig(learning_rate=-1), "learning_rate"),
        (lambda: jm.TrainConfig(loss="ppo"), "loss"),
        (lambda: jm.TrainConfig(lerning_rate=1e-4), "lerning_rate"),
        (lambda: jm.LoRAConfig(rank="eight"), "rank"),
        (lambda: jm.LoRAConfig(dropout=1.5), "dropout"),
        (lambda: jm.TrainableModel(name="m", project="p", base_model="x", lora={"rank": "big"}), "lora.rank"),
        (lambda: jm.TrainableModel(name="m", project="p", base_model=3), "base_model"),
    ],
)
def test_wrong_types_in_configs_name_the_field_and_why(make: Any, field: str) -> None:
    with pytest.raises(ValueError, match=r"1 validation error") as caught:  # pydantic's, field by field
        make()
    assert f"\n{field}\n  " in str(caught.value)
    with pytest.raises(jm.ConfigError, match="no '/'"):
        jm.TrainableModel(name="a/b", project="p", base_model="smollm2-135m")


async def test_a_rollout_returning_garbage_is_a_recorded_failure() -> None:
    async def garbage() -> Any:
        return {"reward": 1}

    async def good() -> jm.Trajectory:
        return jm.Trajectory(**GOOD)

    (group,) = await jm.gather_trajectory_groups(
        [jm.TrajectoryGroup([good(), garbage()])], max_exceptions=1, progress=False
    )
    assert len(group) == 1
    (failure,) = group.failures
    assert failure.type == "InvalidDataError" and "returned dict, not a Trajectory" in failure.message


def test_a_corrupt_line_in_stored_groups_names_the_file_and_line_and_keeps_the_rest(tmp_path: Path) -> None:
    store = ModelStore("p", "m", root=tmp_path)
    good = jm.TrajectoryGroup([jm.Trajectory(**GOOD)])
    path = store.save_groups([good], "train", 0)
    with path.open("a") as handle:
        handle.write(json.dumps({"trajectories": [{"reward": "x"}]}) + "\n")
    with pytest.raises(InvalidDataError, match=rf"{path.name}, line 2: invalid trajectory group"):
        store.load_groups("train", 0)
    assert load_group(path.read_text().splitlines()[0]) == good


async def test_unknown_base_models_fail_before_anything_starts(tmp_path: Path) -> None:
    from journeyman.backend import LocalBackend

    async with LocalBackend(root=tmp_path) as backend:
        model = jm.TrainableModel(
            name="m", project="p", base_model="no-such-org/no-such-model", root=tmp_path
        )
        with pytest.raises(ModelPreparationError, match=r"no-such-org/no-such-model.*smollm2-135m"):
            await model.register(backend)
        assert backend.server is None
        folder = tmp_path / "not-a-model"
        folder.mkdir()
        model = jm.TrainableModel(name="m", project="p", base_model=str(folder), root=tmp_path)
        with pytest.raises(ModelPreparationError, match=r"no config\.json"):
            await model.register(backend)
        assert backend.server is None


async def test_train_refuses_what_is_not_a_list_of_groups(tmp_path: Path) -> None:

    from journeyman.backend.training.trainer import Trainer

    trainer = Trainer("smollm2-135m", ModelStore("p", "m", root=tmp_path))
    group = jm.TrajectoryGroup([jm.Trajectory(**GOOD)])
    with pytest.raises(InvalidDataError, match="list of TrajectoryGroup"):
        await trainer.train(group)  # type: ignore[arg-type]
    with pytest.raises(InvalidDataError, match="list of TrajectoryGroup"):
        await trainer.train([jm.Trajectory(**GOOD)])  # type: ignore[list-item]
    with pytest.raises(jm.ConfigError, match="at least one group"):
        await trainer.train([])
    assert not (tmp_path / "p").exists()  # nothing was written, nothing was loaded
