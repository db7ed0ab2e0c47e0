"""Trajectories and groups: the currency of journeyman.

A :class:`Trajectory` is one attempt at a task: the conversation (messages and model turns), the
tools the model saw, the reward it earned, metrics, metadata, logs and timings. Sub-agents and
conversations that diverge from the main one (a summarised context, a second agent of a crew)
are extra :class:`History` objects; all histories of a trajectory share its reward.

A :class:`TrajectoryGroup` holds the attempts at one scenario, which GRPO compares with each
other, and the failures recorded while producing them (a rollout, reward or judge that raised):
failures are data, kept with type, message and traceback, never dropped silently.

Both round-trip exactly through JSON::

    text = group.model_dump_json()
    assert TrajectoryGroup.model_validate_json(text) == group

:func:`load_group` / :func:`load_trajectory` do the same with errors turned into
:class:`~journeyman.errors.InvalidDataError` that name each bad field and why.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import logging
import math
import statistics
import time
import traceback as traceback_module
import uuid
from collections.abc import Awaitable, Generator, Iterable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any, Literal, Protocol, TypeAlias

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, TypeAdapter, ValidationError, field_validator

from journeyman.errors import InvalidDataError, RolloutError
from journeyman.messages import Item, Message, ModelTurn, Tool, item_message

__all__ = [
    "Failure",
    "History",
    "JsonScalar",
    "RolloutObserver",
    "Trajectory",
    "TrajectoryGroup",
    "first_error",
    "format_validation_error",
    "load_group",
    "load_trajectory",
    "rollout_observer",
]

logger = logging.getLogger("journeyman.gather")  # rollouts are run (and fail) inside a gather

JsonScalar: TypeAlias = str | int | float | bool | None
"""A metadata value: anything JSON can hold that is not a container."""

_items: TypeAdapter[Item] = TypeAdapter(Item)


class RolloutObserver(Protocol):
    """Told of each rollout a group finishes awaiting (``gather_trajectory_groups`` counts them and
    shows progress). It may raise :class:`RolloutError` to stop the gather."""

    def rollout_finished(self, trajectory: Trajectory | None, error: Exception | None) -> None: ...


rollout_observer: contextvars.ContextVar[RolloutObserver | None] = contextvars.ContextVar(
    "journeyman_rollout_observer", default=None
)


def first_error(errors: BaseExceptionGroup[RolloutError]) -> RolloutError:
    """The first leaf of a (possibly nested) exception group."""
    first: BaseException = errors
    while isinstance(first, BaseExceptionGroup):
        first = first.exceptions[0]
    assert isinstance(first, RolloutError)
    return first


def _new_id() -> str:
    return uuid.uuid4().hex


def _now() -> datetime:
    return datetime.now(UTC)


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class History(_Record):
    """A conversation: ordered messages and model turns, and the tools the model could call."""

    name: str | None = None
    """What produced this conversation: an agent's role, a graph node, a sub-agent."""
    conversation: list[Item] = Field(default_factory=list)
    """Messages and model turns, in the order they happened."""
    tools: list[Tool] | None = None
    """The tool schemas the model was given (``None``: no tools)."""

    def add(self, item: Item | dict[str, Any]) -> None:
        """Append a message or model turn, validating it (a dict in OpenAI format is accepted)."""
        try:
            self.conversation.append(_items.validate_python(item))
        except ValidationError as error:
            raise InvalidDataError(format_validation_error(error, "conversation item")) from None

    @property
    def messages(self) -> list[Message]:
        """The conversation as plain chat messages (model turns become their assistant message)."""
        return [item_message(item) for item in self.conversation]

    def openai_messages(self) -> list[dict[str, Any]]:
        """The conversation as OpenAI API message dicts (unset fields left out), ready to send."""
        return [message.model_dump(exclude_none=True) for message in self.messages]

    @property
    def model_turns(self) -> list[ModelTurn]:
        """The model turns of the conversation: what training learns from."""
        return [item for item in self.conversation if isinstance(item, ModelTurn)]


