"""A step's groups, one attempt's conversation and its tokens, and the diff of two attempts, as
the viewer shows them.

The token view is made by the trainer's own code (:func:`~journeyman.backend.training.batch.
history_sequences`, then the same ``max_seq_len`` cut), so a token marked trained here is a token
a training step put a loss on, and one marked context is one it did not.
"""

from __future__ import annotations

import difflib
import json
import math
import statistics
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from journeyman.config import TrainConfig
from journeyman.messages import ModelTurn, content_text
from journeyman.trajectory import Failure, History, Trajectory, TrajectoryGroup

from ...training.batch import history_sequences, limit_sequence

__all__ = [
    "AttemptCard",
    "GroupRow",
    "MessageView",
    "TokenSequence",
    "conversation",
    "diff",
    "group_rows",
    "succeeded",
    "token_sequences",
    "tokenizer_for",
    "trained_attempts",
]

Show = Literal["all", "success", "failure"]
Decode = Callable[[int], str]


@dataclass
class AttemptCard:
    """One attempt in a group's row."""

    id: str
    reward: float | None
    success: bool | None
    final: str
    calls: list[str]
    metrics: dict[str, Any]
    explanation: str | None
    versions: list[str]
    failures: int


@dataclass
class GroupRow:
    index: int
    id: str
    attempts: list[AttemptCard]
    failures: list[Failure]
    metrics: dict[str, Any]
    hidden: int = 0
    """Attempts the filter left out."""

    trained: bool = True
    """Whether a training step learned from the group (its rewards differ)."""


@dataclass
class MessageView:
    role: str
    text: str
    calls: list[tuple[str, str]] = field(default_factory=list)
    """(function name, arguments pretty-printed when they are JSON)."""
    tool: str | None = None
    """A tool result's tool name or call id."""
    version: str | None = None
    """The served name (``name@step``) a model turn was sampled from."""
    finish_reason: str | None = None
    tokens: int | None = None


@dataclass
class TokenSequence:
    """One training sequence: each token's text, whether it is trained, its sampling logprob."""

    tokens: list[tuple[str, bool, float | None]]
    trained: int
    cut: int = 0
    """Trained tokens past ``max_seq_len`` that the cut left untrained."""


def succeeded(trajectory: Trajectory, group_top: float | None) -> bool | None:
    """Success as the run recorded it (a ``success`` metric), else having the group's best reward
    when the group's rewards differ; ``None`` when neither tells."""
    value = trajectory.metrics.get("success")
    if value is not None:
        return bool(value)
    if group_top is None or trajectory.reward is None:
        return None
    return trajectory.reward >= group_top


def group_rows(groups: list[TrajectoryGroup], show: Show = "all") -> list[GroupRow]:
    """Each group as a row of its attempts sorted by reward (best first), filtered by success."""
    rows = []
    for index, group in enumerate(groups):
        rewards = [t.reward for t in group.trajectories if t.reward is not None]
        top = max(rewards) if rewards and max(rewards) > min(rewards) else None
        cards = [_card(t, top, group.failures) for t in group.trajectories]
        cards.sort(key=lambda c: -math.inf if c.reward is None else c.reward, reverse=True)
        kept = [c for c in cards if show == "all" or (c.success is True) == (show == "success")]
        trained = bool(trained_attempts(group))
        hidden = len(cards) - len(kept)
        rows.append(GroupRow(index, group.id, kept, group.failures, dict(group.metrics), hidden, trained))
    return rows


def conversation(history: History) -> list[MessageView]:
    """A history's messages as the page shows them, with each model turn's served version."""
    views = []
    for item in history.conversation:
        message = item.message if isinstance(item, ModelTurn) else item
        data = message.model_dump(exclude_none=True)
        calls = [
            (call["function"]["name"], _pretty(call["function"].get("arguments", "")))
            for call in data.get("tool_calls") or []
        ]
        view = MessageView(data["role"], content_text(getattr(message, "content", None)), calls)
        view.tool = data.get("name") or data.get("tool_call_id")
        if isinstance(item, ModelTurn):
            version = f"step {item.policy_version}" if item.policy_version is not None else item.model
            view.version, view.finish_reason = version, item.finish_reason
            view.tokens = len(item.completion_token_ids) if item.completion_token_ids is not None else None
        views.append(view)
    return views


