"""How far two runs of one seed stay the same run: rollouts shared token for token, and whether
their checkpoints are the same bytes, step by step.

A resumed run that repeats its twin exactly samples the same tokens at every step (each group's
rollouts compared as a multiset: the same completions, in any order) and saves the same adapter.
Prints one row per stretch of steps that agree alike, and the first step where they part.

    python -m bench.twins /tmp/pair-clean/demo/clean /tmp/pair-chaos/demo/chaos
"""

from __future__ import annotations

import argparse
import itertools
import math
from collections import Counter
from pathlib import Path

import journeyman as jm
from journeyman.store import ModelStore

ADAPTER = Path("adapter") / "adapter_model.safetensors"


def _tokens(trajectory: jm.Trajectory) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(turn.completion_token_ids) for turn in trajectory.model_turns)


def _rollouts(group: jm.TrajectoryGroup) -> Counter[tuple[tuple[int, ...], ...]]:
    return Counter(_tokens(t) for t in group)


def _rewarded(group: jm.TrajectoryGroup) -> Counter[tuple[object, ...]]:
    """Each rollout's tokens with its reward: two groups rewarded alike give the same multiset."""
    return Counter((_tokens(t), t.reward) for t in group)


def _largest_difference(first: bytes, second: bytes) -> float:
    """The largest absolute difference between two adapters' weights (inf when they cannot be
    compared: not safetensors, or other tensors)."""
    if first == second:
        return 0.0
    try:
        from safetensors.numpy import load

        a, b = load(first), load(second)
    except Exception:
        return math.inf
    if a.keys() != b.keys() or any(a[k].shape != b[k].shape for k in a):
        return math.inf
    return max(
        (float(abs(a[k].astype("float64") - b[k].astype("float64")).max()) for k in a if a[k].size),
        default=0.0,
    )


def compare(first: Path, second: Path) -> list[dict[str, int | bool | float]]:
    """Per trained step: rollouts, how many of them both runs sampled, whether each group was
    rewarded alike, whether the checkpoint the step saved (``checkpoints/<step + 1>``) is byte for
    byte the same, and the largest difference between its weights."""
    runs = [ModelStore.from_path(path) for path in (first, second)]
    rows: list[dict[str, int | bool | float]] = []
    for step in itertools.count():
        if not all((run.path / "checkpoints" / f"{step + 1:04d}").is_dir() for run in runs):
            return rows
        a, b = (run.load_groups("train", step) for run in runs)
        shared = sum(sum((_rollouts(x) & _rollouts(y)).values()) for x, y in zip(a, b, strict=True))
        adapters = [(run.path / "checkpoints" / f"{step + 1:04d}" / ADAPTER).read_bytes() for run in runs]
        rows.append(
            {
                "step": step,
                "rollouts": sum(len(g) for g in a),
                "shared": shared,
                "same_rewards": all(_rewarded(x) == _rewarded(y) for x, y in zip(a, b, strict=True)),
                "same_adapter": adapters[0] == adapters[1],
                "weight_difference": _largest_difference(*adapters),
            }
        )


def table(rows: list[dict[str, int | bool | float]]) -> str:
    lines = [
        "| steps | rollouts | shared token for token | rewarded alike | adapters the same bytes | "
        "largest weight difference |",
        "|---|---|---|---|---|---|",
    ]
    for (_all_shared, rewarded, equal), stretch in itertools.groupby(
        rows, key=lambda r: (r["shared"] == r["rollouts"], r.get("same_rewards", True), r["same_adapter"])
    ):
        part = list(stretch)
        rollouts, shared = sum(int(r["rollouts"]) for r in part), sum(int(r["shared"]) for r in part)
        steps = f"{part[0]['step'] + 1}-{part[-1]['step'] + 1}" if len(part) > 1 else f"{part[0]['step'] + 1}"
        largest = max(float(r.get("weight_difference", 0.0)) for r in part)
        lines.append(
            f"| {steps} | {rollouts} | {shared} ({shared / max(rollouts, 1):.0%}) | "
            f"{'yes' if rewarded else 'no'} | {'yes' if equal else 'no'} | {largest:.3g} |"
        )
    parted = next((r["step"] for r in rows if r["shared"] != r["rollouts"] or not r["same_adapter"]), None)
    total, shared = sum(int(r["rollouts"]) for r in rows), sum(int(r["shared"]) for r in rows)
    lines += ["", f"{len(rows)} steps, {shared}/{total} rollouts shared; "
              + (f"the runs part at step {int(parted) + 1}" if parted is not None else "the runs never part")]  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("first", type=Path, help="a run folder (ROOT/demo/NAME)")
    parser.add_argument("second", type=Path)
    args = parser.parse_args()
    print(table(compare(args.first, args.second)))


if __name__ == "__main__":
    main()
