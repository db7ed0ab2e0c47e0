"""The GPU check's own code, run here: its trainer part on the CPU with a tiny model, through the
same command a GPU machine runs (``make gpu-check``), printing its tables."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]


def test_the_gpu_check_runs_its_trainer_part_on_the_cpu_and_prints_its_tables(tmp_path: Path) -> None:
    env = {**os.environ, "OUT": str(tmp_path), "CI": ""}  # its own tests' skips are its to report
    done = subprocess.run(
        [sys.executable, "scripts/gpu_check.py", "run", "--cpu"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert [row["shape"] for row in results["step"]] == ["tiny"]
    packing = {row["compared"]: row for row in results["packing"]}
    assert packing["one packed row"]["max_abs_diff"] < 1e-3 and packing["one packed row"]["tokens"] == 450
    for heading in ("## Versions", "## step", "## packing", "## trl"):
        assert heading in done.stdout
    assert "the serving part needs a CUDA GPU" in done.stdout  # what it skipped, said
