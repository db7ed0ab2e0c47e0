"""The SkyPilot recipe, deploy/skypilot/journeyman-serve.yaml, read by SkyPilot itself.

SkyPilot cannot share the main environment (it requires click<8.2 and uvicorn<0.36), so the checks
run in a subprocess with the python of the environment that scripts/skypilot-env.sh builds (part of
``make setup``). They are offline and need no API server: ``sky.Task.from_yaml``, the loader that
``sky launch`` uses with its ``--secret`` values, and the launch's check that every secret without
a value was given one. No cloud is asked for anything.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

from journeyman.backend.models import EMBEDDED_MODELS
from journeyman.backend.settings import journeyman_home

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "deploy" / "skypilot" / "journeyman-serve.yaml"

READ_RECIPE = """
import json, sys
import sky
from sky import execution
from sky.utils import dag_utils

path = sys.argv[1]
task = sky.Task.from_yaml(path)
launches = {}
for label, secrets in {"no secret": [], "token": [("JOURNEYMAN_TOKEN", "t")],
                       "token and HF_TOKEN": [("JOURNEYMAN_TOKEN", "t"), ("HF_TOKEN", "h")]}.items():
    dag = dag_utils.load_chain_dag_from_yaml(path, secret_overrides=secrets or None)
    try:
        execution._resolve_managed_secrets(dag)
        error = None
    except RuntimeError as raised:
        error = str(raised)
    launches[label] = {"secrets": sorted(dag.tasks[0].secrets), "error": error}
print(json.dumps({
    "name": task.name, "envs": task.envs, "setup": task.setup, "run": task.run,
    "accelerators": sorted(name for r in task.resources for name in (r.accelerators or {})),
    "ports": sorted({port for r in task.resources for port in (r.ports or [])}),
    "launches": launches,
}))
"""


def skypilot_python() -> Path:
    """The python of SkyPilot's own environment; the tests skip without it (CI turns that into a failure)."""
    venv = Path(os.environ.get("JOURNEYMAN_SKYPILOT_VENV") or journeyman_home() / "venvs" / "skypilot")
    python = venv.expanduser() / "bin" / "python"
    if not python.exists():
        pytest.skip(f"no SkyPilot environment at {venv}: `make skypilot-env` (or `make setup`) builds it")
    return python


@pytest.fixture(scope="module")
def recipe(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """What SkyPilot reads in the recipe, once per run. SkyPilot's state goes to a fresh HOME, so
    the developer's ~/.sky (its config, its clusters) changes nothing."""
    env = {
        **os.environ,
        "HOME": str(tmp_path_factory.mktemp("sky-home")),
        "SKYPILOT_DISABLE_USAGE_COLLECTION": "1",
    }
    result = subprocess.run(
        [str(skypilot_python()), "-c", READ_RECIPE, str(RECIPE)],
        capture_output=True, text=True, timeout=120, env=env, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    read: dict[str, Any] = json.loads(result.stdout.splitlines()[-1])
    return read


def test_skypilot_reads_the_recipe(recipe: dict[str, Any]) -> None:
    assert recipe["name"] == "journeyman-serve"
    assert recipe["ports"] == ["8000"]
    assert {"L4", "H100"} <= set(recipe["accelerators"])
    envs = recipe["envs"]
    assert envs["BASE_MODEL"] in EMBEDDED_MODELS  # prepared at setup with `journeyman model prepare`
    assert envs["JOURNEYMAN_UNSLOTH"] == "0" and envs["HF_HUB_OFFLINE"] == "0"


def test_launch_needs_the_token_and_nothing_else(recipe: dict[str, Any]) -> None:
    launches = recipe["launches"]
    error = launches["no secret"]["error"]
    assert error is not None and "JOURNEYMAN_TOKEN" in error and "HF_TOKEN" not in error
    assert launches["token"] == {"secrets": ["JOURNEYMAN_TOKEN"], "error": None}
    # HF_TOKEN is optional: `--secret HF_TOKEN` adds it for a gated model
    assert launches["token and HF_TOKEN"] == {"secrets": ["HF_TOKEN", "JOURNEYMAN_TOKEN"], "error": None}


@pytest.mark.parametrize("section", ["setup", "run"])
def test_the_recipe_scripts_parse_and_name_files_that_exist(recipe: dict[str, Any], section: str) -> None:
    script = recipe[section]
    result = subprocess.run(["bash", "-n", "-c", script], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    for named in re.findall(r"[\w./-]*requirements/[\w.-]+", script):
        assert (ROOT / named).is_file(), f"the recipe's {section} names {named}, which does not exist"
