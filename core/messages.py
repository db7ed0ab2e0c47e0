"""Chat messages, tool schemas and model turns in the OpenAI chat format.

A conversation is a list of :data:`Item`: plain messages (what a person, a tool or the prompt
wrote) and :class:`ModelTurn` records (what the model sampled, with the exact token ids and
logprobs when the call went through journeyman's gateway). Model turns are what training learns
from; everything else is context.

JSON shapes, exactly as the OpenAI API uses them::

    {"role": "system" | "developer" | "user", "content": "..."}
    {"role": "assistant", "content": "..." | null, "tool_calls": [{"id", "type": "function",
                                                    "function": {"name", "arguments": "<json>"}}]}
    {"role": "tool", "tool_call_id": "...", "content": "..."}
    {"type": "model_turn", "message": {<assistant message>}, "completion_id": ..., ...}
"""

from __future__ import annotations

import json
import math
from typing import Annotated, Any, Literal, TypeAlias

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator, model_validator

from journeyman._deprecated import warn
from journeyman.errors import InvalidDataError

__all__ = [
    "AssistantMessage",
    "ContentPart",
    "FunctionCall",
    "FunctionDefinition",
    "Item",
    "Message",
    "ModelTurn",
    "StreamedReply",
    "SystemPrompt",
    "Tool",
    "ToolCall",
    "ToolResult",
    "UserMessage",
    "item_message",
]


class _Strict(BaseModel):
    """Base for schema objects: unknown fields are an error, so typos never pass silently."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ContentPart(BaseModel):
    """One part of a multi-part content list (``{"type": "text", "text": ...}``, images, ...)."""

    model_config = ConfigDict(extra="allow")

    type: str
    """The part's kind, e.g. ``"text"`` or ``"image_url"``; other keys depend on it."""


Content: TypeAlias = str | list[ContentPart]


def content_text(content: Content | None) -> str:
    """The text of a message's content: a string as is, text parts joined, other parts skipped."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(str(getattr(part, "text", "")) for part in content if part.type == "text")


class FunctionCall(_Strict):
    name: str = Field(min_length=1)
    """Name of the function the model called."""
    arguments: str
    """The arguments exactly as the model wrote them: a JSON string, which may be malformed
    (a model's mistake is data to learn from). A dict given here is serialised with ``json.dumps``."""

    @field_validator("arguments", mode="before")
    @classmethod
    def _dump_dict(cls, value: Any) -> Any:
        return json.dumps(value) if isinstance(value, dict) else value

    def parsed_arguments(self) -> dict[str, Any]:
        """The arguments as a dict; :class:`InvalidDataError` when they are not a JSON object."""
        try:
            parsed = json.loads(self.arguments)
        except json.JSONDecodeError as error:
            raise InvalidDataError(
                f"tool call {self.name!r} has arguments that are not valid JSON ({error.msg} at "
                f"position {error.pos}): {self.arguments[:200]!r}"
            ) from None
        if not isinstance(parsed, dict):
            raise InvalidDataError(
                f"tool call {self.name!r} has arguments that are JSON but not an object: {self.arguments[:200]!r}"
            )
        return parsed


class ToolCall(_Strict):
    id: str
    """The id a tool message answers with ``tool_call_id``."""
    type: Literal["function"] = "function"
    function: FunctionCall


class SystemPrompt(_Strict):
    """A ``system`` or ``developer`` message: the instructions the model is given."""

    role: Literal["system", "developer"] = "system"
    content: Content
    name: str | None = None


class UserMessage(_Strict):
    role: Literal["user"] = "user"
    content: Content
    name: str | None = None


class AssistantMessage(_Strict):
    role: Literal["assistant"] = "assistant"
    content: Content | None = None
    """The text; ``None`` when the model only called tools."""
    tool_calls: list[ToolCall] | None = None
    name: str | None = None
    refusal: str | None = None
    reasoning_content: str | None = None
    """Reasoning text, for servers that return it separately (vLLM reasoning parsers)."""


class ToolResult(_Strict):
    """A ``tool`` message: what a tool call returned."""

    role: Literal["tool"] = "tool"
    tool_call_id: str
    """The ``id`` of the tool call this message answers."""
    content: Content
    name: str | None = None


class FunctionDefinition(_Strict):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    """A JSON schema of the arguments."""
    strict: bool | None = None


class Tool(_Strict):
    """A tool schema as the OpenAI ``tools`` parameter takes it."""

    type: Literal["function"] = "function"
    function: FunctionDefinition


class ModelTurn(_Strict):
    """One completion sampled by the model: the assistant message and what makes it trainable.

    The token fields are filled when the call went through journeyman's gateway (or any server
    that returns them); a turn captured from an external API has only the message, and training
    then has to tokenise it (which is counted, never hidden).
    """

    type: Literal["model_turn"] = "model_turn"
    message: AssistantMessage
    completion_id: str | None = None
    """The ``id`` of the chat completion; joins captured calls to the gateway's records."""
    model: str | None = None
    """The name the server served the completion under, e.g. ``calc-agent@3`` (adapter version)."""
    policy_version: int | None = None
    """The training step of the policy that sampled it (from the gateway's record: also known when
    the adapter is merged into the served weights, which are then served under the base model's
    name); None for the base model or where unknown."""
    prompt_token_ids: list[int] | None = None
    """The exact prompt tokens the server rendered for this call."""
    completion_token_ids: list[int] | None = None
    """The exact tokens the model sampled, including a final end-of-turn token if one was sampled."""
    logprobs: list[float | None] | None = None
    """Sampling logprob of each completion token (same length as ``completion_token_ids``).
    ``None`` marks a token whose logprob was not reported; NaN and infinities are stored as
    ``None`` (JSON cannot hold them, and a sampled token cannot have probability 0)."""
    finish_reason: str | None = None
    """``stop``, ``length``, ``tool_calls``, ..."""
    sampling: dict[str, Any] | None = None
    """Sampling parameters of the request (temperature, top_p, max_tokens, ...)."""

    @field_validator("logprobs", mode="before")
    @classmethod
    def _non_finite_to_none(cls, value: Any) -> Any:
        if isinstance(value, list):
            return [None if isinstance(v, float) and not math.isfinite(v) else v for v in value]
        return value

    @model_validator(mode="after")
    def _lengths_agree(self) -> ModelTurn:
        ids, logprobs = self.completion_token_ids, self.logprobs
        if ids is not None and logprobs is not None and len(ids) != len(logprobs):
            raise ValueError(
                f"completion_token_ids has {len(ids)} tokens but logprobs has {len(logprobs)} values: "
                "they must describe the same tokens, one logprob per token"
            )
        if logprobs is not None and ids is None:
            raise ValueError("logprobs were given without completion_token_ids: give both or neither")
        return self

    @property
    def is_token_exact(self) -> bool:
        """True when the turn carries the sampled prompt and completion token ids."""
        return self.prompt_token_ids is not None and self.completion_token_ids is not None


_ROLE_TAGS = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
}


