"""The trainer trains on one device: the model is loaded onto it and every tensor of a step is
made there, with no wait for the device's numbers inside the step.

There is no GPU here, so the device is torch's ``meta`` device, run through the trainer's own
code: a meta tensor meeting a CPU tensor raises ("Tensor on device meta is not on the expected
device cpu"), as a CUDA one does, and reading a meta tensor's value (``.item()``, ``float()``,
``.tolist()``, boolean indexing, ``nonzero``) raises, where on a GPU it would wait for the
device. torch's ``FakeTensorMode`` with fake ``cuda:0`` tensors, the first choice, cannot run a
model on a CPU build of torch: autograd, and already rotary embeddings' ``.to(device=...)``, end
in "PyTorch is not linked with support for cuda devices" (the first aborts the process). What
only CUDA has (its RNG, the allocator's cache, Unsloth) is checked by ``make gpu-check``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import journeyman as jm
from journeyman.backend.training.trainer import Trainer
from journeyman.config import TrainConfig
from journeyman.errors import ConfigError
from journeyman.messages import ModelTurn
from journeyman.store import ModelStore
from tests.integration.test_distributed_trainer import tiny_llama
from tests.integration.test_trainer import _groups as _unsampled


def _groups(tokenizer: Any) -> list[jm.TrajectoryGroup]:
    """The trainer tests' groups, with vLLM's sampling logprobs recorded: about a random tiny
    model's own (-ln 49152), so that some ratios fall inside PPO's clip range and some outside."""
    groups = _unsampled(tokenizer)
    for group in groups:
        for trajectory in group.trajectories:
            for turn in trajectory.conversation:
                if isinstance(turn, ModelTurn):
                    turn.logprobs = [-10.8 + 0.5 * (i % 3 - 1) for i in range(len(turn.completion_token_ids))]
    return groups


META = torch.device("meta")


class OneDevice(TorchDispatchMode):
    """Refuses an operation whose tensors are on two devices, as CUDA kernels do, where the meta
    device's kernels would let a CPU index tensor through (an embedding lookup with CPU token
    ids, say). A 0-dim CPU tensor is a scalar anywhere, indexing may take CPU indices, and a copy
    is how a tensor moves."""

    MOVES: ClassVar[set[str]] = {"aten._to_copy.default", "aten.copy_.default", "aten._copy_from.default"}
    INDEXING: ClassVar[set[str]] = {
        "aten.index.Tensor",
        "aten.index_put.default",
        "aten.index_put_.default",
        "aten._index_put_impl_.default",
    }

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = str(func)
        if name not in self.MOVES:
            leaves = tree_leaves((args, kwargs or {}))
            if name in self.INDEXING:
                leaves = [leaves[0]]
            devices = {
                t.device
                for t in leaves
                if isinstance(t, torch.Tensor) and (t.dim() or t.device.type != "cpu")
            }
            if len(devices) > 1:
                raise RuntimeError(f"{name} mixes devices {sorted(map(str, devices))}")
        return func(*args, **(kwargs or {}))


# Loading a checkpoint into meta parameters keeps their shapes, not its values: that is the point.
pytestmark = pytest.mark.filterwarnings("ignore:for .*copying from a non-meta parameter")


@pytest.fixture(scope="module")
def resumable(tmp_path_factory: pytest.TempPathFactory, model_dir: Path, tokenizer: Any) -> tuple[str, Path]:
    """A random tiny Llama and a store whose latest checkpoint (step 1) holds AdamW's state."""
    folder = tmp_path_factory.mktemp("device")
    base = str(tiny_llama(folder / "tiny", model_dir))
    trainer = Trainer(base, ModelStore("test", "agent", root=folder / "root"), threads=1, precision="fp32")
    trainer.load()
    trainer.train_step(_groups(tokenizer), TrainConfig(learning_rate=1e-3))
    return base, folder / "root"


def _on_meta(resumable: tuple[str, Path], **kwargs: Any) -> Trainer:
    base, root = resumable
    trainer = Trainer(base, ModelStore("test", "agent", root=root), threads=1, device=META, **kwargs)
    assert trainer.load() == 1
    return trainer


def test_the_model_and_the_resumed_optimizer_state_are_on_the_training_device(
    resumable: tuple[str, Path],
) -> None:
    trainer = _on_meta(resumable, precision="fp32")
    assert {p.device for p in trainer.model.parameters()} == {META}
    assert {b.device for b in trainer.model.buffers()} <= {META}
    assert trainer.describe() == "transformers on meta in float32"
    state = trainer.optimizer.state if trainer.optimizer is not None else {}
    assert len(state) == len(trainer._trainable())
    for values in state.values():  # AdamW's moments beside their parameter; its step count on the CPU
        assert values["exp_avg"].device == values["exp_avg_sq"].device == META
        assert values["step"].device.type == "cpu" and values["step"].dim() == 0


