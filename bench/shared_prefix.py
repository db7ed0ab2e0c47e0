"""Training on a group that shares its prompt: one tree-masked row vs one row per sequence.

A group of 8 sequences with the same prompt (random token ids, LoRA r=8 on all projections, bf16,
2 threads), 4 steps per side alternating in one process, the first dropped. "shared" is the
trainer's default (the cost model decides); "separate" forces one row per sequence.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

import torch

import journeyman as jm
from bench.common import machine, table
from journeyman.backend.training.trainer import Trainer
from journeyman.config import TrainConfig
from journeyman.store import ModelStore

SHAPES = [(40, 64), (400, 40), (1000, 60)]


def group(prompt_tokens: int, completion_tokens: int, seed: int, size: int = 8) -> jm.TrajectoryGroup:
    generator = torch.Generator().manual_seed(seed)
    prompt = torch.randint(100, 40000, (prompt_tokens,), generator=generator).tolist()
    trajectories = []
    for index in range(size):
        completion = torch.randint(100, 40000, (completion_tokens,), generator=generator).tolist()
        turn = {"type": "model_turn", "message": {"role": "assistant", "content": "x"}, "prompt_token_ids": prompt,
                "completion_token_ids": completion, "logprobs": [-2.0] * completion_tokens}  # fmt: skip
        trajectories.append(jm.Trajectory(conversation=[turn], reward=float(index % 2)))
    return jm.TrajectoryGroup(trajectories)


def measure(steps: int) -> str:
    rows = []
    for prompt_tokens, completion_tokens in SHAPES:
        trainers = {}
        for mode in ("shared", "separate"):
            trainer = Trainer("smollm2-135m", ModelStore("bench", mode, root=tempfile.mkdtemp()), threads=2)
            trainer.load()
            if mode == "separate":
                trainer._row_cost = lambda n: 2.0 ** min(n, 1000)  # sharing never pays
            trainers[mode] = trainer
        times: dict[str, list[float]] = {mode: [] for mode in trainers}
        for step in range(steps + 1):
            for mode, trainer in trainers.items():
                result = trainer.train_step([group(prompt_tokens, completion_tokens, step)], TrainConfig())
                times[mode].append(result.metrics["time/forward_backward"])
        shared, separate = (statistics.median(times[m][1:]) for m in ("shared", "separate"))
        rows.append((f"8 x ({prompt_tokens} + {completion_tokens})", f"{separate:.2f}", f"{shared:.2f}",
                     f"{separate / shared:.2f}x"))  # fmt: skip
    return (
        f"### A group's shared prompt computed once (forward + backward s/step; {machine()})\n\n"
        + table(
            ["group: sequences x (prompt + completion tokens)", "one row each", "shared row", "speed-up"],
            rows,
        )
        + "\n"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    print(measure(args.steps))
