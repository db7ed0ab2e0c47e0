"""Capture OpenAI Agents SDK runs as trajectories.

::

    from journeyman.integrations.openai_agents import AgentsTracer

    with AgentsTracer() as tracer:                      # the one line
        result = await Runner.run(agent, "What is 3 plus 4?")
    trajectory = tracer.trajectory

Built on the SDK's own extension point: one trace processor (``add_trace_processor``), registered
on first use, hands each span to the tracer whose trace it belongs to. The tracer opens a trace
for the block (or joins the one already open, ``with trace(...)``), so runs in different tasks
or threads are kept apart by their trace id. From the spans it takes

- each model call: a ``generation`` span (Chat Completions models: the messages sent and the
  reply, which journeyman's gateway tags with the completion id) or a ``response`` span
  (Responses models, the SDK's default: the input items and the response, whose id is the
  gateway's record id); both streamed and not;
- each tool run (``function`` spans: arguments, output, the error a tool raised);
- handoffs between agents (``handoff`` spans, in ``metadata["handoffs"]``): the agent handed to
  sees other instructions, so its calls become another history of the trajectory; counted in
  ``metrics["handoffs"]``, named in ``metadata["handoffs"]`` (``"triage -> calc"``) and the log.

The SDK must trace with its data: no ``set_tracing_disabled(True)`` or
``RunConfig(tracing_disabled=True)``, and ``trace_include_sensitive_data`` left on (its
default). A Responses model's spans do not name the endpoint they called: give ``records=`` the
gateway's URL, unless the SDK's default client (``set_default_openai_client``) or
``OPENAI_BASE_URL`` points at the gateway already.
"""

from __future__ import annotations

import os
import threading
from datetime import datetime
from types import TracebackType
from typing import Any, Unpack

from journeyman.errors import ConfigError, MissingDependencyError
from journeyman.responses import assistant_message, input_messages
from journeyman.trajectory import Trajectory

from .capture import Call, RecordSource, ToolRun, Tracer, TracerOptions

try:
    from agents.tracing import (
        Span,
        Trace,
        TracingProcessor,
        add_trace_processor,
        get_current_trace,
        trace,
    )
except ImportError as error:  # pragma: no cover - depends on the installed extras
    raise MissingDependencyError(
        "openai-agents", "openai-agents", "journeyman.integrations.openai_agents"
    ) from error

__all__ = ["AgentsTracer"]


class _Dispatch(TracingProcessor):
    """The one trace processor: sends each span to the tracer of its trace."""

    def __init__(self) -> None:
        self.tracers: dict[str, AgentsTracer] = {}
        self.lock = threading.Lock()
        self.seen: set[str] = set()
        """Traces whose start this processor saw (a trace it missed means it was unregistered)."""

    def _tracer(self, trace_id: str) -> AgentsTracer | None:
        with self.lock:
            return self.tracers.get(trace_id)

    def on_trace_start(self, trace: Trace) -> None:
        if self._tracer(trace.trace_id) is not None:
            with self.lock:
                self.seen.add(trace.trace_id)

    def on_trace_end(self, trace: Trace) -> None:
        pass

    def on_span_start(self, span: Span[Any]) -> None:
        if (tracer := self._tracer(span.trace_id)) is not None:
            tracer._guard(tracer._on_span_start, span)

    def on_span_end(self, span: Span[Any]) -> None:
        if (tracer := self._tracer(span.trace_id)) is not None:
            tracer._guard(tracer._on_span_end, span)

    def shutdown(self) -> None:
        pass

    def force_flush(self) -> None:
        pass


_dispatch = _Dispatch()
_registered = False
_register_lock = threading.Lock()


def _register() -> None:
    global _registered
    with _register_lock:
        if not _registered:
            add_trace_processor(_dispatch)
            _registered = True


