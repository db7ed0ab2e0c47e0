"""Training configuration: what a user passes to ``model.train(groups, config=...)``.

Both classes are frozen and validated once; choices are ``Literal`` values. Defaults that depend
on the loss (clip ranges, reward scaling) are derived in properties, so an explicit value always
wins and nothing is mutated after construction.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from journeyman.errors import ConfigError

__all__ = [
    "LOSSES",
    "Aggregation",
    "LoRAConfig",
    "LossType",
    "LossVariant",
    "Objective",
    "SFTConfig",
    "Scale",
    "Schedule",
    "TrainConfig",
]

Schedule = Literal["constant", "linear", "cosine"]
"""How a supervised run's learning rate moves over its batches, after any warm-up."""
LossType = Literal["grpo", "dr_grpo", "dapo", "gspo", "cispo"]
Objective = Literal["ppo", "gspo", "cispo"]
Aggregation = Literal["sequence_mean", "token_mean", "constant"]


@dataclass(frozen=True)
class LossVariant:
    """A loss as the trainer runs it (``journeyman.backend.training.loss``): its per-token objective,
    how the tokens are aggregated, and its paper's default clip range (epsilon, epsilon_high)."""

    objective: Objective
    aggregation: Aggregation
    epsilon: float
    epsilon_high: float


LOSSES: dict[str, LossVariant] = {
    "grpo": LossVariant("ppo", "sequence_mean", 0.2, 0.2),
    "dr_grpo": LossVariant("ppo", "constant", 0.2, 0.2),
    "dapo": LossVariant("ppo", "token_mean", 0.2, 0.28),
    "gspo": LossVariant("gspo", "sequence_mean", 3e-4, 4e-4),
    "cispo": LossVariant("cispo", "token_mean", 0.2, 5.0),
}
"""The loss table. A new loss is its name in ``LossType`` and one line here; a new objective also
adds its function to the trainer's ``loss.py``."""


Scale = Literal["group", "batch", "none"]
"""How GRPO scales a group's advantages: by the group's reward std, the batch's, or not at all."""


class TrainConfig(BaseModel):
    """One training step's settings. See :mod:`journeyman.backend.training.loss` for the formulas."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    learning_rate: float = Field(5e-5, gt=0)
    """AdamW learning rate for the LoRA parameters."""
    loss: LossType = "dapo"
    """The objective x aggregation: grpo, dr_grpo, dapo, gspo or cispo."""
    epsilon: float | None = Field(None, gt=0)
    """Lower clip range (ratio >= 1 - epsilon). Default: 0.2, or 3e-4 for gspo."""
    epsilon_high: float | None = Field(None, gt=0)
    """Upper clip range. Default: 0.28 for dapo, 4e-4 for gspo, 5.0 for cispo, else epsilon."""
    scale_rewards: Scale | None = None
    """Divide advantages by the group's or the batch's reward std. Default: none for dr_grpo, else group."""
    beta: float = Field(0.0, ge=0)
    """Weight of the KL penalty to the base model (k3 estimator); 0 skips the reference forward pass."""
    mismatch: Literal["none", "mask", "truncate"] = "none"
    """What to do with tokens whose ratio to the sampling logprob leaves [1/threshold, threshold]."""
    mismatch_threshold: float = Field(2.0, gt=1)
    """The ratio beyond which ``mismatch`` masks or truncates a token (and its inverse below)."""
    max_grad_norm: float | None = Field(1.0, gt=0)
    """Clip the gradient norm; None disables clipping."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW's decoupled weight decay on the adapter's weights."""
    max_seq_len: int = Field(4096, gt=0)
    """Longest training sequence, in tokens."""
    overlong: Literal["truncate", "exclude"] = "truncate"
    """A longer sequence is cut to max_seq_len (tokens past it are not trained) or left out; either way counted."""
    max_tokens: int = Field(1024, gt=0)
    """Dr. GRPO's constant normaliser: tokens per sequence."""
    micro_batch_tokens: int = Field(4096, gt=0)
    """Padded tokens per forward/backward pass; sequences are packed by length up to this budget."""
    logprob_chunk: int = Field(512, gt=0)
    """Trained positions whose vocabulary logits are computed at once (bounds logit memory)."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass: less memory, about a third more compute."""
    seed: int = 0
    """Seeds the adapter's initial weights and the order of micro-batches, so a step repeats."""

    @model_validator(mode="before")
    @classmethod
    def _no_precision(cls, data: Any) -> Any:
        if isinstance(data, dict) and "precision" in data:
            raise ConfigError(
                "TrainConfig has no precision: the model's dtype is chosen once, when the trainer loads it "
                "(bf16 where the CPU or GPU supports it, else fp32; Trainer(precision=...) overrides it)"
            )
        return data

    @property
    def effective_epsilon(self) -> float:
        return self.epsilon if self.epsilon is not None else LOSSES[self.loss].epsilon

    @property
    def effective_epsilon_high(self) -> float:
        if self.epsilon_high is not None:
            return self.epsilon_high
        return (
            self.epsilon
            if self.epsilon is not None and self.loss in ("grpo", "dr_grpo")
            else LOSSES[self.loss].epsilon_high
        )

    @property
    def effective_scale_rewards(self) -> Scale:
        if self.scale_rewards is not None:
            return self.scale_rewards
        return "none" if self.loss == "dr_grpo" else "group"


