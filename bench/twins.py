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
from collections import Counter
from pathlib import Path

import journeyman as jm
from journeyman.store import ModelStore

ADAPTER = Path("adapter") / "adapter_model.safetensors"


def _rollouts(group: jm.TrajectoryGroup) -> Counter[tuple[tuple[int, ...], ...]]:
    return Counter(tuple(tuple(turn.completion_token_ids) for turn in t.model_turns) for t in group)


def compare(first: Path, second: Path) -> list[dict[str, int | bool]]:
    """Per trained step: rollouts, how many of them both runs sampled, and whether the
    checkpoint the step saved (``checkpoints/<step + 1>``) is byte for byte the same."""
    runs = [ModelStore.from_path(path) for path in (first, second)]
    rows: list[dict[str, int | bool]] = []
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
                "same_adapter": adapters[0] == adapters[1],
            }
        )


def table(rows: list[dict[str, int | bool]]) -> str:
    lines = ["| steps | rollouts | shared token for token | adapters the same bytes |", "|---|---|---|---|"]
    for (_all_shared, equal), stretch in itertools.groupby(
        rows, key=lambda r: (r["shared"] == r["rollouts"], r["same_adapter"])
    ):
        part = list(stretch)
        rollouts, shared = sum(int(r["rollouts"]) for r in part), sum(int(r["shared"]) for r in part)
        steps = f"{part[0]['step'] + 1}-{part[-1]['step'] + 1}" if len(part) > 1 else f"{part[0]['step'] + 1}"
        lines.append(
            f"| {steps} | {rollouts} | {shared} ({shared / max(rollouts, 1):.0%}) | {'yes' if equal else 'no'} |"
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
