"""MLflow: each history row's metrics against ``training_step``, each step's trajectories as a
JSON table artifact, each checkpoint as a version of the registered model ``<project>-<model>``
(tag ``step``; aliases ``production`` and ``canary`` follow promotions).

The tracking URI is ``tracking_uri=``, else ``$MLFLOW_TRACKING_URI``, else a SQLite file in the
run's folder (``<run>/mlflow/mlflow.db``, artifacts beside it). A resumed run continues the same
MLflow run (its id is kept).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from journeyman.errors import MissingDependencyError
from journeyman.trackers import TABLE_COLUMNS, TrackedRun

from . import numbers_of, require

__all__ = ["MlflowTracker", "tracker"]


class MlflowTracker:
    name = "mlflow"

    def __init__(self, *, tracking_uri: str | None = None, experiment: str | None = None, **_: Any) -> None:
        self.tracking_uri = tracking_uri
        self.experiment = experiment
        self._client: Any = None
        self._run_id = ""
        self._model = ""
        self._versions: dict[int, str] = {}

    def start(self, run: TrackedRun) -> str:
        try:
            from mlflow.tracking import MlflowClient
        except ImportError as error:
            raise MissingDependencyError("mlflow-skinny", "mlflow", "report_to=['mlflow']") from error
        folder = run.store_path / "mlflow"
        uri = self.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        if uri is None:
            folder.mkdir(parents=True, exist_ok=True)
            uri = f"sqlite:///{folder / 'mlflow.db'}"
        self._client = client = MlflowClient(tracking_uri=uri, registry_uri=uri)
        name = self.experiment or run.project
        found = client.get_experiment_by_name(name)
        experiment = (
            found.experiment_id
            if found is not None
            else client.create_experiment(name, artifact_location=(folder / "artifacts").as_uri())
        )
        self._model = f"{run.project}-{run.model}"
        if run.run_id is not None:
            self._run_id = run.run_id
            client.update_run(self._run_id, status="RUNNING")
        else:
            self._run_id = client.create_run(experiment, run_name=run.model).info.run_id
            for key, value in _flat(run.config).items():
                client.log_param(self._run_id, key, value)
        if not client.search_registered_models(filter_string=f"name = '{self._model}'"):
            client.create_registered_model(self._model)
        self._versions = {
            int(v.tags["step"]): v.version
            for v in client.search_model_versions(f"name = '{self._model}'")
            if "step" in v.tags
        }
        return self._run_id

    def log_row(self, row: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        step = int(row["training_step"])
        stamp = int(time.time() * 1000)
        metrics = [Metric(key, value, stamp, step) for key, value in numbers_of(row).items()]
        if metrics:
            self._client.log_batch(self._run_id, metrics=metrics)
        self._client.set_tag(self._run_id, "served", row["served"])

    def log_table(self, split: str, step: int, rows: list[dict[str, Any]]) -> None:
        self._client.log_table(
            self._run_id, data=_columns(rows), artifact_file=f"trajectories/{split}-{step:04d}.json"
        )

    def log_checkpoint(self, step: int, path: Path, aliases: list[str]) -> None:
        self._client.log_artifacts(self._run_id, str(path), artifact_path=f"checkpoints/{step:04d}")
        if step not in self._versions:
            source = f"runs:/{self._run_id}/checkpoints/{step:04d}"
            version = self._client.create_model_version(
                self._model, source, run_id=self._run_id, tags={"step": str(step)}
            )
            self._versions[step] = version.version
        for alias in aliases:
            if alias != "latest":  # MLflow reserves it: its newest version is already the latest
                self._client.set_registered_model_alias(self._model, alias, self._versions[step])

    def set_alias(self, step: int, path: Path, alias: str) -> None:
        if step not in self._versions:
            self.log_checkpoint(step, path, [])
        self._client.set_registered_model_alias(self._model, alias, self._versions[step])

    def finish(self) -> None:
        if self._client is not None:
            self._client.set_terminated(self._run_id)
            self._client = None


def _flat(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    flat: dict[str, str] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            flat |= _flat(value, f"{prefix}{key}.")
        else:
            flat[f"{prefix}{key}"] = str(value)[:6000]
    return flat


def _columns(rows: list[dict[str, Any]]) -> dict[str, list[Any]]:
    return {column: [row[column] for row in rows] for column in TABLE_COLUMNS}


def tracker(**options: Any) -> MlflowTracker:
    require("mlflow", "mlflow-skinny", "mlflow")
    return MlflowTracker(**options)