def trained_attempts(group: TrajectoryGroup) -> set[str]:
    """The ids of the attempts a training step learns from: those with a reward, in a group whose
    rewards differ (by the trainer's rule: a population std over 1e-6); the rest get advantage 0
    and their sequences are left out."""
    rewards = {t.id: t.reward for t in group.trajectories if t.reward is not None}
    if len(rewards) < 2 or statistics.pstdev(rewards.values()) <= 1e-6:
        return set()
    return set(rewards)


def token_sequences(
    history: History, decode: Decode, config: TrainConfig, *, trained: bool = True
) -> list[TokenSequence]:
    """The training sequences of a history, cut at ``config.max_seq_len`` as the trainer cuts them
    (all context when ``trained`` is false: an evaluation, or an attempt the step left out).
    Raises :class:`~journeyman.errors.InvalidDataError` when a model turn has no recorded tokens
    (training then re-tokenises it with the chat template, which the viewer does not load)."""
    counts: Counter[str] = Counter()
    result = []
    for sequence in history_sequences(history, None, counts):
        limited = limit_sequence(sequence, config, counts) if trained else None
        kept = limited.mask if limited is not None else []
        mask = [*kept, *[0] * (len(sequence) - len(kept))]
        tokens = [
            (decode(token), bool(trained), None if math.isnan(lp) else lp)
            for token, trained, lp in zip(sequence.tokens, mask, sequence.sampling_logprobs, strict=True)
        ]
        cut = sequence.trained_tokens - sum(mask) if trained else 0
        result.append(TokenSequence(tokens, sum(mask), cut=cut))
    return result


def tokenizer_for(base_model: str | None) -> Decode | None:
    """Token id -> text with the base model's ``tokenizer.json`` (the ``tokenizers`` package, which
    transformers installs), or ``None`` when either is missing."""
    if base_model is None or not (Path(base_model) / "tokenizer.json").is_file():
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return None
    tokenizer = Tokenizer.from_file(str(Path(base_model) / "tokenizer.json"))
    return lambda token: tokenizer.decode([token], skip_special_tokens=False)


def diff(a: Trajectory, b: Trajectory) -> list[tuple[str, str]]:
    """The two attempts' messages as text lines, compared: (" ", "+" or "-", line)."""
    return [(line[0], line[2:]) for line in difflib.ndiff(_lines(a), _lines(b)) if line[0] in " +-"]


def _lines(trajectory: Trajectory) -> list[str]:
    lines = []
    for view in conversation(trajectory):
        lines.append(f"[{view.role}{' ' + view.tool if view.tool else ''}]")
        lines += view.text.splitlines() or [""]
        lines += [f"-> {name}({arguments})" for name, arguments in view.calls]
    return lines


def _card(trajectory: Trajectory, top: float | None, failures: list[Failure]) -> AttemptCard:
    messages = trajectory.openai_messages()
    last = next((m for m in reversed(messages) if m["role"] == "assistant"), None)
    own = [turn.message.model_dump(exclude_none=True) for turn in trajectory.model_turns]
    calls = [  # the attempt's own calls: not those of worked examples in its prompt
        f"{call['function']['name']}({call['function'].get('arguments', '')})"
        for m in own
        for call in m.get("tool_calls") or []
    ]
    final = ""
    if last is not None:
        final = _text_of(last) or (calls[-1] if last.get("tool_calls") and calls else "")
    explanation = trajectory.metadata.get("judge_explanation")
    versions = [f"step {step}" for step in trajectory.policy_versions] or sorted(
        {t.model for h in trajectory.histories for t in h.model_turns if t.model}
    )
    return AttemptCard(
        id=trajectory.id,
        reward=trajectory.reward,
        success=succeeded(trajectory, top),
        final=final,
        calls=calls,
        metrics=dict(trajectory.metrics),
        explanation=str(explanation) if explanation else None,
        versions=versions,
        failures=sum(f.trajectory_id == trajectory.id for f in failures),
    )


def _text_of(message: dict[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, list):
        return "".join(str(part.get("text", "")) for part in content if part.get("type") == "text")
    return str(content or "")


def _pretty(arguments: str) -> str:
    try:
        return json.dumps(json.loads(arguments), indent=1, ensure_ascii=False)
    except ValueError:
        return arguments
