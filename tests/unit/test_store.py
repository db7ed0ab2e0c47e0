from __future__ import annotations

import errno
import json
import multiprocessing
import os
import threading
from pathlib import Path

import pytest

import journeyman as jm
from journeyman import store as store_module
from journeyman.errors import InvalidDataError, StorageError
from journeyman.store import ModelStore, atomic_dir, atomic_write


def _group(reward: float) -> jm.TrajectoryGroup:
    conversation = [{"role": "user", "content": "2+3?"}, {"role": "assistant", "content": "5"}]
    return jm.TrajectoryGroup([jm.Trajectory(conversation=conversation, reward=reward)])


def test_layout_and_round_trip(tmp_path: Path) -> None:
    store = ModelStore("demo", "calc-agent", root=tmp_path)
    groups = [_group(1.0), _group(0.0)]
    path = store.save_groups(groups, "train", 3)
    assert path == tmp_path / "demo" / "calc-agent" / "trajectories" / "train" / "0003.jsonl"
    assert store.load_groups("train", 3) == groups
    store.save_groups([_group(0.5)], "train", 3)  # adds, keeps what was there
    assert [g.reward for g in store.load_groups("train", 3)] == [1.0, 0.0, 0.5]
    store.save_groups([_group(0.5)], "val", 0)
    assert store.splits() == ["train", "val"]
    assert store.steps("train") == [3]
    assert store.load_groups("train", 7) == []
    again = ModelStore.from_path(tmp_path / "demo" / "calc-agent" / "." / "")  # the folder a run prints
    assert (again.project, again.model, again.path) == ("demo", "calc-agent", store.path.resolve())


def test_root_defaults_to_env_then_dot_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("JOURNEYMAN_ROOT", raising=False)
    assert ModelStore("p", "m").path == Path(".journeyman/p/m")
    monkeypatch.setenv("JOURNEYMAN_ROOT", str(tmp_path))
    assert ModelStore("p", "m").path == tmp_path / "p" / "m"


@pytest.mark.parametrize("name", ["../etc", "a/b", "", ".hidden", "with space", "x" * 129, "a..b", "-flag"])
def test_unsafe_names_are_refused(name: str, tmp_path: Path) -> None:
    with pytest.raises(jm.ConfigError, match="invalid project name"):
        ModelStore(name, "m", root=tmp_path)
    with pytest.raises(jm.ConfigError, match="invalid split"):
        ModelStore("p", "m", root=tmp_path).save_groups([], name, 0)


@pytest.mark.parametrize("step", [-1, 1.5, True, "3"])
def test_bad_steps_are_refused(step: object, tmp_path: Path) -> None:
    with pytest.raises(InvalidDataError, match="non-negative integer"):
        ModelStore("p", "m", root=tmp_path).trajectories_path("train", step)  # type: ignore[arg-type]


def test_history_rows_append_with_time_and_reject_bad_rows(tmp_path: Path) -> None:
    store = ModelStore("p", "m", root=tmp_path)
    store.append_history({"step": 1, "train/reward": 0.25})
    store.append_history({"step": 2, "train/reward": 0.5})
    rows = store.read_history()
    assert [(r["step"], r["train/reward"]) for r in rows] == [(1, 0.25), (2, 0.5)]
    assert all("time" in r for r in rows)
    with pytest.raises(InvalidDataError, match="needs a 'step'"):
        store.append_history({"loss": 1.0})
    with pytest.raises(InvalidDataError, match="finite numbers"):
        store.append_history({"step": 3, "loss": float("nan")})
    assert len(store.read_history()) == 2


def test_a_failed_write_leaves_the_old_file_and_no_temporary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = ModelStore("p", "m", root=tmp_path)
    store.save_groups([_group(1.0)], "train", 0)
    before = store.trajectories_path("train", 0).read_bytes()

    def disk_full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", disk_full)
    with pytest.raises(StorageError) as caught:
        store.save_groups([_group(0.0)], "train", 0)
    message = str(caught.value)
    assert "No space left on device" in message and "JOURNEYMAN_ROOT" in message
    monkeypatch.undo()
    assert store.trajectories_path("train", 0).read_bytes() == before
    folder = store.trajectories_path("train", 0).parent
    assert sorted(p.name for p in folder.iterdir() if not p.name.endswith(".lock")) == ["0000.jsonl"]


