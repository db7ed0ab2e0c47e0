"""Shared test set-up: offline, tiers marked by folder, the slow tier run last, one prepared model per
run, Hypothesis derandomized in CI, and a skip that CI does not expect made a failure."""

from __future__ import annotations

import gc
import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

_TIERS = {"unit": "unit", "integration": "integration", "faults": "faults", "gpu": "gpu"}

IN_CI = bool(os.environ.get("CI"))
"""CI sets ``CI`` (any value): its runs are derandomized and may skip only what it expects."""

EXPECTED_SKIPS: dict[str, str] = {
    r"needs a CUDA GPU": "CI's machine has no GPU",
    r"the plugin serves vLLM's CPU backend": "a CPU-only check, skipped where CUDA serves",
    r"to run against a real Langfuse": "CI holds no keys of a live Langfuse",
    r"to run against a live W&B": "CI holds no W&B key",
}
"""The skips CI expects, as a pattern of the skip's reason -> why CI expects it. In CI, a test
skipped for any other reason fails: a missing browser, package or device file would otherwise go
unnoticed while its tests pass by not running. A feature whose tests skip somewhere on purpose adds
its entry here."""

# Property tests: in CI the same examples every run (a failure there fails again on the next run);
# elsewhere random ones, so a developer's runs keep exploring (a failure prints how to reproduce it).
settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.register_profile("dev", print_blob=True)
settings.load_profile("ci" if IN_CI else "dev")


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
    # The slow tier last, so that one session runs both (CI): the ordinary tests' session servers are
    # stopped once no test after needs them (tests/integration/conftest.py), before the slow tier's
    # own servers and trainers need the memory; within it, the tests on those servers come first.
    # The order is otherwise the collection's (a stable sort).
    items.sort(key=_place)


_SHARED = ("vllm_server", "qwen_server", "served")
"""The session servers of tests/integration/conftest.py, and ``served``, which takes one by name (a
test's fixture names hold the fixtures its fixtures need, but not one taken by name)."""


def _place(item: pytest.Item) -> tuple[bool, bool]:
    slow = item.get_closest_marker("slow") is not None
    on_shared = any(name in getattr(item, "fixturenames", ()) for name in _SHARED)
    return slow, slow and not on_shared


def fail_unexpected_skip(report: pytest.CollectReport | pytest.TestReport) -> None:
    """In CI, turn a skip whose reason no pattern of :data:`EXPECTED_SKIPS` matches into a failure."""
    if not (IN_CI and report.skipped and isinstance(report.longrepr, tuple)):
        return
    reason = str(report.longrepr[2]).removeprefix("Skipped: ")
    if not any(re.search(pattern, reason) for pattern in EXPECTED_SKIPS):
        report.outcome = "failed"
        report.longrepr = (
            f"{report.nodeid} skipped in CI for a reason CI does not expect: {reason!r}. Install what it "
            "needs in scripts/setup.sh, or add the reason to EXPECTED_SKIPS in tests/conftest.py with why."
        )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    fail_unexpected_skip(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Iterator[None]:
    outcome = yield
    fail_unexpected_skip(outcome.get_result())


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
