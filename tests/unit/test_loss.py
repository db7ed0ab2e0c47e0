"""Each objective and aggregation against values computed by hand, with edge cases."""

from __future__ import annotations

import math
from typing import get_args

import pytest
import torch

from journeyman.backend.training import loss as L


def t(values: object, **kwargs: object) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64, **kwargs)


def test_ppo_clip_by_hand() -> None:
    ratio = t([[0.5, 1.0, 1.5]])
    assert L.ppo_clip_objective(ratio, t([[1.0]]), 0.2).tolist() == [[-0.5, -1.0, -1.2]]
    assert L.ppo_clip_objective(ratio, t([[-1.0]]), 0.2).tolist() == [[0.8, 1.0, 1.5]]
    # clip-higher: the upper bound moves, the lower does not
    assert L.ppo_clip_objective(ratio, t([[1.0]]), 0.2, 0.4).tolist() == [[-0.5, -1.0, -1.4]]


def test_aggregations_by_hand() -> None:
    per_token = t([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0], [7.0, 7.0, 7.0]])
    mask = t([[1, 1, 1], [1, 0, 0], [0, 0, 0]])  # the third sequence has no trained token
    assert L.aggregate(per_token, mask, "sequence_mean").item() == pytest.approx((2.0 + 4.0) / 2)
    assert L.aggregate(per_token, mask, "token_mean").item() == pytest.approx(10.0 / 4)
    assert L.aggregate(per_token, mask, "constant", max_tokens=10).item() == pytest.approx(10.0 / (2 * 10))
    empty = torch.zeros(3, 3, dtype=torch.float64)
    for how in get_args(L.Aggregation):
        assert L.aggregate(per_token, empty, how).item() == 0.0


def test_advantages_by_hand() -> None:
    rewards = t([1.0, 0.0, 1.0, 0.0, 0.5, 0.5, 2.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 2])
    advantage, informative = L.advantages(rewards, groups, "group")
    assert advantage.tolist() == pytest.approx([1, -1, 1, -1, 0, 0, 0], abs=1e-5)
    assert informative.tolist() == [True] * 4 + [False] * 3  # equal rewards; a group of one
    assert L.advantages(rewards, groups, "none")[0].tolist() == pytest.approx([0.5, -0.5, 0.5, -0.5, 0, 0, 0])
    assert L.advantages(rewards, groups, "batch")[0].tolist() == pytest.approx(
        [1, -1, 1, -1, 0, 0, 0], abs=1e-5
    )


def test_batch_scaling_uses_the_spread_of_all_informative_rewards() -> None:
    rewards = t([1.0, 0.0, 10.0, 0.0])
    groups = torch.tensor([0, 0, 1, 1])
    by_group = L.advantages(rewards, groups, "group")[0]
    by_batch = L.advantages(rewards, groups, "batch")[0]
    assert by_group.tolist() == pytest.approx([1, -1, 1, -1], abs=1e-5)
    std = rewards.std(unbiased=False).item()
    assert by_batch.tolist() == pytest.approx([0.5 / std, -0.5 / std, 5 / std, -5 / std], rel=1e-5)


def test_huge_rewards_stay_finite() -> None:
    advantage, _ = L.advantages(t([1e12, 0.0, 1e12]), torch.tensor([0, 0, 0]), "group")
    assert torch.isfinite(advantage).all()
    assert advantage.tolist() == pytest.approx([math.sqrt(0.5), -math.sqrt(2), math.sqrt(0.5)], rel=1e-5)


def test_unknown_sampling_logprobs_mean_ratio_one_with_gradient() -> None:
    logprobs = t([[-1.0, -2.0]], requires_grad=True)
    ratio, _ = L.mismatch_ratio(logprobs, t([[math.nan, -2.5]]), t([[1, 1]]))
    assert ratio[0, 0].item() == 1.0
    assert ratio[0, 1].item() == pytest.approx(math.exp(0.5))
    ratio.sum().backward()
    assert logprobs.grad is not None and logprobs.grad[0, 0].item() == 1.0