def test_unwritable_root_is_a_clear_storage_error(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the root folder should be")
    store = ModelStore("p", "m", root=blocker)
    with pytest.raises(StorageError, match=r"could not .* Free disk space or fix the folder's permissions"):
        store.save_groups([_group(1.0)], "train", 0)
    with pytest.raises(StorageError):
        store.append_history({"step": 0})


def test_leftover_temporaries_are_never_read(tmp_path: Path) -> None:
    store = ModelStore("p", "m", root=tmp_path)
    store.save_groups([_group(1.0)], "train", 1)
    folder = store.trajectories_path("train", 1).parent
    (folder / ".0002.jsonl.abc.tmp").write_text('{"half": ')  # what a crash mid-write leaves
    (store.checkpoints_path / ".0005.xyz.tmp").mkdir(parents=True)
    assert store.steps("train") == [1]
    assert store.checkpoint_steps() == []
    assert store.latest_checkpoint() is None


def test_checkpoint_appears_only_when_complete(tmp_path: Path) -> None:
    store = ModelStore("p", "m", root=tmp_path)
    with store.write_checkpoint(0) as folder:
        (folder / "adapter.safetensors").write_bytes(b"v0")
        assert store.checkpoint_steps() == []  # not visible while being written
    with pytest.raises(RuntimeError), store.write_checkpoint(1) as folder:
        (folder / "adapter.safetensors").write_bytes(b"half")
        raise RuntimeError("trainer killed")
    assert store.checkpoint_steps() == [0]
    assert [p.name for p in store.checkpoints_path.iterdir()] == ["0000"]
    with store.write_checkpoint(0) as folder:  # rewriting a step replaces it whole
        (folder / "other.bin").write_bytes(b"v1")
    assert sorted(p.name for p in store.checkpoint_path(0).iterdir()) == ["other.bin"]
    assert store.latest_checkpoint() == (0, store.checkpoint_path(0))


def test_files_get_the_usual_permissions(tmp_path: Path) -> None:
    mask = os.umask(0o022)
    try:
        atomic_write(tmp_path / "f.json", "{}")
        with atomic_dir(tmp_path / "d"):
            pass
    finally:
        os.umask(mask)
    assert (tmp_path / "f.json").stat().st_mode & 0o777 == 0o644
    assert (tmp_path / "d").stat().st_mode & 0o777 == 0o755


def test_concurrent_appends_from_threads_lose_nothing(tmp_path: Path) -> None:
    store = ModelStore("p", "m", root=tmp_path)

    def writer(index: int) -> None:
        other = ModelStore("p", "m", root=tmp_path)  # separate instances share the lock
        for step in range(10):
            (store if index % 2 else other).append_history({"step": step, "writer": index})

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    rows = store.read_history()
    assert sorted((r["writer"], r["step"]) for r in rows) == [(w, s) for w in range(6) for s in range(10)]


def _append_from_process(root: str, index: int) -> None:
    store = ModelStore("p", "m", root=root)
    for step in range(15):
        store.append_history({"step": step, "writer": index})


def test_concurrent_appends_from_processes_lose_nothing(tmp_path: Path) -> None:
    context = multiprocessing.get_context("spawn")
    processes = [context.Process(target=_append_from_process, args=(str(tmp_path), i)) for i in range(3)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout=60)
        assert process.exitcode == 0
    rows = ModelStore("p", "m", root=tmp_path).read_history()
    assert len(rows) == 45
    assert len({(r["writer"], r["step"]) for r in rows}) == 45


def test_corrupt_lines_name_the_file_and_line(tmp_path: Path) -> None:
    store = ModelStore("p", "m", root=tmp_path)
    store.save_groups([_group(1.0)], "train", 0)
    path = store.trajectories_path("train", 0)
    path.write_text(path.read_text() + json.dumps({"trajectories": [{"reward": "x"}]}) + "\n")
    with pytest.raises(InvalidDataError, match=r"0000\.jsonl, line 2: invalid trajectory group"):
        store.load_groups("train", 0)
    store.history_path.write_text('{"step": 0}\n{"step": \n')
    with pytest.raises(InvalidDataError, match=r"history\.jsonl, line 2: not JSON"):
        store.read_history()


def test_module_exports() -> None:
    assert set(store_module.__all__) >= {"ModelStore", "atomic_write", "atomic_dir", "validate_name"}


def test_prune_keeps_the_latest_and_the_best(tmp_path: Path) -> None:
    store = ModelStore("p", "m", root=tmp_path)
    for step in range(5):
        with store.write_checkpoint(step) as folder:
            (folder / "adapter.safetensors").write_bytes(b"w")
    for step, reward in [(1, 0.2), (2, 0.9), (2, 0.7), (3, 0.5), (4, 0.1)]:
        store.append_history({"step": step, "val/reward": reward})
    assert store.best_step("val/reward") == 2
    assert store.best_step("val/reward", higher_is_better=False) == 4
    assert store.prune_checkpoints("val/reward") == [0, 1, 3]
    assert store.checkpoint_steps() == [2, 4]
    assert sorted(p.name for p in store.checkpoints_path.iterdir()) == ["0002", "0004"]
    assert store.prune_checkpoints(None) == [2]
    assert store.checkpoint_steps() == [4]
