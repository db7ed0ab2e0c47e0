"""bench.twins: where two runs of one seed part, from their stored groups and checkpoints; and
bench.chaos_pair, which draws a chaos run beside its twin."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

import journeyman as jm
from bench.chaos import plan, write_faults
from bench.chaos_pair import plot
from bench.twins import ADAPTER, compare, table
from journeyman.store import ModelStore


def _run(root: Path, name: str, completions: list[list[list[int]]], adapters: list[bytes]) -> Path:
    """A run folder: per step, the rollouts' completions (one group), and the adapter it saved."""
    store = ModelStore("demo", name, root=root)
    for step, (rollouts, adapter) in enumerate(zip(completions, adapters, strict=True)):
        group = jm.TrajectoryGroup(
            jm.Trajectory(
                conversation=[
                    {"role": "user", "content": "3+4?"},
                    {
                        "type": "model_turn",
                        "message": {"role": "assistant", "content": "7"},
                        "prompt_token_ids": [1, 2],
                        "completion_token_ids": tokens,
                    },
                ],
                reward=1.0,
            )
            for tokens in rollouts
        )
        store.save_groups([group], "train", step)
        path = store.path / "checkpoints" / f"{step + 1:04d}" / ADAPTER
        path.parent.mkdir(parents=True)
        path.write_bytes(adapter)
    return store.path


def test_runs_that_sample_alike_in_any_order_are_one_run_until_they_part(tmp_path: Path) -> None:
    first = _run(tmp_path, "a", [[[5], [6]], [[7], [8]], [[9], [10]]], [b"w1", b"w2", b"w3"])
    # the same completions in another order, then one rollout apart and another adapter
    second = _run(tmp_path, "b", [[[6], [5]], [[7], [8]], [[9], [11]]], [b"w1", b"w2", b"w3'"])
    rows = compare(first, second)
    assert [(r["shared"], r["rollouts"], r["same_rewards"], r["same_adapter"]) for r in rows] == [
        (2, 2, True, True),
        (2, 2, True, True),
        (1, 2, False, False),
    ]
    assert [r["weight_difference"] for r in rows] == [0.0, 0.0, math.inf]  # not safetensors: no comparing
    text = table(rows)
    assert "| 1-2 | 4 | 4 (100%) | yes | yes | 0 |" in text and "| 3 | 2 | 1 (50%) | no | no | inf |" in text
    assert text.endswith("3 steps, 5/6 rollouts shared; the runs part at step 3")


def test_adapters_apart_by_float_sums_are_told_from_other_training(tmp_path: Path) -> None:
    from safetensors.numpy import save

    weights = np.array([[0.5, -0.25], [1e-3, 2.0]], dtype=np.float32)
    nudged = weights.copy()
    nudged[1, 0] = np.nextafter(nudged[1, 0], np.float32(1))  # the last bit of one weight
    first = _run(tmp_path, "a", [[[5]]], [save({"lora_A": weights})])
    second = _run(tmp_path, "b", [[[5]]], [save({"lora_A": nudged})])
    (row,) = compare(first, second)
    assert not row["same_adapter"] and 0 < row["weight_difference"] < 1e-9
    assert row["same_rewards"]
    third = _run(tmp_path, "c", [[[5]]], [save({"lora_A": weights + 2e-4})])
    assert compare(first, third)[0]["weight_difference"] == pytest.approx(2e-4, rel=1e-3)


def test_the_comparison_ends_where_either_run_has_no_checkpoint(tmp_path: Path) -> None:
    first = _run(tmp_path, "a", [[[5]], [[6]]], [b"w1", b"w2"])
    second = _run(tmp_path, "b", [[[5]]], [b"w1"])
    rows = compare(first, second)
    assert len(rows) == 1
    assert table(rows).endswith("the runs never part")


def test_chaos_pair_draws_a_run_beside_its_twin_with_its_faults(tmp_path: Path) -> None:
    clean = _run(tmp_path, "clean", [[[5]], [[6]]], [b"w1", b"w2"])
    chaos = _run(tmp_path, "chaos", [[[5]], [[6]]], [b"w1", b"w2"])
    for folder in (clean, chaos):
        store = ModelStore.from_path(folder)
        for step, success in enumerate([0.25, 0.75]):
            store.append_history({"step": step, "split": "rollouts", "rollouts/success": success})
        report = {
            when: {"sampled": {"success": s}, "greedy": {"success": s}}
            for when, s in [("before", 0.2), ("after", 0.6)]
        }
        (folder / "demo_report.json").write_text(json.dumps(report))
    with pytest.raises(SystemExit, match=r"chaos\.chaos\.json"):
        plot(clean, chaos, tmp_path / "pair.png")
    faults = plan(2, 2, ["kill", "judge"], seed=0, max_delay=1.0)
    for fault, outcome in zip(faults, ["demo exited -9, resumed", "carried on"], strict=True):
        fault.injected_at, fault.recovered_after, fault.outcome = 1.0, 60.0, outcome
    write_faults(faults, chaos.parent / "chaos.chaos.json")
    assert [f["step"] for f in json.loads((chaos.parent / "chaos.chaos.json").read_text())] == [1, 2]
    out = plot(clean, chaos, tmp_path / "pair.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
