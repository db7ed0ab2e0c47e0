"""What the viewer shows, read from the run store: runs, a run's curves, checkpoints and failures.

Every function here only reads. Names that come from a URL go through
:func:`~journeyman.store.validate_name` (inside :class:`~journeyman.store.ModelStore`) before they
touch the filesystem, and a file being written while it is read is never seen half-written (the
store writes atomically and appends whole lines).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from journeyman.config import TrainConfig
from journeyman.errors import JourneymanError
from journeyman.store import CHECKPOINT_STATE, ModelStore, validate_name
from journeyman.trajectory import Failure

__all__ = [
    "CHARTS",
    "CheckpointRow",
    "FailureRow",
    "RunSummary",
    "chart_data",
    "chart_keys",
    "charts",
    "checkpoints",
    "failures",
    "find_runs",
    "summarise",
    "train_config",
]

CHARTS: list[tuple[str, str]] = [
    ("Reward", "reward/"),
    ("Loss terms", "train/*loss"),
    ("Mismatch KL (sampling vs training logprobs)", "mismatch/kl"),
    ("Entropy", "train/entropy"),
    ("Share of zero-variance groups", "data/zero_variance_share"),
    ("Judge seconds", "*judge_seconds"),
    ("Seconds per phase", "time/"),
]
"""The run page's charts: a title and which history keys each draws (a prefix ending in ``/``, an
exact key, ``prefix/*part`` for keys under a prefix that end with a part, ``*part`` for any key
ending with it). A chart with no matching key is left out."""


@dataclass
class RunSummary:
    """One row of the runs page."""

    project: str
    model: str
    base_model: str | None = None
    steps: int = 0
    latest_reward: float | None = None
    served: str | None = None
    """``name@step`` of the latest checkpoint: what a server on this store serves."""
    last_activity: datetime | None = None


@dataclass
class CheckpointRow:
    step: int
    size_mb: float
    metrics: dict[str, float] = field(default_factory=dict)
    best: bool = False


@dataclass
class FailureRow:
    """A failure with where it happened: the split and step of its group (``None`` for failures
    the history counts but no group holds, such as training data drops)."""

    stage: str
    type: str
    message: str
    traceback: str | None
    split: str | None = None
    step: int | None = None
    group: str | None = None
    trajectory: str | None = None
    count: int = 1


def find_runs(root: Path) -> list[ModelStore]:
    """Every project/model folder under ``root`` that holds a history, trajectories or checkpoints,
    sorted by name. Folders whose names the store would refuse are skipped."""
    stores: list[ModelStore] = []
    if not root.is_dir():
        return stores
    for project in sorted(root.iterdir()):
        if not project.is_dir() or not _valid(project.name):
            continue
        for model in sorted(project.iterdir()):
            if not model.is_dir() or not _valid(model.name):
                continue
            if any((model / part).exists() for part in ("history.jsonl", "trajectories", "checkpoints")):
                stores.append(ModelStore(project.name, model.name, root=root))
    return stores


def summarise(store: ModelStore, rows: list[dict[str, Any]] | None = None) -> RunSummary:
    """The runs page's row of one store, from its history ``rows`` when the caller has read them
    already; a history that cannot be read leaves its fields empty."""
    summary = RunSummary(store.project, store.model)
    rows = _history(store) if rows is None else rows
    train = [row for row in rows if row.get("split", "train") == "train"]
    steps = [int(row["step"]) for row in train if isinstance(row.get("step"), int)]
    summary.steps = max(steps, default=max(store.steps("train"), default=0))
    rewards = [row["reward/mean"] for row in train if _number(row.get("reward/mean"))]
    summary.latest_reward = rewards[-1] if rewards else None
    latest = store.latest_checkpoint()
    if latest is not None:
        summary.served = f"{store.model}@{latest[0]}"
        summary.base_model = _state(latest[1]).get("base_model")
    summary.last_activity = _last_activity(store)
    return summary


def chart_data(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The run page's chart data as JSON-ready lists: for training rows, the step, the minutes
    since the first row and every numeric key; for each evaluation split the same. Missing values
    are ``None`` (uPlot leaves a gap)."""
    start = _first_time(rows)
    by_split: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_split.setdefault(str(row.get("split", "train")), []).append(row)
    result: dict[str, Any] = {}
    for split, split_rows in by_split.items():
        keys = sorted({k for row in split_rows for k, v in row.items() if _number(v) and k != "step"})
        result[split] = {
            "step": [row.get("step") for row in split_rows],
            "minutes": [_minutes(row, start) for row in split_rows],
            "series": {k: [row[k] if _number(row.get(k)) else None for row in split_rows] for k in keys},
        }
    return result


def charts(data: dict[str, Any]) -> list[tuple[str, str, list[str]]]:
    """The run page's charts from :func:`chart_data`: (title, split, keys). Each of :data:`CHARTS`
    draws from the training rows, or else the first split that has its keys (the demo logs judge
    seconds with its rollouts); each other split with rewards or successes gets a chart of them."""
    order = ["train", *sorted(split for split in data if split != "train")]
    order = [split for split in order if split in data]
    result = []
    for title, pattern in CHARTS:
        for split in order:
            keys = chart_keys(sorted(data[split]["series"]), pattern)
            if keys:
                result.append((title, split, keys))
                break
    for split in order:
        keys = [k for k in sorted(data[split]["series"]) if k.endswith(("/reward", "/success"))]
        if split != "train" and keys:
            result.append((f"{split}: reward and success", split, keys))
    return result


def chart_keys(keys: list[str], pattern: str) -> list[str]:
    """The history keys a :data:`CHARTS` pattern draws, in order."""
    if pattern.startswith("*"):
        return [k for k in keys if k.endswith(pattern[1:])]
    if "/*" in pattern:
        prefix, part = pattern.split("/*", 1)
        return [k for k in keys if k.startswith(f"{prefix}/") and k.endswith(part)]
    if pattern.endswith("/"):
        return [k for k in keys if k.startswith(pattern)]
    return [k for k in keys if k == pattern]


def train_config(store: ModelStore, step: int) -> TrainConfig:
    """The sequence limits of the training step that learned from the groups stored at ``step``
    (recorded in checkpoint ``step + 1``); the defaults when it does not say."""
    limits = _state(store.checkpoint_path(step + 1)).get("sequences") or {}
    try:
        return TrainConfig(**{k: v for k, v in limits.items() if k in ("max_seq_len", "overlong")})
    except ValueError:
        return TrainConfig()


def checkpoints(store: ModelStore, metric: str, *, higher_is_better: bool = True) -> list[CheckpointRow]:
    """Each complete checkpoint with its size and saved metrics; the best by ``metric`` (the mean
    of its history rows, as :meth:`ModelStore.best_step` picks it) is marked."""
    try:
        best = store.best_step(metric, higher_is_better=higher_is_better)
    except JourneymanError:
        best = None
    result = []
    for step in store.checkpoint_steps():
        folder = store.checkpoint_path(step)
        size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) / 2**20
        metrics = {k: v for k, v in _state(folder).get("metrics", {}).items() if _number(v)}
        result.append(CheckpointRow(step, size, metrics, best=step == best))
    return result


def failures(store: ModelStore) -> list[FailureRow]:
    """Every failure recorded on a stored group, by split and step, and each training data drop
    the history counts (sequences truncated or left out, unscored trajectories) as one row per
    step and kind."""
    result: list[FailureRow] = []
    for split in store.splits():
        for step in store.steps(split):
            try:
                groups = store.load_groups(split, step)
            except JourneymanError as error:
                result.append(FailureRow("other", type(error).__name__, str(error), None, split, step))
                continue
            for group in groups:
                result += [_failure_row(f, split, step, group.id) for f in group.failures]
    for row in _history(store):
        for key in _DROPS:
            count = row.get(key, 0)
            if _number(count) and float(count) > 0:
                message = f"{_DROPS[key]} at step {row.get('step')}"
                result.append(
                    FailureRow("train", key, message, None, "train", row.get("step"), count=int(count))
                )
    return result


_DROPS = {
    "data/truncated_sequences": "sequences cut at max_seq_len (tokens past it not trained)",
    "data/excluded_overlong_sequences": "sequences over max_seq_len left out",
    "data/sequences_without_trained_tokens": "sequences with no trained token dropped",
    "data/unscored_trajectories": "trajectories without a reward left out",
}


def _failure_row(failure: Failure, split: str, step: int, group: str) -> FailureRow:
    return FailureRow(
        failure.stage,
        failure.type,
        failure.message,
        failure.traceback,
        split,
        step,
        group,
        failure.trajectory_id,
    )


def _history(store: ModelStore) -> list[dict[str, Any]]:
    try:
        return store.read_history()
    except JourneymanError:
        return []


def _state(folder: Path) -> dict[str, Any]:
    try:
        state = json.loads((folder / CHECKPOINT_STATE).read_text())
    except (OSError, ValueError):
        return {}
    return state if isinstance(state, dict) else {}


def _last_activity(store: ModelStore) -> datetime | None:
    paths = [store.history_path, store.checkpoints_path, store.records_path]
    for split in store.splits():
        paths += [store.trajectories_path(split, step) for step in store.steps(split)[-1:]]
    times = [p.stat().st_mtime for p in paths if p.exists()]
    return datetime.fromtimestamp(max(times), UTC) if times else None


def _first_time(rows: list[dict[str, Any]]) -> datetime | None:
    times = [t for t in (_time(row) for row in rows) if t is not None]
    return min(times, default=None)


def _time(row: dict[str, Any]) -> datetime | None:
    try:
        return datetime.fromisoformat(str(row["time"]))
    except (KeyError, ValueError):
        return None


def _minutes(row: dict[str, Any], start: datetime | None) -> float | None:
    time = _time(row)
    return None if time is None or start is None else round((time - start).total_seconds() / 60, 3)


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _valid(name: str) -> bool:
    try:
        validate_name(name)
    except JourneymanError:
        return False
    return True
