"""In CI a skip fails unless its reason is one CI expects (tests/conftest.py's EXPECTED_SKIPS)."""

from __future__ import annotations

import pytest

from tests import conftest


def _skipped(reason: str) -> pytest.TestReport:
    return pytest.TestReport(
        "tests/unit/test_x.py::test_x", ("tests/unit/test_x.py", 1, "test_x"), {}, "skipped",
        ("tests/unit/test_x.py", 2, f"Skipped: {reason}"), "call",
    )  # fmt: skip


@pytest.mark.parametrize("in_ci", [True, False])
def test_an_unexpected_skip_fails_in_ci_only(in_ci: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(conftest, "IN_CI", in_ci)
    report = _skipped("no Chromium at /usr/bin/chromium")
    conftest.fail_unexpected_skip(report)
    assert report.outcome == ("failed" if in_ci else "skipped")
    if in_ci:
        assert "'no Chromium at /usr/bin/chromium'" in str(report.longrepr)
        assert "EXPECTED_SKIPS in tests/conftest.py" in str(report.longrepr)


@pytest.mark.parametrize(
    "reason",
    [
        "needs a CUDA GPU",
        "set LANGFUSE_PUBLIC_KEY, LANGFUSE_SECRET_KEY and LANGFUSE_HOST to run against a real Langfuse",
    ],
)
def test_an_expected_skip_stays_a_skip_in_ci(reason: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(conftest, "IN_CI", True)
    report = _skipped(reason)
    conftest.fail_unexpected_skip(report)
    assert report.outcome == "skipped"


def test_a_passed_test_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(conftest, "IN_CI", True)
    report = pytest.TestReport("t", ("t", 1, "t"), {}, "passed", None, "call")
    conftest.fail_unexpected_skip(report)
    assert report.outcome == "passed"
