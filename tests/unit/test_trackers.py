"""The trackers follow a run's store, each read back with its own library, offline: W&B's run file
through wandb's protobuf schema, TensorBoard's events through ``EventAccumulator``, MLflow's store
through ``MlflowClient``. Values, steps, tables, checkpoint versions and the aliases promotions and
rollbacks move; a tracker that raises leaves training and the store intact."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import pytest

import journeyman as jm
from journeyman.store import ModelStore
from journeyman.trackers import TrackedRun, TrackerSync, default_report_to, make_trackers, trajectory_table
from tests import wandb_records
from tests.loop_backend import CountingBackend

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # wandb's and mlflow's own


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")


def checkpoint(store: ModelStore, step: int) -> None:
    with store.write_checkpoint(step) as folder:
        (folder / "adapter_model.safetensors").write_bytes(bytes([step]) * 64)
        (folder / "adapter_config.json").write_text(json.dumps({"r": 8}))


def group(step: int, n: int = 3) -> jm.TrajectoryGroup:
    return jm.TrajectoryGroup(
        jm.Trajectory(
            conversation=[
                {"role": "user", "content": f"question {step}"},
                {"role": "assistant", "content": f"answer {i}"},
            ],
            reward=float(i == 0),
            metrics={"turns": 1.0},
        )
        for i in range(n)
    )


def train(store: ModelStore, step: int) -> None:
    """What a training step leaves in the store: its groups, its rows, a checkpoint, a promotion."""
    store.save_groups([group(step), group(step)], "train", step)
    store.append_history(
        {"step": step, "split": "rollouts", "rollouts/reward": 0.25 * step, "rollouts/ok": True}
    )
    checkpoint(store, step + 1)
    store.append_history({"step": step + 1, "split": "train", "train/loss": 1.0 / (step + 1)})
    store.append_promotion({"action": "promote", "step": step + 1, "by": "training"})


def made_run(tmp_path: Path, steps: int = 3) -> ModelStore:
    store = ModelStore("proj", "agent", root=tmp_path)
    checkpoint(store, 0)
    for step in range(steps):
        train(store, step)
    return store


def metrics_of(store: ModelStore, key: str) -> list[tuple[int, float]]:
    return [(row["step"], float(row[key])) for row in store.read_history() if key in row]


def test_each_tracker_holds_the_history_tables_checkpoints_and_aliases(tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    store = made_run(tmp_path)
    store.append_promotion({"action": "rollback", "step": 2, "by": "person"})
    store.append_promotion({"action": "canary", "step": 3, "share": 0.25, "by": "person"})
    sync = TrackerSync(store, make_trackers(["wandb", "tensorboard", "mlflow"]), config={"lr": 1e-4})
    sync.close()
    assert sync.failures == {"wandb": 0, "tensorboard": 0, "mlflow": 0}
    state = json.loads((store.path / "trackers.json").read_text())
    assert all(
        s["rows"] == 6 and s["checkpoints"] == [0, 1, 2, 3] and s["promotions"] == 5 for s in state.values()
    )
    loss, reward = metrics_of(store, "train/loss"), metrics_of(store, "rollouts/reward")

    # W&B: every row against training_step, with the served name@step; the tables; the adapters.
    run = wandb_records.run_file(store.path / "wandb")
    rows = [r for r in wandb_records.history(run) if "served" in r]
    assert [(r["training_step"], r["train/loss"]) for r in rows if "train/loss" in r] == loss
    assert [(r["training_step"], r["rollouts/reward"]) for r in rows if "rollouts/reward" in r] == reward
    # the plain name as each row was written: a train row comes before its step is promoted
    assert [r["served"] for r in rows] == ["agent@0", "agent@1", "agent@1", "agent@1", "agent@2", "agent@2"]
    assert all(r["rollouts/ok"] == 1 for r in rows if "rollouts/ok" in r)  # a boolean as 0/1
    tables = [r for r in wandb_records.history(run) if "trajectories/train/nrows" in r]
    assert [(t["training_step"], t["trajectories/train/nrows"]) for t in tables] == [(0, 6), (1, 6), (2, 6)]
    assert wandb_records.config(run)["lr"] == 1e-4
    adapters = [a for a in wandb_records.artifacts(run) if a.type == "lora"]
    digest = {
        json.loads(a.metadata)["step"]: a.digest
        for a in adapters
        if any(x.startswith("step") for x in a.aliases)
    }
    assert sorted(digest) == [0, 1, 2, 3] and len(set(digest.values())) == 4
    moved = [(a.digest, sorted(set(a.aliases) - {"latest"})) for a in adapters[4:]]
    assert moved == [(digest[1], ["production"]), (digest[2], ["production"]), (digest[3], ["production"]),
                     (digest[2], ["production"]), (digest[3], ["canary"])]  # fmt: skip

    # TensorBoard: each scalar at its step; the tables and checkpoints as text.
    events = EventAccumulator(str(store.path / "tensorboard"))
    events.Reload()
    assert [(e.step, pytest.approx(e.value)) for e in events.Scalars("train/loss")] == loss
    assert [(e.step, e.value) for e in events.Scalars("rollouts/reward")] == reward
    texts = events.Tags()["tensors"]
    assert {
        "trajectories/train/text_summary",
        "checkpoints/text_summary",
        "aliases/production/text_summary",
    } <= set(texts)
    assert [e.step for e in events.Tensors("trajectories/train/text_summary")] == [0, 1, 2]

    # MLflow: metrics by step, a model version per checkpoint, aliases where promotions left them.
    client = MlflowClient(f"sqlite:///{store.path / 'mlflow' / 'mlflow.db'}")
    run_id = state["mlflow"]["run_id"]
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "train/loss")] == loss
    versions = {int(v.tags["step"]): v for v in client.search_model_versions("name = 'proj-agent'")}
    assert sorted(versions) == [0, 1, 2, 3]
    assert client.get_model_version_by_alias("proj-agent", "production").tags["step"] == "2"  # the rollback
    assert client.get_model_version_by_alias("proj-agent", "canary").tags["step"] == "3"
    assert client.get_model_version_by_alias("proj-agent", "step1").version == versions[1].version
    table = json.loads(
        Path(
            client.download_artifacts(run_id, "trajectories/train-0001.json", str(tmp_path / "dl"))
        ).read_text()
    )
    assert (
        len(table["data"]) == 6 and "question 1" in table["data"][0][table["columns"].index("conversation")]
    )
    assert client.get_run(run_id).data.params["lr"] == "0.0001"
    assert client.get_run(run_id).data.tags["served"] == "agent@2"  # as the last row was written


def test_a_later_sync_sends_only_what_is_new_and_a_resumed_sync_continues_the_run(tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    store = made_run(tmp_path, steps=2)
    sync = TrackerSync(store, make_trackers(["tensorboard", "mlflow"]))
    sync.sync()
    train(store, 2)
    sync.sync()
    sync.close()
    first = json.loads((store.path / "trackers.json").read_text())
    resumed = TrackerSync(store, make_trackers(["tensorboard", "mlflow"]))  # a new process, the same run
    train(store, 3)
    resumed.close()
    state = json.loads((store.path / "trackers.json").read_text())
    assert state["mlflow"]["run_id"] == first["mlflow"]["run_id"] and state["mlflow"]["rows"] == 8
    loss = metrics_of(store, "train/loss")
    client = MlflowClient(f"sqlite:///{store.path / 'mlflow' / 'mlflow.db'}")
    assert [
        (m.step, m.value) for m in client.get_metric_history(state["mlflow"]["run_id"], "train/loss")
    ] == loss
    events = EventAccumulator(str(store.path / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [step for step, _ in loss]  # none twice


class Flaky:
    """A tracker that fails its second row once, as a network error would."""

    name = "flaky"

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self.calls = 0
        self.run: TrackedRun | None = None

    def start(self, run: TrackedRun) -> str:
        self.run = run
        return "flaky-1"

    def log_row(self, row: dict[str, Any]) -> None:
        self.calls += 1
        if self.calls == 2:
            raise ConnectionError("the tracker's server went away")
        self.rows.append(row)

    def log_table(self, split: str, step: int, rows: list[dict[str, Any]]) -> None: ...
    def log_checkpoint(self, step: int, path: Path, aliases: list[str]) -> None: ...
    def set_alias(self, step: int, path: Path, alias: str) -> None: ...
    def finish(self) -> None: ...


def test_a_tracker_that_raises_is_counted_logged_once_and_sent_the_rest_later(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = made_run(tmp_path, steps=2)
    before = store.history_path.read_bytes()
    flaky = Flaky()
    sync = TrackerSync(store, [flaky])
    with caplog.at_level(logging.DEBUG, logger="journeyman.trackers"):
        sync.sync()
        assert sync.failures == {"flaky": 1} and len(flaky.rows) == 1
        sync.sync()  # sent again from the row that failed
    assert [r["step"] for r in flaky.rows] == [r["step"] for r in store.read_history()]
    assert (
        sum(
            "tracker flaky failed (ConnectionError" in r.message and r.levelno == logging.WARNING
            for r in caplog.records
        )
        == 1
    )
    assert store.history_path.read_bytes() == before  # the store is left as it was


async def test_the_training_loop_reports_each_step_to_its_trackers(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    backend = CountingBackend()
    model = jm.TrainableModel(name="loop", project="test", base_model="smollm2-135m", root=tmp_path)
    await model.register(backend)
    seen: list[int] = []

    async def rollout(model: jm.TrainableModel, scenario: str) -> jm.Trajectory:
        return jm.Trajectory(
            conversation=[{"role": "assistant", "content": scenario}], reward=float(scenario == "a")
        )

    def after_step(report: Any) -> None:  # the tracker was sent the step's rows before the hook runs
        state = json.loads((model.store.path / "trackers.json").read_text())
        seen.append(state["tensorboard"]["rows"] - len(model.store.read_history()))

    backend.metrics_url = lambda: "http://127.0.0.1:9/metrics"  # type: ignore[attr-defined]
    flaky = Flaky()  # a tracker object of one's own goes in report_to beside the named ones
    loop = jm.TrainingLoop(
        model, rollout, ["a", "b", "c", "d"], group_size=2, scenarios_per_step=2, steps=2,
        progress=False, report_to=["tensorboard", flaky], on_step_end=after_step,
    )  # fmt: skip
    await loop.run()
    assert flaky.run is not None and flaky.run.metrics_url == "http://127.0.0.1:9/metrics"
    assert flaky.run.config["group_size"] == 2 and flaky.run.config["train"]["learning_rate"] > 0
    assert loop.trackers is not None and loop.trackers.failures["flaky"] == 1  # its one failure, counted
    assert loop.trackers.failures["tensorboard"] == 0
    assert loop.trackers.seconds["tensorboard"] > 0 and seen == [0, 0]
    events = EventAccumulator(str(model.store.path / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("loss")] == [1, 2]  # the trainer's rows
    assert [e.step for e in events.Scalars("rollouts/reward")] == [0, 1]  # the loop's


async def test_trackers_refuse_a_remote_backend_and_unknown_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(jm.ConfigError, match="'comet', which is no tracker"):
        make_trackers(["comet"])
    monkeypatch.setenv("WANDB_API_KEY", "k")
    assert default_report_to() == ["wandb"]
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    assert default_report_to() == []  # a key alone does not stop a run that did not ask for W&B
    monkeypatch.setattr(importlib.util, "find_spec", real)
    monkeypatch.delenv("WANDB_API_KEY")
    assert default_report_to() == []
    model = jm.TrainableModel(name="remote", project="test", base_model="smollm2-135m", root=tmp_path)
    model._backend = jm.RemoteBackend("http://127.0.0.1:9")  # registered there (no server to ask)
    loop = jm.TrainingLoop(model, lambda m, s: None, ["a"], scenarios_per_step=1, report_to=["tensorboard"])  # type: ignore[arg-type, return-value]
    with pytest.raises(jm.ConfigError, match="trackers write where training happens"):
        await loop.run()


def test_a_table_samples_across_groups() -> None:
    rows = trajectory_table([group(0, n=3), group(1, n=3)], "train", 5, size=4)
    assert [(r["group"], r["step"]) for r in rows] == [(0, 5), (1, 5), (0, 5), (1, 5)]
    assert rows[0]["conversation"] == "user: question 0\nassistant: answer 0" and rows[0]["reward"] == 1.0


async def test_a_run_resumed_offline_is_several_wandb_runs_until_track_writes_it_as_one(
    tmp_path: Path,
) -> None:
    from typer.testing import CliRunner

    from journeyman.backend.app.cli import app

    async def rollout(model: jm.TrainableModel, scenario: str) -> jm.Trajectory:
        return jm.Trajectory(
            conversation=[{"role": "assistant", "content": scenario}], reward=float(scenario == "a")
        )

    for steps in (2, 4):  # a run, then the same run resumed in a new process
        time.sleep(1.1)  # W&B names an offline run's folder by the second and the run's id
        backend = CountingBackend()
        model = jm.TrainableModel(name="resumed", project="test", base_model="smollm2-135m", root=tmp_path)
        await model.register(backend)
        loop = jm.TrainingLoop(
            model, rollout, ["a", "b", "c", "d"], group_size=2, scenarios_per_step=2, steps=steps,
            progress=False, report_to=["wandb"],
        )  # fmt: skip
        await loop.run()
    store = model.store
    parts = [
        wandb_records.finished(p) for p in sorted((store.path / "wandb").glob("offline-run-*/run-*.wandb"))
    ]
    assert len(parts) == 2  # W&B cannot resume an offline run: the resumed part is a run of its own
    assert sum(len([r for r in wandb_records.history(p) if "served" in r]) for p in parts) == len(
        store.read_history()
    )

    out = tmp_path / "rebuilt"
    result = CliRunner().invoke(
        app,
        ["track", "test", "resumed", "--to", "wandb", "--root", str(tmp_path)],
        env={"WANDB_DIR": str(out)},
    )
    assert result.exit_code == 0, result.output
    rebuilt = [
        wandb_records.finished(p)
        for p in sorted((store.path / "wandb").glob("offline-run-*/run-*.wandb"))
        if p not in parts
    ]
    assert len(rebuilt) == 1 and "wandb: run " in result.output
    rows = [r for r in wandb_records.history(rebuilt[0]) if "served" in r]
    assert [(r["training_step"], r.get("loss")) for r in rows] == [
        (row["step"], row.get("loss")) for row in store.read_history()
    ]  # one run, every row in order
    adapters = [a for a in wandb_records.artifacts(rebuilt[0]) if a.type == "lora"]
    assert sorted(
        json.loads(a.metadata)["step"] for a in adapters if any(x.startswith("step") for x in a.aliases)
    ) == [1, 2, 3, 4]
    assert json.loads((store.path / "trackers.json").read_text())["wandb"]["rows"] == len(
        store.read_history()
    )

    missing = CliRunner().invoke(app, ["track", "test", "nothing", "--to", "wandb", "--root", str(tmp_path)])
    assert missing.exit_code != 0 and "no run at" in missing.output


async def test_journeyman_serve_writes_each_models_run_where_it_trains(tmp_path: Path) -> None:
    """The server's trackers follow each model's store there: after a step trains, before the
    client hears it is done (a RemoteBackend client logs nothing itself)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from journeyman.backend.app.server import _Api, _train_events
    from journeyman.backend.local import LocalBackend

    api = _Api(LocalBackend(root=tmp_path, gateway_thread=False), report_to=["tensorboard"])
    backend = CountingBackend()  # trains as the server's backend would: rows, groups, a checkpoint
    model = jm.TrainableModel(name="served", project="test", base_model="smollm2-135m", root=tmp_path)
    await model.register(backend)
    for _ in range(2):
        events = [
            e
            async for e in _train_events(
                model, {"event": "started"}, backend.train(model, [group(0)], jm.TrainConfig()), api.track
            )
        ]
        assert json.loads(events[-1])["event"] == "done"
        state = json.loads((model.store.path / "trackers.json").read_text())
        assert state["tensorboard"]["rows"] == len(model.store.read_history())  # before "done" went out
    await api.close_trackers()
    scalars = EventAccumulator(str(model.store.path / "tensorboard"))
    scalars.Reload()
    assert [e.step for e in scalars.Scalars("loss")] == [1, 2]


