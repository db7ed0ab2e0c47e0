"""Experiment trackers: W&B, TensorBoard and MLflow follow a run's store.

A tracker run mirrors what the store records, so it holds the same numbers whichever way the run
went (resumed, interrupted, rebuilt later): every ``history.jsonl`` row against ``training_step``,
a sample of each step's trajectories as a table, every checkpoint as a versioned artifact, and the
promotions, rollbacks and canaries as aliases (``production``, ``canary``) of those artifacts.

:class:`TrackerSync` sends each tracker what it has not sent yet, and keeps how far each got (and
its run id, to continue the same run after a resume) in ``trackers.json`` in the run's folder. A
tracker that raises never stops training: the failure is counted (``failures``), logged once, and
what it had not sent is sent again at the next sync.

``jm.TrainingLoop(report_to=[...])`` syncs after each step and evaluation; ``journeyman track``
writes a whole run from a store. The trackers themselves live in
:mod:`journeyman.integrations.trackers` and are found through the ``journeyman.trackers`` entry
points (an extra each, imported when used).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from journeyman.errors import ConfigError
from journeyman.plugins import load
from journeyman.store import ModelStore, atomic_write
from journeyman.trajectory import Trajectory, TrajectoryGroup

__all__ = [
    "STATE_FILE",
    "TRACKERS",
    "TrackedRun",
    "Tracker",
    "TrackerSync",
    "default_report_to",
    "make_trackers",
    "trajectory_table",
]

logger = logging.getLogger(__name__)

TRACKERS = "journeyman.trackers"
"""The entry-point group: ``name = "module:factory"``, the factory ``(**options) -> Tracker``."""
STATE_FILE = "trackers.json"
"""In the run's folder: each tracker's run id and how far it got."""
TABLE_COLUMNS = ["split", "step", "group", "trajectory_id", "reward", "conversation", "metrics"]


@dataclass(frozen=True)
class TrackedRun:
    """What a tracker is told when it starts."""

    project: str
    model: str
    store_path: Path
    run_id: str | None
    """The id this tracker gave the run before (from ``trackers.json``): continue it."""
    config: dict[str, Any]
    metrics_url: str | None = None
    """The serving engine's Prometheus ``/metrics``, for a tracker that scrapes it."""


@runtime_checkable
class Tracker(Protocol):
    """One experiment tracker's run. Each method may raise: :class:`TrackerSync` counts it."""

    name: str

    def start(self, run: TrackedRun) -> str:
        """Open the run (``run.run_id``: the one to continue) and return its id."""
        ...

    def log_row(self, row: dict[str, Any]) -> None:
        """One history row; ``row["training_step"]`` is its x-axis, ``row["served"]`` the
        ``name@step`` served when it was written."""
        ...

    def log_table(self, split: str, step: int, rows: list[dict[str, Any]]) -> None:
        """A sample of one step's trajectories, one row each (:data:`TABLE_COLUMNS`)."""
        ...

    def log_checkpoint(self, step: int, path: Path, aliases: list[str]) -> None:
        """The adapter of ``step`` (its folder) as a version, with ``aliases``."""
        ...

    def set_alias(self, step: int, path: Path, alias: str) -> None:
        """Move ``alias`` (``production``, ``canary``) to the version of ``step``."""
        ...

    def finish(self) -> None:
        """Flush and close the run."""
        ...


def default_report_to() -> list[str]:
    """W&B when ``WANDB_API_KEY`` is set (as OpenPipe ART does) and wandb is installed, else none
    (a key without the library is logged once: a run is not stopped for a tracker nobody asked for)."""
    if not os.environ.get("WANDB_API_KEY"):
        return []
    if importlib.util.find_spec("wandb") is None:
        logger.warning(
            "WANDB_API_KEY is set but wandb is not installed: this run is not logged to W&B "
            '(pip install "./journeyman[wandb]" beside your clone of journeyman, or report_to=[] to say so)'
        )
        return []
    return ["wandb"]