def test_mismatch_mask_and_truncate() -> None:
    logprobs = t([[-1.0, -1.0, -1.0]], requires_grad=True)
    sampling = t([[-1.1, -3.0, 1.0]])  # ratios e^0.1, e^2 (too high), e^-2 (too low)
    mask = t([[1, 1, 1]])
    _, masked = L.mismatch_ratio(logprobs, sampling, mask, "mask", threshold=2.0)
    assert masked.tolist() == [[1, 0, 0]]
    ratio, kept = L.mismatch_ratio(logprobs, sampling, mask, "truncate", threshold=2.0)
    assert kept.tolist() == [[1, 1, 1]]
    assert ratio[0].tolist() == pytest.approx([math.exp(0.1), 2.0, 0.5])
    ratio.sum().backward()
    assert logprobs.grad is not None
    assert logprobs.grad[0].tolist() == pytest.approx([math.exp(0.1), 2.0, 0.5])  # d(c * ratio)/dlogp = value


def test_cispo_weight_is_clipped_and_detached() -> None:
    logprobs = t([[-1.0, -1.0]], requires_grad=True)
    ratio = t([[1.5, 9.0]])
    loss = L.cispo_objective(logprobs, ratio, t([[2.0]]), epsilon_high=3.0)
    assert loss[0].tolist() == pytest.approx([-1.5 * 2 * -1, -4.0 * 2 * -1])
    loss.sum().backward()
    assert logprobs.grad is not None and logprobs.grad[0].tolist() == pytest.approx([-3.0, -8.0])


def test_gspo_token_form_matches_the_sequence_form() -> None:
    logprobs = t([[-1.0, -2.0, -0.5]], requires_grad=True)
    sampling = t([[-1.1, -2.1, -0.4]])
    mask = t([[1, 1, 1]])
    per_token = L.gspo_objective(logprobs, sampling, mask, t([[1.0]]), epsilon=10.0)  # no clipping
    loss = L.aggregate(per_token, mask, "sequence_mean")
    s = math.exp(((-1.0 + 1.1) + (-2.0 + 2.1) + (-0.5 + 0.4)) / 3)
    assert loss.item() == pytest.approx(-s)
    loss.backward()
    assert logprobs.grad is not None and logprobs.grad[0].tolist() == pytest.approx([-s / 3] * 3)


def test_k3_is_non_negative_and_zero_at_equality() -> None:
    logprobs = t([[-1.0, -2.0, -0.1]])
    assert L.k3_kl(logprobs, logprobs).tolist() == [[0.0, 0.0, 0.0]]
    kl = L.k3_kl(logprobs, t([[-1.5, -1.0, -3.0]]))
    assert (kl > 0).all()
    assert kl[0, 0].item() == pytest.approx(math.exp(-0.5) + 0.5 - 1)


@pytest.mark.parametrize("loss_type", get_args(L.LossType))
def test_every_variant_handles_edge_cases(loss_type: L.LossType) -> None:
    logprobs = t([[-1.0, -2.0, -0.5], [-0.3, -0.2, -0.1]], requires_grad=True)
    sampling = t([[-1.0, math.nan, -0.4], [-0.3, -0.25, -0.1]])
    mask = t([[1, 1, 1], [1, 1, 0]])
    parts = L.policy_loss(loss_type, logprobs, sampling, mask, t([1.0, -1.0]), epsilon_high=0.28)
    assert torch.isfinite(parts.loss)
    parts.loss.backward()
    assert logprobs.grad is not None and torch.isfinite(logprobs.grad).all()
    assert logprobs.grad[1, 2].item() == 0.0  # an untrained token gets no gradient
    # empty completions (no trained token) and zero advantages (equal rewards, a group of one)
    empty = L.policy_loss(loss_type, logprobs, sampling, torch.zeros_like(mask), t([1.0, -1.0]))
    assert empty.loss.item() == 0.0
    flat = L.policy_loss(loss_type, logprobs, sampling, mask, t([0.0, 0.0]))
    assert flat.loss.item() == pytest.approx(0.0)
    with_kl = L.policy_loss(
        loss_type,
        logprobs,
        sampling,
        mask,
        t([1.0, -1.0]),
        beta=0.1,
        reference_logprobs=sampling.nan_to_num(-1.0),
    )
    assert with_kl.kl is not None and with_kl.kl.item() >= 0