def test_a_tracker_whose_library_is_missing_fails_when_named(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a)
    )
    with pytest.raises(jm.errors.MissingDependencyError, match=r"pip install \"\./journeyman\[mlflow\]\""):
        make_trackers(["tensorboard", "mlflow"])


async def test_a_remote_clients_rows_reach_the_servers_run_and_a_refused_row_is_counted(
    tmp_path: Path,
) -> None:
    """A loop on a RemoteBackend sends its rollouts and evaluation rows (with the evaluation's
    groups) to the server's store, which its trackers follow; the server writes its own train rows."""
    import httpx
    from starlette.applications import Starlette
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from journeyman.backend.app.server import _Api
    from journeyman.backend.local import LocalBackend
    from journeyman.errors import BackendError, ConfigError

    api = _Api(LocalBackend(root=tmp_path / "server", gateway_thread=False), report_to=["tensorboard"])
    served = jm.TrainableModel(
        name="far", project="test", base_model="smollm2-135m", root=tmp_path / "server"
    )
    api.models[("test", "far")] = served
    remote = jm.RemoteBackend("http://serve")
    remote._http = httpx.AsyncClient(
        transport=httpx.ASGITransport(app=Starlette(routes=api.routes())), base_url="http://serve"
    )
    client = jm.TrainableModel(
        name="far", project="test", base_model="smollm2-135m", root=tmp_path / "client"
    )
    client._backend = remote
    await remote.record(client, {"step": 0, "split": "rollouts", "rollouts/reward": 0.5})
    await remote.record(client, {"step": 1, "split": "val", "val/reward": 0.75}, [group(1)])
    with pytest.raises(ConfigError, match="'train' rows are written here"):
        await remote.record(client, {"step": 1, "split": "train", "train/loss": 1.0})
    assert [(r["split"], r["step"]) for r in served.store.read_history()] == [("rollouts", 0), ("val", 1)]
    assert served.store.load_groups("val", 1)[0].trajectories[0].reward == 1.0
    await api.close_trackers()
    events = EventAccumulator(str(served.store.path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("val/reward")] == [(1, 0.75)]

    class Refusing(CountingBackend):
        async def record(self, model: Any, row: dict[str, Any], groups: Any = None) -> None:
            raise BackendError("the server went away")

    async def answer(model: jm.TrainableModel, scenario: str) -> jm.Trajectory:
        return jm.Trajectory(
            conversation=[{"role": "assistant", "content": scenario}], reward=float(scenario == "a")
        )

    backend = Refusing()
    model = jm.TrainableModel(name="near", project="test", base_model="smollm2-135m", root=tmp_path)
    await model.register(backend)
    loop = jm.TrainingLoop(model, answer, ["a", "b"], group_size=2, scenarios_per_step=1, steps=1, progress=False,
                           evals=[jm.EvalSet("val", ["c"])], report_to=[])  # fmt: skip
    await loop.run()
    assert loop.mirror_failures == 3  # before, the step's rollouts, after; the run went on
    assert [r["split"] for r in model.store.read_history() if r["split"] != "train"] == [
        "val",
        "rollouts",
        "val",
    ]
