"""The capture kit: what every framework integration is built from, with no framework in it.

An integration subclasses :class:`Tracer` (or calls the functions below), records each model call
the framework makes as a :class:`Call` and each tool run as a :class:`ToolRun`, and hands them to
:meth:`Tracer.finish` when the agent's run ends. ``integrations/langgraph.py`` is the worked
example; "Adding an integration" in the README walks through it.

An integration sees each model call from the agent's side: the messages the framework sent, the
tools it bound, the reply and the completion id. :func:`build_trajectory` joins those calls to
the gateway's records by completion id (for the exact prompt and sampled tokens), then chains
them into conversations: a call whose messages continue an earlier conversation extends it, a
call that does not (a sub-agent, a summarised context, a second crew member) starts another
history. Calls without a record (another endpoint, a framework that dropped the completion
id) keep their messages only and are counted in ``metrics["calls_without_tokens"]``.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypedDict
from uuid import uuid4

from pydantic import ValidationError

from journeyman.errors import ConfigError, InvalidDataError
from journeyman.loop import RolloutInfo, rollout_info
from journeyman.messages import AssistantMessage, ModelTurn, ToolResult
from journeyman.model import Model
from journeyman.records import TOOL_CALL_FORMS, CompletionRecord, RecordSource
from journeyman.trajectory import History, Trajectory, format_validation_error

from ._gateway_records import HttpRecords, gateway_records, gateway_root, http_records

__all__ = [
    "Call",
    "HttpRecords",
    "RecordSource",
    "ToolRun",
    "Tracer",
    "TracerOptions",
    "build_trajectory",
    "fill_trajectory",
    "gateway_records",
    "gateway_root",
    "http_records",
    "join_each",
    "join_records",
    "rollout_call",
]

logger = logging.getLogger("journeyman.integrations")


@dataclass
class Call:
    """One model call as the agent's framework saw it."""

    messages: list[dict[str, Any]]
    """The request's messages in OpenAI format."""
    tools: list[dict[str, Any]] | None = None
    name: str | None = None
    """Node, agent role or sub-agent that made the call."""
    reply: dict[str, Any] | None = None
    """The assistant message in OpenAI format; None while running or when the call failed."""
    completion_id: str | None = None
    error: str | None = None
    endpoint: str | None = None
    """The OpenAI base URL the call went to, when known (its gateway holds the record)."""
    record: CompletionRecord | None = None
    """The gateway's record, once joined."""
    started: float = field(default_factory=time.monotonic)


@dataclass
class ToolRun:
    """One tool execution: its call id, name, arguments and result or error."""

    name: str
    tool_call_id: str | None = None
    arguments: Any = None
    output: str | None = None
    error: str | None = None


def join_records(calls: Iterable[Call], source: RecordSource | None) -> int:
    """Attach each call's gateway record; returns how many lookups failed (logged)."""
    pending = [c for c in calls if c.record is None and c.completion_id is not None]
    if source is None or not pending:
        return 0
    if isinstance(source, HttpRecords):  # one request for the whole run, not one per call
        try:
            found = source.get_many([c.completion_id for c in pending if c.completion_id is not None])
        except Exception as error:
            logger.warning("could not read %d records from %s: %r", len(pending), source.root, error)
            return len(pending)
        for call in pending:
            call.record = found.get(call.completion_id or "")
        return 0
    failures = 0
    for call in pending:
        try:
            call.record = source.get(call.completion_id or "")
        except Exception as error:
            failures += 1
            logger.warning("could not read the record of %s: %r", call.completion_id, error)
    return failures


def join_each(calls: Iterable[Call], source_of: Callable[[Call], RecordSource | None]) -> int:
    """:func:`join_records` for calls that may have gone to different gateways."""
    groups: dict[int, tuple[RecordSource | None, list[Call]]] = {}
    for call in calls:
        source = source_of(call)
        groups.setdefault(id(source), (source, []))[1].append(call)
    return sum(join_records(group, source) for source, group in groups.values())


class TracerOptions(TypedDict, total=False):
    """What every tracer takes besides ``records`` (see :class:`Tracer`)."""

    api_key: str | None
    raise_error: bool


