"""Held-out success of finished demo runs on a larger held-out set than their own, side by side.

A run's own evaluation (``--val-scenarios 20 --val-samples 2``: 40 samples) cannot tell two runs
5 points apart: a difference of two rates measured on 40 samples each has a 95% interval of about
+-21 points. This evaluates each run's latest step again, on ``--questions`` held-out questions of
the run's own seed (``--samples`` at its temperature, and once greedily), all runs on one vLLM
server with their adapters served as LoRA. The runs are copied to a scratch root first, so their
own files are left as they were.

    python -m bench.heldout /tmp/pair-chaos/demo/chaos /tmp/pair-clean/demo/clean --questions 200
"""

from __future__ import annotations

import argparse
import asyncio
import math
import shutil
import tempfile
from dataclasses import replace
from pathlib import Path

import httpx
from rich.console import Console

from journeyman.backend import LocalBackend
from journeyman.backend.app.demo import Demo, resume_config


def interval(successes: float, n: int) -> float:
    """Half the width of a 95% normal interval of a success rate measured on ``n`` samples."""
    return 1.96 * math.sqrt(max(successes * (1 - successes), 1e-9) / n)


async def evaluate(
    runs: list[Path], questions: int, samples: int, scratch: Path, dtype: str = "auto"
) -> list[dict[str, float]]:
    console = Console()
    rows = []
    async with (
        LocalBackend(root=scratch, merge_adapters=False, dtype=dtype) as backend,
        httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=512)) as http,
    ):
        for run in runs:
            copy = scratch / "runs" / run.parent.name / run.name
            shutil.copytree(run, copy)
            config = replace(
                resume_config(copy),
                val_scenarios=questions,
                val_samples=samples,
                langfuse=False,
                viewer=False,
            )
            demo = Demo(config, resume=True)
            demo.console, demo.http, demo.backend = console, http, backend
            model, _ = demo._model()
            await model.register(backend)
            demo.records = backend.records
            result = await demo.evaluate(model, f"{run.name} step {await model.get_step()}")
            sampled, greedy = result.sampled["success"], result.greedy["success"]
            rows.append(
                {"step": result.step, "sampled": sampled, "n_sampled": questions * samples,
                 "greedy": greedy, "n_greedy": questions}
            )  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run folders (ROOT/demo/NAME)")
    parser.add_argument("--questions", type=int, default=200)
    parser.add_argument(
        "--samples", type=int, default=2, help="samples per question at the run's temperature"
    )
    parser.add_argument(
        "--dtype", default="auto", help="vLLM's --dtype (float32: runs with the same adapter score the same)"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="journeyman-heldout-") as scratch:
        rows = asyncio.run(evaluate(args.runs, args.questions, args.samples, Path(scratch), args.dtype))
    print("| run | step | success, sampled (95% interval) | success, greedy (95% interval) |")
    print("|---|---|---|---|")
    for run, row in zip(args.runs, rows, strict=True):
        sampled = f"{row['sampled']:.1%} +-{interval(row['sampled'], int(row['n_sampled'])):.1%} of {row['n_sampled']}"
        greedy = (
            f"{row['greedy']:.1%} +-{interval(row['greedy'], int(row['n_greedy'])):.1%} of {row['n_greedy']}"
        )
        print(f"| {run} | {row['step']} | {sampled} | {greedy} |")


if __name__ == "__main__":
    main()
