"""What ``make gpu-check`` measures, as functions the tests in this folder assert on.

The trainer part needs only torch, transformers, peft and accelerate (and Unsloth or TRL where
present): the models are the real architectures built from their configs with random weights
(Qwen2 at the 0.5B and 1.5B shapes, Llama at SmolLM2-135M's), with the real tokenizers' files,
so nothing is downloaded and no embedded model's weights are needed. On the CPU the same
functions run with a tiny shape (``tests/integration/test_gpu_check.py``).
"""

from __future__ import annotations

import math
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import journeyman as jm
from journeyman.backend.training.batch import TrainSequence, pack
from journeyman.backend.training.device import synchronize
from journeyman.backend.training.logprobs import packed_inputs, sequence_views, token_logprobs
from journeyman.backend.training.trainer import Trainer
from journeyman.config import TrainConfig
from journeyman.store import ModelStore
from tests.trl_stand_in import GRPOStandIn

SHAPES: dict[str, tuple[str, str, dict[str, Any]]] = {
    # name: (architecture, tokenizer, config); the published shapes
    "smollm2-135m": ("llama", "smollm2", dict(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, tie_word_embeddings=True, max_position_embeddings=8192, rope_theta=100000.0,
        rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )),
    "qwen2.5-0.5b": ("qwen2", "qwen", dict(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=32768, rope_theta=1000000.0,
        rms_norm_eps=1e-6, bos_token_id=151643, eos_token_id=151645,
    )),
    "qwen2.5-1.5b": ("qwen2", "qwen", dict(
        vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
        num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=32768, rope_theta=1000000.0,
        rms_norm_eps=1e-6, bos_token_id=151643, eos_token_id=151645,
    )),
    # the CPU's stand-in: SmolLM2's tokenizer, a few layers
    "tiny": ("llama", "smollm2", dict(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=8192, bos_token_id=1,
        eos_token_id=2, pad_token_id=2,
    )),
}  # fmt: skip

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
TOKENIZER_SOURCES = {"smollm2": "smollm2-135m", "qwen": "qwen2.5-coder-0.5b"}
"""The shapes' tokenizers by name, and the embedded model each is taken from."""


def copy_tokenizer(source: Path, target: Path) -> None:
    """A tokenizer's files (those of :data:`TOKENIZER_FILES` that ``source`` has) into ``target``."""
    target.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (source / name).exists():
            shutil.copy(source / name, target / name)


BF16_PEAK = {  # dense bf16 tensor-core FLOP/s by the GPU's name (NVIDIA's data sheets)
    "H100 PCIe": 756e12, "H100 NVL": 835e12, "H100": 989e12, "H200": 989e12, "GH200": 989e12, "B200": 2250e12,
    "A100": 312e12, "L40S": 362e12, "L4": 121e12, "A10G": 70e12, "A10": 125e12, "RTX 4090": 165e12,
}  # fmt: skip


def bf16_peak(device: torch.device) -> float | None:
    """The GPU's dense bf16 peak in FLOP/s, by name (the longest name that matches); None on a CPU."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    found = [key for key in BF16_PEAK if key in name]
    return BF16_PEAK[max(found, key=len)] if found else None


def build_model(shape: str, folder: Path, tokenizers: Path, device: torch.device) -> Path:
    """The architecture of ``shape`` with random weights (seed 0) saved to ``folder`` with its
    tokenizer's files (from ``tokenizers/<tokenizer>``); made on ``device``, so a 1.5B takes seconds."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    if (folder / "config.json").exists():
        return folder
    architecture, tokenizer, values = SHAPES[shape]
    config = (LlamaConfig if architecture == "llama" else Qwen2Config)(**values)
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder)
    del model
    copy_tokenizer(tokenizers / tokenizer, folder)
    return folder


