"""`journeyman demo` end to end with tiny settings: real vLLM, LangGraph, trainer and redeploy."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

import journeyman as jm
from journeyman.backend.cli import app

TINY = ["--steps", "1", "--scenarios-per-step", "2", "--group-size", "2", "--train-scenarios", "2",
        "--val-scenarios", "2", "--val-samples", "1", "--max-tokens", "40", "--name", "smoke"]  # fmt: skip


def test_demo_evaluates_trains_redeploys_and_reports(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["demo", *TINY, "--root", str(tmp_path)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "held-out success" in result.output and "held-out evaluation" in result.output
    store = jm.ModelStore("demo", "smoke", root=tmp_path)
    report = json.loads((store.path / "demo_report.json").read_text())
    assert report["before"]["step"] == 0 and report["after"]["step"] == 1
    for part in ("sampled", "greedy", "zero_shot"):
        assert report["after"][part]["n"] == 2 and 0 <= report["after"][part].get("success", 0) <= 1
    assert store.checkpoint_steps()[-1] == 1
    assert Path(report["png"]).read_bytes()[:4] == b"\x89PNG"
    # Trajectories on disk: the training groups and each evaluation, captured token-exact.
    train = store.load_groups("train", 0)
    assert len(train) == 2 and all(len(g) + len(g.failures) == 2 for g in train)
    for split in ("val", "val_greedy", "val_zero_shot"):
        assert store.steps(split) == [0, 1]
    turns = [turn for g in train for t in g for turn in t.model_turns]
    assert turns and all(turn.is_token_exact for turn in turns)
    served = {r.get("rollouts/n") for r in store.read_history() if r.get("split") == "rollouts"}
    assert served == {4.0}
