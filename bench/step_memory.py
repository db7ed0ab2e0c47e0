"""Resident memory of a process across async training steps: the step's activations go back to the
OS after each step, and nothing piles up from step to step (not a test: numbers for results.md;
``tests/integration/test_trainer.py`` checks the behaviour).

    python -m bench.step_memory
"""

from __future__ import annotations

import asyncio
import random
import tempfile
from pathlib import Path

import journeyman as jm
from bench.common import machine
from journeyman.store import ModelStore

GIB = 2**20  # /proc/self/status counts kB


def resident_gib() -> tuple[float, float]:
    """(resident now, peak so far) of this process, from /proc/self/status."""
    status = dict(
        line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line
    )
    return int(status["VmRSS"].split()[0]) / GIB, int(status["VmHWM"].split()[0]) / GIB


def demo_shaped_groups(seed: int = 0) -> list[jm.TrajectoryGroup]:
    """The demo's shape: a long shared prompt, short answers, rewards spread. Three groups of
    700 + 8 x 80 tokens fill one 4096-token micro-batch, as the demo's step does."""
    rng = random.Random(seed)
    groups = []
    for _ in range(3):
        prompt = [rng.randrange(100, 40000) for _ in range(700)]
        trajectories = []
        for i in range(8):
            completion = [rng.randrange(100, 40000) for _ in range(80)]
            turn = {
                "type": "model_turn", "message": {"role": "assistant", "content": "x"},
                "prompt_token_ids": prompt, "completion_token_ids": completion, "logprobs": [-1.0] * 80,
            }  # fmt: skip
            trajectories.append(
                jm.Trajectory(conversation=[{"role": "user", "content": "q"}, turn], reward=i % 2)
            )
        groups.append(jm.TrajectoryGroup(trajectories))
    return groups


async def measure(steps: int = 3) -> list[tuple[float, float]]:
    from journeyman.backend.training.trainer import Trainer

    with tempfile.TemporaryDirectory() as folder:
        trainer = Trainer("smollm2-135m", ModelStore("bench", "memory", root=folder))
        trainer.load()
        loaded = resident_gib()
        after = []
        for _ in range(steps):
            await trainer.train(demo_shaped_groups(), jm.TrainConfig(learning_rate=1e-4))
            after.append(resident_gib())
    return [loaded, *after]


def main() -> None:
    rows = asyncio.run(measure())
    print(
        f"### Resident memory across async training steps (SmolLM2-135M, 3 groups of 700 + 8 x 80 tokens; {machine()})\n"
    )
    print("| after | resident (GiB) | peak so far (GiB) |")
    print("|---|---|---|")
    for i, (now, peak) in enumerate(rows):
        print(f"| {'loading' if i == 0 else f'step {i}'} | {now:.2f} | {peak:.2f} |")


if __name__ == "__main__":
    main()
