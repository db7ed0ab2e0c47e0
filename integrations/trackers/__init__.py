"""The experiment trackers behind ``report_to=``: W&B (``wandb``), TensorBoard (``tensorboard``) and
MLflow (``mlflow``), each an extra of its own, found through the ``journeyman.trackers`` entry points.
What they are sent, and when, is :mod:`journeyman.trackers`'."""

from __future__ import annotations

import importlib.util
from numbers import Real
from typing import Any

from journeyman.errors import MissingDependencyError

__all__ = ["numbers_of", "require"]

SKIPPED = {"step", "training_step", "time", "split", "served"}


def numbers_of(row: dict[str, Any]) -> dict[str, float]:
    """A history row's numeric metrics (booleans as 0 and 1), without its bookkeeping keys."""
    return {key: float(value) for key, value in row.items() if key not in SKIPPED and isinstance(value, Real)}


def require(module: str, package: str, extra: str) -> None:
    """Fail when the tracker is asked for, not at its first sync: ``report_to`` names a tracker
    whose library is missing."""
    if importlib.util.find_spec(module) is None:
        raise MissingDependencyError(package, extra, f"report_to=[{extra!r}]")
