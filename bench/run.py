"""Run every benchmark, each in a fresh process, and write bench/results.md (``make bench``).

A fresh process per benchmark keeps one benchmark's threads and memory out of the next one's
numbers (idle OpenMP threads left by a training run can spin and steal the CPU).
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
    "distributed_step",
    "tracer_overhead",
    "load",
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
    header = f"# Benchmark results\n\nMeasured {datetime.date.today()} on {machine()} by `make bench`.\n\n"
    RESULTS.write_text(header + "\n".join(sections))
    print(RESULTS.read_text())


if __name__ == "__main__":
    main()
