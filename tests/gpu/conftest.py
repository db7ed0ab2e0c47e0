"""The GPU check's fixtures: the device, the models built from their configs, and the table of
measurements ``scripts/gpu_check.py`` prints (written to ``$JOURNEYMAN_GPU_CHECK_OUT/results.json``).

Without CUDA every test here skips, unless ``JOURNEYMAN_GPU_CHECK_DEVICE=cpu`` runs the trainer
part on the CPU with a tiny model (how its code is tested without a GPU).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.gpu.checks import TOKENIZER_SOURCES, build_model, copy_tokenizer

ROOT = Path(__file__).parents[2]
OUT = Path(os.environ.get("JOURNEYMAN_GPU_CHECK_OUT", ROOT / "build" / "gpu-check"))
TOKENIZERS = Path(
    os.environ.get("JOURNEYMAN_GPU_CHECK_TOKENIZERS", ROOT / "build" / "gpu-check" / "tokenizers")
)
ON_CPU = os.environ.get("JOURNEYMAN_GPU_CHECK_DEVICE") == "cpu"
RESULTS: dict[str, list[dict[str, Any]]] = {}


@pytest.fixture(scope="session")
def device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", 0)
    if ON_CPU:
        return torch.device("cpu")
    pytest.skip("needs a CUDA GPU (JOURNEYMAN_GPU_CHECK_DEVICE=cpu runs the trainer part on the CPU, tiny)")


@pytest.fixture(scope="session")
def shapes(device: torch.device) -> list[str]:
    return ["tiny"] if device.type == "cpu" else ["smollm2-135m", "qwen2.5-0.5b", "qwen2.5-1.5b"]


@pytest.fixture(scope="session")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tokenizer files by name (``smollm2``, ``qwen``): the ones ``scripts/gpu_check.py prepare``
    copied, else the embedded models' own where they are prepared on this machine."""
    if TOKENIZERS.is_dir():
        return TOKENIZERS
    from journeyman.backend.models import prepared_folder

    folder = tmp_path_factory.mktemp("tokenizers")
    for name, alias in TOKENIZER_SOURCES.items():
        prepared = prepared_folder(alias)
        if prepared is None:
            pytest.skip(f"no tokenizer files: run `python scripts/gpu_check.py prepare` (or prepare {alias})")
        copy_tokenizer(prepared, folder / name)
    return folder


@pytest.fixture(scope="session")
def models(tokenizers: Path, device: torch.device, tmp_path_factory: pytest.TempPathFactory) -> Any:
    folder = tmp_path_factory.mktemp("models")

    def model(shape: str) -> Path:
        return build_model(shape, folder / shape, tokenizers, device)

    return model


@pytest.fixture(scope="session")
def record() -> Iterator[Any]:
    """``record(table, row)``: a row of a table the check prints."""

    def add(table: str, row: dict[str, Any]) -> None:
        RESULTS.setdefault(table, []).append(row)

    yield add
    if RESULTS:
        OUT.mkdir(parents=True, exist_ok=True)
        (OUT / "results.json").write_text(json.dumps(RESULTS, indent=2, default=str) + "\n")
