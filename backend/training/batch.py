"""From trajectory groups to training sequences, using the exact tokens the model sampled.

For one conversation, consecutive model turns are merged into one sequence while turn k's
prompt + completion is a token prefix of turn k+1's prompt: the model's own sampled tokens are
trained (mask 1) with the logprobs vLLM sampled them with; everything between (tool results,
user turns, template tokens) is context (mask 0). When the prefix does not hold (vLLM's hermes
parser re-renders about 1 turn in 25 differently from what was sampled) a new sequence starts,
counted as ``data/prefix_breaks``.

A model turn without recorded tokens (captured from an external API) is tokenised with the chat
template, counted as ``data/retokenized_turns``; its tokens have no sampling logprob. A turn with
its sampled tokens but no prompt tokens (put under another prompt, ``journeyman.sft.with_context``)
keeps its sampled tokens after a prompt rendered with the template, counted as
``data/recontextualized_turns``, and as ``data/drifted_turns`` where the template renders its text
as other tokens.

Sequences longer than ``max_seq_len`` are truncated (``overlong="truncate"``: tokens past the
limit are not trained) or left out (``"exclude"``), counted either way; a sequence left with no
trained token is dropped and counted.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any, Protocol

from journeyman.config import TrainConfig
from journeyman.errors import InvalidDataError
from journeyman.messages import ModelTurn
from journeyman.trajectory import History, TrajectoryGroup

__all__ = [
    "Batch",
    "Row",
    "TrainSequence",
    "build_batch",
    "history_sequences",
    "limit_sequence",
    "pack",
    "template_messages",
]


class Tokenizer(Protocol):
    eos_token_id: int | None

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...


@dataclass
class TrainSequence:
    tokens: list[int]
    mask: list[int]
    """1 where the token was sampled by the policy and is trained."""
    sampling_logprobs: list[float]
    """vLLM's logprob for each masked token; NaN elsewhere or when unknown."""
    trajectory: int = 0
    """Index of its trajectory in :attr:`Batch.rewards`."""

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def trained_tokens(self) -> int:
        return sum(self.mask)


@dataclass
class Batch:
    sequences: list[TrainSequence]
    rewards: list[float]
    """One per trajectory that made it into the batch."""
    groups: list[int]
    """Group index of each trajectory."""
    counts: Counter[str] = field(default_factory=Counter)
    """``data/...`` counters: what was skipped, broken, truncated, re-tokenised."""


