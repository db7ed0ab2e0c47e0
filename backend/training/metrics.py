"""What a training step reports: the data it trained on, and the running sums of its loss terms."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .batch import Batch, TrainSequence

__all__ = ["StepTotals", "data_metrics", "zero_variance_groups"]


def zero_variance_groups(batch: Batch, informative: torch.Tensor) -> int:
    groups = {g for g, keep in zip(batch.groups, informative.tolist(), strict=True) if not keep}
    return len(groups)


def data_metrics(batch: Batch, zero_variance: int, sequences: list[TrainSequence]) -> dict[str, float]:
    metrics = {key: float(value) for key, value in batch.counts.items()}
    groups = batch.counts["data/groups"]
    metrics["data/zero_variance_groups"] = float(zero_variance)
    metrics["data/zero_variance_share"] = zero_variance / groups if groups else 0.0
    metrics["data/sequences"] = float(len(sequences))
    metrics["data/trained_tokens"] = float(sum(s.trained_tokens for s in sequences))
    if batch.rewards:
        rewards = torch.tensor(batch.rewards)
        metrics["reward/mean"] = float(rewards.mean())
        metrics["reward/std"] = float(rewards.std(unbiased=False))
    return metrics


class StepTotals:
    """The batch-level denominators and the running sums for the step's metrics. Processes that
    share a step add their :meth:`sums` together and take the largest :attr:`max_ratio`."""

    SUMMED = ("loss", "policy", "kl", "clipped", "entropy", "masked", "known", "mismatch_k1", "micro_batches")

    def __init__(self, sequences: list[TrainSequence]) -> None:
        # Targets are shifted by one, so a sequence's first token is never a target.
        self.tokens = sum(sum(s.mask[1:]) for s in sequences)
        self.live_sequences = sum(1 for s in sequences if sum(s.mask[1:]) > 0)
        self.loss = self.policy = self.kl = 0.0
        self.clipped = self.entropy = self.masked = 0.0
        self.known = 0
        self.mismatch_k1 = 0.0
        self.max_ratio = 1.0
        self.micro_batches = 0

    def share(self, mask: torch.Tensor, aggregation: str) -> float:
        if aggregation == "token_mean":
            return float(mask.sum()) / max(1, self.tokens)
        return float((mask.sum(-1) > 0).sum()) / max(1, self.live_sequences)

    def add(
        self,
        parts: Any,
        weight: float,
        logprobs: torch.Tensor,
        sampling: torch.Tensor,
        mask: torch.Tensor,
        entropy: torch.Tensor,
    ) -> None:
        tokens = float(mask.sum())
        self.micro_batches += 1
        self.loss += float(parts.loss.detach()) * weight
        self.policy += float(parts.policy) * weight
        if parts.kl is not None:
            self.kl += float(parts.kl) * weight
        self.clipped += float(parts.clip_fraction) * tokens
        self.masked += float(parts.masked_by_mismatch)
        self.entropy += float((entropy * mask).sum())
        known = mask.bool() & ~torch.isnan(sampling)
        if known.any():
            delta = sampling[known] - logprobs[known]  # log mu - log pi on tokens sampled from mu
            self.known += int(known.sum())
            self.mismatch_k1 += float(delta.sum())
            self.max_ratio = max(self.max_ratio, float(torch.exp(delta.abs()).max()))

    def sums(self) -> list[float]:
        """The running sums, in :attr:`SUMMED` order."""
        return [float(getattr(self, key)) for key in self.SUMMED]

    def set_sums(self, values: Sequence[float]) -> None:
        """Replace the running sums (all processes' together), in :attr:`SUMMED` order."""
        for key, value in zip(self.SUMMED, values, strict=True):
            setattr(self, key, type(getattr(self, key))(value))

    def metrics(self) -> dict[str, float]:
        tokens = max(1, self.tokens)
        result = {
            "train/loss": self.loss,
            "train/policy_loss": self.policy,
            "train/clip_fraction": self.clipped / tokens,
            "train/entropy": self.entropy / tokens,
            "train/micro_batches": float(self.micro_batches),
            "mismatch/masked_tokens": self.masked,
            "mismatch/tokens_with_sampling_logprobs": float(self.known),
        }
        if self.kl:
            result["train/kl"] = self.kl
        if self.known:
            result["mismatch/kl"] = self.mismatch_k1 / self.known
            result["mismatch/max_ratio"] = self.max_ratio
        return result