def test_clip_fraction_counts_tokens_cut_off_by_the_clip() -> None:
    logprobs = t([[0.0, 0.0, 0.0, 0.0]])
    sampling = t([[0.0, -1.0, 1.0, 0.05]])  # ratios 1, e, 1/e, e^-0.05
    parts = L.policy_loss("grpo", logprobs, sampling, t([[1, 1, 1, 1]]), t([1.0]))
    assert parts.clip_fraction.item() == pytest.approx(0.25)  # only e > 1.2 with A > 0 is clipped
    parts = L.policy_loss("grpo", logprobs, sampling, t([[1, 1, 1, 1]]), t([-1.0]))
    assert parts.clip_fraction.item() == pytest.approx(0.25)  # only 1/e < 0.8 with A < 0


def test_mismatch_masking_is_counted() -> None:
    parts = L.policy_loss(
        "dapo",
        t([[0.0, 0.0]]),
        t([[0.0, -5.0]]),
        t([[1, 1]]),
        t([1.0]),
        mismatch="mask",
        mismatch_threshold=2.0,
    )
    assert parts.masked_by_mismatch.item() == 1.0


@pytest.mark.parametrize("loss_type", get_args(L.LossType))
def test_tokens_masked_for_mismatch_keep_their_place_in_the_denominators(loss_type: L.LossType) -> None:
    """So the loss of a batch is the weighted sum of its parts' losses, however it is split."""
    logprobs = t([[-1.0, -1.0, -1.0], [-2.0, -2.0, 0.0]], requires_grad=True)
    sampling = t([[-1.0, -9.0, -1.05], [-2.0, -2.0, math.nan]])  # one token with ratio e^8
    mask = t([[1, 1, 1], [1, 1, 0]])
    kwargs: dict[str, object] = {"mismatch": "mask", "mismatch_threshold": 2.0, "max_tokens": 4}
    whole = L.policy_loss(loss_type, logprobs, sampling, mask, t([1.0, -1.0]), **kwargs)  # type: ignore[arg-type]
    assert whole.masked_by_mismatch.item() == 1.0
    parts = [
        L.policy_loss(loss_type, logprobs[i : i + 1], sampling[i : i + 1], mask[i : i + 1], t([a]), **kwargs)  # type: ignore[arg-type]
        for i, a in enumerate([1.0, -1.0])
    ]
    aggregation = L.LOSSES[loss_type].aggregation
    weights = [3 / 5, 2 / 5] if aggregation == "token_mean" else [1 / 2, 1 / 2]  # the trainer's shares
    assert whole.loss.item() == pytest.approx(
        sum(w * p.loss.item() for w, p in zip(weights, parts, strict=True))
    )


def test_every_loss_name_is_registered_once_everywhere() -> None:
    """A loss is named in TrainConfig's choices and has its line in the loss table: one missing
    registration fails here, not in the middle of a training step."""
    from journeyman.config import LOSSES, LossType

    assert set(get_args(LossType)) == set(LOSSES)
    assert L.LOSSES is LOSSES


def test_train_config_refuses_the_precision_it_never_used() -> None:
    import journeyman as jm

    with pytest.raises(jm.ConfigError, match="chosen once, when the trainer loads it"):
        jm.TrainConfig(precision="bf16")  # type: ignore[call-arg]
