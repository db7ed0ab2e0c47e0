"""Rollouts overlapping training: steps per minute, seconds per phase, policy lag and held-out
success of demo runs side by side (``max_steps_off_policy`` 0 against 1).

Run the demos one at a time (each alone on the machine), then table them::

    journeyman demo --steps 1000 --max-train-minutes 20 --no-zero-shot-eval --tool-seconds 1 \\
      --seed 0 --name tool-k0-s0 --root /tmp/overlap
    journeyman demo --steps 1000 --max-train-minutes 20 --no-zero-shot-eval --tool-seconds 1 \\
      --seed 0 --name tool-k1-s0 --root /tmp/overlap \\
      --max-steps-off-policy 1 --vllm-cores 1 --trainer-threads 1
    python -m bench.overlap /tmp/overlap/demo/tool-k0-s0 /tmp/overlap/demo/tool-k1-s0
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from journeyman.store import ModelStore


def summary(run_dir: Path) -> dict[str, Any]:
    """One run's numbers from its history and report."""
    store = ModelStore.from_path(run_dir)
    rows = store.read_history()
    rollouts = sorted((r for r in rows if r.get("split") == "rollouts"), key=lambda r: r["step"])
    trained = [r for r in rows if r.get("split") == "train"]
    config = json.loads((run_dir / "demo_config.json").read_text())
    report_path = run_dir / "demo_report.json"
    report = json.loads(report_path.read_text()) if report_path.exists() else {}
    minutes = max((float(r.get("elapsed_s", 0.0)) for r in rollouts), default=0.0) / 60
    ends = [float(r["elapsed_s"]) for r in rollouts if "elapsed_s" in r]
    walls = [b - a for a, b in zip([0.0, *ends], ends, strict=False)]

    def mean(key: str, among: list[dict[str, Any]]) -> float:
        values = [float(r[key]) for r in among if key in r]
        return statistics.fmean(values) if values else float("nan")

    def success(when: str, part: str) -> float:
        return float(report.get(when, {}).get(part, {}).get("success", float("nan")))

    return {
        "run": run_dir.name
        if run_dir.parent.name != "demo"
        else f"{run_dir.parent.parent.name}/{run_dir.name}",
        "k": int(config.get("max_steps_off_policy", 0)),
        "tool_s": float(config.get("tool_seconds", 0.0)),
        "seed": int(config.get("seed", 0)),
        "steps": len(rollouts),
        "minutes": minutes,
        "steps_per_min": len(rollouts) / minutes if minutes else float("nan"),
        "step_s": statistics.fmean(walls) if walls else float("nan"),
        "rollout_s": mean("rollouts/seconds", rollouts),
        "train_s": statistics.fmean(
            sum(float(v) for k, v in r.items() if k.startswith("time/")) for r in trained
        )
        if trained
        else float("nan"),
        "lag_max": max((float(r.get("rollouts/off_policy_max", 0.0)) for r in rollouts), default=0.0),
        "lag_mean": mean("rollouts/off_policy_mean", rollouts),
        "failures": sum(float(r.get("rollouts/failures", 0.0)) for r in rollouts),
        "train_success": mean("rollouts/success", rollouts[-5:]),
        "before": (success("before", "sampled"), success("before", "greedy")),
        "after": (success("after", "sampled"), success("after", "greedy")),
    }


def table(runs: list[dict[str, Any]]) -> str:
    lines = [
        "| run | k | tool wait | steps | training min | steps/min | s/step | rollout s/step | train s/step "
        "| lag max (mean) | rollout failures | success last 5 steps | held-out before -> after (sampled; greedy) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        (bs, bg), (as_, ag) = r["before"], r["after"]
        lines.append(
            f"| {r['run']} | {r['k']} | {r['tool_s']:.0f} s | {r['steps']} | {r['minutes']:.1f} | "
            f"{r['steps_per_min']:.2f} | {r['step_s']:.1f} | {r['rollout_s']:.1f} | {r['train_s']:.1f} | "
            f"{r['lag_max']:.0f} ({r['lag_mean']:.2f}) | {r['failures']:.0f} | {r['train_success']:.2f} | "
            f"{bs:.2f} -> {as_:.2f}; {bg:.2f} -> {ag:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run folders (ROOT/demo/NAME)")
    args = parser.parse_args()
    runs = [summary(path) for path in args.runs]
    print(table(runs))
    print()
    print(ratios(runs))


def ratios(runs: list[dict[str, Any]]) -> str:
    """Each overlapping run's steps per minute against the k=0 run of the same tool wait and seed."""
    alone = {(r["tool_s"], r["seed"]): r for r in runs if r["k"] == 0}
    lines = []
    for r in runs:
        if r["k"] > 0 and (base := alone.get((r["tool_s"], r["seed"]))) is not None:
            ratio = r["steps_per_min"] / base["steps_per_min"]
            lines.append(f"{r['run']}: {ratio:.2f}x the steps per minute of {base['run']}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