class LoRAConfig(BaseModel):
    """The adapter that training updates."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    rank: int = Field(8, gt=0)
    """The rank r of each low-rank update B @ A."""
    alpha: float = Field(16.0, gt=0)
    """Scales the update by alpha / rank."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapter's input in training."""
    target_modules: tuple[str, ...] | None = None
    """Module names to adapt. Default: all attention and MLP projections of llama- and qwen-style
    models (q, k, v, o, gate, up, down)."""

    @property
    def effective_target_modules(self) -> tuple[str, ...]:
        return self.target_modules or (
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        )


class SFTConfig(BaseModel):
    """A supervised run's settings (``model.train_sft(trajectories, config=...)``): cross-entropy on
    the model turns' tokens, in batches of conversations, over epochs, as one checkpoint step."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    learning_rate: float = Field(1e-4, gt=0)
    """AdamW's peak learning rate for the LoRA parameters."""
    epochs: int = Field(1, gt=0)
    """Passes over the training conversations."""
    batch_size: int = Field(8, gt=0)
    """Conversations per optimizer step."""
    schedule: Schedule = "cosine"
    """After warm-up, the learning rate stays (constant) or falls to 0 by the last batch (linear, cosine)."""
    warmup_ratio: float = Field(0.0, ge=0, lt=1)
    """Share of the batches over which the learning rate rises linearly from 0 to its peak."""
    max_grad_norm: float | None = Field(1.0, gt=0)
    """Clip the gradient norm; None disables clipping."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW's decoupled weight decay on the adapter's weights."""
    max_seq_len: int = Field(4096, gt=0)
    """Longest conversation, in tokens (also bounded by the model's context)."""
    overlong: Literal["error", "truncate", "exclude"] = "error"
    """A longer conversation stops the run with an error naming it (nothing is trained), is cut to
    max_seq_len (tokens past it are not trained), or is left out; cut or left out, it is counted."""
    micro_batch_tokens: int = Field(4096, gt=0)
    """Padded tokens per forward/backward pass; a batch's conversations are packed up to this budget."""
    logprob_chunk: int = Field(512, gt=0)
    """Trained positions whose vocabulary logits are computed at once (bounds logit memory)."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass: less memory, about a third more compute."""
    eval_fraction: float = Field(0.0, ge=0, lt=1)
    """Share of the conversations held out (drawn with ``seed``) for the validation loss, when no
    evaluation conversations are given."""
    eval_every: int | None = Field(None, gt=0)
    """Batches between validation losses; None: at the end of each epoch."""
    early_stopping_patience: int | None = Field(None, gt=0)
    """Stop after this many validation losses in a row that do not beat the best; None: never."""
    keep_best: bool = True
    """With a validation loss: the checkpoint holds the weights of the batch with the lowest one."""
    seed: int = 0
    """Seeds the order of the conversations, the held-out draw and the adapter's initial weights."""
