"""A chaos run beside its clean twin, as a picture: each run's rollout success per step with the
faults at their steps (by kind; a resume marked), how long each fault held the run up, and what
``bench.twins`` finds of the pair (rollouts shared token for token, adapters the same bytes) with
both runs' held-out success before and after.

    python -m bench.chaos_pair /tmp/pair/a/demo/clean /tmp/pair/b/demo/chaos --out bench/chaos_pair.png

The chaos run's faults come from ``<chaos folder>.chaos.json``, which ``bench.chaos`` writes.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from bench.chaos import KINDS
from bench.compare_demo_runs import read
from bench.twins import compare
from journeyman.backend.app.plots import pyplot, save

MARKERS = {"vllm": "v", "kill": "X", "interrupt": "s", "memory": "D", "judge": "^"}


def _success(rows: list[dict[str, Any]]) -> dict[int, float]:
    """Rollout success by step, counted from 1 (a step the run repeated after a resume: its last row)."""
    return {r["step"] + 1: r["rollouts/success"] for r in rows if r.get("split") == "rollouts"}


def _held_out(folder: Path) -> str:
    report = json.loads((folder / "demo_report.json").read_text())
    before, after = (report[when]["sampled"]["success"] for when in ("before", "after"))
    greedy = (report[when]["greedy"]["success"] for when in ("before", "after"))
    return f"held-out {before:.0%} -> {after:.0%} (greedy {' -> '.join(f'{g:.0%}' for g in greedy)})"


def plot(clean: Path, chaos: Path, out: Path) -> Path:
    plt = pyplot()
    faults_file = chaos.parent / f"{chaos.name}.chaos.json"
    if not faults_file.exists():
        raise SystemExit(f"no {faults_file}: the chaos run's faults, written by python -m bench.chaos")
    faults = [f for f in json.loads(faults_file.read_text()) if f["injected_at"] is not None]
    steps = compare(clean, chaos)
    shared, rollouts = sum(int(s["shared"]) for s in steps), sum(int(s["rollouts"]) for s in steps)
    same = sum(bool(s["same_adapter"]) for s in steps)

    figure, (axis, lost_axis) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [3, 2]})
    for name, folder, style in (("clean", clean, {"linewidth": 5, "alpha": 0.35}), ("chaos", chaos, {})):
        success = _success(read(folder))
        axis.plot(list(success), list(success.values()), color="C0" if name == "clean" else "black",
                  label=f"{name}: {_held_out(folder)}", **style)  # fmt: skip
    for k, kind in enumerate(KINDS):
        of_kind = [f for f in faults if f["kind"] == kind]
        if not of_kind:
            continue
        color = f"C{k + 1}"
        for fault in of_kind:
            axis.axvline(fault["step"], color=color, alpha=0.4, linewidth=1)
        axis.scatter([f["step"] for f in of_kind], [1.04] * len(of_kind), marker=MARKERS[kind], color=color,
                     s=60, label=f"{kind} ({len(of_kind)})", clip_on=False)  # fmt: skip
        lost_axis.bar([i for i, f in enumerate(faults) if f["kind"] == kind],
                      [f["recovered_after"] or 0 for f in of_kind], color=color, label=kind)  # fmt: skip
    axis.set(xlabel="step", ylabel="rollout success", ylim=(-0.02, 1.08),
             title=f"{shared}/{rollouts} rollouts the same token for token; {same}/{len(steps)} adapters "
             "the same bytes")  # fmt: skip
    axis.title.set_fontsize(10)
    axis.legend(loc="lower right", fontsize=8)
    lost_axis.set_xticks(range(len(faults)), [str(f["step"]) for f in faults])
    resumed = [i for i, f in enumerate(faults) if "resumed" in f["outcome"]]
    lost_axis.scatter(resumed, [3] * len(resumed), marker="*", color="white", edgecolors="black", linewidths=0.5,
                      s=60, zorder=3, label="the demo exited and was resumed")  # fmt: skip
    lost_axis.set(xlabel="fault, at step", ylabel="s from the fault to the next step done")
    lost_axis.legend(fontsize=8)
    return save(figure, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("clean", type=Path, help="the clean twin's model folder")
    parser.add_argument("chaos", type=Path, help="the chaos run's model folder")
    parser.add_argument("--out", type=Path, default=Path("bench/chaos_pair.png"))
    args = parser.parse_args()
    print(plot(args.clean, args.chaos, args.out))


if __name__ == "__main__":
    main()
