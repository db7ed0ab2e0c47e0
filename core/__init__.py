"""journeyman: on-the-job reinforcement learning for the LLM agents you already run.

``import journeyman as jm`` offers what most users need (``dir(jm)``); the rest lives in its module:
``journeyman.judge`` (judges, judging a group, calibration),
``journeyman.messages``, ``journeyman.errors``, ``journeyman.replay``, ``journeyman.gate``
(promotion), ``journeyman.store``, ``journeyman.trajectory``.

``import journeyman`` is light: it never imports torch, vLLM, LangChain, CrewAI or Langfuse.
``jm.LocalBackend`` and ``jm.trainable`` live in the outer packages and load on first use.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from journeyman._deprecated import warn
from journeyman.config import LoRAConfig, SFTConfig, TrainConfig
from journeyman.data import iterate_dataset
from journeyman.errors import ConfigError, JourneymanError
from journeyman.gather import gather_trajectory_groups
from journeyman.loop import EvalSet, JudgeReward, LoopResult, TrainingLoop, WarmStart, rollout_info
from journeyman.model import Model, TrainableModel
from journeyman.remote import RemoteBackend
from journeyman.trajectory import Trajectory, TrajectoryGroup

if TYPE_CHECKING:  # for type checkers and IDEs; at run time their entry points (journeyman.plugins)
    from journeyman.backend import LocalBackend
    from journeyman.integrations.trainable import trainable

__version__ = "0.2.0.dev0"

__all__ = [
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

_OUTER = ("LocalBackend", "trainable")
"""Names from the outer packages, found by the ``journeyman.exports`` entry points."""

_MOVED = {
    "journeyman.data": ("DatasetBatch",),
    "journeyman.errors": (
        "AdapterError", "BackendError", "ExportError", "InvalidDataError", "JudgeError",
        "MissingDependencyError", "ModelPreparationError", "RolloutError", "ServerStartError",
        "StorageError",
    ),
    "journeyman.gate": ("Gate", "GateDecision", "promote_canary_if_better", "promote_if_better"),
    "journeyman.gather": ("retry",),
    "journeyman.judge": (
        "Calibration", "DEFAULT_PAIRWISE_RUBRIC", "DEFAULT_RUBRIC", "DEFAULT_VERDICT_RUBRIC",
        "GroupCalibration", "Judge", "Judgement", "Score", "calibrate_judge", "judge_trajectories",
    ),
    "journeyman.messages": (
        "AssistantMessage", "FunctionCall", "FunctionDefinition", "Item", "Message", "ModelTurn",
        "Tool", "ToolCall", "UserMessage",
    ),
    "journeyman.model": ("Backend", "Registration", "TrainResult"),
    "journeyman.records": ("CompletionRecord",),
    "journeyman.replay": (
        "Scenario", "read_scenarios", "replay", "scenarios_from_trajectories", "split_held_out",
        "write_scenarios",
    ),
    "journeyman.store": ("ModelStore",),
    "journeyman.trajectory": ("Failure", "History", "load_group", "load_trajectory"),
}  # fmt: skip
"""Names ``jm`` exported in 0.1, kept with a warning until 0.3: import them from their module."""

MOVED_NAMES = {name: (module, name) for module, names in _MOVED.items() for name in names} | {
    "AnyMessage": ("journeyman.messages", "Message"),  # three unions of the same messages are one
    "SystemMessage": ("journeyman.messages", "SystemPrompt"),  # LangChain has a SystemMessage
    "ToolMessage": ("journeyman.messages", "ToolResult"),  # and a ToolMessage
    "ruler": ("journeyman.judge", "score_trajectories"),  # named by what they do
    "ruler_score_group": ("journeyman.judge", "judge_group"),
}
"""Old name -> (module, name there)."""

_KEEPS_01_DEFAULTS = {"ruler": "_ruler_01", "ruler_score_group": "_judge_group_01"}
"""Renamed functions whose defaults changed: the old name keeps 0.1's (``method="scores"``,
``reward_from="score"``), from ``journeyman.ruler``."""


def __getattr__(name: str) -> Any:
    if name in _OUTER:
        from journeyman.plugins import EXPORTS, load

        return load(EXPORTS, name)
    if (moved := MOVED_NAMES.get(name)) is not None:
        module, new = moved
        warn(f"jm.{name}", f"`from {module} import {new}`")
        if name in _KEEPS_01_DEFAULTS:
            return getattr(import_module("journeyman.ruler"), _KEEPS_01_DEFAULTS[name])
        return getattr(import_module(module), new)
    raise AttributeError(f"module 'journeyman' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
