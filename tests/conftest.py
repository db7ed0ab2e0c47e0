"""Shared test set-up: offline, tiers marked by folder, one prepared model per run."""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

_TIERS = {"unit": "unit", "integration": "integration", "faults": "faults", "gpu": "gpu"}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "unit: no model, no server; seconds")
    config.addinivalue_line("markers", "integration: the real small model, real servers and frameworks")
    config.addinivalue_line("markers", "faults: injected faults, bad input, security (some start vLLM)")
    config.addinivalue_line("markers", "gpu: needs CUDA; skipped without it")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        tier = Path(str(item.fspath)).relative_to(Path(__file__).parent).parts[0]
        if tier in _TIERS:
            item.add_marker(getattr(pytest.mark, _TIERS[tier]))


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """The embedded default model, converted once (a no-op when `make setup` already did it)."""
    from journeyman.backend.models import prepare_model

    return prepare_model("smollm2-135m")


@pytest.fixture(autouse=True)
def _give_memory_back(request: pytest.FixtureRequest) -> Iterator[None]:
    """After each model-loading test, free its models and return the freed heap to the system:
    glibc keeps it otherwise, and the run's vLLM servers and the 0.5B trainer need it (24 GiB)."""
    yield
    if request.node.get_closest_marker("unit") is None:
        from journeyman.backend.training.memory import release_memory

        gc.collect()
        release_memory()
