"""What the gateway records for every completion it serves.

A :class:`CompletionRecord` holds the request as the client sent it (messages, tools, sampling
parameters) and what makes training token-exact: the prompt token ids the server rendered, and
per choice the sampled token ids with their logprobs. Captured agent calls are joined to records
by ``completion_id`` (or collected by ``rollout_id``) and become :class:`~journeyman.ModelTurn`s.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from journeyman.messages import AssistantMessage, ModelTurn

__all__ = ["ChoiceRecord", "CompletionRecord"]

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


class CompletionRecord(BaseModel):
    model_config = ConfigDict(extra="forbid")

    completion_id: str
    """The ``id`` of the response the client received."""
    rollout_id: str | None = None
    """The rollout the caller attached (header or per-rollout base URL), if any."""
    kind: Literal["chat", "completion"] = "chat"
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
            prompt_token_ids=self.prompt_token_ids,
            completion_token_ids=choice.completion_token_ids,
            logprobs=choice.logprobs,
            finish_reason=choice.finish_reason,
            sampling=self.sampling or None,
        )
