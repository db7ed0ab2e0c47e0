"""Training throughput of the GRPO LoRA step, as tokens/s and as a share of the bf16 matmul peak.

The peak is measured in the same run (2048^3 bf16 matmuls on the same threads). A LoRA step is
counted as 4 x parameters x tokens FLOPs (forward 2PT, backward through frozen weights 2PT), the
input embedding left out (a lookup, not a matmul).
Target: >= 50% of the peak. On a CPU without bf16 instructions bf16 is emulated (hundreds of
times slower than fp32), so only fp32 training is measured there, against the fp32 peak: the
precision the trainer picks by itself on that machine.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

import journeyman as jm
from bench.common import machine, table
from journeyman.backend.training.trainer import Trainer, bf16_supported
from journeyman.config import TrainConfig
from journeyman.store import ModelStore

PROMPT, COMPLETION = 40, 64


def matmul_peak(threads: int, dtype: torch.dtype, size: int = 2048, repeats: int = 5) -> float:
    torch.set_num_threads(threads)
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    a @ b
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - start)
    return 2 * size**3 / min(times)


def groups(sequences: int, seed: int) -> list[jm.TrajectoryGroup]:
    generator = torch.Generator().manual_seed(seed)
    trajectories = []
    for index in range(sequences):
        prompt = torch.randint(100, 40000, (PROMPT,), generator=generator).tolist()
        completion = torch.randint(100, 40000, (COMPLETION,), generator=generator).tolist()
        turn = {"type": "model_turn", "message": {"role": "assistant", "content": "x"}, "prompt_token_ids": prompt,
                "completion_token_ids": completion, "logprobs": [-2.0] * COMPLETION}  # fmt: skip
        trajectories.append(jm.Trajectory(conversation=[turn], reward=float(index % 2)))
    return [jm.TrajectoryGroup(trajectories)]


def step_seconds(trainer: Trainer, sequences: int, steps: int) -> list[float]:
    """Forward + backward + optimizer seconds of ``steps + 1`` steps (the first one warms up)."""
    times = []
    for step in range(steps + 1):
        result = trainer.train_step(groups(sequences, step), TrainConfig(micro_batch_tokens=8192))
        times.append(result.metrics["time/forward_backward"] + result.metrics["time/optimizer"])
    return times


def measure(model: str, threads: int, sequences: int, steps: int) -> str:
    peak_bf16 = matmul_peak(threads, torch.bfloat16)
    peak_fp32 = matmul_peak(threads, torch.float32)
    rows = []
    for precision in ("bf16", "fp32") if bf16_supported() else ("fp32",):
        with tempfile.TemporaryDirectory() as tmp:
            trainer = Trainer(model, ModelStore("bench", "t", root=tmp), threads=threads, precision=precision)
            trainer.load()
            # The input embedding is a lookup, not a matmul: its parameters cost no FLOPs (tied
            # to the output head, as in SmolLM2 and the 1.5B, they count once, as the head).
            embedding = trainer.model.get_input_embeddings().weight
            head = trainer.model.get_output_embeddings().weight
            parameters = sum(p.numel() for p in trainer.model.parameters())
            parameters -= embedding.numel() if embedding is not head else 0
            seconds = statistics.median(step_seconds(trainer, sequences, steps)[1:])
            tokens = sequences * (PROMPT + COMPLETION)
            flops = 4 * parameters * tokens / seconds
            rows.append((precision, f"{seconds:.2f}", f"{tokens / seconds:.0f}", f"{flops / 1e9:.0f}",
                         f"{100 * flops / peak_bf16:.0f}%", f"{100 * flops / peak_fp32:.0f}%"))  # fmt: skip
    return (
        f"### Training throughput, {model} ({sequences} sequences x {PROMPT}+{COMPLETION} tokens, LoRA r=8 on all 7 "
        f"projections, {threads} threads; {machine()})\n\n"
        f"Matmul peak measured in this run: bf16 {peak_bf16 / 1e9:.0f} GFLOP/s, fp32 {peak_fp32 / 1e9:.0f} GFLOP/s.\n\n"
        + table(["compute", "s/step", "tokens/s", "GFLOP/s (4PT)", "of bf16 peak", "of fp32 peak"], rows)
        + "\n"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2-135m", help="embedded model alias")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--sequences", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    print(measure(args.model, args.threads, args.sequences, args.steps))
