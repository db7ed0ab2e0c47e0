"""Capture PydanticAI agent runs as trajectories.

::

    from journeyman.integrations.pydantic_ai import PydanticAITracer

    with PydanticAITracer() as tracer:                  # the one line
        result = agent.run_sync("What is 3 plus 4?")    # or await agent.run(...), agent.iter(...)
    trajectory = tracer.trajectory

Built on PydanticAI's own ``capture_run_messages``: the block captures the messages of the first
run started in it (a context variable, so runs in other tasks or threads are their own). On exit
each ``ModelResponse`` of that run becomes a model call, joined to the gateway's record by its
``provider_response_id`` (the completion id of a Chat Completions model, the response id of a
Responses model; streamed or not) and read from the gateway at its ``provider_url``. Tool
returns become tool results; a tool that raised ``ModelRetry`` (or whose arguments failed
validation) is a tool error the model saw, and the run goes on. Messages of an earlier run given
as ``message_history`` are context, not calls of this run.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import AbstractContextManager
from types import TracebackType
from typing import Any, Unpack

from journeyman.errors import ConfigError, MissingDependencyError
from journeyman.trajectory import Trajectory

from .capture import Call, RecordSource, ToolRun, Tracer, TracerOptions

try:
    from pydantic_ai import capture_run_messages
    from pydantic_ai.messages import (
        ModelMessage,
        ModelRequest,
        ModelResponse,
        RetryPromptPart,
        SystemPromptPart,
        TextPart,
        ToolCallPart,
        ToolReturnPart,
        UserPromptPart,
    )
except ImportError as error:  # pragma: no cover - depends on the installed extras
    raise MissingDependencyError(
        "pydantic-ai-slim", "pydantic-ai", "journeyman.integrations.pydantic_ai"
    ) from error

__all__ = ["PydanticAITracer"]


class PydanticAITracer(Tracer):
    """Records a PydanticAI run's model calls and tool runs while the ``with`` block runs.

    ``records``: the gateway's ``RecordLog``, a gateway URL, or None to ask the gateway each call
    went to (the model's ``provider_url``). ``name`` names the trajectory's history.
    """

    def __init__(
        self,
        records: RecordSource | str | None = None,
        *,
        name: str | None = None,
        **options: Unpack[TracerOptions],
    ) -> None:
        super().__init__(records, **options)
        self.name = name
        self._capture: AbstractContextManager[list[ModelMessage]] | None = None
        self._messages: list[ModelMessage] = []
        self._trajectory: Trajectory | None = None

    @property
    def trajectory(self) -> Trajectory:
        """The run's trajectory, built when the ``with`` block exited."""
        if self._trajectory is None:
            raise ConfigError(
                "the trajectory is built when the `with PydanticAITracer() as tracer:` block exits"
            )
        return self._trajectory

    @property
    def messages(self) -> list[ModelMessage]:
        """The run's messages as PydanticAI captured them."""
        return self._messages

    def __enter__(self) -> PydanticAITracer:
        self._capture = capture_run_messages()
        self._messages = self._capture.__enter__()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        assert self._capture is not None
        self._capture.__exit__(kind, error, traceback)
        try:
            calls, tool_runs = _calls(self._messages, self.name)
            self._trajectory = self.finish(Trajectory(), calls, tool_runs, error=error, raised_by="the agent")
        except Exception as failure:
            self.failed("building the trajectory", failure)


def _calls(messages: list[ModelMessage], name: str | None) -> tuple[list[Call], list[ToolRun]]:
    """The model calls of the run (the last message's run) and its tool runs."""
    run_id = next((m.run_id for m in reversed(messages) if m.run_id is not None), None)
    sent: list[dict[str, Any]] = []  # what the model has seen so far, in the chat format
    instructions: str | None = None
    calls: list[Call] = []
    tool_runs: list[ToolRun] = []
    for number, message in enumerate(messages):
        ours = run_id is None or message.run_id == run_id
        if isinstance(message, ModelRequest):
            instructions = message.instructions or instructions
            for part, chat in _request_messages(message):
                sent.append(chat)
                if ours and isinstance(part, ToolReturnPart | RetryPromptPart) and part.tool_name:
                    tool_runs.append(_tool_run(part))
            continue
        reply = _reply(message)
        if ours:
            system = [{"role": "system", "content": instructions}] if instructions else []
            calls.append(
                Call(
                    messages=[*system, *sent],
                    name=name or message.model_name,
                    reply=reply,
                    completion_id=message.provider_response_id,
                    endpoint=message.provider_url,
                    started=message.timestamp.timestamp() + number * 1e-6,  # keeps their order
                )
            )
        sent.append(reply)
    return calls, tool_runs


def _request_messages(request: ModelRequest) -> Iterator[tuple[Any, dict[str, Any]]]:
    for part in request.parts:
        if isinstance(part, SystemPromptPart):
            yield part, {"role": "system", "content": part.content}
        elif isinstance(part, UserPromptPart):
            content = part.content
            text = content if isinstance(content, str) else "".join(c for c in content if isinstance(c, str))
            yield part, {"role": "user", "content": text}
        elif isinstance(part, ToolReturnPart):
            yield (
                part,
                {"role": "tool", "tool_call_id": part.tool_call_id, "content": part.model_response_str()},
            )
        elif isinstance(part, RetryPromptPart):
            if part.tool_name:
                yield (
                    part,
                    {"role": "tool", "tool_call_id": part.tool_call_id, "content": part.model_response()},
                )
            else:
                yield part, {"role": "user", "content": part.model_response()}


def _reply(response: ModelResponse) -> dict[str, Any]:
    text = "".join(p.content for p in response.parts if isinstance(p, TextPart))
    calls = [
        {
            "id": p.tool_call_id,
            "type": "function",
            "function": {"name": p.tool_name, "arguments": p.args_as_json_str()},
        }
        for p in response.parts
        if isinstance(p, ToolCallPart)
    ]
    reply: dict[str, Any] = {"role": "assistant", "content": text or (None if calls else "")}
    if calls:
        reply["tool_calls"] = calls
    return reply


def _tool_run(part: ToolReturnPart | RetryPromptPart) -> ToolRun:
    if isinstance(part, ToolReturnPart):
        return ToolRun(name=part.tool_name, tool_call_id=part.tool_call_id, output=part.model_response_str())
    content = part.content
    error = content if isinstance(content, str) else json.dumps(content, default=str)
    return ToolRun(name=part.tool_name or "", tool_call_id=part.tool_call_id, error=error)
