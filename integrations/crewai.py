"""Capture CrewAI crews as trajectories.

::

    from journeyman.integrations.crewai import CrewTracer

    llm = crew_llm(model, temperature=0.7)      # the crew's LLM, on the model being trained
    ...                                         # build the crew's agents with `llm`, as before
    with CrewTracer() as tracer:                # the one line
        crew.kickoff(inputs=...)
    trajectory = tracer.trajectory

The tracer listens on ``crewai_event_bus`` while the block runs: LLM calls (started, completed,
failed) and tool usage (started, finished, error). On exit it flushes the bus (handlers run on
a thread pool), unregisters, joins each call to the gateway's record by its ``response_id`` and
builds the trajectory: one history per agent of the crew (each agent keeps its own
conversation), token-exact where the call went through journeyman's gateway.

The bus is process-wide: give ``crew=`` to keep only the events of that crew's agents when
several crews run at once. Run CrewAI offline with ``CREWAI_DISABLE_TELEMETRY=true`` and
``CREWAI_TRACING_ENABLED=false`` (never ``OTEL_SDK_DISABLED``, which also silences Langfuse).
"""

from __future__ import annotations

from collections.abc import Callable
from types import TracebackType
from typing import Any, Unpack

from journeyman.errors import ConfigError, MissingDependencyError
from journeyman.messages import AssistantMessage
from journeyman.model import Model
from journeyman.trajectory import Trajectory

from .capture import Call, RecordSource, ToolRun, Tracer, TracerOptions, gateway_root, logger, rollout_call

try:
    import crewai
    from crewai.events import (
        LLMCallCompletedEvent,
        LLMCallFailedEvent,
        LLMCallStartedEvent,
        ToolUsageErrorEvent,
        ToolUsageFinishedEvent,
        ToolUsageStartedEvent,
        crewai_event_bus,
    )
except ImportError as error:  # pragma: no cover - depends on the installed extras
    raise MissingDependencyError("crewai", "crewai", "journeyman.integrations.crewai") from error

__all__ = ["CrewTracer", "crew_llm"]

_MESSAGE_KEYS = {"role", "content", "tool_calls", "tool_call_id", "name"}


def crew_llm(model: Model, *, rollout_id: str | None = None, **options: Any) -> crewai.LLM:
    """A ``crewai.LLM`` that calls ``model`` through journeyman's gateway, for one rollout: build
    the crew with it in the rollout function.

    It calls the gateway's per-rollout URL (``.../r/<rollout_id>/v1``): the gateway records the
    calls under ``rollout_id``, and while a canary runs all of the rollout's calls go to the
    candidate or all to the promoted step. Default id: one made from the training loop's
    :func:`~journeyman.rollout_info` in progress, which also gives the calls its sampling ``seed``;
    else a new one. ``options`` go to ``crewai.LLM`` (``temperature``, ``max_tokens``...)."""
    rollout_id, info = rollout_call(model, rollout_id, "crew's LLM")
    assert model.inference_base_url is not None  # rollout_call checked it
    gateway = gateway_root(model.inference_base_url)
    if info is not None:
        options.setdefault("seed", info.seed)
    return crewai.LLM(
        model=f"openai/{model.inference_name}",  # the plain name follows the newest trained adapter
        base_url=f"{gateway}/r/{rollout_id}/v1",
        api_key=model.inference_api_key or "journeyman",
        **options,
    )


