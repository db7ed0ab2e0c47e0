"""What vLLM answers, as records, and the client's copy of it.

The gateway asks vLLM for token ids and logprobs whatever the client asked for. Here a response
(or the chunks of a streamed one) becomes :class:`~journeyman.records.ChoiceRecord`s, and the
client's copy loses what it did not ask for.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from typing import Any

from journeyman.messages import AssistantMessage, StreamedReply
from journeyman.records import TOOL_CALL_FORMS, ChoiceRecord, ToolCallForm

__all__ = ["StreamState", "choice_records", "strip", "tag_deltas", "tag_messages", "tool_call_forms"]

logger = logging.getLogger("journeyman.backend.serving.gateway")

_FORM_ID = re.compile(r"call_(tagged|bare|fenced)_[0-9a-f]+")
"""Tool call ids from journeyman's vLLM tool parser (``vllm_plugin/journeyman_tool_parser.py``,
``tool_call_id``), which name the form the model wrote the call in."""
_FORMS: dict[str, ToolCallForm] = {form: form for form in TOOL_CALL_FORMS}


def _assistant_message(raw: dict[str, Any]) -> AssistantMessage:
    calls = raw.get("tool_calls") or None
    if calls:
        calls = [
            {
                "id": c.get("id") or "",
                "type": "function",
                "function": {
                    "name": c["function"]["name"],
                    "arguments": c["function"].get("arguments") or "",
                },
            }
            for c in calls
        ]
    return AssistantMessage(
        content=raw.get("content"),
        tool_calls=calls,
        refusal=raw.get("refusal"),
        reasoning_content=raw.get("reasoning_content") or raw.get("reasoning"),
    )


def tool_call_forms(calls: list[dict[str, Any]] | None) -> list[ToolCallForm | None] | None:
    """The form of each call, from its id; None when no id comes from journeyman's parser."""
    forms = [
        _FORMS[match.group(1)] if (match := _FORM_ID.fullmatch(str(c.get("id") or ""))) else None
        for c in calls or []
    ]
    return forms if any(form is not None for form in forms) else None


def _calls_as_text(choice: dict[str, Any]) -> list[dict[str, Any]]:
    """Turn tool calls whose arguments are JSON but not an object into text; return them.

    A small model sometimes writes ``"arguments": [3, 4]``. vLLM's tool parsers pass that on,
    and OpenAI clients that parse arguments raise on it (langchain-openai's ``AIMessage``
    refuses a list), which would end the agent's run as an error. Returned as text instead, the
    agent sees an answer without the call, the run ends normally and gets its reward: a wrong
    call is trained against rather than lost. The tokens the model sampled are unchanged.
    """
    message = choice.get("message") or {}
    invalid: list[tuple[str, str, Any]] = []  # (id, name, arguments parsed)
    kept: list[dict[str, Any]] = []
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        name, arguments = function.get("name"), function.get("arguments")
        try:
            parsed = json.loads(arguments) if isinstance(arguments, str) and arguments.strip() else {}
        except ValueError:  # not JSON at all: clients already handle that (as an invalid call)
            parsed = {}
        if isinstance(parsed, dict) or not name:
            kept.append(call)
        else:
            invalid.append((call.get("id") or "", name, parsed))
    if not invalid:
        return []
    written = [json.dumps({"name": name, "arguments": parsed}) for _, name, parsed in invalid]
    message["content"] = "\n".join([message["content"], *written] if message.get("content") else written)
    message["tool_calls"] = kept
    if not kept and choice.get("finish_reason") == "tool_calls":
        choice["finish_reason"] = "stop"
    logger.info("returned %d tool call(s) with non-object arguments as text", len(invalid))
    return [
        {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(parsed)}}
        for call_id, name, parsed in invalid
    ]


def _chat_logprobs(logprobs: dict[str, Any] | None) -> list[float | None] | None:
    if not logprobs or logprobs.get("content") is None:
        return None
    return [entry.get("logprob") for entry in logprobs["content"]]


def _text_logprobs(logprobs: dict[str, Any] | None) -> list[float | None] | None:
    return None if not logprobs else list(logprobs.get("token_logprobs") or [])


@dataclass
class _StreamedChoice:
    """One choice of a stream so far."""

    reply: StreamedReply = field(default_factory=StreamedReply)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    has_logprobs: bool = False
    finish_reason: str | None = None