def synthetic_groups(
    vocab: int,
    *,
    groups: int,
    size: int,
    prompt: int,
    completion: int,
    seed: int = 0,
    logprob: float | None = None,
) -> list[jm.TrajectoryGroup]:
    """Token-exact groups: ``groups`` prompts of ``prompt`` random tokens, each answered ``size``
    times with ``completion`` random tokens, rewards 0 and 1 in turn (every group has a spread).
    ``logprob`` is the sampling logprob recorded for every sampled token (None: not recorded)."""
    generator = torch.Generator().manual_seed(seed)
    made = []
    for _ in range(groups):
        prompt_ids = torch.randint(3, vocab - 1, (prompt,), generator=generator).tolist()
        trajectories = []
        for k in range(size):
            tokens = torch.randint(3, vocab - 1, (completion,), generator=generator).tolist()
            turn = {
                "type": "model_turn",
                "message": {"role": "assistant", "content": "-"},
                "prompt_token_ids": prompt_ids,
                "completion_token_ids": tokens,
                "logprobs": [logprob] * completion,
            }
            messages = [{"role": "user", "content": "-"}, turn]
            trajectories.append(jm.Trajectory(conversation=messages, reward=float(k % 2)))
        made.append(jm.TrajectoryGroup(trajectories))
    return made


@dataclass
class StepTiming:
    engine: str
    shape: str
    seconds: float
    tokens: int
    """Tokens in the step's forward passes (packed rows, padding excluded)."""
    peak_gib: float | None
    flops_share: float | None
    """Of the GPU's bf16 peak, counting 4 x parameters x tokens (forward 2, backward to the
    activations 2; LoRA computes no gradient of the base weights)."""
    dtype: str
    device: str

    def row(self) -> dict[str, Any]:
        return self.__dict__.copy()


def trainer_for(folder: Path, root: Path, device: torch.device, engine: str, **kwargs: Any) -> Trainer:
    trainer = Trainer(
        str(folder), ModelStore("gpu-check", engine, root=root), engine=engine, device=device, **kwargs
    )
    trainer.load()
    return trainer


def timed_step(
    trainer: Trainer, groups: list[jm.TrajectoryGroup], config: TrainConfig, shape: str
) -> StepTiming:
    """One warm-up step, then one measured step on the same groups."""
    trainer.train_step(groups, config)
    device = trainer.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    synchronize(device)
    start = time.perf_counter()
    result = trainer.train_step(groups, config)
    synchronize(device)
    seconds = time.perf_counter() - start
    _, sequences, _ = trainer._prepare(groups, config)
    rows = [row for micro_batch, _ in trainer._micro_batches(sequences, config) for row in micro_batch]
    tokens = sum(len(row) for row in rows)
    parameters = sum(p.numel() for p in trainer.model.parameters())
    peak = bf16_peak(device)
    assert result.metrics["train/grad_norm"] > 0
    return StepTiming(
        engine="unsloth" if trainer.uses_unsloth else "transformers",
        shape=shape,
        seconds=seconds,
        tokens=tokens,
        peak_gib=torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
        flops_share=(4 * parameters * tokens / seconds) / peak if peak else None,
        dtype=str(trainer.dtype).removeprefix("torch."),
        device=str(device),
    )


def shared_prefix_sequences(
    vocab: int, prompt: int, completion: int, siblings: int, seed: int = 1
) -> list[TrainSequence]:
    """``siblings`` sequences sharing a ``prompt``-token prefix, ``completion`` trained tokens each."""
    generator = torch.Generator().manual_seed(seed)
    shared = torch.randint(3, vocab - 1, (prompt,), generator=generator).tolist()
    sequences = []
    for i in range(siblings):
        rest = torch.randint(3, vocab - 1, (completion,), generator=generator).tolist()
        sequences.append(
            TrainSequence(
                shared + rest, [0] * prompt + [1] * completion, [math.nan] * (prompt + completion), i
            )
        )
    return sequences