class CrewTracer(Tracer):
    """Records a crew's LLM calls and tool runs while the ``with`` block runs.

    ``records``: the gateway's ``RecordLog``, a gateway URL, or None to ask the gateway each LLM
    points at (its ``base_url``). ``crew``: keep only events from this crew's agents.
    """

    def __init__(
        self,
        records: RecordSource | str | None = None,
        *,
        crew: Any = None,
        flush_timeout: float = 30.0,
        **options: Unpack[TracerOptions],
    ) -> None:
        super().__init__(records, **options)
        self._agents = {str(agent.id) for agent in crew.agents} if crew is not None else None
        self._flush_timeout = flush_timeout
        self._calls: dict[str, Call] = {}
        self._tools: dict[str, ToolRun] = {}
        self._trajectory: Trajectory | None = None
        self._handlers: list[tuple[type[Any], Callable[[Any, Any], None]]] = [
            (LLMCallStartedEvent, self._on_llm_started),
            (LLMCallCompletedEvent, self._on_llm_completed),
            (LLMCallFailedEvent, self._on_llm_failed),
            (ToolUsageStartedEvent, self._on_tool_started),
            (ToolUsageFinishedEvent, self._on_tool_finished),
            (ToolUsageErrorEvent, self._on_tool_error),
        ]

    @property
    def trajectory(self) -> Trajectory:
        """The crew's trajectory, built when the ``with`` block exited."""
        if self._trajectory is None:
            raise ConfigError("the trajectory is built when the `with CrewTracer() as tracer:` block exits")
        return self._trajectory

    def __enter__(self) -> CrewTracer:
        for event_type, handler in self._handlers:
            crewai_event_bus.on(event_type)(handler)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        try:
            if not crewai_event_bus.flush(timeout=self._flush_timeout):
                logger.warning("CrewAI event handlers still running after %.0f s", self._flush_timeout)
        finally:
            for event_type, handler in self._handlers:
                crewai_event_bus.off(event_type, handler)
        try:
            self._trajectory = self.finish(
                Trajectory(), self._calls.values(), self._tools.values(), error=error, raised_by="the crew"
            )
        except Exception as failure:
            self.failed("building the trajectory", failure)

    # Handlers (run on CrewAI's thread pool) ------------------------------------------------------

    def _guard(self, handle: Any, event: Any, source: Any = None) -> None:
        if self._agents is not None and getattr(event, "agent_id", None) not in self._agents:
            return
        try:
            with self._lock:
                handle(event, source)
        except Exception as error:
            self.failed(f"handling {type(event).__name__}", error)

    def _on_llm_started(self, source: Any, event: LLMCallStartedEvent) -> None:
        def handle(event: LLMCallStartedEvent, source: Any) -> None:
            messages = event.messages
            if isinstance(messages, str):
                messages = [{"role": "user", "content": messages}]
            endpoint = getattr(source, "base_url", None)
            self._calls[event.call_id] = Call(
                messages=[{k: v for k, v in m.items() if k in _MESSAGE_KEYS} for m in messages or []],
                tools=event.tools,
                name=event.agent_role,
                endpoint=endpoint if isinstance(endpoint, str) else None,
                started=event.timestamp.timestamp(),
            )

        self._guard(handle, event, source)

    def _on_llm_completed(self, source: Any, event: LLMCallCompletedEvent) -> None:
        def handle(event: LLMCallCompletedEvent, _: Any) -> None:
            call = self._calls.get(event.call_id)
            if call is None:
                return
            call.completion_id = event.response_id
            response = event.response
            if isinstance(response, list):
                calls = [c if isinstance(c, dict) else getattr(c, "model_dump", dict)() for c in response]
                call.reply = {"role": "assistant", "content": None, "tool_calls": calls}
            elif isinstance(response, AssistantMessage):
                call.reply = response.model_dump(exclude_none=True)
            else:
                call.reply = {"role": "assistant", "content": str(response)}

        self._guard(handle, event)

    def _on_llm_failed(self, source: Any, event: LLMCallFailedEvent) -> None:
        def handle(event: LLMCallFailedEvent, _: Any) -> None:
            if (call := self._calls.get(event.call_id)) is not None:
                call.error = event.error

        self._guard(handle, event)

    def _on_tool_started(self, source: Any, event: ToolUsageStartedEvent) -> None:
        def handle(event: ToolUsageStartedEvent, _: Any) -> None:
            self._tools[event.event_id] = ToolRun(name=event.tool_name, arguments=event.tool_args)

        self._guard(handle, event)

    def _tool(self, event: Any) -> ToolRun:
        run = self._tools.get(event.started_event_id or "")
        if run is None:  # no start event seen (e.g. an input validation error)
            run = self._tools[event.event_id] = ToolRun(name=event.tool_name, arguments=event.tool_args)
        return run

    def _on_tool_finished(self, source: Any, event: ToolUsageFinishedEvent) -> None:
        def handle(event: ToolUsageFinishedEvent, _: Any) -> None:
            run = self._tool(event)
            run.output = str(event.output)
            if event.failure is not None:
                run.error = str(event.failure)

        self._guard(handle, event)

    def _on_tool_error(self, source: Any, event: ToolUsageErrorEvent) -> None:
        def handle(event: ToolUsageErrorEvent, _: Any) -> None:
            self._tool(event).error = str(event.error)

        self._guard(handle, event)
