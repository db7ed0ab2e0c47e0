"""The OpenAI Responses API in the chat format, and back.

The gateway serves ``/v1/responses`` by turning each request into the chat completion the model
actually runs (so the record keeps the exact prompt and sampled tokens, as for chat), and the
chat answer into a Responses object. Tracers of frameworks that speak the Responses API (the
OpenAI Agents SDK by default) use the same functions to read a call's input items as messages.

Request items, and the chat messages they become::

    "instructions": "..."                                   -> {"role": "system", ...} first
    {"role": "user" | "system" | "developer" | "assistant",  -> the same role ("developer"
     "content": "..." | [{"type": "input_text", ...}]}          becomes "system")
    {"type": "function_call", "call_id", "name", "arguments"} -> a tool call of the assistant
                                                                message just before it (or a new one)
    {"type": "function_call_output", "call_id", "output"}    -> {"role": "tool", "tool_call_id", ...}
    {"type": "reasoning", ...}                               -> left out (the model never sees it)

Only function tools are served: a hosted tool (web search, file search, computer use) is an
error that names it, as is an item this gateway cannot turn into a message.
"""

from __future__ import annotations

import json
import time
from typing import Any

from journeyman.errors import InvalidDataError

__all__ = [
    "assistant_message",
    "chat_request",
    "chat_tools",
    "input_messages",
    "output_items",
    "response_id",
    "response_object",
]

_TEXT_PARTS = {"input_text", "output_text", "text", "refusal"}
_CHAT_SAMPLING = {
    "temperature": "temperature",
    "top_p": "top_p",
    "max_output_tokens": "max_tokens",
    "parallel_tool_calls": "parallel_tool_calls",
    "user": "user",
    "seed": "seed",
    "stop": "stop",
}
"""Responses request keys that carry over to the chat request, by their chat name."""


def response_id(completion_id: str) -> str:
    """The Responses id of a chat completion (``chatcmpl-abc`` -> ``resp_abc``)."""
    return "resp_" + completion_id.removeprefix("chatcmpl-")


def _text(content: Any, where: str) -> str | list[dict[str, Any]]:
    """A message's content in the chat format: text, or parts when it holds an image."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise InvalidDataError(f"{where}: content must be a string or a list of parts, got {content!r}")
    parts: list[dict[str, Any]] = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _TEXT_PARTS:
            parts.append({"type": "text", "text": part.get("text") or part.get("refusal") or ""})
        elif kind == "input_image" and part.get("image_url"):
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
        else:
            raise InvalidDataError(
                f"{where}: a content part of type {kind!r} cannot be served "
                "(text and images given by URL can)"
            )
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def _output_text(output: Any) -> str:
    """A function call's output as the tool message's text."""
    if isinstance(output, str):
        return output
    if isinstance(output, list):
        return "".join(str(p.get("text", "")) for p in output if isinstance(p, dict))
    return json.dumps(output)


def input_messages(items: str | list[Any], instructions: str | None = None) -> list[dict[str, Any]]:
    """The chat messages for a Responses request's ``input`` (and its ``instructions``)."""
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    if isinstance(items, str):
        return [*messages, {"role": "user", "content": items}]
    if not isinstance(items, list):
        raise InvalidDataError(f"'input' must be a string or a list of items, got {type(items).__name__}")
    calls_open = False  # the last message is an assistant message that function calls extend
    for number, item in enumerate(items):
        where = f"input item {number}"
        if not isinstance(item, dict):
            raise InvalidDataError(f"{where} must be a JSON object, got {item!r}")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise InvalidDataError(f"{where}: unknown role {role!r}")
            messages.append(
                {
                    "role": "system" if role == "developer" else role,
                    "content": _text(item.get("content"), where),
                }
            )
            calls_open = role == "assistant"
        elif kind == "function_call":
            call = {
                "id": item.get("call_id") or item.get("id") or f"call_{number}",
                "type": "function",
                "function": {"name": item.get("name") or "", "arguments": item.get("arguments") or "{}"},
            }
            if not calls_open:
                messages.append({"role": "assistant", "content": None})
                calls_open = True
            messages[-1].setdefault("tool_calls", []).append(call)
            if messages[-1]["content"] == "":
                messages[-1]["content"] = None
        elif kind == "function_call_output":
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": item.get("call_id"),
                    "content": _output_text(item.get("output")),
                }
            )
            calls_open = False
        elif kind == "reasoning":
            continue
        else:
            raise InvalidDataError(
                f"{where}: items of type {kind!r} cannot be served "
                "(messages, function_call and function_call_output can)"
            )
    return messages


def chat_tools(tools: list[Any] | None) -> list[dict[str, Any]] | None:
    """Responses function tools as chat tools; an error names a hosted tool."""
    if not tools:
        return None
    converted = []
    for tool in tools:
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else tool
            raise InvalidDataError(
                f"the gateway serves function tools only, not {kind!r}: hosted tools (web search, "
                "file search, computer use) run on OpenAI's servers"
            )
        function = {"name": tool["name"], "parameters": tool.get("parameters") or {"type": "object"}}
        if tool.get("description"):
            function["description"] = tool["description"]
        if tool.get("strict") is not None:
            function["strict"] = tool["strict"]
        converted.append({"type": "function", "function": function})
    return converted


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _response_format(text: Any) -> dict[str, Any] | None:
    form = (text or {}).get("format") if isinstance(text, dict) else None
    if not isinstance(form, dict) or form.get("type") in (None, "text"):
        return None
    if form["type"] == "json_schema":
        schema = {k: form[k] for k in ("name", "schema", "strict", "description") if k in form}
        return {"type": "json_schema", "json_schema": schema}
    return {"type": form["type"]}