def template_messages(messages: Seq[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as vLLM hands them to a chat template: tool-call ``arguments`` parsed from their
    JSON string into an object (``{}`` when they are not a JSON object), as Hugging Face templates
    expect. Qwen's renders ``arguments | tojson``: a string would come out quoted and escaped, and
    journeyman's tokens would differ from what vLLM served. The input is not changed."""
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if message.get("role") == "assistant" and isinstance(calls, list) and calls:
            message = {**message, "tool_calls": [_parsed_call(call) for call in calls]}
        out.append(message)
    return out


def _parsed_call(call: Any) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or isinstance(function.get("arguments"), dict):
        return call
    try:
        arguments = json.loads(function.get("arguments") or "{}")
    except (TypeError, ValueError):
        arguments = {}
    return {**call, "function": {**function, "arguments": arguments if isinstance(arguments, dict) else {}}}


def _retokenize(
    tokenizer: Tokenizer, history: History, index: int, turn: ModelTurn
) -> tuple[list[int], list[int]]:
    """(prompt ids, completion ids) of a model turn rendered with the chat template."""
    before = template_messages([m.model_dump(exclude_none=True) for m in history.messages[:index]])
    tools = [t.model_dump(exclude_none=True) for t in history.tools] if history.tools else None
    prompt = list(
        tokenizer.apply_chat_template(
            before, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
    )
    full = list(
        tokenizer.apply_chat_template(
            [*before, *template_messages([turn.message.model_dump(exclude_none=True)])],
            tools=tools,
            tokenize=True,
            return_dict=True,
        )["input_ids"]
    )
    if full[: len(prompt)] != prompt:
        raise InvalidDataError(
            "the chat template does not render the conversation before a turn as a prefix of the "
            "conversation with it, so the turn cannot be re-tokenised; record turns through the gateway"
        )
    completion = full[len(prompt) :]
    eos = tokenizer.eos_token_id
    if eos is not None and eos in completion:
        completion = completion[: completion.index(eos) + 1]
    return prompt, completion


def history_sequences(
    history: History, tokenizer: Tokenizer | None, counts: Counter[str]
) -> list[TrainSequence]:
    """The training sequences of one conversation (see the module docstring)."""
    sequences: list[TrainSequence] = []
    current: TrainSequence | None = None
    for index, item in enumerate(history.conversation):
        if not isinstance(item, ModelTurn):
            continue
        counts["data/model_turns"] += 1
        if item.is_token_exact:
            prompt, completion = list(item.prompt_token_ids or []), list(item.completion_token_ids or [])
            logprobs = [math.nan if lp is None else lp for lp in (item.logprobs or [None] * len(completion))]
        else:
            if tokenizer is None:
                raise InvalidDataError(
                    "a model turn has no recorded tokens and no tokenizer was given to re-tokenise it"
                )
            prompt, completion = _retokenize(tokenizer, history, index, item)
            logprobs = [math.nan] * len(completion)
            if item.completion_token_ids is not None:  # sampled under another prompt: its own tokens
                if list(item.completion_token_ids) != completion:
                    counts["data/drifted_turns"] += 1
                completion = list(item.completion_token_ids)
                logprobs = [math.nan] * len(completion)  # sampled under the other prompt: no ratio
                counts["data/recontextualized_turns"] += 1
            else:
                counts["data/retokenized_turns"] += 1
        if not completion:
            counts["data/empty_completions"] += 1
        if current is not None and prompt[: len(current.tokens)] == current.tokens:
            extra = prompt[len(current.tokens) :]
            current.tokens += extra
            current.mask += [0] * len(extra)
            current.sampling_logprobs += [math.nan] * len(extra)
        else:
            if current is not None:
                counts["data/prefix_breaks"] += 1
                sequences.append(current)
            current = TrainSequence(list(prompt), [0] * len(prompt), [math.nan] * len(prompt))
        current.tokens += completion
        current.mask += [1] * len(completion)
        current.sampling_logprobs += logprobs
    if current is not None:
        sequences.append(current)
    return sequences


def limit_sequence(
    sequence: TrainSequence, config: TrainConfig, counts: Counter[str]
) -> TrainSequence | None:
    """The sequence within ``config.max_seq_len``: cut there (``overlong="truncate"``) or ``None``
    (``"exclude"``), counted either way."""
    if len(sequence) <= config.max_seq_len:
        return sequence
    if config.overlong == "exclude":
        counts["data/excluded_overlong_sequences"] += 1
        counts["data/excluded_overlong_tokens"] += sequence.trained_tokens
        return None
    limit = config.max_seq_len
    counts["data/truncated_sequences"] += 1
    counts["data/truncated_trained_tokens"] += sum(sequence.mask[limit:])
    return TrainSequence(
        sequence.tokens[:limit],
        sequence.mask[:limit],
        sequence.sampling_logprobs[:limit],
        sequence.trajectory,
    )


def build_batch(groups: Seq[TrajectoryGroup], tokenizer: Tokenizer | None, config: TrainConfig) -> Batch:
    """Sequences of every scored trajectory, with their rewards and group indices.

    Advantages are computed by the trainer from ``rewards`` and ``groups``; trajectories without
    a reward are left out and counted (``data/unscored_trajectories``).
    """
    batch = Batch([], [], [])
    counts = batch.counts
    for group_index, group in enumerate(groups):
        counts["data/groups"] += 1
        counts["data/failures"] += len(group.failures)
        for trajectory in group.trajectories:
            if trajectory.reward is None:
                counts["data/unscored_trajectories"] += 1
                continue
            index = len(batch.rewards)
            batch.rewards.append(trajectory.reward)
            batch.groups.append(group_index)
            counts["data/trajectories"] += 1
            for history in trajectory.histories:
                for sequence in history_sequences(history, tokenizer, counts):
                    sequence.trajectory = index
                    limited = limit_sequence(sequence, config, counts)
                    if limited is None:
                        continue
                    if limited.trained_tokens == 0:
                        counts["data/sequences_without_trained_tokens"] += 1
                        continue
                    batch.sequences.append(limited)
    return batch


@dataclass
class Row:
    """Sequences that share their first ``prefix`` tokens, packed into one row of the forward
    pass: the prefix once, then the rest of each sequence. Each rest attends to the prefix and
    to itself only (a tree-shaped mask) and keeps its own positions, so every token sees exactly
    what it would see in its own sequence. No trained token lies inside the shared prefix."""

    sequences: list[TrainSequence]
    prefix: int = 0

    def __len__(self) -> int:
        return self.prefix + sum(len(s) - self.prefix for s in self.sequences)

    def layout(self) -> tuple[list[int], list[int], list[int], list[list[int]]]:
        """(tokens, position ids, start of each token's segment, and for each sequence the row
        index of each of its tokens). A token at row index q may attend to index k when
        ``k <= q and (k >= segment[q] or k < prefix)``."""
        p = self.prefix
        first = self.sequences[0].tokens
        tokens, positions, segments = list(first[:p]), list(range(p)), [0] * p
        where: list[list[int]] = []
        for sequence in self.sequences:
            start = len(tokens)
            rest = sequence.tokens[p:]
            tokens += rest
            positions += range(p, len(sequence))
            segments += [start] * len(rest)
            where.append(list(range(p)) + list(range(start, start + len(rest))))
        return tokens, positions, segments, where


def _first_trained(sequence: TrainSequence) -> int:
    return sequence.mask.index(1) if 1 in sequence.mask else len(sequence)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _rows(
    sequences: Seq[TrainSequence], token_budget: int, cost: Callable[[int], float], share_prefix: bool = True
) -> list[Row]:
    """Sorted by tokens, so sequences with a common prefix (a group's prompt, a shared system
    prompt) are neighbours; a sequence joins the row before it when sharing the prefix costs
    less than a row of its own and the row stays within the budget (never without
    ``share_prefix``)."""
    rows: list[Row] = []
    for sequence in sorted(sequences, key=lambda s: s.tokens):
        if rows and share_prefix:
            row = rows[-1]
            shared = min(
                _common_prefix(row.sequences[0].tokens, sequence.tokens),
                _first_trained(sequence),
                min(_first_trained(s) for s in row.sequences),
            )
            joined = Row([*row.sequences, sequence], shared)
            if (
                shared > 0
                and len(joined) <= token_budget
                and cost(len(joined)) < cost(len(row)) + cost(len(sequence))
            ):
                rows[-1] = joined
                continue
        rows.append(Row([sequence], _first_trained(sequence)))
    return rows


def pack(
    sequences: Seq[TrainSequence],
    token_budget: int,
    cost: Callable[[int], float] | None = None,
    *,
    share_prefix: bool = True,
) -> list[list[Row]]:
    """Rows of prefix-sharing sequences, grouped into micro-batches whose padded size (rows x
    longest row) fits the budget; a row longer than the budget gets a micro-batch of its own.

    ``cost(n)`` is the compute of a forward pass over a row of ``n`` tokens (linear layers grow
    with n, attention with n^2): sequences share a row only when that is cheaper. The default
    counts tokens, so any shared prefix is shared. ``share_prefix=False`` gives each sequence a
    row of its own, for an engine that attends causally over the whole row (Unsloth in training).
    """
    rows = _rows(sequences, token_budget, cost or float, share_prefix)
    micro_batches: list[list[Row]] = []
    current: list[Row] = []
    for row in sorted(rows, key=len, reverse=True):
        longest = len(current[0]) if current else len(row)
        if current and (len(current) + 1) * longest > token_budget:
            micro_batches.append(current)
            current = []
        current.append(row)
    if current:
        micro_batches.append(current)
    return micro_batches