def logprobs_of(trainer: Trainer, sequences: list[TrainSequence], *, share_prefix: bool) -> torch.Tensor:
    """The trained tokens' logprobs (sequence order, flat), packed into shared rows or one row each."""
    rows = [row for mb in pack(sequences, 1 << 20, share_prefix=share_prefix) for row in mb]
    ordered = [s for row in rows for s in row.sequences]
    inputs = packed_inputs(rows, trainer.tokenizer.pad_token_id or 0, trainer.device)
    views = sequence_views(ordered, inputs.where, trainer.device)
    trainer.model.eval()
    with torch.no_grad():
        logprobs, _ = token_logprobs(trainer.model, inputs, views, 512)
    by_sequence = {id(s): logprobs[b][views.mask[b].bool()] for b, s in enumerate(ordered)}
    return torch.cat([by_sequence[id(s)] for s in sequences]).float().cpu()


def differences(a: torch.Tensor, b: torch.Tensor) -> dict[str, float]:
    diff = (a - b).abs()
    return {"mean_abs_diff": float(diff.mean()), "max_abs_diff": float(diff.max()), "tokens": a.numel()}


# TRL's training step on the same batch ------------------------------------------------------------


def trl_step(trainer: Trainer, groups: list[jm.TrajectoryGroup], config: TrainConfig) -> float:
    """TRL's GRPO training step on the same groups, model and optimizer settings: its forward
    (``_get_per_token_logps_and_entropies`` through its fused, chunked output layer, over left-
    padded prompts and right-padded completions, one row per sequence), its
    loss (``_compute_loss``, DAPO), backward, AdamW. Never its generation. The seconds of the
    second of two steps."""
    from trl import GRPOTrainer
    from trl.trainer.utils import add_fused_lm_head

    device = trainer.device
    prompts, completions, advantages = [], [], []
    batch_advantage, sequences, _ = trainer._prepare(groups, config)
    for sequence in sequences:
        first = sequence.mask.index(1)
        prompts.append(sequence.tokens[:first])
        completions.append(sequence.tokens[first:])
        advantages.append(float(batch_advantage[sequence.trajectory]))
    prompt_width, completion_width = max(map(len, prompts)), max(map(len, completions))
    pad = trainer.tokenizer.pad_token_id or 0

    def left(ids: list[int]) -> list[int]:
        return [pad] * (prompt_width - len(ids)) + ids

    def right(ids: list[int]) -> list[int]:
        return ids + [pad] * (completion_width - len(ids))

    inputs = {
        "prompt_ids": torch.tensor([left(p) for p in prompts], device=device),
        "prompt_mask": torch.tensor(
            [[0] * (prompt_width - len(p)) + [1] * len(p) for p in prompts], device=device
        ),
        "completion_ids": torch.tensor([right(c) for c in completions], device=device),
        "completion_mask": torch.tensor(
            [[1] * len(c) + [0] * (completion_width - len(c)) for c in completions], device=device
        ),
        "advantages": torch.tensor(advantages, device=device),
        "old_per_token_logps": None,
    }
    inputs["num_items_in_batch"] = inputs["completion_mask"].sum()
    stand_in = GRPOStandIn(
        "dapo", epsilon=config.effective_epsilon, epsilon_high=config.effective_epsilon_high, beta=0.0,
        max_completion_length=completion_width,
    )  # fmt: skip
    stand_in._get_per_token_logps_and_entropies = GRPOTrainer._get_per_token_logps_and_entropies.__get__(
        stand_in
    )
    model = trainer.model
    # as GRPOTrainer.__init__ does: TRL's chunked output layer, logprobs without the full logits
    add_fused_lm_head(model.get_base_model(), temperature=1.0, outputs=("log_probs", "entropy"))
    parameters = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(parameters, lr=config.learning_rate, weight_decay=config.weight_decay)
    model.train()
    seconds = 0.0
    for _ in range(2):
        synchronize(device)
        start = time.perf_counter()
        loss = GRPOTrainer._compute_loss(stand_in, model, inputs)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(parameters, config.max_grad_norm or math.inf)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        synchronize(device)
        seconds = time.perf_counter() - start
    return seconds