class AgentsTracer(Tracer):
    """Records an Agents SDK run's model calls, tool runs and handoffs while the block runs.

    ``records``: the gateway's ``RecordLog``, a gateway URL, or None to ask the gateway each call
    went to (a Chat Completions model's ``base_url``; for a Responses model the SDK's default
    client or ``OPENAI_BASE_URL``). ``workflow_name`` names the trace the tracer opens.
    """

    def __init__(
        self,
        records: RecordSource | str | None = None,
        *,
        workflow_name: str = "journeyman rollout",
        **options: Unpack[TracerOptions],
    ) -> None:
        super().__init__(records, **options)
        self.workflow_name = workflow_name
        self._trace: Trace | None = None
        self._own_trace = False
        self._agents: dict[str, str] = {}  # agent span id -> agent name
        self._parents: dict[str, str | None] = {}  # span id -> parent span id
        self._calls: list[Call] = []
        self._tools: list[ToolRun] = []
        self._handoffs: list[tuple[str | None, str | None]] = []
        self._log: list[str] = []
        self._trajectory: Trajectory | None = None

    @property
    def trajectory(self) -> Trajectory:
        """The run's trajectory, built when the ``with`` block exited."""
        if self._trajectory is None:
            raise ConfigError("the trajectory is built when the `with AgentsTracer() as tracer:` block exits")
        return self._trajectory

    def __enter__(self) -> AgentsTracer:
        _register()
        current = get_current_trace()
        if current is not None and current.trace_id != "no-op":
            self._trace = current  # the caller's own `with trace(...)`: its spans are this run's
        else:
            self._trace, self._own_trace = trace(self.workflow_name), True
        trace_id = self._trace.trace_id
        with _dispatch.lock:
            _dispatch.tracers[trace_id] = self
        if self._own_trace:
            self._trace.start(mark_as_current=True)
            if trace_id == "no-op":
                self.failed("opening a trace", ConfigError(_DISABLED))
            elif trace_id not in _dispatch.seen:  # set_trace_processors() replaced ours: add it back
                add_trace_processor(_dispatch)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        assert self._trace is not None
        trace_id = self._trace.trace_id
        try:
            if self._own_trace:
                self._trace.finish(reset_current=True)
        finally:
            with _dispatch.lock:
                if _dispatch.tracers.get(trace_id) is self:
                    del _dispatch.tracers[trace_id]
                _dispatch.seen.discard(trace_id)
        try:
            trajectory = Trajectory()
            for line in self._log:
                trajectory.log(line)
            trajectory.metrics["handoffs"] = len(self._handoffs)
            if self._handoffs:
                trajectory.metadata["handoffs"] = ", ".join(f"{a} -> {b}" for a, b in self._handoffs)
            self._trajectory = self.finish(trajectory, self._calls, self._tools, error=error)
        except Exception as failure:
            self.failed("building the trajectory", failure)

    def source(self, call: Call) -> RecordSource | None:
        if self._records is None and call.endpoint is None:
            call.endpoint = _default_endpoint()
        return super().source(call)

    # Spans (ended on the run's event loop, or its thread for run_sync) --------------------------

    def _guard(self, handle: Any, span: Span[Any]) -> None:
        try:
            with self._lock:
                handle(span)
        except Exception as error:
            self.failed(f"handling a {span.span_data.type} span", error)

    def _on_span_start(self, span: Span[Any]) -> None:
        self._parents[span.span_id] = span.parent_id
        if span.span_data.type == "agent":
            self._agents[span.span_id] = span.span_data.name

    def _agent_of(self, span: Span[Any]) -> str | None:
        parent = span.parent_id
        while parent is not None and parent not in self._agents:
            parent = self._parents.get(parent)
        return self._agents.get(parent) if parent is not None else None

    def _on_span_end(self, span: Span[Any]) -> None:
        data = span.span_data
        error = span.error
        failure = f"{error.get('message')}: {error.get('data')}" if error else None
        if data.type == "generation":
            reply, completion_id = _generation_reply(data.output)
            config = data.model_config or {}
            self._calls.append(
                Call(
                    messages=list(data.input or []),
                    name=self._agent_of(span),
                    reply=reply,
                    completion_id=completion_id,
                    error=failure if reply is None else None,
                    endpoint=str(config["base_url"]) if config.get("base_url") else None,
                    started=_timestamp(span.started_at),
                )
            )
        elif data.type == "response":
            response = data.response
            self._calls.append(
                Call(
                    messages=input_messages(data.input or [], getattr(response, "instructions", None)),
                    name=self._agent_of(span),
                    reply=assistant_message(_dumped(response.output)) if response is not None else None,
                    completion_id=response.id if response is not None else None,
                    error=failure if response is None else None,
                    started=_timestamp(span.started_at),
                )
            )
        elif data.type == "function":
            output = data.output
            self._tools.append(
                ToolRun(
                    name=data.name,
                    arguments=data.input,
                    output=None if output is None else str(output),
                    error=failure,
                )
            )
        elif data.type == "handoff":
            self._handoffs.append((data.from_agent, data.to_agent))
            self._log.append(f"{data.from_agent} handed the run to {data.to_agent}")


_DISABLED = (
    "the OpenAI Agents SDK has tracing disabled (set_tracing_disabled(True) or "
    "OPENAI_AGENTS_DISABLE_TRACING): AgentsTracer reads the run from its traces, so the run is not "
    "captured. Turn tracing on; to send traces nowhere else, call set_trace_processors([]) first"
)


def _dumped(items: Any) -> list[dict[str, Any]]:
    return [i.model_dump() if hasattr(i, "model_dump") else dict(i) for i in items or []]


def _generation_reply(output: Any) -> tuple[dict[str, Any] | None, str | None]:
    """The assistant message and completion id of a generation span's output: a chat message
    (tagged with its completion id by the gateway), or for a streamed call the Responses object
    the SDK assembled (its items carry the completion id in ``provider_data``)."""
    if not output:
        return None, None
    first = output[0]
    if first.get("object") == "response":
        items = first.get("output") or []
        ids = [(i.get("provider_data") or {}).get("response_id") for i in items]
        return assistant_message(items), next((i for i in ids if i), None)
    reply = {k: v for k, v in first.items() if k in ("role", "content", "tool_calls", "refusal")}
    return reply, first.get("id")


def _timestamp(started_at: str | None) -> float:
    return datetime.fromisoformat(started_at).timestamp() if started_at else 0.0


def _default_endpoint() -> str | None:
    """Where the SDK's Responses models send calls by default."""
    try:
        from agents.models._openai_shared import get_default_openai_client

        client = get_default_openai_client()
    except ImportError:  # pragma: no cover - the SDK moved it
        client = None
    if client is not None:
        return str(client.base_url)
    return os.environ.get("OPENAI_BASE_URL")