class StreamState:
    """Accumulates a streamed completion into what a non-streamed one would have returned."""

    def __init__(self) -> None:
        self.completion_id: str | None = None
        self.prompt_token_ids: list[int] | None = None
        self.usage: dict[str, Any] | None = None
        self.choices: dict[int, _StreamedChoice] = {}

    def add(self, chunk: dict[str, Any], kind: str) -> None:
        self.completion_id = self.completion_id or chunk.get("id")
        if chunk.get("prompt_token_ids") is not None:
            self.prompt_token_ids = chunk["prompt_token_ids"]
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            state = self.choices.setdefault(choice.get("index", 0), _StreamedChoice())
            if kind == "completion" and choice.get("prompt_token_ids") is not None:
                self.prompt_token_ids = choice["prompt_token_ids"]
            state.reply.add(
                (choice.get("delta") or {}) if kind == "chat" else {"content": choice.get("text")}
            )
            state.token_ids.extend(choice.get("token_ids") or [])
            read = _chat_logprobs if kind == "chat" else _text_logprobs
            found = read(choice.get("logprobs"))
            if found is not None:
                state.has_logprobs = True
                state.logprobs.extend(found)
            state.finish_reason = choice.get("finish_reason") or state.finish_reason

    def choice_records(self, kind: str) -> list[ChoiceRecord]:
        records = []
        for index, state in sorted(self.choices.items()):
            text = state.reply.text
            message, forms = None, None
            if kind == "chat":
                calls = state.reply.tool_calls
                message = AssistantMessage(
                    content=text if text or not calls else None, tool_calls=calls or None
                )
                forms = tool_call_forms(calls)
            records.append(
                ChoiceRecord(
                    index=index,
                    message=message,
                    text=text if kind == "completion" else None,
                    completion_token_ids=state.token_ids or None,
                    logprobs=state.logprobs if state.has_logprobs and state.token_ids else None,
                    finish_reason=state.finish_reason,
                    tool_call_forms=forms,
                )
            )
        return records


def choice_records(data: dict[str, Any], kind: str) -> tuple[list[ChoiceRecord], list[int] | None]:
    """The choices of a whole (not streamed) response, and its prompt token ids. A chat choice's
    tool calls whose arguments are not a JSON object become text in ``data`` (:func:`_calls_as_text`)."""
    prompt_token_ids = data.get("prompt_token_ids")
    records = []
    for choice in data.get("choices") or []:
        if kind == "completion" and choice.get("prompt_token_ids") is not None:
            prompt_token_ids = choice["prompt_token_ids"]
        if kind == "chat":  # forms first: _calls_as_text moves calls out of the message
            forms = tool_call_forms((choice.get("message") or {}).get("tool_calls"))
            invalid = _calls_as_text(choice)
        else:
            forms, invalid = None, []
        records.append(
            ChoiceRecord(
                index=choice.get("index", 0),
                message=_assistant_message(choice["message"]) if kind == "chat" else None,
                text=choice.get("text") if kind == "completion" else None,
                completion_token_ids=choice.get("token_ids"),
                logprobs=(_chat_logprobs if kind == "chat" else _text_logprobs)(choice.get("logprobs")),
                finish_reason=choice.get("finish_reason"),
                invalid_tool_calls=invalid or None,
                tool_call_forms=forms,
            )
        )
    return records, prompt_token_ids


def strip(data: dict[str, Any], logprobs: bool, token_ids: bool) -> None:
    """Remove what the gateway asked vLLM for but the client did not."""
    if not token_ids:
        data.pop("prompt_token_ids", None)
    for choice in data.get("choices") or []:
        if not logprobs and "logprobs" in choice:
            choice["logprobs"] = None
        if not token_ids:
            choice.pop("token_ids", None)
            choice.pop("prompt_token_ids", None)


def tag_deltas(chunk: dict[str, Any], completion_id: str) -> None:
    """Give each streamed delta the completion id, as ``delta["id"]``.

    OpenAI-compatible clients ignore the extra key, while langchain-openai, which keeps no
    chunk's top-level ``id``, makes it the streamed message's ``id``: so a tracer can join a
    token-streamed LangChain call to its record.
    """
    for choice in chunk.get("choices") or []:
        if isinstance(choice.get("delta"), dict):
            choice["delta"].setdefault("id", completion_id)


def tag_messages(data: dict[str, Any], completion_id: str) -> None:
    """Give each choice's message the completion id, as ``message["id"]`` (what
    :func:`tag_deltas` does for a stream): OpenAI clients keep the extra key, so a
    tracer that sees only the message (the Agents SDK's generation spans) can join it to its record."""
    for choice in data.get("choices") or []:
        if isinstance(choice.get("message"), dict):
            choice["message"].setdefault("id", completion_id)
