"""Seconds per training step of the embedded model, and memory held: one process, and two gloo processes under
torchrun holding the whole model each (data parallel) or its layers sharded (FSDP).

The cores are split between the processes (one process gets them all), so on a machine with as
many cores as processes this shows what the collectives cost, not a speed-up. The script is also
the torchrun worker (``--worker``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import machine, table


def worker(out: Path, mode: str, threads: int, sequences: int, steps: int) -> None:
    from bench.train_throughput import groups
    from journeyman.backend.training.distributed import DataParallelTrainer
    from journeyman.config import TrainConfig
    from journeyman.store import ModelStore

    rank = int(os.environ.get("RANK", "0"))
    store = ModelStore("bench", "t", root=out / f"root{rank}")
    trainer = DataParallelTrainer("smollm2-135m", store, threads=threads, fsdp=mode == "fsdp")
    trainer.load()
    resident = _resident_mib()
    times = []
    for step in range(steps + 1):  # the first step warms up
        start = time.perf_counter()
        trainer.train_step(groups(sequences, step), TrainConfig(micro_batch_tokens=1024))
        times.append(time.perf_counter() - start)
    if rank == 0:
        (out / f"{mode}.json").write_text(json.dumps({"times": times[1:], "resident": resident}))


def _resident_mib() -> float:
    """This process's resident memory (Linux)."""
    status = Path("/proc/self/status").read_text().splitlines()
    return int(next(line for line in status if line.startswith("VmRSS")).split()[1]) / 1024


def measure(cores: int, sequences: int, steps: int) -> str:
    rows = []
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    with tempfile.TemporaryDirectory() as tmp:
        for label, mode, processes in (
            ("one process", "single", 1),
            ("data parallel", "dp", 2),
            ("FSDP", "fsdp", 2),
        ):
            threads = max(1, cores // processes)
            command = [
                sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                str(processes), __file__, "--worker", tmp, mode, str(threads), str(sequences), str(steps),
            ]  # fmt: skip
            subprocess.run(command, env={**env, "OMP_NUM_THREADS": str(threads)}, check=True)
            result = json.loads((Path(tmp) / f"{mode}.json").read_text())
            rows.append(
                (label, str(processes), str(threads), f"{statistics.median(result['times']):.2f}",
                 f"{result['resident']:.0f}")
            )  # fmt: skip
    return (
        f"### Distributed training step ({sequences} sequences x 40+64 tokens, embedded model, "
        f"{machine()})\n\n"
        + table(
            ["trainer", "processes", "threads each", "s/step (median)", "MiB resident after load (rank 0)"],
            rows,
        )
        + "\n"
    )


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        out, mode, threads, sequences, steps = sys.argv[2:7]
        worker(Path(out), mode, int(threads), int(sequences), int(steps))
        raise SystemExit
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cores", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--sequences", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    print(measure(args.cores, args.sequences, args.steps))
