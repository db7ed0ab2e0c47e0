"""Supervised fine-tuning of a trainer's LoRA adapter: one call is one checkpoint step.

    sequences = each conversation's model turns as trained tokens, all else context
                (batch.history_sequences: token exact where recorded, else rendered with the
                model's chat template and the conversation's tools)
    for each epoch, the conversations shuffled by the seed, in batches of batch_size:
        loss = - (sum of log pi(token) over the batch's trained tokens) / those tokens
        one clipped AdamW step at the schedule's learning rate; a row of split sft_batch
        every eval_every batches (or at each epoch's end): the validation loss; early stopping
    the weights of the lowest validation loss (keep_best), checkpoints/<step + 1>

The trainer's RL optimizer state is not touched: supervised steps have an AdamW of their own, and
the next RL step goes on from the adapter this one saved.
"""

from __future__ import annotations

import math
import random
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from journeyman.config import SFTConfig, TrainConfig
from journeyman.errors import InvalidDataError
from journeyman.sft import raise_problems, source_of
from journeyman.trajectory import Trajectory

from .batch import TrainSequence, history_sequences, limit_sequence, pack
from .logprobs import packed_inputs, sequence_views, token_logprobs


class Trainer(Protocol):
    """What a supervised run uses of :class:`~.trainer.Trainer`."""

    model: Any
    tokenizer: Any

    @property
    def device(self) -> torch.device: ...

    @property
    def uses_unsloth(self) -> bool: ...

    def _trainable(self) -> list[tuple[str, torch.nn.Parameter]]: ...

    def _row_cost(self, tokens: int) -> float: ...

    def _checkpoint_activations(self, on: bool) -> None: ...


__all__ = ["Conversation", "SFTProgress", "learning_rate_at", "run_sft", "sft_conversations"]

SFTProgress = Callable[[dict[str, Any], int], None]
"""Called after each batch with its ``sft_batch`` row and the run's number of batches."""


@dataclass
class Conversation:
    """One conversation's training sequences and where it came from."""

    sequences: list[TrainSequence]
    source: str

    @property
    def targets(self) -> int:
        """Trained tokens that are predicted (a sequence's first token never is)."""
        return sum(sum(s.mask[1:]) for s in self.sequences)


@dataclass
class _Run:
    rows: list[dict[str, Any]] = field(default_factory=list)
    evaluations: list[tuple[int, float]] = field(default_factory=list)
    best: tuple[float, int, dict[str, torch.Tensor]] | None = None
    stale: int = 0


def sft_conversations(
    trajectories: Sequence[Trajectory], tokenizer: Any, config: SFTConfig, context: int, counts: Counter[str]
) -> list[Conversation]:
    """Each trajectory's training sequences, within ``min(config.max_seq_len, context)`` tokens.
    A longer conversation is an error naming it (``overlong="error"``: every such conversation is
    listed, nothing trains), is cut, or is left out; a conversation with no trained token is an error."""
    limit = min(config.max_seq_len, context)
    cut = TrainConfig(max_seq_len=limit, overlong="exclude" if config.overlong == "exclude" else "truncate")
    problems: list[str] = []
    conversations = []
    for index, trajectory in enumerate(trajectories):
        where = source_of(trajectory, index)
        try:
            sequences = [s for h in trajectory.histories for s in history_sequences(h, tokenizer, counts)]
        except InvalidDataError as error:
            problems.append(f"{where}: {error}")
            continue
        longest = max((len(s) for s in sequences), default=0)
        if longest > limit and config.overlong == "error":
            problems.append(
                f"{where}: {longest} tokens, more than {limit} (max_seq_len {config.max_seq_len}, the model's "
                f"context {context}): shorten it, or set overlong='truncate' or 'exclude'"
            )
            continue
        kept = [limited for s in sequences if (limited := limit_sequence(s, cut, counts)) is not None]
        conversation = Conversation([s for s in kept if sum(s.mask[1:])], where)
        if not conversation.sequences:
            if longest > limit:
                counts["data/excluded_conversations"] += 1
                continue
            problems.append(f"{where}: its assistant turns hold no token to train")
            continue
        counts["data/trajectories"] += 1
        conversations.append(conversation)
    raise_problems(problems, "the conversations")
    return conversations


def learning_rate_at(config: SFTConfig, index: int, total: int) -> float:
    """The learning rate of batch ``index`` (from 0) of ``total``: a linear warm-up over
    ``warmup_ratio`` of the batches, then constant, or falling linearly or along a half cosine
    from the peak at the first batch after warm-up towards 0 after the last."""
    peak = config.learning_rate
    warmup = round(config.warmup_ratio * total)
    if index < warmup:
        return peak * (index + 1) / warmup
    if config.schedule == "constant":
        return peak
    progress = (index - warmup) / max(1, total - warmup)
    if config.schedule == "linear":
        return peak * (1 - progress)
    return peak * 0.5 * (1 + math.cos(math.pi * progress))


