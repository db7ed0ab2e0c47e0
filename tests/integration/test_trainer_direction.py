"""A training step moves the policy the right way, and each ``TrainConfig`` option does what it
says, through the real :class:`Trainer` on the embedded model (fp32).

Two kinds of check:

* Direction, for every loss: one step on a group where one answer has the highest reward raises
  that answer's sequence logprob and lowers the lowest-rewarded one's; negated rewards do the
  opposite; equal rewards change nothing.
* The formula: the gradient the trainer's optimizer steps with equals the gradient of
  :func:`loss.policy_loss` over the whole batch at once, computed here from a plain forward pass
  of each sequence (no packing, no shared prompts, no micro-batches, advantages from
  :func:`loss.advantages`), with each option's effect applied by hand: scaled advantages, a
  mismatch-masked or -truncated token, a truncated or excluded overlong answer, the KL term to the
  base model, a small token budget, logits in chunks, the gradient clip, weight decay.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_args

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

import journeyman as jm
from journeyman.backend.training import loss as L
from journeyman.backend.training import trainer as trainer_module
from journeyman.backend.training.trainer import Trainer
from journeyman.config import LossType, TrainConfig
from journeyman.store import ModelStore

QUESTIONS = [
    ("What is 2+3?", [("5", 1.0), ("It is 5.", 0.6), ("6, I think", 0.3), ("nine", 0.0)]),
    ("Name a colour.", [("Blue.", 4.0), ("A dog", 0.0), ("Red is a colour.", 4.0), ("7", 0.0)]),
]
"""Two groups; the second's rewards spread four times wider (group and batch scaling differ)."""


@dataclass
class Answer:
    prompt: list[int]
    tokens: list[int]
    reward: float
    group: int
    sampling: list[float] = field(default_factory=list)
    """The logprobs it was "sampled" with: the policy's own before the step, unless a test changes them."""


