"""A training step happens whole or not at all: a failure in any phase leaves the trainer as it
was before the step (counter, LoRA weights, gradients, optimizer state, activation
checkpointing), and training the same step again gives what a step that never failed gives."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from journeyman.backend.training import trainer as trainer_module
from journeyman.backend.training.trainer import Trainer
from journeyman.config import TrainConfig
from journeyman.store import ModelStore
from tests.integration.test_distributed_trainer import tiny_llama
from tests.integration.test_trainer import _groups

# Several micro-batches, so that a failure in a later one meets gradients from an earlier one
CONFIG = TrainConfig(learning_rate=1e-3, loss="cispo", micro_batch_tokens=40, gradient_checkpointing=True)


class Injected(RuntimeError):
    pass


@contextmanager
def failing_in(phase: str, trainer: Trainer) -> Iterator[None]:
    """The next step fails in ``phase``: the second micro-batch's forward pass, the first backward
    pass through the last layer, the optimizer step after it changed every weight, or the
    checkpoint's write."""
    undo: list[Callable[[], Any]] = []
    if phase == "forward":
        calls = {"n": 0}
        real = trainer_module.token_logprobs

        def forward(*args: Any, **kwargs: Any) -> Any:
            calls["n"] += 1
            if calls["n"] == 2:
                raise Injected(phase)
            return real(*args, **kwargs)

        trainer_module.token_logprobs = forward  # type: ignore[assignment]
        undo.append(lambda: setattr(trainer_module, "token_logprobs", real))
    elif phase == "backward":
        layer = trainer.model.get_base_model().get_decoder().layers[-1]

        def backward(*args: Any) -> None:
            raise Injected(phase)

        undo.append(layer.register_full_backward_hook(backward).remove)
    elif phase == "optimizer":

        def optimizer(*args: Any) -> None:
            raise Injected(phase)

        undo.append(register_optimizer_step_post_hook(optimizer).remove)
    else:
        real_write = trainer_module.write_checkpoint

        def write(*args: Any, **kwargs: Any) -> Any:
            raise OSError(28, "No space left on device")

        trainer_module.write_checkpoint = write  # type: ignore[assignment]
        undo.append(lambda: setattr(trainer_module, "write_checkpoint", real_write))
    try:
        yield
    finally:
        for step in undo:
            step()


def _state(trainer: Trainer) -> dict[str, Any]:
    optimizer = trainer.optimizer
    return {
        "step": trainer.step,
        "weights": {n: p.detach().clone() for n, p in trainer._trainable()},
        "grads": [n for n, p in trainer._trainable() if p.grad is not None],
        "moments": {
            (n, key): value.clone()
            for n, p in trainer._trainable()
            for key, value in (optimizer.state.get(p, {}) if optimizer is not None else {}).items()
        },
        "checkpointing": trainer.model.get_base_model().is_activation_checkpointing,
        "checkpoints": trainer.store.checkpoint_steps(),
    }


def _same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["step"] == b["step"] and a["grads"] == b["grads"] == []
    assert a["checkpointing"] == b["checkpointing"] is False and a["checkpoints"] == b["checkpoints"]
    assert a["weights"].keys() == b["weights"].keys() and a["moments"].keys() == b["moments"].keys()
    assert all(torch.equal(a["weights"][n], b["weights"][n]) for n in a["weights"])
    assert all(torch.equal(a["moments"][k], b["moments"][k]) for k in a["moments"])


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> str:
    return str(tiny_llama(tmp_path_factory.mktemp("transaction") / "tiny", model_dir))


@pytest.fixture(scope="module")
def two_clean_steps(base: str, tmp_path_factory: pytest.TempPathFactory, tokenizer: Any) -> dict[str, Any]:
    trainer = Trainer(base, ModelStore("test", "clean", root=tmp_path_factory.mktemp("clean")), threads=1)
    trainer.load()
    for variant in (0, 1):
        trainer.train_step(_groups(tokenizer, variant), CONFIG)
    return _state(trainer)


@pytest.mark.parametrize("phase", ["forward", "backward", "optimizer", "checkpoint"])
def test_a_step_that_fails_in_any_phase_leaves_the_trainer_as_before_and_can_be_trained_again(
    phase: str, base: str, tmp_path: Path, tokenizer: Any, two_clean_steps: dict[str, Any]
) -> None:
    trainer = Trainer(base, ModelStore("test", "failing", root=tmp_path), threads=1)
    trainer.load()
    trainer.train_step(_groups(tokenizer, 0), CONFIG)  # step 1: the optimizer has state to keep
    before = _state(trainer)
    with failing_in(phase, trainer), pytest.raises(Injected if phase != "checkpoint" else OSError):
        trainer.train_step(_groups(tokenizer, 1), CONFIG)
    _same(_state(trainer), before)
    assert trainer.train_step(_groups(tokenizer, 1), CONFIG).step == 2  # the same step, again
    _same(_state(trainer), two_clean_steps)  # exactly what two steps without a failure give
