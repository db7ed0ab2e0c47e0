"""Weights & Biases: each history row against ``training_step``, each step's trajectories as a
``wandb.Table``, each checkpoint as a ``lora`` artifact (aliases ``step<N>``, ``latest``;
``production`` and ``canary`` follow promotions), the serving engine's ``/metrics`` scraped into
the run's system metrics.

Online when ``WANDB_API_KEY`` is set (or ``mode=``/``WANDB_MODE`` says so), else offline, into
``<run>/wandb``. A resumed run continues the same W&B run online (its id is kept, ``resume="allow"``);
W&B cannot resume an offline run, so an offline run resumed is several W&B runs until
``journeyman track`` writes it as one.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from journeyman.errors import MissingDependencyError
from journeyman.trackers import TABLE_COLUMNS, TrackedRun

from . import numbers_of, require

__all__ = ["WandbTracker", "tracker"]


class WandbTracker:
    name = "wandb"

    def __init__(
        self,
        *,
        project: str | None = None,
        entity: str | None = None,
        mode: str | None = None,
        dir: str | Path | None = None,
        run_name: str | None = None,
        settings: dict[str, Any] | None = None,
        **_: Any,
    ) -> None:
        """``settings``: more ``wandb.Settings`` (``x_stats_sampling_interval``...)."""
        self.project, self.entity, self.mode, self.dir, self.run_name = project, entity, mode, dir, run_name
        self.settings = settings or {}
        self._run: Any = None
        self._artifact = "lora"

    def start(self, run: TrackedRun) -> str:
        try:
            import wandb
        except ImportError as error:
            raise MissingDependencyError("wandb", "wandb", "report_to=['wandb']") from error
        mode = (
            self.mode
            or os.environ.get("WANDB_MODE")
            or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
        )
        settings: dict[str, Any] = {
            "console": "off",
            "silent": True,
            "x_save_requirements": False,
            **self.settings,
        }
        if run.metrics_url is not None:
            settings["x_stats_open_metrics_endpoints"] = {"vllm": run.metrics_url}
        directory = Path(self.dir) if self.dir is not None else run.store_path
        directory.mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(
            project=self.project or run.project, entity=self.entity, name=self.run_name or run.model,
            id=run.run_id, resume="allow", dir=str(directory), config=run.config, mode=mode,  # type: ignore[arg-type]
            reinit="create_new", settings=wandb.Settings(**settings),
        )  # fmt: skip
        self._run.define_metric("training_step")
        self._run.define_metric("*", step_metric="training_step")
        self._artifact = f"{run.model}-lora"
        return str(self._run.id)

    def log_row(self, row: dict[str, Any]) -> None:
        self._run.log({**numbers_of(row), "training_step": row["training_step"], "served": row["served"]})

    def log_table(self, split: str, step: int, rows: list[dict[str, Any]]) -> None:
        import wandb

        columns: list[str | int] = list(TABLE_COLUMNS)
        table = wandb.Table(columns=columns, data=[[r[c] for c in TABLE_COLUMNS] for r in rows])
        self._run.log({f"trajectories/{split}": table, "training_step": step})

    def _log_adapter(self, step: int, path: Path, aliases: list[str]) -> None:
        import wandb

        artifact = wandb.Artifact(self._artifact, type="lora", metadata={"step": step})
        artifact.add_dir(str(path))
        self._run.log_artifact(artifact, aliases=aliases)

    def log_checkpoint(self, step: int, path: Path, aliases: list[str]) -> None:
        self._log_adapter(step, path, aliases)

    def set_alias(self, step: int, path: Path, alias: str) -> None:
        self._log_adapter(step, path, [alias])  # the same files: the same version, one alias more

    def finish(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None


def tracker(**options: Any) -> WandbTracker:
    require("wandb", "wandb", "wandb")
    return WandbTracker(**options)