class Trajectory(History):
    """One attempt at a task, with its reward."""

    id: str = Field(default_factory=_new_id)
    """Unique id; also used to derive trace ids when exported."""
    additional_histories: list[History] = Field(default_factory=list)
    """Conversations beside the main one (sub-agents, diverging contexts); they share the reward."""
    reward: float | None = None
    """The reward; ``None`` until something scored the trajectory (never trained on while None)."""
    metrics: dict[str, float | int | bool] = Field(default_factory=dict)
    """Numbers worth averaging across trajectories (a metric is a reward of weight 0)."""
    metadata: dict[str, JsonScalar] = Field(default_factory=dict)
    """Labels: scenario id, difficulty, ... (not averaged)."""
    logs: list[str] = Field(default_factory=list)
    """Free-form notes: judge explanations, tool errors, anything a person debugging would want."""
    started_at: datetime = Field(default_factory=_now)
    finished_at: datetime | None = None
    timings: dict[str, float] = Field(default_factory=dict)
    """Seconds spent per named phase (see :meth:`track`)."""
    initial_policy_version: int | None = None
    """Training step of the adapter that served the first model turn."""
    final_policy_version: int | None = None
    """Training step of the adapter that served the last model turn."""

    @field_validator("reward")
    @classmethod
    def _finite_reward(cls, value: float | None) -> float | None:
        if value is not None and not math.isfinite(value):
            raise ValueError(
                f"reward must be a finite number, got {value}: score the trajectory or leave it None"
            )
        return value

    @property
    def histories(self) -> list[History]:
        """The main conversation followed by the additional histories."""
        main = History(name=self.name, conversation=self.conversation, tools=self.tools)
        return [main, *self.additional_histories]

    @property
    def policy_versions(self) -> list[int]:
        """The training steps of the policies whose samples it holds (every history's model turns),
        in order; empty when only the base model, or no recorded version, answered."""
        turns = [t for history in self.histories for t in history.model_turns]
        return sorted({t.policy_version for t in turns if t.policy_version is not None})

    @property
    def duration(self) -> float | None:
        """Seconds from start to :meth:`finish`, or None while unfinished."""
        if self.finished_at is None:
            return None
        return (self.finished_at - self.started_at).total_seconds()

    def log(self, message: str) -> None:
        """Append a line to the trajectory's logs."""
        self.logs.append(message)

    def finish(self) -> Trajectory:
        """Mark the trajectory finished (records ``finished_at``); returns it for chaining."""
        self.finished_at = _now()
        return self

    @contextmanager
    def track(self, name: str) -> Iterator[None]:
        """Add the seconds spent inside the block to ``timings[name]``."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.timings[name] = self.timings.get(name, 0.0) + time.perf_counter() - start


class Failure(_Record):
    """An exception raised while producing, scoring or exporting a trajectory, kept as data."""

    type: str
    """The exception's class name, e.g. ``TimeoutError``."""
    message: str
    traceback: str | None = None
    stage: Literal["rollout", "reward", "judge", "tool", "export", "train", "other"] = "rollout"
    """Where it happened."""
    trajectory_id: str | None = None
    """The trajectory it belongs to, when one exists."""
    time: datetime = Field(default_factory=_now)

    @classmethod
    def from_exception(
        cls,
        error: BaseException,
        *,
        stage: Literal["rollout", "reward", "judge", "tool", "export", "train", "other"] = "rollout",
        trajectory_id: str | None = None,
    ) -> Failure:
        return cls(
            type=type(error).__name__,
            message=str(error),
            traceback="".join(traceback_module.format_exception(error)),
            stage=stage,
            trajectory_id=trajectory_id,
        )


