"""Each loss variant against the reference it claims to implement: TRL 1.16's
``GRPOTrainer._compute_loss`` on the same tensors, in fp64, value and gradient.

TRL's method runs unchanged on a stand-in trainer (:class:`TRL`) whose model "returns" the
logprobs the test gives it; everything around the loss is switched off (one process, no
accumulation, no entropy terms, no vLLM correction). Where journeyman differs on purpose, the
test says how and checks the difference:

* CISPO: TRL's ``epsilon_high`` is the weight's upper bound itself; ours is the excess over 1, as
  in the paper's clip(r, 1 - eps_low, 1 + eps_high): our ``epsilon_high=e`` is TRL's ``1 + e``.
* GSPO is TRL's ``grpo`` loss with ``importance_sampling_level="sequence"`` (its sequence form;
  ours is the token form, equal in value and gradient).
* A sequence with no trained token (every token masked, e.g. by the mismatch mask) counts in none
  of our denominators; TRL's ``grpo`` mean and ``dr_grpo`` divisor still count its row.
* Advantages: TRL divides by the Bessel-corrected std + 1e-4, we by the population std + 1e-6,
  as in the GRPO paper's std of the group's rewards. For a group of n that is a constant factor
  sqrt((n - 1) / n) (checked below), which Adam's step does not see.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from trl import GRPOTrainer
from trl.trainer.utils import nanstd

from journeyman.backend.training import loss as L
from tests.trl_stand_in import GRPOStandIn

TOLERANCE = 1e-6


class TRL(GRPOStandIn):
    """Just enough of a ``GRPOTrainer`` for its ``_compute_loss``: the "model" returns ``logprobs``."""

    def __init__(
        self, loss_type: str, *, level: str = "token", epsilon: float, epsilon_high: float, beta: float,
        max_completion_length: int,
    ) -> None:  # fmt: skip
        super().__init__(
            loss_type, level=level, epsilon=epsilon, epsilon_high=epsilon_high, beta=beta,
            max_completion_length=max_completion_length,
        )  # fmt: skip
        self._logprobs: torch.Tensor | None = None

    def _get_per_token_logps_and_entropies(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, ...]:
        assert self._logprobs is not None
        return self._logprobs, torch.zeros_like(self._logprobs), None

    def loss(
        self, logprobs: torch.Tensor, old: torch.Tensor, mask: torch.Tensor, advantage: torch.Tensor,
        reference: torch.Tensor | None,
    ) -> torch.Tensor:  # fmt: skip
        self._logprobs = logprobs
        rows, length = mask.shape
        inputs = {
            "prompt_ids": torch.zeros(rows, 1, dtype=torch.long),
            "prompt_mask": torch.ones(rows, 1, dtype=torch.long),
            "completion_ids": torch.zeros(rows, length, dtype=torch.long),
            "completion_mask": mask,
            "advantages": advantage,
            "old_per_token_logps": old,
            "num_items_in_batch": mask.sum(),
        }
        if reference is not None:
            inputs["ref_per_token_logps"] = reference
        return GRPOTrainer._compute_loss(self, None, inputs)


def trl_for(loss_type: L.LossType, epsilon: float, epsilon_high: float, beta: float, max_tokens: int) -> TRL:
    """TRL's settings for our variant (see the module's docstring for the two mappings)."""
    if loss_type == "gspo":
        return TRL("grpo", level="sequence", epsilon=epsilon, epsilon_high=epsilon_high, beta=beta,
                   max_completion_length=max_tokens)  # fmt: skip
    if loss_type == "cispo":
        epsilon_high = 1 + epsilon_high
    return TRL(
        loss_type, epsilon=epsilon, epsilon_high=epsilon_high, beta=beta, max_completion_length=max_tokens
    )


SETTINGS = {  # loss_type: (epsilon, epsilon_high), the trainer's defaults
    "grpo": (0.2, 0.2),
    "dr_grpo": (0.2, 0.2),
    "dapo": (0.2, 0.28),
    "gspo": (3e-4, 4e-4),
    "cispo": (0.2, 5.0),
}


def batch(seed: int, loss_type: str) -> dict[str, torch.Tensor]:
    """Six sequences of ragged length (7, 5, 3, 1, 6, 2 trained tokens) with advantages of both signs
    and zeros (a group of equal rewards and a group of one), random logprobs, a KL reference, and
    ratios outside the clip on both sides: above it where A > 0 (sequence 0), below it where A < 0
    (sequence 4). GSPO clips each sequence's mean log-ratio (its range is about 1e-3 wide), so there
    the sequences get offsets of their own; CISPO's weight is bounded at 6 by default."""
    generator = torch.Generator().manual_seed(seed)

    def uniform(scale: float) -> torch.Tensor:
        return (torch.rand(6, 7, generator=generator, dtype=torch.float64) - 0.5) * scale

    lengths = [7, 5, 3, 1, 6, 2]
    mask = torch.tensor([[1.0] * n + [0.0] * (7 - n) for n in lengths], dtype=torch.float64)
    logprobs = -torch.rand(6, 7, generator=generator, dtype=torch.float64) * 3
    if loss_type == "gspo":
        offsets = torch.tensor([2e-3, 2e-3, 0.0, 1e-4, -2e-3, 0.0], dtype=torch.float64)
        drift = offsets[:, None] + uniform(2e-4)
    else:
        drift = uniform(1.2)
        drift[0, 0], drift[4, 0] = (2.5 if loss_type == "cispo" else 0.5), -0.5
    advantage = torch.tensor([1.3, -0.7, 0.0, 2.1, -1.5, 0.0], dtype=torch.float64)
    return {"logprobs": logprobs, "old": logprobs - drift, "mask": mask, "advantage": advantage,
            "reference": logprobs + uniform(1.0)}  # fmt: skip


