"""``@jm.trainable``: a plain OpenAI-SDK agent function becomes a rollout that returns a Trajectory.

::

    @jm.trainable(model)
    async def agent(scenario, client) -> float:      # client: the model's OpenAI client
        response = await client.chat.completions.create(messages=[...])   # model= is filled in
        return 1.0 if ... else 0.0                    # the reward

    trajectory = await agent(scenario)                # a Trajectory with that reward
    group = await agent.group(scenario, n=8)          # a TrajectoryGroup; failures recorded on it

The function gets a ``client`` (if it has a parameter of that name) that records every
``chat.completions.create`` call of the current rollout, and carries the rollout id to the
gateway. With a :class:`~journeyman.TrainableModel` each call is joined to the gateway's record
(token ids, logprobs); with a plain :class:`~journeyman.Model` (an external endpoint) the
messages are captured without token ids. Nothing is patched globally: a context variable tells
concurrent rollouts apart. Sync functions get a sync ``OpenAI`` client and run in a thread.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import threading
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from journeyman.errors import ConfigError
from journeyman.messages import StreamedReply
from journeyman.model import Model, TrainableModel
from journeyman.records import ROLLOUT_HEADER
from journeyman.trajectory import Trajectory, TrajectoryGroup

from .capture import Call, RecordSource, fill_trajectory, gateway_records

__all__ = ["Trainable", "trainable"]


Scenario = TypeVar("Scenario")
RewardFn = Callable[[Any, Any], float | Awaitable[float]]
"""``reward(scenario, output)``: a score for what the agent function returned."""


@dataclass
class _Rollout:
    id: str
    calls: list[Call] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


_current: ContextVar[_Rollout | None] = ContextVar("journeyman_rollout", default=None)


def _plain(value: Any) -> Any:
    return value.model_dump(exclude_none=True) if hasattr(value, "model_dump") else value


class _Completions:
    """``client.chat.completions`` that records each call into the current rollout."""

    def __init__(self, inner: Any, model_name: str, send_rollout_id: bool) -> None:
        self._inner = inner
        self._model_name = model_name
        self._send_rollout_id = send_rollout_id

    def _prepare(self, kwargs: dict[str, Any]) -> Call | None:
        kwargs.setdefault("model", self._model_name)
        rollout = _current.get()
        if rollout is None:
            return None
        if self._send_rollout_id:
            kwargs["extra_headers"] = {**(kwargs.get("extra_headers") or {}), ROLLOUT_HEADER: rollout.id}
        call = Call(
            messages=[_plain(m) for m in kwargs.get("messages") or []],
            tools=[_plain(t) for t in kwargs["tools"]] if kwargs.get("tools") else None,
        )
        with rollout.lock:
            rollout.calls.append(call)
        return call

    def create(self, **kwargs: Any) -> Any:
        call = self._prepare(kwargs)
        if call is None:
            return self._inner.create(**kwargs)
        try:
            response = self._inner.create(**kwargs)
        except BaseException as error:
            call.error = f"{type(error).__name__}: {error}"
            raise
        if inspect.isawaitable(response):
            return _finish_async(response, call)
        if kwargs.get("stream"):
            return _SyncStream(response, call)
        _fill(call, response)
        return response

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


async def _finish_async(pending: Awaitable[Any], call: Call) -> Any:
    try:
        response = await pending
    except BaseException as error:
        call.error = f"{type(error).__name__}: {error}"
        raise
    if hasattr(response, "__aiter__"):
        return _AsyncStream(response, call)
    _fill(call, response)
    return response


def _fill(call: Call, response: Any) -> None:
    call.completion_id = getattr(response, "id", None)
    choices = getattr(response, "choices", None) or []
    if choices:
        call.reply = _plain(choices[0].message)


class _Assembler:
    """Builds the reply of a streamed completion from its chunks."""

    def __init__(self, call: Call) -> None:
        self.call = call
        self.reply = StreamedReply()

    def add(self, chunk: Any) -> None:
        self.call.completion_id = self.call.completion_id or getattr(chunk, "id", None)
        for choice in getattr(chunk, "choices", None) or []:
            if choice.index == 0 and choice.delta is not None:
                self.reply.add(choice.delta.model_dump(exclude_none=True))

    def done(self) -> None:
        reply: dict[str, Any] = {"role": "assistant", "content": self.reply.text or None}
        if calls := self.reply.tool_calls:
            reply["tool_calls"] = calls
        self.call.reply = reply


class _AsyncStream:
    def __init__(self, inner: Any, call: Call) -> None:
        self._inner = inner
        self._assembler = _Assembler(call)

    async def __aiter__(self) -> AsyncIterator[Any]:
        async for chunk in self._inner:
            self._assembler.add(chunk)
            yield chunk
        self._assembler.done()

    async def __aenter__(self) -> _AsyncStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._inner.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _SyncStream:
    def __init__(self, inner: Any, call: Call) -> None:
        self._inner = inner
        self._assembler = _Assembler(call)

    def __iter__(self) -> Iterator[Any]:
        for chunk in self._inner:
            self._assembler.add(chunk)
            yield chunk
        self._assembler.done()

    def __enter__(self) -> _SyncStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self._inner.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _Chat:
    def __init__(self, completions: _Completions) -> None:
        self.completions = completions


class CapturingClient:
    """An OpenAI client (sync or async) whose chat completions are captured per rollout."""

    def __init__(self, inner: Any, model_name: str, send_rollout_id: bool) -> None:
        self._inner = inner
        self.chat = _Chat(_Completions(inner.chat.completions, model_name, send_rollout_id))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class Trainable(Generic[Scenario]):
    """An agent function turned into a rollout: ``await agent(scenario)`` -> :class:`Trajectory`."""

    def __init__(
        self,
        function: Callable[..., Any],
        model: Model,
        *,
        reward: RewardFn | None = None,
        records: RecordSource | None = None,
    ) -> None:
        self.function = function
        self.model = model
        self.reward = reward
        self._records = records
        self._is_async = inspect.iscoroutinefunction(function)
        self._takes_client = "client" in inspect.signature(function).parameters
        self._clients: dict[bool, CapturingClient] = {}
        functools.update_wrapper(self, function)

    @property
    def trainable(self) -> bool:
        """True when calls go to a journeyman backend (token-exact turns)."""
        return isinstance(self.model, TrainableModel)

    def client(self, sync: bool = False) -> Any:
        """The capturing client handed to the function (async, or sync for sync functions)."""
        if sync not in self._clients:
            if sync:
                inner: Any = self.model.sync_openai_client()
            else:
                inner = self.model.openai_client()
            self._clients[sync] = CapturingClient(inner, self.model.inference_name, self.trainable)
        return self._clients[sync]

    def _source(self) -> RecordSource | None:
        if self._records is not None or not self.trainable:
            return self._records
        assert self.model.inference_base_url is not None  # set by register()
        return gateway_records(self.model.inference_base_url, self.model.inference_api_key)

    async def __call__(self, scenario: Scenario, /, *args: Any, **kwargs: Any) -> Trajectory:
        return await self._rollout(scenario, args, kwargs, None)

    def group(self, scenario: Scenario, /, *args: Any, n: int = 8, **kwargs: Any) -> TrajectoryGroup:
        """``n`` rollouts of one scenario as an awaitable group (or for ``gather_trajectory_groups``).

        A rollout that raises is recorded on the group (stage ``rollout``); a reward function
        that raises leaves its trajectory unscored and is recorded too (stage ``reward``).
        """
        if n < 1:
            raise ConfigError(f"a group needs at least one rollout, got n={n}")
        holder: list[TrajectoryGroup] = []
        group = TrajectoryGroup(
            (self._rollout(scenario, args, kwargs, holder) for _ in range(n)), metadata=_labels(scenario)
        )
        holder.append(group)
        return group

    async def _rollout(
        self,
        scenario: Scenario,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        holder: list[TrajectoryGroup] | None,
    ) -> Trajectory:
        rollout = _Rollout(id=f"rollout-{uuid.uuid4().hex}")
        trajectory = Trajectory(
            name=getattr(self.function, "__name__", None),
            metadata={"rollout_id": rollout.id, **_labels(scenario)},
        )
        if self._takes_client:
            kwargs = {**kwargs, "client": self.client(sync=not self._is_async)}
        token = _current.set(rollout)
        try:
            with trajectory.track("rollout"):
                if self._is_async:
                    output = await self.function(scenario, *args, **kwargs)
                else:
                    output = await asyncio.to_thread(self.function, scenario, *args, **kwargs)
        finally:
            _current.reset(token)
        source = self._source()
        await asyncio.to_thread(fill_trajectory, trajectory, rollout.calls, (), lambda call: source)
        if isinstance(output, bool | int | float):
            trajectory.reward = float(output)
        if self.reward is not None:
            try:
                with trajectory.track("reward"):
                    score = self.reward(scenario, output)
                    trajectory.reward = float(await score if inspect.isawaitable(score) else score)
            except Exception as error:
                trajectory.reward = None
                if holder is None:
                    raise
                holder[0].record_failure(error, stage="reward", trajectory_id=trajectory.id)
                trajectory.log(f"the reward function raised {type(error).__name__}: {error}")
        return trajectory.finish()


def _labels(scenario: Any) -> dict[str, Any]:
    if isinstance(scenario, dict) and isinstance(scenario.get("id"), str | int):
        return {"scenario_id": scenario["id"]}
    return {}


def trainable(
    model: Model, *, reward: RewardFn | None = None, records: RecordSource | None = None
) -> Callable[[Callable[..., Any]], Trainable[Any]]:
    """Turn an agent function into a rollout of ``model`` (see the module docstring).

    ``reward(scenario, output)`` scores what the function returned (by default a returned number
    is the reward). ``records`` overrides where gateway records are read (default: over HTTP
    from the backend the model is registered with).
    """
    if not isinstance(model, Model):
        raise ConfigError(
            f"@trainable needs a jm.Model or jm.TrainableModel, got {type(model).__name__}: "
            "write @jm.trainable(model) with the model the agent calls"
        )

    def decorate(function: Callable[..., Any]) -> Trainable[Any]:
        return Trainable(function, model, reward=reward, records=records)

    return decorate
