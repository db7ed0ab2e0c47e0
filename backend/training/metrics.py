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
    share a step add their :meth:`sums` together and take the largest :attr:`max_ratio`.

    :meth:`add` keeps each micro-batch's values as tensors on the device that computed them;
    :meth:`gather` brings them to the host in one transfer, the step's one wait for the device.
    """

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
        self._pending: list[tuple[torch.Tensor, float, int]] = []
        """Each micro-batch's values on its device, its weight and its trained tokens."""

    def share(self, tokens: int, live: int, aggregation: str) -> float:
        """A micro-batch's share of the batch's denominator, from what the host knows of it: its
        trained tokens and its sequences with trained tokens."""
        if aggregation == "token_mean":
            return tokens / max(1, self.tokens)
        return live / max(1, self.live_sequences)

    def add(
        self,
        parts: Any,
        weight: float,
        tokens: int,
        logprobs: torch.Tensor,
        sampling: torch.Tensor,
        mask: torch.Tensor,
        entropy: torch.Tensor,
    ) -> None:
        """Keep a micro-batch's values (no wait for the device)."""
        self.micro_batches += 1
        known = mask.bool() & ~torch.isnan(sampling)
        delta = torch.where(known, sampling - logprobs, 0.0)  # log mu - log pi on tokens sampled from mu
        kl = parts.kl if parts.kl is not None else torch.zeros((), device=logprobs.device)
        values = torch.stack(
            [
                parts.loss.detach().float(),
                parts.policy.float(),
                kl.float(),
                parts.clip_fraction.float(),
                parts.masked_by_mismatch.float(),
                (entropy * mask).sum(),
                known.sum().float(),
                delta.sum(),
                torch.exp(delta.abs()).max() if delta.numel() else torch.ones((), device=delta.device),
            ]
        )
        self._pending.append((values, weight, tokens))

    def gather(self, *extra: torch.Tensor) -> list[float]:
        """Add the kept micro-batches' values to the sums, and return ``extra``'s values, in one
        transfer from the device."""
        pending, self._pending = self._pending, []
        whole = [t.full_tensor() if hasattr(t, "full_tensor") else t for t in extra]  # FSDP's DTensor norm
        rows = [values.double() for values, _, _ in pending] + [t.detach().double().reshape(1) for t in whole]
        host: list[float] = torch.cat(rows).tolist() if rows else []
        flat = iter(host)
        for _, weight, tokens in pending:
            loss, policy, kl, clipped, masked, entropy, known, mismatch, ratio = (
                next(flat) for _ in range(9)
            )
            self.loss += loss * weight
            self.policy += policy * weight
            self.kl += kl * weight
            self.clipped += clipped * tokens
            self.masked += masked
            self.entropy += entropy
            self.known += int(known)
            self.mismatch_k1 += mismatch
            self.max_ratio = max(self.max_ratio, ratio)
        return list(flat)

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
