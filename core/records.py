"""What the gateway records for every completion it serves.

A :class:`CompletionRecord` holds the request as the client sent it (messages, tools, sampling
parameters) and what makes training token-exact: the prompt token ids the server rendered, and
per choice the sampled token ids with their logprobs. Captured agent calls are joined to records
by ``completion_id`` (or collected by ``rollout_id``) and become :class:`~journeyman.ModelTurn`s.
"""

from __future__ import annotations

import threading
from datetime import datetime
from typing import Any, Literal, Protocol
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field

from journeyman.messages import AssistantMessage, ModelTurn, ToolCall

__all__ = [
    "ROLLOUT_HEADER",
    "TOOL_CALL_FORMS",
    "ChoiceRecord",
    "CompletionRecord",
    "RecordSource",
    "ToolCallForm",
    "in_process_records",
    "register_in_process",
    "unregister_in_process",
]

ROLLOUT_HEADER = "x-journeyman-rollout-id"
"""The request header that tags a completion with its rollout; the gateway groups its records by it
(the same as calling the per-rollout base URL ``{gateway}/r/{rollout_id}/v1``)."""

SAMPLING_KEYS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "max_tokens",
    "max_completion_tokens",
    "n",
    "seed",
    "stop",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "tool_choice",
    "response_format",
)
"""Request keys kept in :attr:`CompletionRecord.sampling`."""

ToolCallForm = Literal["tagged", "bare", "fenced"]
"""How a model wrote a tool call: in ``<tool_call>`` tags (what hermes-style chat templates ask
for), as a bare JSON object in its text, or in a ```json fence."""
TOOL_CALL_FORMS: tuple[ToolCallForm, ...] = ("tagged", "bare", "fenced")


class ChoiceRecord(BaseModel):
    model_config = ConfigDict(extra="forbid")

    index: int = 0
    message: AssistantMessage | None = None
    """The assistant message (chat completions)."""
    text: str | None = None
    """The completion text (plain completions)."""
    completion_token_ids: list[int] | None = None
    logprobs: list[float | None] | None = None
    finish_reason: str | None = None
    invalid_tool_calls: list[ToolCall] | None = None
    """Tool calls the model wrote with arguments that are JSON but not an object (``[3, 4]``):
    the client received them as text in ``message.content`` (OpenAI clients such as
    langchain-openai raise on them), and they are kept here as the server parsed them."""
    tool_call_forms: list[ToolCallForm | None] | None = None
    """How the model wrote each tool call of the server's response, in its order (calls moved to
    ``invalid_tool_calls`` included). Read from the ids journeyman's vLLM tool parser gives
    (``call_bare_<hex>``); None for a call with another id (another parser, a named
    ``tool_choice``), and for the whole list when no call has such an id."""


class CompletionRecord(BaseModel):
    model_config = ConfigDict(extra="forbid")

    completion_id: str
    """The ``id`` of the response the client received."""
    rollout_id: str | None = None
    """The rollout the caller attached (header or per-rollout base URL), if any."""
    kind: Literal["chat", "completion", "response"] = "chat"
    """``response``: a Responses API call, run and recorded as the chat completion it amounts to
    (``messages`` and ``tools`` in the chat format; ``completion_id`` is the response's id)."""
    requested_model: str
    """The model name the client asked for (an alias such as ``calc-agent``)."""
    served_model: str
    """The name vLLM served it under (``calc-agent@3``, or the base model)."""
    policy_version: int | None = None
    """Training step of the adapter that answered; None for the base model."""
    messages: list[dict[str, Any]] | None = None
    """The request's messages exactly as sent (chat)."""
    prompt: Any = None
    """The request's prompt exactly as sent (plain completions)."""
    tools: list[dict[str, Any]] | None = None
    sampling: dict[str, Any] = Field(default_factory=dict)
    stream: bool = False
    prompt_token_ids: list[int] | None = None
    choices: list[ChoiceRecord] = Field(default_factory=list)
    usage: dict[str, Any] | None = None
    started_at: datetime
    finished_at: datetime
    upstream_seconds: float
    """Time from forwarding the request to the last byte from vLLM."""

    def model_turn(self, index: int = 0) -> ModelTurn:
        """Choice ``index`` as a token-exact model turn."""
        choice = self.choices[index]
        message = choice.message or AssistantMessage(content=choice.text or "")
        return ModelTurn(
            message=message,
            completion_id=self.completion_id,
            model=self.served_model,
            policy_version=self.policy_version,
            prompt_token_ids=self.prompt_token_ids,
            completion_token_ids=choice.completion_token_ids,
            logprobs=choice.logprobs,
            finish_reason=choice.finish_reason,
            sampling=self.sampling or None,
        )


class RecordSource(Protocol):
    """Where completion records are looked up by completion id (a gateway's ``RecordLog``, HTTP)."""

    def get(self, completion_id: str) -> CompletionRecord | None: ...


# Gateways running in this process, by address: a tracer next to one reads its records directly
# instead of over HTTP. Loopback and wildcard hosts are one address (127.0.0.1, localhost, 0.0.0.0).
_in_process: dict[tuple[str, int], RecordSource] = {}
_in_process_lock = threading.Lock()
_LOCAL_HOSTS = frozenset({"localhost", "::1", "0.0.0.0", "::", ""})


def _address(url: str) -> tuple[str, int] | None:
    parts = urlsplit(url if "//" in url else f"//{url}")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        return None
    host = (parts.hostname or "").lower()
    return ("local" if host in _LOCAL_HOSTS or host.startswith("127.") else host, port)


def register_in_process(url: str, records: RecordSource) -> None:
    """Announce that the gateway at ``url`` (``http://host:port``) runs in this process."""
    if (address := _address(url)) is not None:
        with _in_process_lock:
            _in_process[address] = records


def unregister_in_process(url: str, records: RecordSource) -> None:
    """Forget the gateway at ``url`` (when it stops), if ``records`` is still the one registered."""
    if (address := _address(url)) is not None:
        with _in_process_lock:
            if _in_process.get(address) is records:
                del _in_process[address]


def in_process_records(url: str) -> RecordSource | None:
    """The records of the gateway at ``url`` when it runs in this process, else None."""
    address = _address(url)
    return _in_process.get(address) if address is not None else None