@pytest.mark.parametrize(
    "config",
    [
        TrainConfig(learning_rate=1e-3, loss="grpo"),  # per-sequence mean
        TrainConfig(learning_rate=1e-3, loss="dapo", mismatch="mask", beta=0.04),  # the reference pass
        TrainConfig(learning_rate=1e-3, loss="dr_grpo", mismatch="truncate", max_grad_norm=None),
        TrainConfig(learning_rate=1e-3, loss="gspo", epsilon_high=0.28, gradient_checkpointing=True),
        TrainConfig(learning_rate=1e-3, loss="cispo", micro_batch_tokens=40),  # many micro-batches
    ],
    ids=["grpo", "dapo-reference", "dr_grpo", "gspo-checkpointing", "cispo-micro-batches"],
)
def test_a_step_runs_on_the_training_device_without_waiting_for_it(
    resumable: tuple[str, Path], tokenizer: Any, config: TrainConfig
) -> None:
    """Packing, logprobs, the reference pass, the loss, backward, clipping and AdamW's step (after
    a resume) on the device; any CPU tensor meeting the device's, and any read of a value, raises."""
    trainer = _on_meta(resumable)
    advantage, sequences, _ = trainer._prepare(_groups(tokenizer), config)
    assert sequences and advantage.device.type == "cpu"  # the host's rewards, moved once per step

    with OneDevice():
        totals, grad_norm, timings = trainer._device_step(sequences, advantage, config)

    assert grad_norm.device == META and set(timings) == {"time/forward_backward", "time/optimizer"}
    assert totals._pending and all(values.device == META for values, _, _ in totals._pending)
    assert totals.micro_batches == len(trainer._micro_batches(sequences, config)) > 0
    assert all(p.grad is None for _, p in trainer._trainable())  # stepped and zeroed
    assert {p.device for _, p in trainer._trainable()} == {META}


def test_the_one_read_of_a_step_brings_every_number_to_the_host(
    tmp_path: Path, model_dir: Path, tokenizer: Any
) -> None:
    """On the CPU, the same step's numbers come back from :meth:`StepTotals.gather` in one transfer."""
    base = str(tiny_llama(tmp_path / "tiny", model_dir))
    trainer = Trainer(base, ModelStore("test", "agent", root=tmp_path / "root"), threads=1, precision="fp32")
    trainer.load()
    config = TrainConfig(learning_rate=1e-3, micro_batch_tokens=40)
    advantage, sequences, _ = trainer._prepare(_groups(tokenizer), config)
    totals, grad_norm, _ = trainer._device_step(sequences, advantage, config)
    pending = len(totals._pending)
    (norm,) = totals.gather(grad_norm)
    assert pending == totals.micro_batches > 1 and not totals._pending
    assert norm == pytest.approx(float(grad_norm)) and norm > 0
    metrics = totals.metrics()
    assert metrics["mismatch/tokens_with_sampling_logprobs"] == totals.tokens > 0
    assert metrics["train/entropy"] > 0 and 0 < metrics["train/clip_fraction"] < 1
    assert metrics["mismatch/max_ratio"] > 1


def test_a_training_device_that_is_not_here_is_refused_with_what_is() -> None:
    store = ModelStore("test", "agent", root=Path("/nonexistent"))
    with pytest.raises(ConfigError, match=r"sees no CUDA GPU.*train_device='cpu'"):
        _ = Trainer("smollm2-135m", store, device="cuda").device
    with pytest.raises(ConfigError, match="'auto', 'cpu', 'cuda' or 'cuda:N'"):
        Trainer("smollm2-135m", store, device="gpu0")
    with pytest.raises(ConfigError, match="trains on a CUDA GPU"):
        _ = Trainer("smollm2-135m", store, device="cpu", engine="unsloth").uses_unsloth


def test_an_unsloth_trainer_packs_one_sequence_per_row_and_refuses_longer_rows_than_it_was_loaded_for(
    resumable: tuple[str, Path], tokenizer: Any
) -> None:
    """Unsloth drops the tree-shaped mask while training and cuts rows past its max_seq_length:
    its trainer never puts two sequences in a row, nor trains rows longer than it was loaded for."""
    trainer = _on_meta(resumable, max_seq_length=1024)
    config = TrainConfig(learning_rate=1e-3)
    _, sequences, _ = trainer._prepare(_groups(tokenizer), config)
    assert max(len(row.sequences) for mb, _ in trainer._micro_batches(sequences, config) for row in mb) > 1
    trainer._unsloth = True  # as loaded by Unsloth (which needs a GPU)
    rows = [row for mb, _ in trainer._micro_batches(sequences, config) for row in mb]
    assert [len(row.sequences) for row in rows] == [1] * len(sequences)
    with pytest.raises(
        ConfigError, match="max_seq_len=4096, but Unsloth was loaded for rows of at most 1024"
    ):
        trainer._device_step(sequences, torch.zeros(8), config)
