"""The trainer on a GPU: where its tensors are, a step's cost per engine and shape, packed rows
longer than 2048 tokens against one row per sequence, resuming, and TRL's step beside ours."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from journeyman.backend.training.checkpoints import OPTIMIZER
from journeyman.config import TrainConfig
from tests.gpu import checks

ENGINES = ["transformers", "unsloth"]


def _engine_here(engine: str, device: torch.device) -> None:
    if engine == "unsloth" and (device.type != "cuda" or importlib.util.find_spec("unsloth") is None):
        pytest.skip("Unsloth trains on CUDA where it is installed (JOURNEYMAN_UNSLOTH=1 make setup)")


def _step_groups(shape: str) -> list[Any]:
    vocab = checks.SHAPES[shape][2]["vocab_size"]
    if shape == "tiny":
        return checks.synthetic_groups(vocab, groups=2, size=4, prompt=40, completion=16)
    # A demo-sized step: 8 groups of 8, a 600-token prompt (system prompt and tools), 200 sampled
    return checks.synthetic_groups(vocab, groups=8, size=8, prompt=600, completion=200)


def test_the_model_and_a_step_are_on_the_gpu(
    device: torch.device, shapes: list[str], models: Any, tmp_path: Path
) -> None:
    shape = shapes[-1]
    trainer = checks.trainer_for(models(shape), tmp_path, device, "transformers")
    assert {p.device for p in trainer.model.parameters()} == {device}
    if device.type == "cuda":
        assert trainer.dtype == torch.bfloat16 and str(device) in trainer.describe()
    trainer.train_step(_step_groups(shape), TrainConfig(learning_rate=1e-4))
    state = trainer.optimizer.state if trainer.optimizer is not None else {}
    assert state and all(values["exp_avg"].device == device for values in state.values())


@pytest.mark.parametrize("engine", ENGINES)
def test_a_step_per_engine_and_shape(
    device: torch.device, shapes: list[str], models: Any, tmp_path: Path, record: Any, engine: str
) -> None:
    _engine_here(engine, device)
    for shape in shapes:
        trainer = checks.trainer_for(models(shape), tmp_path / shape, device, engine)
        timing = checks.timed_step(trainer, _step_groups(shape), TrainConfig(learning_rate=1e-4), shape)
        record("step", timing.row())
        assert timing.seconds > 0 and timing.tokens > 0
        del trainer
        if device.type == "cuda":
            torch.cuda.empty_cache()


@pytest.mark.parametrize("engine", ENGINES)
def test_rows_over_2048_tokens_give_each_sequence_its_own_logprobs(
    device: torch.device, shapes: list[str], models: Any, tmp_path: Path, record: Any, engine: str
) -> None:
    """Three answers sharing a 2200-token prompt: packed into one 2650-token tree-masked row (the
    transformers engine), or one row each (what Unsloth trains on), against one row per
    sequence on the transformers engine in fp32. A sibling that saw another's tokens, or a row cut
    at 2048, is off by nats; rounding is not."""
    _engine_here(engine, device)
    shape = "qwen2.5-0.5b" if device.type == "cuda" else "tiny"
    folder = models(shape)
    sequences = checks.shared_prefix_sequences(checks.SHAPES[shape][2]["vocab_size"], 2200, 150, 3)
    reference = checks.trainer_for(folder, tmp_path / "reference", device, "transformers", precision="fp32")
    separate = checks.logprobs_of(reference, sequences, share_prefix=False)
    packed = checks.logprobs_of(reference, sequences, share_prefix=True)
    fp32 = checks.differences(packed, separate)
    record("packing", {"engine": "transformers", "dtype": "float32", "compared": "one packed row", **fp32})
    assert fp32["max_abs_diff"] < 1e-3
    del reference
    trainer = checks.trainer_for(folder, tmp_path / engine, device, engine)
    ours = checks.logprobs_of(trainer, sequences, share_prefix=not trainer.uses_unsloth)
    trained = checks.differences(ours, separate)
    record("packing", {"engine": engine, "dtype": str(trainer.dtype).removeprefix("torch."),
                       "compared": "as the engine trains", **trained})  # fmt: skip
    # bf16 against fp32: a few hundredths on average (a token out of place is off by nats)
    assert trained["mean_abs_diff"] < 0.05 and trained["max_abs_diff"] < 1.0


def test_a_resumed_trainer_steps_on_the_gpu_with_its_optimizer_and_rng(
    device: torch.device, shapes: list[str], models: Any, tmp_path: Path
) -> None:
    shape = shapes[0]
    groups, config = _step_groups(shape), TrainConfig(learning_rate=1e-4)
    first = checks.trainer_for(models(shape), tmp_path, device, "transformers")
    first.train_step(groups, config)
    del first
    resumed = checks.trainer_for(models(shape), tmp_path, device, "transformers")
    assert resumed.step == 1
    state = resumed.optimizer.state if resumed.optimizer is not None else {}
    assert state and all(values["exp_avg"].device == device for values in state.values())
    saved = load_file(str(resumed.store.checkpoint_path(1) / OPTIMIZER))
    if device.type == "cuda":
        assert torch.equal(saved[f"rng/cuda:{device.index}"], torch.cuda.get_rng_state(device))
    assert resumed.train_step(groups, config).step == 2


def test_our_step_beside_trls_on_the_same_batch(
    device: torch.device, shapes: list[str], models: Any, tmp_path: Path, record: Any
) -> None:
    """Phases compared: forward to the completion tokens' logprobs, the DAPO loss, backward,
    gradient clipping and AdamW, on the same model, LoRA, batch and GPU; TRL never generates."""
    try:
        import trl  # noqa: F401
    except Exception as error:  # trl needs datasets and pyarrow, which a bare GPU machine may lack
        pytest.skip(f"TRL does not import here ({type(error).__name__}: {error})")
    shape = shapes[-1]
    groups, config = _step_groups(shape), TrainConfig(learning_rate=1e-4, loss="dapo")
    ours = checks.timed_step(
        checks.trainer_for(models(shape), tmp_path / "ours", device, "transformers"), groups, config, shape
    )
    theirs = checks.trl_step(
        checks.trainer_for(models(shape), tmp_path / "trl", device, "transformers"), groups, config
    )
    record(
        "trl", {"shape": shape, "ours_s": ours.seconds, "trl_s": theirs, "speed-up": theirs / ours.seconds}
    )
    assert theirs > 0
