r"""The GRPO family of policy-gradient losses, as two independent choices.

Notation, for trajectory :math:`i` with reward :math:`R_i` in a group :math:`G`, and token
:math:`t` of one of its sequences:

* :math:`\log\pi_\theta(t)`: the training logprob of the token (with gradient);
* :math:`\log\mu(t)`: the logprob vLLM sampled the token with (recorded by the gateway);
* ratio :math:`r_t = \exp(\log\pi_\theta(t) - \log\mu(t))`;
* advantage :math:`A_i = (R_i - \mathrm{mean}_G R) / s` with :math:`s` the group's std
  (``scale="group"``), the batch's std (``"batch"``) or 1 (``"none"``); every token of every
  sequence of trajectory :math:`i` shares :math:`A_i`. Groups whose rewards are all equal give
  :math:`A_i = 0` and are dropped before batching (counted as ``data/zero_variance_groups``).

A loss is a per-token **objective** :math:`\ell_t` times an **aggregation** over tokens:

============  =====================================================  ========================
loss_type     objective :math:`\ell_t`                               aggregation
============  =====================================================  ========================
``grpo``      :math:`-\min(r_t A, \mathrm{clip}(r_t,1-\epsilon,1+\epsilon) A)`  sequence mean, then mean
``dr_grpo``   same PPO clip                                          sum / (sequences x ``max_tokens``)
``dapo``      PPO clip with :math:`\epsilon_{high} > \epsilon`      token mean over the batch
``gspo``      PPO clip on the sequence ratio :math:`s_i`            sequence mean, then mean
``cispo``     :math:`-\mathrm{sg}[\mathrm{clip}(r_t, 0, 1+\epsilon_{high})]\, A \log\pi_\theta(t)`  token mean over the batch
============  =====================================================  ========================

Deviations from the papers, on purpose:

* The "old" policy of PPO is the sampling policy :math:`\mu` itself: journeyman takes one
  gradient step per batch of fresh rollouts, so :math:`\pi_{old} = \mu` up to the numerical
  mismatch between vLLM and the trainer. That mismatch is handled explicitly: tokens whose ratio
  leaves :math:`[1/C, C]` can be masked (``mismatch="mask"``: they add nothing, but still count in
  the aggregation's denominators, so micro-batches add up to the whole batch) or have their ratio
  truncated to that range (``mismatch="truncate"``, the value clamped, the gradient direction kept).
* A token without a recorded sampling logprob (a turn captured from an external API and
  re-tokenised) uses :math:`\log\mu = \mathrm{sg}[\log\pi_\theta]`, i.e. ratio 1: plain
  REINFORCE with the group baseline.
* GRPO (Shao et al. 2024) and GSPO (Zheng et al. 2025) average each sequence's tokens, then the
  sequences. GSPO uses the token-level form: :math:`s_{i,t} = \mathrm{sg}[s_i]\,\pi_\theta(t)/\mathrm{sg}[\pi_\theta(t)]`
  with :math:`s_i = \exp(\mathrm{mean}_t(\log\pi_\theta - \log\mu))`, same value and gradient
  as the sequence form. Its clip range is small (``epsilon=3e-4``, ``epsilon_high=4e-4``).
* Dr. GRPO (Liu et al. 2025) divides the token sum by a constant, here sequences x
  ``max_tokens``; it also drops std scaling (``scale="none"`` by default for it).
* DAPO (Yu et al. 2025) is the clip-higher objective with token-level mean; its dynamic sampling
  is the zero-variance filter above, and its overlong shaping is left to reward functions.
* CISPO (MiniMax 2025) clips and detaches the importance weight; only the upper bound is used.
* KL to the reference model (the base model, adapter disabled) is optional (``beta``), estimated
  with k3: :math:`\exp(\log\pi_{ref} - \log\pi_\theta) - (\log\pi_{ref} - \log\pi_\theta) - 1`,
  aggregated like the objective.

Against TRL (``tests/unit/test_loss_reference.py`` runs TRL 1.16's ``GRPOTrainer._compute_loss`` on
the same fp64 tensors): every variant, with and without the KL term, equals TRL's ``loss_type`` of
the same name in value and gradient (GSPO: TRL's ``grpo`` at ``importance_sampling_level="sequence"``),
except where journeyman differs on purpose:

* CISPO's ``epsilon_high`` is the excess over 1, as in the paper's clip(r, 1-eps_low, 1+eps_high);
  TRL's is the bound itself (our 5.0 is TRL's 6.0).
* A sequence with no trained token counts in no denominator; TRL's ``grpo`` mean and ``dr_grpo``
  divisor count its row.
* Advantages divide by the group's population std + 1e-6; TRL's by the Bessel-corrected std + 1e-4:
  a constant factor sqrt((n-1)/n) for groups of n.

Every function here is pure: tensors in, tensors out, no trainer needed to test it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from journeyman.config import LOSSES, Aggregation, LossType, Scale

__all__ = [
    "LOSSES",
    "LossParts",
    "LossType",
    "advantages",
    "aggregate",
    "cispo_objective",
    "gspo_objective",
    "k3_kl",
    "mismatch_ratio",
    "policy_loss",
    "ppo_clip_objective",
]


def advantages(
    rewards: torch.Tensor, groups: torch.Tensor, scale: Scale = "group", eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-relative advantages and a mask of trajectories in groups with reward variance.

    rewards  # (N,) one per trajectory
    groups   # (N,) integer group index of each trajectory
    Returns (advantages (N,), informative (N,) bool). Zero-variance groups (including groups of
    one) get advantage 0 and ``informative=False``.
    """
    advantage = torch.zeros_like(rewards)
    informative = torch.zeros_like(rewards, dtype=torch.bool)
    group_std = torch.ones_like(rewards)
    for group in groups.unique():  # type: ignore[no-untyped-call]  # torch leaves it untyped
        members = groups == group
        values = rewards[members]
        centred = values - values.mean()
        spread = values.std(unbiased=False)
        if values.numel() > 1 and spread > eps:
            advantage[members] = centred
            informative[members] = True
            group_std[members] = spread
    if scale == "group":
        advantage = advantage / (group_std + eps)
    elif scale == "batch":
        batch_std = (
            rewards[informative].std(unbiased=False) if informative.sum() > 1 else rewards.new_tensor(1.0)
        )
        advantage = advantage / (batch_std + eps)
    return advantage * informative, informative


