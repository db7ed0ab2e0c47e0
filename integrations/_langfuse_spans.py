"""Langfuse export, one level down: a history's model turns and tool calls as observations under a
trace (see :mod:`journeyman.integrations.langfuse`)."""

from __future__ import annotations

import json
from typing import Any

from journeyman.errors import InvalidDataError
from journeyman.integrations._langfuse_read import KEY, SCHEMA
from journeyman.messages import ModelTurn, ToolResult
from journeyman.trajectory import History

__all__ = ["export_history", "final_message", "history_info", "payload", "prompt_of"]


def payload(info: dict[str, Any]) -> str:
    # Our own JSON text: the SDK's serializer turns integers beyond 2**53 into strings and cuts
    # nesting deeper than 20 levels, and a lossless import needs neither.
    return json.dumps(info)


def history_info(history: History) -> dict[str, Any]:
    dumped = history.model_dump(mode="json", exclude_none=True)
    last_turn = max(
        (i for i, item in enumerate(history.conversation) if isinstance(item, ModelTurn)), default=-1
    )
    return {
        "name": history.name,
        "tools": dumped.get("tools"),
        "tail": dumped["conversation"][last_turn + 1 :],
    }


def prompt_of(history: History) -> list[dict[str, Any]]:
    """The messages before the first model turn: the task as the model first saw it."""
    prompt = []
    for item in history.conversation:
        if isinstance(item, ModelTurn):
            break
        prompt.append(item.model_dump(mode="json", exclude_none=True))
    return prompt


def final_message(history: History) -> dict[str, Any] | None:
    messages = history.openai_messages()
    return messages[-1] if messages else None


def export_history(parent: Any, history: History) -> None:
    messages: list[dict[str, Any]] = []
    answers = {
        item.tool_call_id: item.model_dump(mode="json")["content"]
        for item in history.messages
        if isinstance(item, ToolResult)
    }
    for index, item in enumerate(history.conversation):
        if isinstance(item, ModelTurn):
            output = item.message.model_dump(mode="json", exclude_none=True)
            usage = {
                key: len(ids)
                for key, ids in (("input", item.prompt_token_ids), ("output", item.completion_token_ids))
                if ids is not None
            }
            generation = parent.start_observation(
                as_type="generation",
                name=item.model or "model",
                model=item.model,
                input=list(messages),
                output=output,
                model_parameters=_display_parameters(item.sampling),
                usage_details=usage or None,
                metadata={
                    KEY: payload(
                        {
                            "schema": SCHEMA,
                            "index": index,
                            "turn": item.model_dump(
                                mode="json", exclude={"type", "message"}, exclude_none=True
                            ),
                        }
                    )
                },
            )
            generation.end()
            for call in item.message.tool_calls or []:
                try:
                    arguments: Any = call.function.parsed_arguments()
                except InvalidDataError:
                    arguments = call.function.arguments
                tool = parent.start_observation(
                    as_type="tool",
                    name=call.function.name,
                    input=arguments,
                    output=answers.get(call.id),
                    metadata={"tool_call_id": call.id},
                )
                tool.end()
            messages.append(output)
        else:
            messages.append(item.model_dump(mode="json", exclude_none=True))


def _display_parameters(sampling: dict[str, Any] | None) -> dict[str, Any] | None:
    # Langfuse shows model parameters as strings and numbers; the exact values ride in metadata.
    if not sampling:
        return None
    return {
        key: value
        if isinstance(value, str | int | float) and not isinstance(value, bool)
        else json.dumps(value)
        for key, value in sampling.items()
    }
