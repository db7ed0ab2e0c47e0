"""``journeyman cloud`` against SkyPilot itself, in its own environment: the launch it would make
checked against the recipe SkyPilot validates, and its calls to SkyPilot's local API server (which
SkyPilot starts), which has no cloud enabled here. A real launch needs a cloud account: none is
reachable from this project's machines, so no test launches one."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

import journeyman as jm
from journeyman.backend.app.cli import app
from journeyman.backend.app.cloud import CloudServe, SkyPilotBackend, source_tree
from tests.integration.test_skypilot_recipe import recipe, skypilot_python

ROOT = Path(__file__).resolve().parents[2]


__all__ = ["recipe"]  # the recipe as SkyPilot reads it (a fixture of the recipe's tests)


@pytest.fixture(scope="module")
def skypilot(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """SkyPilot's python, its state in a fresh HOME (the developer's ~/.sky changes nothing); the
    local API server the calls start is stopped after the module."""
    python = skypilot_python()
    saved = {name: os.environ.get(name) for name in ("HOME", "JOURNEYMAN_SKYPILOT_VENV")}
    os.environ["JOURNEYMAN_SKYPILOT_VENV"] = str(python.parents[1])  # found from the new HOME too
    os.environ["HOME"] = str(tmp_path_factory.mktemp("sky-home"))
    try:
        yield python
    finally:
        subprocess.run(
            [str(python.parent / "sky"), "api", "stop"], capture_output=True, timeout=120,
            env={**os.environ, "SKYPILOT_DISABLE_USAGE_COLLECTION": "1"},
        )  # fmt: skip
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def test_the_launch_is_the_recipe_with_the_settings_given(skypilot: Path, recipe: dict[str, Any]) -> None:
    serve = CloudServe(
        base_model="qwen2.5-coder-0.5b",
        gpus="H100:1",
        trainers=2,
        report_to=["wandb", "mlflow"],
        python=skypilot,
    )
    plan = serve.call("plan", timeout=120)
    assert plan["name"] == recipe["name"] and plan["ports"] == ["8000"]
    assert plan["workdir"] == str(source_tree()) == str(ROOT)  # the node installs this tree
    assert plan["accelerators"] == ["H100"]  # instead of the recipe's choice
    assert plan["envs"] == {**recipe["envs"], "BASE_MODEL": "qwen2.5-coder-0.5b", "NUM_TRAINERS": "2",
                            "JOURNEYMAN_UNSLOTH": "0", "REPORT_TO": "wandb mlflow"}  # fmt: skip
    assert plan["secrets"] == ["JOURNEYMAN_TOKEN", "WANDB_API_KEY"]  # W&B's key only where W&B follows runs
    assert CloudServe(python=skypilot).call("plan", timeout=120)["accelerators"] == sorted(
        recipe["accelerators"]
    )
    assert "--report-to" in recipe["run"] and "$REPORT_TO" in recipe["setup"]


def test_without_a_cloud_up_says_how_to_enable_one_and_status_finds_no_cluster(
    skypilot: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("JOURNEYMAN_TOKEN", raising=False)
    with pytest.raises(jm.ConfigError, match="export JOURNEYMAN_TOKEN"):
        CloudServe(python=skypilot).up()  # before any call
    monkeypatch.setenv("JOURNEYMAN_TOKEN", "t0ken")
    monkeypatch.setenv("JOURNEYMAN_SKYPILOT_VENV", str(skypilot.parents[1]))
    with pytest.raises(jm.ConfigError, match=r"SkyPilot has no cloud enabled: install your cloud's extra"):
        CloudServe(cluster="jm-test").up()  # asked SkyPilot's API server, which it started
    assert CloudServe(cluster="jm-test").status() == {"status": None, "endpoint": None}
    result = CliRunner().invoke(app, ["cloud", "status", "--cluster", "jm-test"])
    assert result.exit_code == 0 and "jm-test: no such cluster" in result.output
    result = CliRunner().invoke(app, ["cloud", "up", "--cluster", "jm-test"])
    assert result.exit_code != 0 and "no cloud enabled" in str(result.exception)


async def test_skypilot_backend_launch_stops_at_the_same_message(
    skypilot: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("JOURNEYMAN_TOKEN", "t0ken")
    with pytest.raises(jm.ConfigError, match="SkyPilot has no cloud enabled"):
        await SkyPilotBackend.launch(CloudServe(cluster="jm-test", python=skypilot))


def test_a_missing_skypilot_environment_says_how_to_build_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("JOURNEYMAN_SKYPILOT_VENV", str(tmp_path / "none"))
    with pytest.raises(jm.ConfigError, match=r"no SkyPilot environment at .*scripts/skypilot-env.sh"):
        CloudServe().status()
