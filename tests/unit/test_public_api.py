"""``import journeyman as jm``: the names most users need, and nothing else. A change to this list is
a change of the public API: the changelog says it, and a removed name is deprecated first (it warns
for one minor version, then goes)."""

from __future__ import annotations

import importlib
import warnings

import pytest

import journeyman as jm

EXPORTED = [
    "ConfigError",
    "EvalSet",
    "JourneymanError",
    "JudgeReward",
    "LoRAConfig",
    "LocalBackend",
    "LoopResult",
    "Model",
    "RemoteBackend",
    "SFTConfig",
    "TrainConfig",
    "TrainableModel",
    "TrainingLoop",
    "Trajectory",
    "TrajectoryGroup",
    "WarmStart",
    "__version__",
    "gather_trajectory_groups",
    "iterate_dataset",
    "rollout_info",
    "trainable",
]


def test_dir_lists_the_public_names_and_each_resolves() -> None:
    assert dir(jm) == EXPORTED == sorted(jm.__all__)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # none of them is deprecated
        for name in EXPORTED:
            assert getattr(jm, name) is not None


def test_the_outer_packages_names_are_their_own_objects() -> None:
    from journeyman.backend import LocalBackend
    from journeyman.integrations.trainable import trainable

    assert jm.LocalBackend is LocalBackend and jm.trainable is trainable


@pytest.mark.parametrize("name", sorted(jm.MOVED_NAMES))
def test_a_name_moved_out_of_jm_still_works_and_says_where_it_went(name: str) -> None:
    module, new = jm.MOVED_NAMES[name]
    if name in ("replay", "ruler"):  # modules of that name now: calling one still calls its function
        importlib.import_module(f"journeyman.{name}")
        called = getattr(jm, name)  # the package's attribute is the module once it is imported
        assert called is importlib.import_module(f"journeyman.{name}")
        with (
            pytest.warns(DeprecationWarning, match=rf"jm\.{name}\(\.\.\.\) is now {module}\.{new}\(\.\.\.\)"),
            pytest.raises(TypeError, match="missing"),  # the function's own error: it was called
        ):
            called()
        return
    with pytest.warns(
        DeprecationWarning,
        match=rf"jm\.{name} is now `from {module} import {new}` \(jm\.{name} goes in journeyman 0\.3\)",
    ):
        moved = getattr(jm, name)
    if name == "ruler_score_group":  # renamed with new defaults: the old name keeps 0.1's
        from journeyman.ruler import _judge_group_01

        assert moved is _judge_group_01
        return
    assert moved is getattr(importlib.import_module(module), new)


@pytest.mark.parametrize(
    ("old", "new"),
    [("SystemMessage", "SystemPrompt"), ("ToolMessage", "ToolResult"), ("AnyMessage", "Message")],
)
def test_message_names_that_clash_with_langchains_are_renamed_with_a_warning(old: str, new: str) -> None:
    import journeyman.messages

    with pytest.warns(
        DeprecationWarning,
        match=f"journeyman.messages.{old} is now {new} \\(journeyman.messages.{old} goes in journeyman 0.3\\)",
    ):
        assert getattr(journeyman.messages, old) is getattr(journeyman.messages, new)
    assert old not in journeyman.messages.__all__


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'Trainer'"):
        jm.Trainer  # noqa: B018
