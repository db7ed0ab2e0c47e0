"""W&B scrapes the serving engine's Prometheus ``/metrics`` into the run's system metrics: the
session's real vLLM server, an offline run read back through wandb's protobuf schema."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from journeyman.backend.serving.vllm import VLLMServer
from journeyman.integrations.trackers.wandb import WandbTracker
from journeyman.trackers import TrackerSync
from tests import wandb_records
from tests.unit.test_trackers import made_run

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # wandb's own


def test_wandb_scrapes_the_policys_vllm_metrics(
    vllm_server: VLLMServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    store = made_run(tmp_path, steps=1)
    tracker = WandbTracker(settings={"x_stats_sampling_interval": 1.0})
    sync = TrackerSync(store, [tracker], metrics_url=f"{vllm_server.base_url}/metrics")
    sync.sync()
    time.sleep(5)  # a few samples
    sync.close()
    run = wandb_records.run_file(store.path / "wandb")
    keys = {
        item.key
        for r in wandb_records.records(run)
        if r.WhichOneof("record_type") == "stats"
        for item in r.stats.item
    }
    scraped = sorted(key for key in keys if key.startswith("openmetrics.vllm."))  # "vllm": the URL's name
    assert len(scraped) >= 10 and "openmetrics.vllm.process_resident_memory_bytes.0" in scraped, sorted(keys)[
        :40
    ]
