"""Time spent in each experiment tracker's calls per training step, replaying a stored run.

    python -m bench.trackers RUN_DIR [--steps 10] [--trackers wandb tensorboard mlflow]

RUN_DIR is a run's folder (``ROOT/PROJECT/MODEL``, e.g. one ``journeyman demo`` wrote). Its first
``--steps`` steps are copied step by step into a new store, as a training run writes them (the
step's rollout groups and rows, then its checkpoint, train row and promotion), and after each step
every tracker is synced once, offline, and timed around its own calls (``TrackerSync.seconds``),
and the sync as a whole (the store read once for all of them, then every tracker). Prints one row
per tracker and one for the whole sync: seconds per step (median and max), the first step apart
(it opens the runs), and what a step sent.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from journeyman.store import ModelStore
from journeyman.trackers import TrackerSync, make_trackers


def replay_step(source: ModelStore, target: ModelStore, step: int) -> None:
    """What a run writes for training step ``step`` (0-based), copied from ``source``."""
    rows = source.read_history()
    for split in source.splits():
        if step in source.steps(split):
            target.save_groups(source.load_groups(split, step), split, step)
    for row in rows:
        if row["step"] == step and row.get("split") != "train":
            target.append_history(row)
    if step + 1 in source.checkpoint_steps():
        with target.write_checkpoint(step + 1) as folder:
            shutil.copytree(source.checkpoint_path(step + 1), folder, dirs_exist_ok=True)
    for row in rows:
        if row["step"] == step + 1 and row.get("split") == "train":
            target.append_history(row)
    for row in source.read_promotions():
        if row["step"] == step + 1:
            target.append_promotion(row)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--trackers", nargs="+", default=["wandb", "tensorboard", "mlflow"])
    args = parser.parse_args(argv)
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("WANDB_SILENT", "true")
    source = ModelStore.from_path(args.run_dir)
    with tempfile.TemporaryDirectory(prefix="bench-trackers-") as scratch:
        target = ModelStore(source.project, source.model, root=scratch)
        if 0 in source.checkpoint_steps():
            with target.write_checkpoint(0) as folder:
                shutil.copytree(source.checkpoint_path(0), folder, dirs_exist_ok=True)
        sync = TrackerSync(target, make_trackers(args.trackers), config={"bench": "trackers"})
        per_step: dict[str, list[float]] = {name: [] for name in [*args.trackers, "whole sync"]}
        for step in range(args.steps):
            replay_step(source, target, step)
            before = dict(sync.seconds)
            started = time.perf_counter()
            sync.sync()
            per_step["whole sync"].append(time.perf_counter() - started)
            for name in args.trackers:
                per_step[name].append(sync.seconds[name] - before[name])
        sync.close()
        adapter_mb = (
            sum(f.stat().st_size for f in source.checkpoint_path(1).rglob("*") if f.is_file()) / 2**20
        )
        rows = len(target.read_history())
        print(
            f"{args.steps} steps of {source.path}: {rows} history rows, one checkpoint of {adapter_mb:.1f} MiB "
            f"and {sum(len(target.steps(s)) for s in target.splits())} trajectory tables a tracker"
        )
        print(
            "| tracker | first step (opens the run), s | later steps, median s | later steps, max s | failures |"
        )
        print("|---|---|---|---|---|")
        for name, seconds in per_step.items():
            later = seconds[1:] or seconds
            print(
                f"| {name} | {seconds[0]:.2f} | {statistics.median(later):.3f} | {max(later):.3f} | "
                f"{sync.failures.get(name, 0)} |"
            )
        print(json.dumps({name: [round(s, 4) for s in seconds] for name, seconds in per_step.items()}))


if __name__ == "__main__":
    main()