def answers(tokenizer: Any, questions: list[tuple[str, list[tuple[str, float]]]] = QUESTIONS) -> list[Answer]:
    result = []
    for group, (question, replies) in enumerate(questions):
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
        )["input_ids"]
        for text, reward in replies:
            tokens = [*tokenizer(text, add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]
            result.append(Answer(list(prompt), tokens, reward, group))
    return result


def groups(items: list[Answer]) -> list[jm.TrajectoryGroup]:
    """The answers as token-exact trajectory groups, as the gateway records them."""
    by_group: dict[int, list[jm.Trajectory]] = {}
    for answer in items:
        turn = {
            "type": "model_turn",
            "message": {"role": "assistant", "content": "..."},
            "prompt_token_ids": answer.prompt,
            "completion_token_ids": answer.tokens,
            "logprobs": list(answer.sampling) or [None] * len(answer.tokens),
        }
        trajectory = jm.Trajectory(
            conversation=[{"role": "user", "content": "q"}, turn], reward=answer.reward
        )
        by_group.setdefault(answer.group, []).append(trajectory)
    return [jm.TrajectoryGroup(ts) for ts in by_group.values()]


def token_logprobs(trainer: Trainer, answer: Answer, cut: int | None = None) -> torch.Tensor:
    """The answer's token logprobs under the model as it is, from one plain forward pass (with gradient)."""
    tokens = answer.tokens[:cut]
    ids = torch.tensor([answer.prompt + tokens])
    logits = trainer.model(input_ids=ids).logits[0, len(answer.prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def sequence_logprobs(trainer: Trainer, items: list[Answer]) -> list[float]:
    with torch.no_grad():
        return [float(token_logprobs(trainer, a).sum()) for a in items]


def on_policy(trainer: Trainer, items: list[Answer]) -> list[Answer]:
    """Record each answer's current token logprobs as its sampling logprobs."""
    with torch.no_grad():
        for answer in items:
            answer.sampling = token_logprobs(trainer, answer).tolist()
    return items


@pytest.fixture(scope="module", autouse=True)
def _one_model_load() -> Iterator[None]:
    """The base model loads once for the module (about 50 trainers): each later fresh trainer gets
    it back as a fresh load leaves it, its adapter the seed's initial one (the same seed gives the
    same weights), no gradient, in eval mode. A trainer of the module is done with before the
    next is made, so they can share it."""
    real = trainer_module.load_transformers
    loaded: dict[str, tuple[Any, Any, dict[str, torch.Tensor]]] = {}

    def load(path: Path | str, checkpoint: Path | None, **options: Any) -> tuple[Any, Any]:
        if checkpoint is not None:
            return real(path, checkpoint, **options)
        key = f"{path} {sorted(options.items())}"
        if key not in loaded:
            model, tokenizer = real(path, None, **options)
            initial = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
            loaded[key] = model, tokenizer, initial
        model, tokenizer, initial = loaded[key]
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if name in initial:
                    parameter.copy_(initial[name])
                    parameter.grad = None
        model.eval()
        return model, tokenizer

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(trainer_module, "load_transformers", load)
        yield


def trainer(folder: Path, random_adapter: bool = False) -> Trainer:
    """A fresh fp32 trainer; ``random_adapter``: lora_B drawn (seeded), so the adapter is not zero
    (a KL term to the base model, and gradients of lora_A, need one)."""
    result = Trainer("smollm2-135m", ModelStore("test", "agent", root=folder), threads=1, precision="fp32")
    result.load()
    if random_adapter:
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for name, p in result._trainable():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=generator) * 0.02)
    return result


@contextmanager
def stepped_gradients() -> Iterator[dict[str, torch.Tensor]]:
    """The gradients an optimizer steps with (after the trainer's clip), by parameter index."""
    recorded: dict[str, torch.Tensor] = {}

    def hook(optimizer: Any, args: Any, kwargs: Any) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        recorded.update({str(i): p.grad.detach().clone() for i, p in enumerate(params) if p.grad is not None})

    handle = register_optimizer_step_pre_hook(hook)
    try:
        yield recorded
    finally:
        handle.remove()


def step_gradient(model: Trainer, items: list[Answer], config: TrainConfig) -> dict[str, torch.Tensor]:
    with stepped_gradients() as recorded:
        model.train_step(groups(items), config)
    return recorded


def formula_gradient(
    model: Trainer, items: list[Answer], config: TrainConfig, *, cut: dict[int, int] | None = None,
    leave_out: set[int] = frozenset(),
) -> dict[str, torch.Tensor]:  # fmt: skip
    """The gradient of ``policy_loss`` over the whole batch, from a plain forward pass per answer.
    ``cut``: answer index -> tokens kept; ``leave_out``: answers trained on by no token (their
    rewards still count in their group's advantages)."""
    cut = cut or {}
    rewards = torch.tensor([a.reward for a in items], dtype=torch.float32)
    group_ids = torch.tensor([a.group for a in items])
    advantage, informative = L.advantages(rewards, group_ids, config.effective_scale_rewards)
    rows = [i for i in range(len(items)) if informative[i] and i not in leave_out]
    params = [p for _, p in model._trainable()]
    model.model.train()
    for p in params:
        p.grad = None
    logprobs = [token_logprobs(model, items[i], cut.get(i)) for i in rows]
    width = max(len(x) for x in logprobs)

    def padded(values: list[torch.Tensor], fill: float) -> torch.Tensor:
        return torch.stack([torch.cat([v, v.new_full((width - len(v),), fill)]) for v in values])

    sampling = [
        torch.tensor(items[i].sampling[: len(x)], dtype=torch.float32)
        for i, x in zip(rows, logprobs, strict=True)
    ]
    reference = None
    if config.beta:
        with torch.no_grad(), model.model.disable_adapter():
            reference = padded([token_logprobs(model, items[i], cut.get(i)) for i in rows], 0.0)
    parts = L.policy_loss(
        config.loss, padded(logprobs, 0.0), padded(sampling, math.nan),
        padded([torch.ones(len(x)) for x in logprobs], 0.0), advantage[rows],
        epsilon=config.effective_epsilon, epsilon_high=config.effective_epsilon_high, max_tokens=config.max_tokens,
        mismatch=config.mismatch, mismatch_threshold=config.mismatch_threshold, beta=config.beta,
        reference_logprobs=reference,
    )  # fmt: skip
    parts.loss.backward()
    gradient = {str(i): p.grad.detach().clone() for i, p in enumerate(params) if p.grad is not None}
    for p in params:
        p.grad = None
    return gradient


def assert_same_gradient(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], rtol: float = 2e-4) -> None:
    """Equal up to float rounding (the trainer packs rows and sums in another order)."""
    assert a.keys() == b.keys() and a
    difference = math.sqrt(sum(float((a[k] - b[k]).square().sum()) for k in a))
    norm = math.sqrt(sum(float(b[k].square().sum()) for k in b))
    assert norm > 0 and difference <= rtol * norm, f"|diff| {difference:.3g} vs |grad| {norm:.3g}"


