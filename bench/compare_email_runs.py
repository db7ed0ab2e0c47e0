"""Email-search runs side by side by minute of training: each step's rollout success by the known
answer (``programmatic_reward == 1``, kept on judged runs too), the reward the trainer saw, and the
trained tokens' entropy, from the model folder the example writes (``--root``/examples/``--name``).

    python -m bench.compare_email_runs --run judged=/tmp/em/judged/examples/judged \
        --run programmatic=/tmp/em/prog/examples/prog --out bench/judged_vs_programmatic_email.png
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path


def steps(folder: Path) -> list[dict[str, float]]:
    """One row per trained step: minutes since the first evaluation ended, success, reward, entropy."""
    history = [
        json.loads(line) for line in (folder / "history.jsonl").read_text().splitlines() if line.strip()
    ]
    start = datetime.datetime.fromisoformat(history[0]["time"])  # the evaluation before training
    rows = []
    for row in history:
        if row["split"] != "train":
            continue
        path = folder / "trajectories" / "train" / f"{row['step'] - 1:04d}.jsonl"
        trajectories = [t for line in path.read_text().splitlines() for t in json.loads(line)["trajectories"]]
        known = [t["metrics"].get("programmatic_reward", t["reward"]) for t in trajectories]
        rows.append({
            "minutes": (datetime.datetime.fromisoformat(row["time"]) - start).total_seconds() / 60,
            "success": sum(k == 1.0 for k in known) / len(known),
            "reward": row["reward/mean"],
            "entropy": row.get("train/entropy", float("nan")),
        })  # fmt: skip
    return rows


def plot(runs: dict[str, list[dict[str, float]]], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (axis, entropy_axis) = plt.subplots(1, 2, figsize=(13, 4.5), gridspec_kw={"width_ratios": [3, 2]})
    for k, (name, rows) in enumerate(runs.items()):
        minutes = [r["minutes"] for r in rows]
        axis.plot(minutes, [r["success"] for r in rows], color=f"C{k}", marker="o", ms=3,
                  label=f"{name}: success by the known answer")  # fmt: skip
        axis.plot(
            minutes, [r["reward"] for r in rows], color=f"C{k}", ls=":", label=f"{name}: reward trained on"
        )
        entropy_axis.plot(minutes, [r["entropy"] for r in rows], color=f"C{k}", marker="o", ms=3, label=name)
    axis.set(xlabel="minutes of training", ylabel="share of the step's 32 rollouts", ylim=(-0.03, 1.03),
             title="email search: training rollouts per step")  # fmt: skip
    entropy_axis.set(xlabel="minutes of training", ylabel="mean entropy of trained tokens (nats)",
                     title="policy entropy")  # fmt: skip
    axis.legend(fontsize=8)
    entropy_axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(out, dpi=110)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--run", action="append", required=True, help="name=model folder")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    runs = {name: steps(Path(folder)) for name, folder in (r.split("=", 1) for r in args.run)}
    for name, rows in runs.items():
        print(
            name, [(round(r["minutes"], 1), round(r["success"], 2), round(r["reward"], 2)) for r in rows[:14]]
        )
    print(plot(runs, args.out))


if __name__ == "__main__":
    main()