def mismatch_ratio(
    logprobs: torch.Tensor,
    sampling_logprobs: torch.Tensor,
    mask: torch.Tensor,
    mode: Literal["none", "mask", "truncate"] = "none",
    threshold: float = 2.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The importance ratio against the sampling policy, and the mask after mismatch handling.

    logprobs           # (B, T) training logprobs, with gradient
    sampling_logprobs  # (B, T) recorded by vLLM; NaN where unknown (ratio 1 there)
    mask               # (B, T) 1 for trained tokens
    """
    log_ratio = logprobs - _old_logprobs(logprobs, sampling_logprobs)
    ratio = torch.exp(log_ratio)
    if mode == "none":
        return ratio, mask
    bound = math.log(threshold)
    extreme = (log_ratio.detach().abs() > bound) & mask.bool()
    if mode == "mask":
        return ratio, mask * ~extreme
    clamped = torch.exp(log_ratio.detach().clamp(-bound, bound))
    return ratio * (clamped / ratio.detach()), mask


def ppo_clip_objective(
    ratio: torch.Tensor, advantage: torch.Tensor, epsilon: float, epsilon_high: float | None = None
) -> torch.Tensor:
    """Per-token PPO clipped surrogate, negated to a loss. ratio (B, T), advantage (B, 1) or (B, T)."""
    high = epsilon if epsilon_high is None else epsilon_high
    unclipped = ratio * advantage
    clipped = ratio.clamp(1 - epsilon, 1 + high) * advantage
    return -torch.minimum(unclipped, clipped)


def gspo_objective(
    logprobs: torch.Tensor,
    sampling_logprobs: torch.Tensor,
    mask: torch.Tensor,
    advantage: torch.Tensor,
    epsilon: float,
    epsilon_high: float | None = None,
) -> torch.Tensor:
    """GSPO-token: the sequence's length-normalised ratio, with per-token gradients."""
    sequence_ratio = _sequence_ratio(logprobs, sampling_logprobs, mask)  # (B,), detached
    token_ratio = sequence_ratio[:, None] * torch.exp(logprobs - logprobs.detach())  # (B, T)
    return ppo_clip_objective(token_ratio, advantage, epsilon, epsilon_high)


def cispo_objective(
    logprobs: torch.Tensor, ratio: torch.Tensor, advantage: torch.Tensor, epsilon_high: float
) -> torch.Tensor:
    """CISPO: the clipped, detached importance weight times the advantage times the logprob."""
    weight = ratio.detach().clamp(max=1 + epsilon_high)
    return -weight * advantage * logprobs


def aggregate(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    how: Aggregation,
    max_tokens: int = 1024,
    live: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduce a (B, T) per-token loss over the trained tokens to a scalar.

    sequence_mean: mean over each sequence's tokens, then over sequences (GRPO, GSPO)
    token_mean:    sum over all tokens / number of tokens (DAPO, CISPO)
    constant:      sum over all tokens / (B * max_tokens) (Dr. GRPO)
    Sequences without trained tokens count in none of the denominators. ``live`` (L,) indexes
    the sequences with trained tokens when the caller knows them (the trainer does, on the
    host): then nothing here waits for the device.
    """
    per_token = per_token * mask
    tokens = mask.sum(-1)
    if live is None:
        live = (tokens > 0).nonzero().squeeze(-1)
    if how == "sequence_mean":
        if live.numel() == 0:
            return per_token.sum() * 0
        return (per_token.sum(-1)[live] / tokens[live]).mean()
    if how == "token_mean":
        return per_token.sum() / tokens.sum().clamp(min=1)
    return per_token.sum() / (max(1, live.numel()) * max_tokens)


def k3_kl(logprobs: torch.Tensor, reference_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi_theta || pi_ref); >= 0, unbiased."""
    delta = reference_logprobs - logprobs
    return torch.exp(delta) - delta - 1


@dataclass(frozen=True)
class LossParts:
    loss: torch.Tensor
    """The scalar to minimise."""
    policy: torch.Tensor
    """The policy term alone (detached)."""
    kl: torch.Tensor | None
    """The KL term before ``beta`` (detached), when computed."""
    clip_fraction: torch.Tensor
    """Share of trained tokens whose ratio was clipped."""
    masked_by_mismatch: torch.Tensor
    """Tokens dropped by ``mismatch="mask"``."""


def policy_loss(
    loss_type: LossType,
    logprobs: torch.Tensor,
    sampling_logprobs: torch.Tensor,
    mask: torch.Tensor,
    advantage: torch.Tensor,
    *,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    max_tokens: int = 1024,
    mismatch: Literal["none", "mask", "truncate"] = "none",
    mismatch_threshold: float = 2.0,
    beta: float = 0.0,
    reference_logprobs: torch.Tensor | None = None,
    live: torch.Tensor | None = None,
) -> LossParts:
    """The loss of one micro-batch. Shapes: logprobs, sampling_logprobs, mask (B, T); advantage
    (B,); ``live`` (L,), the sequences with trained tokens, when known (:func:`aggregate`)."""
    variant = LOSSES[loss_type]
    given = mask.to(logprobs.dtype)
    ratio, mask = mismatch_ratio(logprobs, sampling_logprobs, given, mismatch, mismatch_threshold)
    advantage = advantage[:, None]  # (B, 1): every token of a sequence shares its trajectory's advantage
    high = epsilon if epsilon_high is None else epsilon_high
    if variant.objective == "ppo":
        per_token = ppo_clip_objective(ratio, advantage, epsilon, epsilon_high)
        clipped = _clipped(ratio.detach(), advantage, epsilon, high)
    elif variant.objective == "gspo":
        per_token = gspo_objective(logprobs, sampling_logprobs, mask, advantage, epsilon, epsilon_high)
        sequence_ratio = _sequence_ratio(logprobs, sampling_logprobs, mask)[:, None].expand_as(mask)
        clipped = _clipped(sequence_ratio, advantage, epsilon, high)
    else:
        per_token = cispo_objective(logprobs, ratio, advantage, high)
        clipped = ratio.detach() > 1 + high
    # Tokens the mismatch mask drops add nothing but keep their place in the denominators (as in
    # TRL's off-policy mask): a micro-batch's share of the batch is then known before its forward
    # pass, and the accumulated gradient does not depend on how the batch was split.
    policy = aggregate(per_token * mask, given, variant.aggregation, max_tokens, live)
    total, kl = policy, None
    if beta and reference_logprobs is not None:
        kl = aggregate(
            k3_kl(logprobs, reference_logprobs) * mask, given, variant.aggregation, max_tokens, live
        )
        total = total + beta * kl
    return LossParts(
        loss=total,
        policy=policy.detach(),
        kl=None if kl is None else kl.detach(),
        clip_fraction=(clipped.to(mask.dtype) * mask).sum() / mask.sum().clamp(min=1),
        masked_by_mismatch=(given - mask).sum(),
    )


def _clipped(ratio: torch.Tensor, advantage: torch.Tensor, epsilon: float, high: float) -> torch.Tensor:
    """Where the clip is active (the gradient is cut): ratio below 1-eps with A<0, above 1+eps_high with A>0."""
    return ((ratio < 1 - epsilon) & (advantage < 0)) | ((ratio > 1 + high) & (advantage > 0))


def _old_logprobs(logprobs: torch.Tensor, sampling_logprobs: torch.Tensor) -> torch.Tensor:
    """The sampling logprobs, with the detached training logprob where none was recorded (ratio 1)."""
    return torch.where(torch.isnan(sampling_logprobs), logprobs.detach(), sampling_logprobs)


def _sequence_ratio(
    logprobs: torch.Tensor, sampling_logprobs: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """GSPO's length-normalised sequence ratio exp(mean_t(log pi - log mu)), detached. (B,)"""
    log_ratio = (logprobs.detach() - _old_logprobs(logprobs, sampling_logprobs)) * mask
    return torch.exp(log_ratio.sum(-1) / mask.sum(-1).clamp(min=1))
