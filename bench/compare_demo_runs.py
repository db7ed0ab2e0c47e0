"""Demo runs side by side by minute of training: each run's rollout success per step (against the
minutes it had trained when the step ended), its held-out success before and after, and the
policy's entropy on the tokens it trained on (a policy that collapses to one answer shows there
first), from the ``history.jsonl`` its model folder keeps. For runs with the same minutes and seed but another
reward (``journeyman demo --judge ruler`` next to the programmatic check).

    python -m bench.compare_demo_runs --run judged=/tmp/runs/demo/judged30 \
        --run programmatic=/tmp/runs/demo/prog30 --out bench/judged_vs_programmatic_demo.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from journeyman.backend.app.plots import pyplot, save


def read(folder: Path) -> list[dict[str, Any]]:
    path = folder / "history.jsonl"
    if not path.exists():
        raise SystemExit(f"no {path}: give the demo's model folder (journeyman demo prints it)")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot(runs: dict[str, list[dict[str, Any]]], out: Path) -> Path:
    plt = pyplot()
    figure, (axis, entropy_axis) = plt.subplots(1, 2, figsize=(13, 4.5), gridspec_kw={"width_ratios": [3, 2]})
    for k, (name, rows) in enumerate(runs.items()):
        color = f"C{k}"
        steps = [
            r for r in rows if r.get("split") == "rollouts" and "elapsed_s" in r
        ]  # a restored row: no time
        minutes = [r["elapsed_s"] / 60 for r in steps]
        axis.plot(
            minutes,
            [r["rollouts/success"] for r in steps],
            color=color,
            marker=".",
            label=f"{name}: training rollouts",
        )
        held_out = [r["val/success"] for r in rows if r.get("split") == "val"]
        if len(held_out) >= 2 and minutes:
            axis.plot([0, minutes[-1]], [held_out[0], held_out[-1]], color=color, marker="s", linestyle="--",
                      label=f"{name}: held-out {held_out[0]:.0%} -> {held_out[-1]:.0%}")  # fmt: skip
        at = {r["step"]: r["elapsed_s"] / 60 for r in steps}
        trained = [
            (at[r["step"]], r["train/entropy"]) for r in rows if "train/entropy" in r and r["step"] in at
        ]
        if trained:
            entropy_axis.plot(*zip(*trained, strict=True), color=color, marker=".", label=name)
    axis.set(xlabel="minutes of training", ylabel="success rate", ylim=(-0.02, 1.02))
    axis.legend(loc="lower right", fontsize=8)
    entropy_axis.set(xlabel="minutes of training", ylabel="entropy (nats a trained token)", ylim=(0, None))
    entropy_axis.legend(fontsize=8)
    return save(figure, out)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", action="append", required=True, help="NAME=MODEL_FOLDER, once per run")
    parser.add_argument("--out", type=Path, default=Path("bench/judged_vs_programmatic_demo.png"))
    args = parser.parse_args()
    if any("=" not in run for run in args.run):
        parser.error("--run takes NAME=MODEL_FOLDER, e.g. --run judged=/tmp/runs/demo/judged30")
    runs = {name: read(Path(folder)) for name, folder in (run.split("=", 1) for run in args.run)}
    print(f"plot: {plot(runs, args.out)}")