def assert_different_gradient(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    difference = math.sqrt(sum(float((a[k] - b[k]).square().sum()) for k in a))
    norm = math.sqrt(sum(float(b[k].square().sum()) for k in b))
    assert difference > 1e-2 * norm, "the option changed nothing"


# Direction ------------------------------------------------------------------------------------


@pytest.mark.parametrize("loss", get_args(LossType))
def test_a_step_raises_the_best_answer_and_lowers_the_worst(
    loss: LossType, tmp_path: Path, tokenizer: Any
) -> None:
    config = TrainConfig(loss=loss, learning_rate=2e-4)
    for sign, folder in ((1.0, "rewarded"), (-1.0, "negated")):
        model = trainer(tmp_path / folder)
        items = on_policy(model, answers(tokenizer, QUESTIONS[:1]))  # rewards 1, 0.6, 0.3, 0
        for answer in items:
            answer.reward *= sign
        before = sequence_logprobs(model, items)
        model.train_step(groups(items), config)
        after = sequence_logprobs(model, items)
        best, worst = (0, 3) if sign > 0 else (3, 0)
        assert after[best] > before[best], (loss, sign, before, after)
        assert after[worst] < before[worst], (loss, sign, before, after)


@pytest.mark.parametrize("loss", get_args(LossType))
def test_equal_rewards_change_nothing(loss: LossType, tmp_path: Path, tokenizer: Any) -> None:
    model = trainer(tmp_path)
    items = on_policy(
        model, answers(tokenizer, [("What is 2+3?", [("5", 0.5), ("6", 0.5), ("It is 5.", 0.5)])])
    )
    before = sequence_logprobs(model, items)
    result = model.train_step(groups(items), TrainConfig(loss=loss, learning_rate=1e-2))
    assert result.metrics["data/zero_variance_share"] == 1.0
    assert sequence_logprobs(model, items) == before


# The formula, option by option -------------------------------------------------------------------


@pytest.mark.parametrize("loss", get_args(LossType))
def test_the_step_gradient_is_the_formulas_however_the_batch_is_split(
    loss: LossType, tmp_path: Path, tokenizer: Any
) -> None:
    """One micro-batch, or one sequence each (a budget below any sequence), with shared prompts
    and the mismatch mask dropping a token: the gradient is the whole batch's."""
    model = trainer(tmp_path, random_adapter=True)
    items = on_policy(model, answers(tokenizer))
    items[2].sampling[1] -= 3.0  # ratio e^3: dropped by the mismatch mask
    expected = formula_gradient(model, items, TrainConfig(loss=loss, mismatch="mask"))
    for budget in (4096, 8):
        config = TrainConfig(loss=loss, mismatch="mask", micro_batch_tokens=budget, max_grad_norm=None)
        stepped = step_gradient(trainer(tmp_path / str(budget), random_adapter=True), items, config)
        assert_same_gradient(stepped, expected)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_reward_scaling(scale: str, tmp_path: Path, tokenizer: Any) -> None:
    model = trainer(tmp_path)
    items = on_policy(model, answers(tokenizer))
    config = TrainConfig(scale_rewards=scale, max_grad_norm=None)
    gradient = formula_gradient(model, items, config)
    assert_same_gradient(step_gradient(model, items, config), gradient)
    other = "none" if scale != "none" else "group"
    scaled_otherwise = formula_gradient(trainer(tmp_path / "other"), items, TrainConfig(scale_rewards=other))
    assert_different_gradient(gradient, scaled_otherwise)


@pytest.mark.parametrize("mismatch", ["mask", "truncate"])
def test_mismatch_handling(mismatch: str, tmp_path: Path, tokenizer: Any) -> None:
    model = trainer(tmp_path)
    items = on_policy(model, answers(tokenizer))
    # The worst answer's first token at ratio 3, past the threshold 2; with A < 0 the PPO clip keeps
    # its gradient (3x a plain token's), so dropping or bounding it shows.
    items[3].sampling[0] -= math.log(3.0)
    config = TrainConfig(mismatch=mismatch, max_grad_norm=None)
    expected = formula_gradient(model, items, config)
    result_gradient = step_gradient(model, items, config)
    assert_same_gradient(result_gradient, expected)
    assert_different_gradient(expected, formula_gradient(trainer(tmp_path / "none"), items, TrainConfig()))


@pytest.mark.parametrize("overlong", ["truncate", "exclude"])
def test_overlong_answers(overlong: str, tmp_path: Path, tokenizer: Any) -> None:
    model = trainer(tmp_path)
    replies = [("5", 1.0), ("6", 0.0), ("It is five, and I am quite sure of it.", 1.0), ("9", 0.0)]
    items = on_policy(model, answers(tokenizer, [("What is 2+3?", replies)]))
    longest = 2
    limit = len(items[longest].prompt) + 2  # the long answer keeps 2 tokens; the others fit
    assert all(
        len(a.prompt) + len(a.tokens) <= limit < len(a.prompt) + len(items[longest].tokens)
        for i, a in enumerate(items)
        if i != longest
    )
    config = TrainConfig(overlong=overlong, max_seq_len=limit, max_grad_norm=None)
    if overlong == "truncate":
        expected = formula_gradient(model, items, config, cut={longest: 2})
    else:
        expected = formula_gradient(model, items, config, leave_out={longest})
    with stepped_gradients() as recorded:
        result = model.train_step(groups(items), config)
    assert_same_gradient(recorded, expected)
    counted = "data/truncated_sequences" if overlong == "truncate" else "data/excluded_overlong_sequences"
    assert result.metrics[counted] == 1


def test_the_kl_term_pulls_toward_the_base_model(tmp_path: Path, tokenizer: Any) -> None:
    model = trainer(tmp_path, random_adapter=True)
    items = on_policy(model, answers(tokenizer))
    config = TrainConfig(beta=0.5, max_grad_norm=None)
    expected = formula_gradient(model, items, config)
    with stepped_gradients() as recorded:
        result = model.train_step(groups(items), config)
    assert_same_gradient(recorded, expected)
    assert result.metrics["train/kl"] > 0
    without_kl = formula_gradient(trainer(tmp_path / "no-kl", random_adapter=True), items, TrainConfig())
    assert_different_gradient(expected, without_kl)


def test_logits_in_chunks_give_the_same_gradient(tmp_path: Path, tokenizer: Any) -> None:
    items = on_policy(trainer(tmp_path / "a"), answers(tokenizer))
    whole = step_gradient(trainer(tmp_path / "b"), items, TrainConfig(max_grad_norm=None))
    chunked = step_gradient(trainer(tmp_path / "c"), items, TrainConfig(logprob_chunk=1, max_grad_norm=None))
    assert_same_gradient(chunked, whole)


def test_the_gradient_clip_bounds_the_norm_and_keeps_the_direction(tmp_path: Path, tokenizer: Any) -> None:
    items = on_policy(trainer(tmp_path / "a"), answers(tokenizer))
    free = step_gradient(trainer(tmp_path / "b"), items, TrainConfig(max_grad_norm=None))
    norm = math.sqrt(sum(float(g.square().sum()) for g in free.values()))
    clipped = step_gradient(trainer(tmp_path / "c"), items, TrainConfig(max_grad_norm=norm / 10))
    assert_same_gradient(clipped, {k: g / 10 for k, g in free.items()}, rtol=1e-5)


def test_weight_decay_shrinks_the_weights_by_lr_times_decay(tmp_path: Path, tokenizer: Any) -> None:
    items = on_policy(trainer(tmp_path / "a"), answers(tokenizer))
    before, after = {}, {}
    for decay in (0.0, 0.5):
        model = trainer(tmp_path / str(decay), random_adapter=True)
        before[decay] = {n: p.detach().clone() for n, p in model._trainable()}
        model.train_step(groups(items), TrainConfig(learning_rate=1e-3, weight_decay=decay))
        after[decay] = {n: p.detach().clone() for n, p in model._trainable()}
    for name, value in before[0.5].items():
        assert torch.equal(
            value, before[0.0][name]
        )  # the same start  # AdamW: w <- w - lr * decay * w - lr * adam_step
        torch.testing.assert_close(after[0.5][name], after[0.0][name] - 1e-3 * 0.5 * value, rtol=0, atol=1e-7)
