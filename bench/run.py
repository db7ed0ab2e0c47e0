"""Run every benchmark, each in a fresh process, and write bench/results.md (``make bench``).

A fresh process per benchmark keeps one benchmark's threads and memory out of the next one's
numbers (idle OpenMP threads left by a training run can spin and steal the CPU).

Only the block between the ``make bench`` markers is rewritten; the sections measured by hand
(longer runs, other models, notes) below it are kept as they are.
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
from pathlib import Path

from bench.common import machine

RESULTS = Path(__file__).with_name("results.md")
SCRIPTS = [
    "gateway_overhead",
    "redeploy_latency",
    "rollout_throughput",
    "train_throughput",
    "shared_prefix",
    "rl_step",
    "step_memory",
    "distributed_step",
    "tracer_overhead",
    "load",
    "viewer",
    "demo_curve",
]


def main() -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    sections = []
    for script in SCRIPTS:
        print(f"running bench.{script} ...", file=sys.stderr, flush=True)
        done = subprocess.run(
            [sys.executable, "-m", f"bench.{script}"], capture_output=True, text=True, env=env, check=False
        )
        if done.returncode != 0:
            raise SystemExit(f"bench.{script} failed:\n{done.stderr[-3000:]}")
        sections.append(done.stdout.strip() + "\n")
    block = f"Measured {datetime.date.today()} on {machine()} by `make bench`.\n\n" + "\n".join(sections)
    RESULTS.write_text(with_generated_block(RESULTS.read_text() if RESULTS.exists() else "", block))
    print(RESULTS.read_text())


BEGIN, END = "<!-- make bench: begin (rewritten by each run) -->", "<!-- make bench: end -->"


def with_generated_block(text: str, block: str) -> str:
    """``text`` with the ``make bench`` block replaced by ``block``; everything else is kept."""
    generated = f"{BEGIN}\n## Written by `make bench`\n\n{block.strip()}\n{END}"
    if BEGIN in text and END in text:
        before, _, rest = text.partition(BEGIN)
        return before + generated + rest.partition(END)[2]
    kept = text.partition("\n")[2].strip() if text.startswith("# ") else text.strip()
    hand = f"\n\n## Measured by hand (kept across runs)\n\n{kept}\n" if kept else "\n"
    return f"# Benchmark results\n\n{generated}{hand}"


if __name__ == "__main__":
    main()