class TrajectoryGroup(_Record):
    """The attempts at one scenario, compared with each other by GRPO, and the failures met.

    ``TrajectoryGroup(trajectories)`` takes them positionally. Given rollout coroutines instead
    (``TrajectoryGroup(rollout(s) for _ in range(8))``), the group is awaitable: ``await group``
    runs them concurrently, keeps each trajectory and records each failure.
    """

    id: str = Field(default_factory=_new_id)
    trajectories: list[Trajectory] = Field(default_factory=list)
    failures: list[Failure] = Field(default_factory=list)
    """Exceptions recorded while producing or scoring this group (type, message, traceback)."""
    metadata: dict[str, JsonScalar] = Field(default_factory=dict)
    metrics: dict[str, float | int | bool] = Field(default_factory=dict)
    logs: list[str] = Field(default_factory=list)

    _pending: list[Awaitable[Any]] = PrivateAttr(default_factory=list)

    def __init__(
        self, trajectories: Iterable[Trajectory | Awaitable[Trajectory]] | None = None, /, **data: Any
    ) -> None:
        pending: list[Awaitable[Any]] = []
        if trajectories is not None:
            if "trajectories" in data:
                raise TypeError("pass the trajectories positionally or as trajectories=..., not both")
            done: list[Trajectory] = []
            for item in trajectories:
                if inspect.isawaitable(item):
                    pending.append(item)
                else:
                    done.append(item)
            data["trajectories"] = done
        super().__init__(**data)
        self._pending = pending

    def __await__(self) -> Generator[Any, None, TrajectoryGroup]:
        """Run the rollouts given as coroutines; failures are recorded on the group."""
        pending, self._pending = self._pending, []
        return self._collect(pending).__await__()

    async def _collect(self, pending: list[Awaitable[Any]]) -> TrajectoryGroup:
        """The rollouts' trajectories join the group in the order the rollouts were given, not
        the order they finished: a seeded run judges and trains on the same batch each time."""
        observer = rollout_observer.get()
        finished: list[Trajectory | None] = [None] * len(pending)

        async def one(index: int, awaitable: Awaitable[Any]) -> None:
            result, failure = None, None
            try:
                result = await awaitable
                if not isinstance(result, Trajectory):
                    raise InvalidDataError(f"a rollout returned {type(result).__name__}, not a Trajectory")
                finished[index] = result
            except asyncio.CancelledError:
                raise
            except Exception as error:
                result, failure = None, error
                self.record_failure(error, stage="rollout")
                logger.warning("a rollout failed: %s: %s", type(error).__name__, error)
            if observer is not None:
                observer.rollout_finished(result, failure)

        try:
            async with asyncio.TaskGroup() as tasks:
                for index, awaitable in enumerate(pending):
                    tasks.create_task(one(index, awaitable))
        except* RolloutError as errors:
            raise first_error(errors) from None
        finally:  # also what finished before an error or a cancel
            self.trajectories.extend(t for t in finished if t is not None)
        return self

    def __len__(self) -> int:
        return len(self.trajectories)

    def __iter__(self) -> Iterator[Trajectory]:  # type: ignore[override]  # iterate trajectories, not fields
        return iter(self.trajectories)

    @property
    def rewards(self) -> list[float]:
        """The rewards of the scored trajectories."""
        return [t.reward for t in self.trajectories if t.reward is not None]

    @property
    def reward(self) -> float | None:
        """Mean reward of the scored trajectories; None when none is scored."""
        rewards = self.rewards
        return statistics.fmean(rewards) if rewards else None

    @property
    def reward_std(self) -> float | None:
        """Population standard deviation of the rewards; None when none is scored."""
        rewards = self.rewards
        return statistics.pstdev(rewards) if rewards else None

    def record_failure(
        self,
        error: BaseException,
        *,
        stage: Literal["rollout", "reward", "judge", "tool", "export", "train", "other"] = "rollout",
        trajectory_id: str | None = None,
    ) -> Failure:
        """Keep an exception as data on the group and return the record."""
        failure = Failure.from_exception(error, stage=stage, trajectory_id=trajectory_id)
        self.failures.append(failure)
        return failure


def format_validation_error(error: ValidationError, what: str) -> str:
    """A pydantic error as one message: each bad field's path and why, one per line."""
    lines = [f"invalid {what}: {error.error_count()} problem(s)"]
    for problem in error.errors(include_url=False):
        location = ".".join(str(part) for part in problem["loc"]) or "(top level)"
        given = repr(problem.get("input"))
        if len(given) > 80:
            given = given[:77] + "..."
        lines.append(f"  {location}: {problem['msg']} (got {given})")
    return "\n".join(lines)


def _load(model: type[BaseModel], data: str | bytes | dict[str, Any], what: str) -> Any:
    try:
        if isinstance(data, str | bytes):
            return model.model_validate_json(data)
        return model.model_validate(data)
    except ValidationError as error:
        raise InvalidDataError(format_validation_error(error, what)) from None


def load_trajectory(data: str | bytes | dict[str, Any]) -> Trajectory:
    """A trajectory from JSON text or a dict; :class:`InvalidDataError` names each bad field."""
    result: Trajectory = _load(Trajectory, data, "trajectory")
    return result


def load_group(data: str | bytes | dict[str, Any]) -> TrajectoryGroup:
    """A group from JSON text or a dict; :class:`InvalidDataError` names each bad field."""
    result: TrajectoryGroup = _load(TrajectoryGroup, data, "trajectory group")
    return result
