"""From trajectory groups to training sequences, using the exact tokens the model sampled.

For one conversation, consecutive model turns are merged into one sequence while turn k's
prompt + completion is a token prefix of turn k+1's prompt: the model's own sampled tokens are
trained (mask 1) with the logprobs vLLM sampled them with; everything between (tool results,
user turns, template tokens) is context (mask 0). When the prefix does not hold (vLLM's hermes
parser re-renders about 1 turn in 25 differently from what was sampled) a new sequence starts,
counted as ``data/prefix_breaks``.

A model turn without recorded tokens (captured from an external API) is tokenised with the chat
template, counted as ``data/retokenized_turns``; its tokens have no sampling logprob.

Sequences longer than ``max_seq_len`` are truncated (``overlong="truncate"``: tokens past the
limit are not trained) or left out (``"exclude"``), counted either way; a sequence left with no
trained token is dropped and counted.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any, Protocol

from journeyman.config import TrainConfig
from journeyman.errors import InvalidDataError
from journeyman.messages import ModelTurn
from journeyman.trajectory import History, TrajectoryGroup

__all__ = ["Batch", "TrainSequence", "build_batch", "history_sequences", "pack"]


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


def _retokenize(
    tokenizer: Tokenizer, history: History, index: int, turn: ModelTurn
) -> tuple[list[int], list[int]]:
    """(prompt ids, completion ids) of a model turn rendered with the chat template."""
    before = [m.model_dump(exclude_none=True) for m in history.messages[:index]]
    tools = [t.model_dump(exclude_none=True) for t in history.tools] if history.tools else None
    prompt = list(
        tokenizer.apply_chat_template(
            before, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
    )
    full = list(
        tokenizer.apply_chat_template(
            [*before, turn.message.model_dump(exclude_none=True)],
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


def _limit(sequence: TrainSequence, config: TrainConfig, counts: Counter[str]) -> TrainSequence | None:
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
                    limited = _limit(sequence, config, counts)
                    if limited is None:
                        continue
                    if limited.trained_tokens == 0:
                        counts["data/sequences_without_trained_tokens"] += 1
                        continue
                    batch.sequences.append(limited)
    return batch


def pack(sequences: Seq[TrainSequence], token_budget: int) -> list[list[TrainSequence]]:
    """Group sequences into micro-batches whose padded size (count x longest) fits the budget.

    Sorted by length so similar lengths share padding; a sequence longer than the budget gets a
    micro-batch of its own.
    """
    micro_batches: list[list[TrainSequence]] = []
    current: list[TrainSequence] = []
    for sequence in sorted(sequences, key=len, reverse=True):
        longest = len(current[0]) if current else len(sequence)
        if current and (len(current) + 1) * longest > token_budget:
            micro_batches.append(current)
            current = []
        current.append(sequence)
    if current:
        micro_batches.append(current)
    return micro_batches