def chat_request(body: dict[str, Any], history: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The chat completion request a Responses request runs as. ``history``: the messages of the
    response named by ``previous_response_id``, its reply included."""
    messages = input_messages(body.get("input") or [], body.get("instructions"))
    if history:
        # the previous response's instructions are not carried over (as on OpenAI's API)
        kept = [m for m in history if m.get("role") != "system"] if body.get("instructions") else history
        system = messages[:1] if body.get("instructions") else []
        messages = [*system, *kept, *messages[len(system) :]]
    if not any(m["role"] != "system" for m in messages):
        raise InvalidDataError("the request has no input: give 'input', a string or a list of items")
    chat: dict[str, Any] = {"model": body["model"], "messages": messages}
    for key, chat_key in _CHAT_SAMPLING.items():
        if body.get(key) is not None:
            chat[chat_key] = body[key]
    if tools := chat_tools(body.get("tools")):
        chat["tools"] = tools
        if body.get("tool_choice") is not None:
            chat["tool_choice"] = _tool_choice(body["tool_choice"])
    if response_format := _response_format(body.get("text")):
        chat["response_format"] = response_format
    if body.get("top_logprobs"):
        chat["top_logprobs"] = body["top_logprobs"]
    if body.get("stream"):
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    return chat


def _logprobs(logprobs: Any) -> list[dict[str, Any]]:
    entries = (logprobs or {}).get("content") if isinstance(logprobs, dict) else None
    return [
        {
            "token": e.get("token", ""),
            "logprob": e.get("logprob"),
            "bytes": e.get("bytes") or [],
            "top_logprobs": e.get("top_logprobs") or [],
        }
        for e in entries or []
    ]


def output_items(
    message: dict[str, Any], id_suffix: str, logprobs: Any = None, with_logprobs: bool = False
) -> list[dict[str, Any]]:
    """A chat assistant message as Responses output items: its text as a message item, then one
    ``function_call`` item per tool call."""
    items: list[dict[str, Any]] = []
    text = message.get("content")
    if text or not message.get("tool_calls"):
        part: dict[str, Any] = {"type": "output_text", "text": text or "", "annotations": []}
        if with_logprobs:
            part["logprobs"] = _logprobs(logprobs)
        items.append(
            {
                "type": "message",
                "id": f"msg_{id_suffix}",
                "status": "completed",
                "role": "assistant",
                "content": [part],
            }
        )
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        items.append(
            {
                "type": "function_call",
                "id": f"fc_{call.get('id')}",
                "call_id": call.get("id"),
                "name": function.get("name"),
                "arguments": function.get("arguments") or "",
                "status": "completed",
            }
        )
    return items


def assistant_message(items: list[dict[str, Any]]) -> dict[str, Any]:
    """Responses output items as one chat assistant message (the inverse of :func:`output_items`)."""
    texts, calls = [], []
    for item in items:
        if item.get("type") == "message":
            texts += [p.get("text") or p.get("refusal") or "" for p in item.get("content") or []]
        elif item.get("type") == "function_call":
            calls.append(
                {
                    "id": item.get("call_id"),
                    "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments") or ""},
                }
            )
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or (None if calls else "")}
    if calls:
        message["tool_calls"] = calls
    return message


def _usage(usage: dict[str, Any] | None) -> dict[str, Any] | None:
    if not usage:
        return None
    return {
        "input_tokens": usage.get("prompt_tokens", 0),
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": usage.get("completion_tokens", 0),
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.get("total_tokens", 0),
    }


def response_object(
    request: dict[str, Any],
    rid: str,
    *,
    message: dict[str, Any] | None,
    finish_reason: str | None,
    usage: dict[str, Any] | None,
    model: str,
    logprobs: Any = None,
    created_at: float | None = None,
) -> dict[str, Any]:
    """The Responses object for a chat answer (``message`` None: one in progress, no output)."""
    with_logprobs = "message.output_text.logprobs" in (request.get("include") or [])
    output = output_items(message, rid.removeprefix("resp_"), logprobs, with_logprobs) if message else []
    incomplete = finish_reason == "length"
    status = "in_progress" if message is None else ("incomplete" if incomplete else "completed")
    return {
        "id": rid,
        "object": "response",
        "created_at": created_at if created_at is not None else time.time(),
        "status": status,
        "model": model,
        "output": output,
        "usage": _usage(usage),
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "instructions": request.get("instructions"),
        "metadata": request.get("metadata") or {},
        "parallel_tool_calls": request.get("parallel_tool_calls", True),
        "temperature": request.get("temperature"),
        "top_p": request.get("top_p"),
        "max_output_tokens": request.get("max_output_tokens"),
        "previous_response_id": request.get("previous_response_id"),
        "tool_choice": request.get("tool_choice", "auto"),
        "tools": request.get("tools") or [],
        "text": request.get("text") or {"format": {"type": "text"}},
        "truncation": request.get("truncation") or "disabled",
    }
