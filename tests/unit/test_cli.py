from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

import journeyman as jm
from journeyman.backend.app.cli import app
from journeyman.errors import MissingDependencyError
from journeyman.store import ModelStore

runner = CliRunner()


def _store(tmp_path: Path) -> ModelStore:
    store = ModelStore("demo", "agent", root=tmp_path)
    for step in range(3):
        with store.write_checkpoint(step) as folder:
            (folder / "trainer_state.json").write_text(
                json.dumps({"metrics": {"reward/mean": step / 4, "train/loss": 1 - step / 4}})
            )
        if step:
            store.append_history(
                {"step": step, "split": "train", "reward/mean": step / 4, "train/loss": 1 - step / 4}
            )
            store.append_history({"step": step, "split": "val", "val/reward": [0.0, 0.8, 0.3][step]})
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
    trajectory = jm.Trajectory(
        conversation=[
            {"role": "user", "content": "What is 2+3?"},
            {"type": "model_turn", "message": {"role": "assistant", "tool_calls": [call]}},
            {"role": "tool", "tool_call_id": "c1", "content": "5"},
            {"role": "assistant", "content": "[5] is the answer"},
        ],
        reward=1.0,
        logs=["judge: correct"],
    )
    group = jm.TrajectoryGroup([trajectory])
    group.record_failure(TimeoutError("tool timed out"), stage="tool")
    store.save_groups([group], "train", 1)
    return store


def test_checkpoints_list_and_prune(tmp_path: Path) -> None:
    store = _store(tmp_path)
    listed = runner.invoke(app, ["checkpoints", "list", "demo", "agent", "--root", str(tmp_path)])
    assert listed.exit_code == 0, listed.output
    assert all(f"│ {step}" in listed.output for step in range(3)) and "0.500" in listed.output
    pruned = runner.invoke(app, ["checkpoints", "prune", "demo", "agent", "--root", str(tmp_path)])
    assert pruned.exit_code == 0, pruned.output
    assert "deleted steps [0]; kept [1, 2]" in pruned.output
    assert store.checkpoint_steps() == [1, 2]


def test_plot_writes_a_png(tmp_path: Path) -> None:
    _store(tmp_path)
    out = tmp_path / "curves.png"
    result = runner.invoke(app, ["plot", "demo", "agent", "--root", str(tmp_path), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_plot_without_matplotlib_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _store(tmp_path)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what `import matplotlib` meets when it is missing
    result = runner.invoke(app, ["plot", "demo", "agent", "--root", str(tmp_path)])
    assert isinstance(result.exception, MissingDependencyError)
    assert 'pip install "./journeyman[bench]"' in str(result.exception)


def test_trajectories_show_prints_the_conversation(tmp_path: Path) -> None:
    _store(tmp_path)
    result = runner.invoke(app, ["trajectories", "show", "demo", "agent", "--root", str(tmp_path)])
    assert result.exit_code == 0, result.output
    for expected in ["reward 1.000", "user: What is 2+3?", '→ add({"a": 2, "b": 3})', "tool: 5",
                     "assistant: [5] is the answer", "log: judge: correct", "failure (tool): TimeoutError"]:  # fmt: skip
        assert expected in result.output, expected
    missing = runner.invoke(
        app, ["trajectories", "show", "demo", "agent", "--split", "val", "--root", str(tmp_path)]
    )
    assert missing.exit_code != 0


def test_serve_fsdp_outside_torchrun_says_how_to_launch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    result = runner.invoke(app, ["serve", "--fsdp", "--root", str(tmp_path)])
    assert result.exit_code == 2
    assert "torchrun" in result.output


def test_demo_resume_needs_a_run_folder_and_takes_its_settings(tmp_path: Path) -> None:
    from journeyman.backend.app.demo import CONFIG_FILE, DemoConfig, resume_config

    result = runner.invoke(app, ["demo", "--resume", str(tmp_path)])
    assert isinstance(result.exception, jm.ConfigError) and CONFIG_FILE in str(result.exception)
    run_dir = tmp_path / "root" / "demo" / "calc-1"
    run_dir.mkdir(parents=True)
    saved = {
        "steps": 7,
        "group_size": 4,
        "root": "/elsewhere",
        "project": "demo",
        "name": "calc-1",
        "seed": 3,
    }
    (run_dir / CONFIG_FILE).write_text(json.dumps(saved))
    config = resume_config(run_dir)
    assert config == DemoConfig(
        steps=7, group_size=4, seed=3, root=run_dir.parents[1].resolve(), name="calc-1"
    )


def test_demo_sampling_seed_reaches_the_config_and_a_resume(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from journeyman.backend.app import demo
    from journeyman.backend.app.demo import CONFIG_FILE, resume_config

    seen: list[Any] = []
    monkeypatch.setattr(demo, "run_demo", lambda config, **_: seen.append(config))
    result = runner.invoke(app, ["demo", "--seed", "3", "--sampling-seed", "7", "--name", "s"])
    assert result.exit_code == 0, result.output
    assert (seen[0].seed, seen[0].sampling_seed) == (3, 7)
    runner.invoke(app, ["demo", "--seed", "3", "--name", "s"])
    assert seen[1].sampling_seed is None  # the rollouts then sample with --seed
    run_dir = tmp_path / "demo" / "s"
    run_dir.mkdir(parents=True)
    (run_dir / CONFIG_FILE).write_text(json.dumps({"name": "s", "seed": 3, "sampling_seed": 7}))
    assert resume_config(run_dir).sampling_seed == 7
