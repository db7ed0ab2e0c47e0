"""TensorBoard: scalars per ``training_step``, trajectories, checkpoints and aliases as text.

Written with ``tensorboardX`` under the run's folder (``<run>/tensorboard``, or ``logdir=``); read
with ``tensorboard --logdir``. A resumed run writes a new event file in the same folder, which
TensorBoard shows as one run.
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import Any

from journeyman.errors import MissingDependencyError
from journeyman.trackers import TrackedRun

from . import numbers_of, require

__all__ = ["TensorBoardTracker", "tracker"]


class TensorBoardTracker:
    name = "tensorboard"

    def __init__(self, *, logdir: str | Path | None = None, **_: Any) -> None:
        self.logdir = Path(logdir) if logdir is not None else None
        self._writer: Any = None

    def start(self, run: TrackedRun) -> str:
        try:
            from tensorboardX import SummaryWriter
        except ImportError as error:
            raise MissingDependencyError(
                "tensorboardX", "tensorboard", "report_to=['tensorboard']"
            ) from error
        logdir = self.logdir or run.store_path / "tensorboard"
        # A file of its own for each part of a run: tensorboardX names files by the second and the
        # host, so a part resumed within the same second would overwrite the one before. The suffix
        # keeps the parts in order (readers load a folder's files sorted by name, and drop steps that
        # come after a later one), then a random part keeps two processes apart.
        self._writer = SummaryWriter(
            logdir=str(logdir),
            flush_secs=10,
            filename_suffix=f".{time.time_ns():020d}.{uuid.uuid4().hex[:8]}",
        )
        if run.run_id is None:
            self._writer.add_text(
                "config", f"```json\n{json.dumps(run.config, indent=2, default=str)}\n```", 0
            )
        return str(logdir)

    def log_row(self, row: dict[str, Any]) -> None:
        step = int(row["training_step"])
        for key, value in numbers_of(row).items():
            self._writer.add_scalar(key, value, step)

    def log_table(self, split: str, step: int, rows: list[dict[str, Any]]) -> None:
        text = "\n\n".join(
            f"**group {r['group']}, reward {r['reward']}** ({r['trajectory_id']})\n\n```\n{r['conversation']}\n```"
            for r in rows
        )
        self._writer.add_text(f"trajectories/{split}", text or "(no trajectories)", step)

    def log_checkpoint(self, step: int, path: Path, aliases: list[str]) -> None:
        self._writer.add_text("checkpoints", f"step {step}: {path} ({', '.join(aliases)})", step)

    def set_alias(self, step: int, path: Path, alias: str) -> None:
        self._writer.add_text(f"aliases/{alias}", f"step {step}: {path}", step)

    def finish(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def tracker(**options: Any) -> TensorBoardTracker:
    require("tensorboardX", "tensorboardX", "tensorboard")
    return TensorBoardTracker(**options)
