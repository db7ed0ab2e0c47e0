"""The W&B tracker against the live service: a run written online, read back through W&B's public
API. Only with a key (``WANDB_API_KEY``); CI holds none, so it skips there (an expected skip)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from journeyman.trackers import TrackerSync, make_trackers
from tests.unit.test_trackers import made_run, metrics_of

pytestmark = pytest.mark.skipif(
    not os.environ.get("WANDB_API_KEY"), reason="set WANDB_API_KEY to run against a live W&B"
)


def test_an_online_run_holds_the_history_and_the_adapters_aliases(tmp_path: Path) -> None:
    import wandb

    store = made_run(tmp_path)
    store.append_promotion({"action": "rollback", "step": 2, "by": "person"})
    project = "journeyman-tests"
    sync = TrackerSync(store, make_trackers(["wandb"], project=project, mode="online"))
    sync.close()
    assert sync.failures == {"wandb": 0}
    run_id = sync.run_ids()["wandb"]
    api = wandb.Api()
    run = api.run(f"{api.default_entity}/{project}/{run_id}")
    rows = [r for r in run.scan_history(keys=["training_step", "train/loss"])]
    assert [(r["training_step"], r["train/loss"]) for r in rows] == metrics_of(store, "train/loss")
    production = api.artifact(f"{api.default_entity}/{project}/agent-lora:production")
    assert production.metadata["step"] == 2
    run.delete(delete_artifacts=True)
