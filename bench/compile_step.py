"""Does torch.compile of the decoder make the CPU LoRA training step faster? (an experiment)

Runs the same steps as bench.train_throughput (bf16, 8 sequences x 40+64 tokens) with the
decoder's forward left eager, compiled for static shapes, or compiled with dynamic shapes, and
prints the first step (which pays the compilation) and the median of the rest. Not part of
`make bench`: the compiled modes spend minutes compiling. Usage:
`python -m bench.compile_step [eager|static|dynamic ...] [--steps 5]`.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

import torch

from bench.common import machine, table
from bench.train_throughput import COMPLETION, PROMPT, matmul_peak, step_seconds
from journeyman.backend.training.trainer import Trainer
from journeyman.store import ModelStore


def measure(mode: str, steps: int, threads: int = 2, sequences: int = 8) -> tuple[str, ...]:
    peak = matmul_peak(threads, torch.bfloat16)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = Trainer(
            "smollm2-135m", ModelStore("bench", "t", root=tmp), threads=threads, precision="bf16"
        )
        trainer.load()
        if mode != "eager":
            decoder = trainer.model.get_base_model().get_decoder()
            decoder.forward = torch.compile(decoder.forward, dynamic=mode == "dynamic")
        parameters = sum(p.numel() for p in trainer.model.parameters())
        times = step_seconds(trainer, sequences, steps)
    seconds = statistics.median(times[1:])
    flops = 4 * parameters * sequences * (PROMPT + COMPLETION) / seconds
    return (mode, f"{times[0]:.1f}", f"{seconds:.2f}", f"{flops / 1e9:.0f}", f"{100 * flops / peak:.0f}%")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("modes", nargs="*", default=["eager", "static", "dynamic"])
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    rows = [measure(mode, args.steps) for mode in args.modes]
    print(
        f"### torch.compile and the training step (8 sequences x {PROMPT}+{COMPLETION} tokens, bf16, "
        f"2 threads; {machine()})\n\n"
        + table(["decoder", "first step s", "s/step (median)", "GFLOP/s (4PT)", "of bf16 peak"], rows)
    )