def both(
    loss_type: L.LossType, data: dict[str, torch.Tensor], beta: float, max_tokens: int = 9
) -> tuple[tuple[float, torch.Tensor], tuple[float, torch.Tensor], float]:
    """(our loss, its gradient), (TRL's, its gradient) with respect to the logprobs, and the share
    of trained tokens our loss reports clipped."""
    epsilon, epsilon_high = SETTINGS[loss_type]
    results = []
    ours = None
    for side in ("ours", "trl"):
        logprobs = data["logprobs"].clone().requires_grad_(True)
        reference = data["reference"] if beta else None
        if side == "ours":
            ours = L.policy_loss(
                loss_type, logprobs, data["old"], data["mask"], data["advantage"], epsilon=epsilon,
                epsilon_high=epsilon_high, max_tokens=max_tokens, beta=beta, reference_logprobs=reference,
            )  # fmt: skip
            loss = ours.loss
        else:
            trl = trl_for(loss_type, epsilon, epsilon_high, beta, max_tokens)
            loss = trl.loss(logprobs, data["old"], data["mask"], data["advantage"], reference)
        (gradient,) = torch.autograd.grad(loss, logprobs)
        results.append((loss.item(), gradient))
    assert ours is not None
    return results[0], results[1], float(ours.clip_fraction)


@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo", "gspo", "cispo"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_each_variant_equals_trl_in_value_and_gradient(loss_type: L.LossType, beta: float, seed: int) -> None:
    data = batch(seed, loss_type)
    (ours, our_gradient), (theirs, their_gradient), clipped = both(loss_type, data, beta)
    assert abs(ours - theirs) <= TOLERANCE, (ours, theirs)
    assert (our_gradient - their_gradient).abs().max().item() <= TOLERANCE
    assert our_gradient.abs().sum() > 0  # not two zeros agreeing
    assert (our_gradient[data["mask"] == 0] == 0).all()  # nothing flows to untrained tokens
    assert 0 < clipped < 1  # the clip is active somewhere, and not everywhere


def test_the_clip_cuts_the_gradient_on_both_sides() -> None:
    """Ratios above 1+eps with A>0 and below 1-eps with A<0 give no gradient, in both losses."""
    logprobs = torch.zeros(2, 3, dtype=torch.float64)
    old = torch.tensor([[-0.5, 0.0, 0.5], [-0.5, 0.0, 0.5]], dtype=torch.float64)  # ratios e^.5, 1, e^-.5
    data = {"logprobs": logprobs, "old": old, "mask": torch.ones(2, 3, dtype=torch.float64),
            "advantage": torch.tensor([1.0, -1.0], dtype=torch.float64), "reference": logprobs}  # fmt: skip
    (_, ours), (_, theirs), _ = both("grpo", data, beta=0.0)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=TOLERANCE)
    assert ours[0, 0] == 0 and ours[1, 2] == 0  # A>0 above the clip; A<0 below it
    assert ours[0, 1] < 0 and ours[1, 1] > 0 and ours[0, 2] < 0 and ours[1, 0] > 0


def test_unknown_sampling_logprobs_are_trls_missing_old_logprobs() -> None:
    """A row with no recorded sampling logprobs (NaN) is TRL's case of no old logprobs: ratio 1."""
    data = batch(3, "dapo")
    data["old"][1] = float("nan")
    (ours, our_gradient), _, _ = both("dapo", data, beta=0.0)
    data["old"][1] = data["logprobs"][1]  # TRL's stand-in: the detached training logprobs
    _, (theirs, their_gradient), _ = both("dapo", data, beta=0.0)
    assert abs(ours - theirs) <= TOLERANCE
    assert (our_gradient - their_gradient).abs().max().item() <= TOLERANCE


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo"])
def test_a_sequence_without_trained_tokens_counts_in_no_denominator(loss_type: L.LossType) -> None:
    """The stated difference: TRL's grpo mean and dr_grpo divisor count an empty row; ours equals
    TRL's on the batch without that row."""
    data = batch(4, loss_type)
    with_empty = {**data, "mask": data["mask"].clone()}
    with_empty["mask"][2] = 0.0
    (ours, _), (theirs_with_row, _), _ = both(loss_type, with_empty, beta=0.04)
    kept = [0, 1, 3, 4, 5]
    _, (theirs_without_row, _), _ = both(loss_type, {k: v[kept] for k, v in with_empty.items()}, beta=0.04)
    assert abs(ours - theirs_without_row) <= TOLERANCE
    assert abs(ours - theirs_with_row) > 1e-3  # TRL's is 5/6 of it


@pytest.mark.parametrize("size", [2, 4, 8])
def test_group_advantages_are_trls_up_to_bessels_correction(size: int) -> None:
    generator = torch.Generator().manual_seed(size)
    rewards = torch.rand(3 * size, generator=generator, dtype=torch.float64)
    rewards[size : 2 * size] = 0.5  # a group of equal rewards: advantage 0 in both
    groups = torch.arange(3).repeat_interleave(size)
    ours, informative = L.advantages(rewards, groups, "group")
    grouped = rewards.view(-1, size)
    theirs = ((grouped - grouped.mean(1, keepdim=True)) / (nanstd(grouped, dim=1)[:, None] + 1e-4)).flatten()
    assert informative.tolist() == [True] * size + [False] * size + [True] * size
    torch.testing.assert_close(ours[~informative], theirs[~informative], rtol=0, atol=0)
    torch.testing.assert_close(
        ours[informative] * math.sqrt((size - 1) / size), theirs[informative], rtol=1e-3, atol=0
    )  # to 1e-3: the two eps differ
