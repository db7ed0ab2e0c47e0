"""examples/langgraph_calculator/train.py runs end to end with tiny flags."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import journeyman as jm

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "langgraph_calculator" / "train.py"


def test_langgraph_calculator_example_trains_one_step(tmp_path: Path) -> None:
    flags = [
        "--steps",
        "1",
        "--scenarios-per-step",
        "2",
        "--group-size",
        "2",
        "--val",
        "2",
        "--val-samples",
        "1",
    ]
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *flags, "--max-tokens", "40", "--root", str(tmp_path)],
        capture_output=True, text=True, timeout=900, env={**os.environ, "HF_HUB_OFFLINE": "1"}, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "held-out success:" in done.stdout and "step 1: reward" in done.stdout
    store = jm.ModelStore("examples", "calc-agent", root=tmp_path)
    assert store.checkpoint_steps()[-1] == 1
    assert store.steps("val") == [0, 1] and len(store.load_groups("train", 0)) == 2