class Tracer:
    """What an integration's tracer shares: where records are read, its own failures, the finish.

    ``records`` is where completion records are read: the gateway's ``RecordLog`` (in process), a
    gateway URL, or None to ask the gateway each call went to (:attr:`Call.endpoint`). ``api_key``
    authenticates HTTP reads against ``journeyman serve``. A failure inside the tracer is logged
    and counted in :attr:`errors`, and never reaches the agent unless ``raise_error``.
    """

    def __init__(
        self,
        records: RecordSource | str | None = None,
        *,
        api_key: str | None = None,
        raise_error: bool = False,
    ) -> None:
        self.raise_error = raise_error
        self.errors = 0
        """Failures inside the tracer itself (logged, never raised into the agent by default)."""
        self._records = records
        self._api_key = api_key
        self._lock = threading.Lock()

    def source(self, call: Call) -> RecordSource | None:
        """Where ``call``'s record is read."""
        records = self._records if self._records is not None else call.endpoint
        return gateway_records(records, self._api_key) if isinstance(records, str) else records

    def failed(self, what: str, error: Exception) -> None:
        """Count and log a failure of the tracer's own (``what`` it was doing); re-raise it when
        ``raise_error``. Call it from an ``except`` block."""
        with self._lock:
            self.errors += 1
        logger.warning("%s: %s failed: %r", type(self).__name__, what, error, exc_info=True)
        if self.raise_error:
            raise error

    def finish(
        self,
        trajectory: Trajectory,
        calls: Iterable[Call],
        tool_runs: Iterable[ToolRun] = (),
        *,
        error: BaseException | None = None,
        raised_by: str = "the run",
    ) -> Trajectory:
        """Join the calls to their records, chain them into ``trajectory`` and finish it. An error
        that ended the run is kept in its metadata and log."""
        if error is not None:
            trajectory.metadata["error"] = f"{type(error).__name__}: {error}"
            trajectory.log(f"{raised_by} raised {type(error).__name__}: {error}")
        return fill_trajectory(trajectory, calls, tool_runs, self.source).finish()


def fill_trajectory(
    trajectory: Trajectory,
    calls: Iterable[Call],
    tool_runs: Iterable[ToolRun] = (),
    source_of: Callable[[Call], RecordSource | None] = lambda call: None,
) -> Trajectory:
    """Join the calls to their records (failed lookups counted in ``record_lookup_errors``) and
    chain them into ``trajectory``'s histories."""
    calls = list(calls)
    failed = join_each(calls, source_of)
    if failed:
        trajectory.metrics["record_lookup_errors"] = failed
    return build_trajectory(calls, tool_runs, trajectory=trajectory)


def _key(message: Mapping[str, Any]) -> tuple[Any, ...]:
    """What makes two renderings of a message the same message (ids, names and formatting aside)."""
    calls = tuple(
        (c.get("function", {}).get("name"), _arguments(c.get("function", {}).get("arguments")))
        for c in message.get("tool_calls") or []
    )
    content = message.get("content")
    if isinstance(content, list):
        content = "".join(
            str(p.get("text", "")) for p in content if isinstance(p, dict) and p.get("type") == "text"
        )
    return (message.get("role"), content or "", calls, message.get("tool_call_id"))