def run_sft(
    trainer: Trainer,
    train: list[Conversation],
    evaluation: list[Conversation],
    config: SFTConfig,
    progress: SFTProgress | None = None,
) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """The batches of a supervised run on ``trainer``'s adapter (its weights change in place):
    the run's summary metrics and its ``sft_batch`` rows (without ``step``)."""
    params = [p for _, p in trainer._trainable()]
    optimizer = torch.optim.AdamW(params, lr=config.learning_rate, weight_decay=config.weight_decay)
    per_epoch = math.ceil(len(train) / config.batch_size)
    total = per_epoch * config.epochs
    every = config.eval_every or per_epoch
    run = _Run()
    metrics: dict[str, float] = {}
    if evaluation:
        metrics["sft/val_loss_before"] = _loss(trainer, evaluation, config)
    trainer.model.train()
    if config.gradient_checkpointing:
        trainer._checkpoint_activations(True)
    start, done, tokens, stopped = time.perf_counter(), 0, 0, False
    try:
        for epoch in range(config.epochs):
            order = list(range(len(train)))
            random.Random(config.seed + epoch).shuffle(order)
            for first in range(0, len(order), config.batch_size):
                batch = [train[i] for i in order[first : first + config.batch_size]]
                rate = learning_rate_at(config, done, total)
                loss, norm, trained = _step(trainer, optimizer, params, batch, config, rate)
                done += 1
                tokens += trained
                row: dict[str, Any] = {"split": "sft_batch", "sft/batch": done, "sft/epoch": epoch + (first + len(batch)) / len(train),
                       "sft/loss": loss, "sft/learning_rate": rate, "sft/grad_norm": norm, "sft/trained_tokens": trained}  # fmt: skip
                if evaluation and (done % every == 0 or done == total):
                    row["sft/val_loss"] = validation = _loss(trainer, evaluation, config)
                    stopped = _evaluated(run, trainer, done, validation, config)
                run.rows.append(row)
                if progress is not None:
                    progress(row, total)
                if stopped:
                    break
            if stopped:
                break
    finally:
        if config.gradient_checkpointing:
            trainer._checkpoint_activations(False)
    if run.best is not None and config.keep_best:
        with torch.no_grad():
            for name, parameter in trainer._trainable():
                parameter.copy_(run.best[2][name])
    last_epoch = [
        r["sft/loss"] for r in run.rows if math.ceil(r["sft/epoch"]) == math.ceil(run.rows[-1]["sft/epoch"])
    ]
    metrics.update({"sft/conversations": float(len(train)), "sft/eval_conversations": float(len(evaluation)),
                    "sft/batches": float(done), "sft/epochs": float(run.rows[-1]["sft/epoch"]),
                    "sft/trained_tokens": float(tokens), "sft/loss": sum(last_epoch) / len(last_epoch),
                    "sft/stopped_early": float(stopped), "time/sft": time.perf_counter() - start})  # fmt: skip
    if run.best is not None:
        chosen = run.best if config.keep_best else (run.evaluations[-1][1], run.evaluations[-1][0], {})
        metrics["sft/val_loss"], metrics["sft/best_batch"] = chosen[0], float(chosen[1])
    return metrics, run.rows


def _evaluated(run: _Run, trainer: Trainer, batch: int, loss: float, config: SFTConfig) -> bool:
    """Keep the best weights; True when early stopping ends the run."""
    run.evaluations.append((batch, loss))
    if run.best is None or loss < run.best[0]:
        weights = {name: p.detach().clone() for name, p in trainer._trainable()} if config.keep_best else {}
        run.best, run.stale = (loss, batch, weights), 0
        return False
    run.stale += 1
    return config.early_stopping_patience is not None and run.stale >= config.early_stopping_patience


def _step(
    trainer: Trainer,
    optimizer: torch.optim.Optimizer,
    params: list[torch.nn.Parameter],
    batch: list[Conversation],
    config: SFTConfig,
    rate: float,
) -> tuple[float, float, int]:
    """One optimizer step on ``batch``: its mean loss per trained token, gradient norm, tokens."""
    sequences = [s for conversation in batch for s in conversation.sequences]
    targets = sum(c.targets for c in batch)
    total = torch.zeros((), device=trainer.device)
    for rows in _micro_batches(trainer, sequences, config):
        nll = _nll(trainer, rows, config)
        (nll / targets).backward()  # type: ignore[no-untyped-call]
        total += nll.detach()
    for group in optimizer.param_groups:
        group["lr"] = rate
    max_norm = config.max_grad_norm if config.max_grad_norm is not None else math.inf
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(total) / targets, float(norm), targets


def _loss(trainer: Trainer, conversations: list[Conversation], config: SFTConfig) -> float:
    """Mean negative log-likelihood per trained token, without gradients."""
    sequences = [s for c in conversations for s in c.sequences]
    total = torch.zeros((), device=trainer.device)
    trainer.model.eval()
    with torch.no_grad():
        for rows in _micro_batches(trainer, sequences, config):
            total += _nll(trainer, rows, config)
    trainer.model.train()
    return float(total) / sum(c.targets for c in conversations)


def _micro_batches(trainer: Trainer, sequences: list[TrainSequence], config: SFTConfig) -> list[list[Any]]:
    return pack(
        sequences, config.micro_batch_tokens, trainer._row_cost, share_prefix=not trainer.uses_unsloth
    )


def _nll(trainer: Trainer, rows: list[Any], config: SFTConfig) -> torch.Tensor:
    """The summed negative log-likelihood of the micro-batch's trained tokens."""
    inputs = packed_inputs(rows, trainer.tokenizer.pad_token_id or 0, trainer.device)
    views = sequence_views([s for row in rows for s in row.sequences], inputs.where, trainer.device)
    logprobs, _ = token_logprobs(trainer.model, inputs, views, config.logprob_chunk)
    return -(logprobs * views.mask).sum()