def make_trackers(report_to: Iterable[str | Tracker], **options: Any) -> list[Tracker]:
    """The trackers named (``wandb``, ``tensorboard``, ``mlflow``), or given as objects."""
    made: list[Tracker] = []
    for item in report_to:
        if isinstance(item, Tracker):
            made.append(item)
            continue
        try:
            factory = load(TRACKERS, item)
        except ConfigError:
            raise ConfigError(
                f"report_to names {item!r}, which is no tracker: use 'wandb', 'tensorboard' or 'mlflow'"
            ) from None
        made.append(factory(**options))
    names = [t.name for t in made]
    if len(set(names)) != len(names):
        raise ConfigError(f"report_to names a tracker twice: {names}")
    return made


def trajectory_table(
    groups: Sequence[TrajectoryGroup], split: str, step: int, size: int = 8
) -> list[dict[str, Any]]:
    """Up to ``size`` trajectories of a step, spread over its groups: one row each."""
    rows: list[dict[str, Any]] = []
    for depth in range(max((len(g.trajectories) for g in groups), default=0)):
        for index, group in enumerate(groups):
            if depth < len(group.trajectories) and len(rows) < size:
                trajectory = group.trajectories[depth]
                rows.append(
                    {
                        "split": split,
                        "step": step,
                        "group": index,
                        "trajectory_id": trajectory.id,
                        "reward": trajectory.reward,
                        "conversation": _transcript(trajectory),
                        "metrics": json.dumps(trajectory.metrics, sort_keys=True),
                    }
                )
    return rows


def _transcript(trajectory: Trajectory) -> str:
    lines = []
    for message in trajectory.messages:
        text = message.content if isinstance(message.content, str) else json.dumps(message.content)
        calls = getattr(message, "tool_calls", None) or []
        called = " ".join(f"<call>{c.function.name} {c.function.arguments}</call>" for c in calls)
        lines.append(f"{message.role}: {text or ''}{(' ' + called) if called else ''}")
    return "\n".join(lines)


@dataclass
class _Progress:
    run_id: str | None = None
    rows: int = 0
    tables: list[str] = field(default_factory=list)
    checkpoints: list[int] = field(default_factory=list)
    promotions: int = 0


