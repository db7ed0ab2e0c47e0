"""journeyman: on-the-job reinforcement learning for the LLM agents you already run.

``import journeyman`` is light: it never imports torch, vLLM, LangChain, CrewAI or Langfuse.
Those live behind ``journeyman.backend`` and ``journeyman.integrations`` and their extras.
"""

from typing import Any

from journeyman.calibration import Calibration, GroupCalibration, calibrate_judge
from journeyman.config import LoRAConfig, TrainConfig
from journeyman.data import DatasetBatch, iterate_dataset
from journeyman.errors import (
    AdapterError,
    BackendError,
    ConfigError,
    ExportError,
    InvalidDataError,
    JourneymanError,
    JudgeError,
    MissingDependencyError,
    ModelPreparationError,
    RolloutError,
    ServerStartError,
    StorageError,
)
from journeyman.gate import Gate, GateDecision, promote_canary_if_better, promote_if_better
from journeyman.gather import gather_trajectory_groups, retry
from journeyman.judge import Judge
from journeyman.loop import EvalSet, JudgeReward, TrainingLoop, rollout_info
from journeyman.messages import (
    AnyMessage,
    AssistantMessage,
    FunctionCall,
    FunctionDefinition,
    Item,
    Message,
    ModelTurn,
    SystemMessage,
    Tool,
    ToolCall,
    ToolMessage,
    UserMessage,
)
from journeyman.model import Backend, Model, Registration, TrainableModel, TrainResult
from journeyman.records import CompletionRecord
from journeyman.remote import RemoteBackend
from journeyman.replay import (
    Scenario,
    read_scenarios,
    replay,
    scenarios_from_trajectories,
    split_held_out,
    write_scenarios,
)
from journeyman.ruler import (
    DEFAULT_PAIRWISE_RUBRIC,
    DEFAULT_RUBRIC,
    DEFAULT_VERDICT_RUBRIC,
    Judgement,
    Score,
    judge_trajectories,
    ruler,
    ruler_score_group,
)
from journeyman.store import ModelStore
from journeyman.trajectory import Failure, History, Trajectory, TrajectoryGroup, load_group, load_trajectory

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # @jm.trainable lives with the other integrations; core finds it by its entry point (plugins).
    if name == "trainable":
        from journeyman.plugins import EXPORTS, load

        return load(EXPORTS, name)
    raise AttributeError(f"module 'journeyman' has no attribute {name!r}")


__all__ = [
    "DEFAULT_PAIRWISE_RUBRIC",
    "DEFAULT_RUBRIC",
    "DEFAULT_VERDICT_RUBRIC",
    "AdapterError",
    "AnyMessage",
    "AssistantMessage",
    "Backend",
    "BackendError",
    "Calibration",
    "CompletionRecord",
    "ConfigError",
    "DatasetBatch",
    "EvalSet",
    "ExportError",
    "Failure",
    "FunctionCall",
    "FunctionDefinition",
    "Gate",
    "GateDecision",
    "GroupCalibration",
    "History",
    "InvalidDataError",
    "Item",
    "JourneymanError",
    "Judge",
    "JudgeError",
    "JudgeReward",
    "Judgement",
    "LoRAConfig",
    "Message",
    "MissingDependencyError",
    "Model",
    "ModelPreparationError",
    "ModelStore",
    "ModelTurn",
    "Registration",
    "RemoteBackend",
    "RolloutError",
    "Scenario",
    "Score",
    "ServerStartError",
    "StorageError",
    "SystemMessage",
    "Tool",
    "ToolCall",
    "ToolMessage",
    "TrainConfig",
    "TrainResult",
    "TrainableModel",
    "TrainingLoop",
    "Trajectory",
    "TrajectoryGroup",
    "UserMessage",
    "__version__",
    "calibrate_judge",
    "gather_trajectory_groups",
    "iterate_dataset",
    "judge_trajectories",
    "load_group",
    "load_trajectory",
    "promote_canary_if_better",
    "promote_if_better",
    "read_scenarios",
    "replay",
    "retry",
    "rollout_info",
    "ruler",
    "ruler_score_group",
    "scenarios_from_trajectories",
    "split_held_out",
    "trainable",
    "write_scenarios",
]