def _arguments(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.dumps(json.loads(arguments), sort_keys=True)
        except ValueError:
            return arguments
    return json.dumps(arguments, sort_keys=True)


def _dump(message: AssistantMessage) -> dict[str, Any]:
    return message.model_dump(exclude_none=True)


def build_trajectory(
    calls: list[Call], tool_runs: Iterable[ToolRun] = (), *, trajectory: Trajectory | None = None
) -> Trajectory:
    """Chain the calls (in start order) into histories; fill ``trajectory`` (or a new one).

    Counts go to ``trajectory.metrics``, 0 included, among them ``tool_calls_tagged``,
    ``tool_calls_bare`` and ``tool_calls_fenced``: how the model wrote its tool calls (the
    records' ``tool_call_forms``), for a reward that prefers the chat template's tagged form.
    """
    chain = _Chain(trajectory if trajectory is not None else Trajectory())
    for number, call in enumerate(sorted(calls, key=lambda c: c.started)):
        chain.add(number, call)
    return chain.finish(tool_runs)


class _Chain:
    """The histories :func:`build_trajectory` makes, call by call: each call extends the history
    whose messages it continues (the longest such), or starts another."""

    def __init__(self, trajectory: Trajectory) -> None:
        self.trajectory = trajectory
        self.histories: list[History] = []
        self.keys: list[list[tuple[Any, ...]]] = []  # what each history holds, as _key()s
        self.versions: list[int] = []
        self.metrics = {
            "llm_calls": 0,
            "token_exact_calls": 0,
            "calls_without_tokens": 0,
            "llm_errors": 0,
            "invalid_messages": 0,
            "invalid_tool_calls": 0,
            **{f"tool_calls_{form}": 0 for form in TOOL_CALL_FORMS},  # how the model wrote its calls
        }  # every count present (0 too), so averages over trajectories are rates

    def add(self, number: int, call: Call) -> None:
        if call.reply is None and call.record is None:
            self.metrics["llm_errors"] += 1
            self.trajectory.log(f"model call {number} ({call.name or 'unnamed'}) failed: {call.error}")
            return
        self.metrics["llm_calls"] += 1
        messages, tools, turn = self._turn(number, call)
        self.metrics["token_exact_calls" if turn.is_token_exact else "calls_without_tokens"] += 1
        key = [_key(m) for m in messages]
        best = self._continued(key)
        if best is None:
            self.histories.append(History(name=call.name, tools=_tools(tools)))
            self.keys.append([])
            best = len(self.histories) - 1
        history = self.histories[best]
        for message in messages[len(self.keys[best]) :]:
            try:
                history.add(message)
            except InvalidDataError as error:  # kept out, not fatal: the rest is still worth having
                self.metrics["invalid_messages"] += 1
                self.trajectory.log(f"model call {number}: a message was left out: {error}")
        history.add(turn)
        if history.tools is None and tools:
            history.tools = _tools(tools)
        self.keys[best] = [*key, _key(_dump(turn.message))]

    def _turn(
        self, number: int, call: Call
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None, ModelTurn]:
        """The messages the call sent, its tools and its model turn: the gateway's record where
        there is one (token-exact), else what the framework saw."""
        record = call.record
        if record is None or not record.choices:
            self.trajectory.log(
                f"model call {number} ({call.name or 'unnamed'}) has no gateway record "
                f"(completion id {call.completion_id}): messages only, no token ids"
            )
            return call.messages, call.tools, _untracked_turn(call)
        if record.policy_version is not None:
            self.versions.append(record.policy_version)
        if invalid := record.choices[0].invalid_tool_calls:
            self.metrics["invalid_tool_calls"] += len(invalid)
            self.trajectory.log(
                f"model call {number}: {len(invalid)} tool call(s) with arguments that are not a JSON "
                f"object were returned as text: {[c.function.arguments for c in invalid]}"
            )
        for form in record.choices[0].tool_call_forms or []:
            if form is not None:
                self.metrics[f"tool_calls_{form}"] += 1
        messages = record.messages if record.messages is not None else call.messages
        tools = record.tools if record.tools is not None else call.tools
        return messages, tools, record.model_turn()

    def _continued(self, key: list[tuple[Any, ...]]) -> int | None:
        """The history whose messages ``key`` starts with (the longest), if any."""
        best: int | None = None
        for index, known in enumerate(self.keys):
            if key[: len(known)] == known and (best is None or len(known) > len(self.keys[best])):
                best = index
        return best

    def finish(self, tool_runs: Iterable[ToolRun]) -> Trajectory:
        trajectory = self.trajectory
        tool_metrics = _add_tool_results(self.histories, self.keys, tool_runs, trajectory)
        if self.histories:
            main, *rest = self.histories
            trajectory.name = trajectory.name or main.name
            trajectory.conversation = main.conversation
            trajectory.tools = main.tools
            trajectory.additional_histories = rest
        if self.versions:
            trajectory.initial_policy_version, trajectory.final_policy_version = (
                self.versions[0],
                self.versions[-1],
            )
        trajectory.metrics.update(self.metrics)
        trajectory.metrics.update(tool_metrics)
        return trajectory


def _tools(tools: list[dict[str, Any]] | None) -> Any:
    return list(tools) if tools else None


def _untracked_turn(call: Call) -> ModelTurn:
    reply = {k: v for k, v in (call.reply or {}).items() if k in AssistantMessage.model_fields}
    reply.pop("role", None)
    try:
        message = AssistantMessage.model_validate({"role": "assistant", **reply})
    except ValidationError as error:
        logger.warning("%s", format_validation_error(error, "assistant reply"))
        message = AssistantMessage(content=str(reply.get("content") or ""))
    return ModelTurn(message=message, completion_id=call.completion_id)


def _add_tool_results(
    histories: list[History],
    keys: list[list[tuple[Any, ...]]],
    tool_runs: Iterable[ToolRun],
    trajectory: Trajectory,
) -> dict[str, int]:
    """Append tool results no later model call saw (the run ended, or the agent stopped on an error)."""
    runs = list(tool_runs)
    errors = 0
    for run in runs:
        if run.error is not None:
            errors += 1
            trajectory.log(f"tool {run.name} ({run.tool_call_id}) raised {run.error}")
        if run.tool_call_id is None:
            continue
        for history, key in zip(histories, keys, strict=True):
            last = history.model_turns[-1] if history.model_turns else None
            calls = (last.message.tool_calls or []) if last is not None else []
            if not any(c.id == run.tool_call_id for c in calls):
                continue
            answered = any(
                isinstance(m, ToolResult) and m.tool_call_id == run.tool_call_id for m in history.messages
            )
            if not answered:
                content = run.output if run.error is None else f"Error: {run.error}"
                message = {"role": "tool", "tool_call_id": run.tool_call_id, "content": content or ""}
                history.add(message)
                key.append(_key(message))
    return {"tool_calls": len(runs), "tool_errors": errors}


def rollout_call(model: Model, rollout_id: str | None, framework: str) -> tuple[str, RolloutInfo | None]:
    """The id under which a framework's chat model calls ``model`` for one rollout, and the training
    loop's rollout in progress (its ``seed``), for the helpers that build that chat model. Default
    id: where the rollout is in the loop (split, step, scenario, sample), then a random part."""
    if model.inference_base_url is None:
        raise ConfigError(
            f"model {model.name!r} has no inference_base_url yet: build the {framework} after "
            "`await model.register(backend)`"
        )
    info = rollout_info()
    if rollout_id is None:
        where = f"{info.split}-{info.step}-{info.index}-{info.sample}-" if info is not None else ""
        rollout_id = where + uuid4().hex[:12]
    return rollout_id, info