class TrackerSync:
    """Sends each tracker what the store recorded since its last sync."""

    def __init__(
        self,
        store: ModelStore,
        trackers: Sequence[Tracker],
        *,
        config: dict[str, Any] | None = None,
        metrics_url: str | None = None,
        table_size: int = 8,
        keep_state: bool = True,
    ) -> None:
        """``keep_state=False``: start new tracker runs and keep no ``trackers.json`` (a rebuild)."""
        self.store = store
        self.trackers = list(trackers)
        self.config = config or {}
        self.metrics_url = metrics_url
        self.table_size = table_size
        self.failures: dict[str, int] = {t.name: 0 for t in self.trackers}
        """Syncs each tracker failed (each retried at the next)."""
        self.seconds: dict[str, float] = {t.name: 0.0 for t in self.trackers}
        """Seconds spent in each tracker's calls (the store is read once a sync, outside them)."""
        self.keep_state = keep_state
        self._started: set[str] = set()
        self._progress = self._read_state() if keep_state else {}

    @property
    def state_path(self) -> Path:
        return self.store.path / STATE_FILE

    def _read_state(self) -> dict[str, _Progress]:
        if not self.state_path.is_file():
            return {}
        data = json.loads(self.state_path.read_text())
        return {name: _Progress(**fields) for name, fields in data.items()}

    def _write_state(self) -> None:
        if not self.keep_state:
            return
        data = {name: vars(progress) for name, progress in self._progress.items()}
        atomic_write(self.state_path, json.dumps(data, indent=2))

    def sync(self) -> None:
        """Send every tracker what is new; a failing tracker is counted and left for the next sync."""
        recorded = _Recorded(self.store, self.table_size)  # read once for every tracker
        for tracker in self.trackers:
            progress = self._progress.setdefault(tracker.name, _Progress())
            start = time.perf_counter()
            try:
                self._sync(tracker, progress, recorded)
            except Exception as error:  # a tracker's own errors have no common type
                self.failures[tracker.name] += 1
                level = logging.WARNING if self.failures[tracker.name] == 1 else logging.DEBUG
                logger.log(
                    level,
                    "tracker %s failed (%s: %s); training goes on, and what it did not send is sent at "
                    "the next sync (failures so far: %d)",
                    tracker.name, type(error).__name__, error, self.failures[tracker.name],
                )  # fmt: skip
            finally:
                self.seconds[tracker.name] += time.perf_counter() - start
                self._write_state()

    def run_ids(self) -> dict[str, str | None]:
        """Each tracker's run id (None before it started)."""
        return {t.name: self._progress.get(t.name, _Progress()).run_id for t in self.trackers}

    def close(self) -> None:
        """A last sync, then each started tracker's run is finished."""
        self.sync()
        for tracker in self.trackers:
            if tracker.name in self._started:
                try:
                    tracker.finish()
                except Exception as error:  # as in sync: counted, never raised
                    self.failures[tracker.name] += 1
                    logger.warning(
                        "tracker %s failed to finish: %s: %s", tracker.name, type(error).__name__, error
                    )
        self._started.clear()

    def _sync(self, tracker: Tracker, progress: _Progress, recorded: _Recorded) -> None:
        if tracker.name not in self._started:
            run = TrackedRun(
                project=self.store.project, model=self.store.model, store_path=self.store.path,
                run_id=progress.run_id, config=self.config, metrics_url=self.metrics_url,
            )  # fmt: skip
            progress.run_id = tracker.start(run)
            self._started.add(tracker.name)
        for row in recorded.rows[progress.rows :]:
            tracker.log_row(
                {**row, "training_step": row["step"], "served": self._served(row, recorded.promotions)}
            )
            progress.rows += 1
        for split, step in recorded.tables:
            key = f"{split}/{step}"
            if key not in progress.tables:
                tracker.log_table(split, step, recorded.table(split, step))
                progress.tables.append(key)
        steps = recorded.checkpoints
        for step in steps:
            if step not in progress.checkpoints:
                aliases = [f"step{step}", *(["latest"] if step == steps[-1] else [])]
                tracker.log_checkpoint(step, self.store.checkpoint_path(step), aliases)
                progress.checkpoints.append(step)
        for row in recorded.promotions[progress.promotions :]:
            alias = _alias(row)
            path = self.store.checkpoint_path(row["step"])
            if alias is not None and path.is_dir():
                tracker.set_alias(row["step"], path, alias)
            progress.promotions += 1

    def _served(self, row: dict[str, Any], promotions: list[dict[str, Any]]) -> str:
        """``name@step`` the plain name served when the row was written."""
        moved = [
            p
            for p in promotions
            if p["action"] in ("promote", "rollback") and p.get("time", "") <= row.get("time", "")
        ]
        step = moved[-1]["step"] if moved else row["step"]
        return f"{self.store.model}@{step}"


class _Recorded:
    """What the store holds at one sync, read once for all the trackers; each step's table is
    made from its groups the first time a tracker needs it."""

    def __init__(self, store: ModelStore, table_size: int) -> None:
        self.store, self.table_size = store, table_size
        self.rows = store.read_history()
        self.promotions = store.read_promotions()
        self.tables = [(split, step) for split in store.splits() for step in store.steps(split)]
        self.checkpoints = store.checkpoint_steps()
        self._made: dict[tuple[str, int], list[dict[str, Any]]] = {}

    def table(self, split: str, step: int) -> list[dict[str, Any]]:
        if (split, step) not in self._made:
            groups = self.store.load_groups(split, step)
            self._made[split, step] = trajectory_table(groups, split, step, self.table_size)
        return self._made[split, step]


def _alias(promotion: dict[str, Any]) -> str | None:
    """The alias a promotion row moves: promote and rollback move ``production``; a canary with a
    share moves ``canary``."""
    if promotion["action"] in ("promote", "rollback"):
        return "production"
    if promotion["action"] == "canary" and promotion.get("share", 0) > 0:
        return "canary"
    return None