def _item_tag(value: Any, messages_only: bool = False) -> str | None:
    """The union member a raw value belongs to; None lets pydantic report a clear error."""
    if isinstance(value, BaseModel):
        if isinstance(value, ModelTurn):
            return None if messages_only else "model_turn"
        role = getattr(value, "role", None)
    elif isinstance(value, dict):
        if not messages_only and value.get("type") == "model_turn":
            return "model_turn"
        role = value.get("role")
    else:
        return None
    return _ROLE_TAGS.get(role) if isinstance(role, str) else None


def _message_tag(value: Any) -> str | None:
    return _item_tag(value, messages_only=True)


_MESSAGE_ERROR = "not a chat message: a message needs a 'role' of system, developer, user, assistant or tool"

Item: TypeAlias = Annotated[
    Annotated[SystemPrompt, Tag("system")]
    | Annotated[UserMessage, Tag("user")]
    | Annotated[AssistantMessage, Tag("assistant")]
    | Annotated[ToolResult, Tag("tool")]
    | Annotated[ModelTurn, Tag("model_turn")],
    Discriminator(
        _item_tag,
        custom_error_type="invalid_item",
        custom_error_message=_MESSAGE_ERROR + '; a model turn needs "type": "model_turn"',
    ),
]
"""An entry of a conversation: a message, or a model turn."""

Message: TypeAlias = Annotated[
    Annotated[SystemPrompt, Tag("system")]
    | Annotated[UserMessage, Tag("user")]
    | Annotated[AssistantMessage, Tag("assistant")]
    | Annotated[ToolResult, Tag("tool")],
    Discriminator(
        _message_tag,
        custom_error_type="invalid_message",
        custom_error_message=_MESSAGE_ERROR,
    ),
]
"""A plain chat message, told apart by its ``role`` (the one message type: in annotations, and to
validate a dict with ``pydantic.TypeAdapter(Message)``)."""

_RENAMED = {"SystemMessage": "SystemPrompt", "ToolMessage": "ToolResult", "AnyMessage": "Message"}
"""Names of 0.1, kept with a warning until 0.3. LangChain has classes of the first two names and
``AnyMessage``; an agent's file imports both."""


def __getattr__(name: str) -> Any:
    if (new := _RENAMED.get(name)) is not None:
        warn(f"journeyman.messages.{name}", new)
        return globals()[new]
    raise AttributeError(f"module 'journeyman.messages' has no attribute {name!r}")


def item_message(item: Message | ModelTurn) -> Message:
    """The chat message of a conversation entry (a model turn's assistant message)."""
    return item.message if isinstance(item, ModelTurn) else item


class StreamedReply:
    """One choice of a streamed chat completion, put back together from its deltas (OpenAI format:
    ``{"content": ..., "tool_calls": [{"index", "id", "function": {"name", "arguments"}}]}``)."""

    def __init__(self) -> None:
        self._text: list[str] = []
        self._calls: dict[int, dict[str, Any]] = {}

    def add(self, delta: dict[str, Any]) -> None:
        if delta.get("content"):
            self._text.append(delta["content"])
        for call in delta.get("tool_calls") or []:
            slot = self._calls.setdefault(call.get("index", 0), {"id": "", "name": "", "arguments": []})
            slot["id"] = call.get("id") or slot["id"]
            function = call.get("function") or {}
            slot["name"] = function.get("name") or slot["name"]
            if function.get("arguments"):
                slot["arguments"].append(function["arguments"])

    @property
    def text(self) -> str:
        return "".join(self._text)

    @property
    def tool_calls(self) -> list[dict[str, Any]]:
        """The tool calls so far, in OpenAI format, by index."""
        return [
            {
                "id": c["id"],
                "type": "function",
                "function": {"name": c["name"], "arguments": "".join(c["arguments"])},
            }
            for _, c in sorted(self._calls.items())
        ]
