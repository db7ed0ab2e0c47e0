"""The trainer killed mid-step, and the disk filling up under it: no partial checkpoint, exact resume.

Runs the real trainer on the embedded model (a few seconds a step on CPU); heavy: run it under
the lock.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import journeyman as jm
from journeyman.backend.training.trainer import Trainer
from journeyman.config import TrainConfig
from journeyman.store import ModelStore
from tests.integration.test_trainer import _groups

CONFIG = TrainConfig(loss="dapo", learning_rate=5e-4)

# The child trains step 1, then is held at one moment of step 2 until it is killed: mid-forward,
# mid-backward (torch's module hooks), just after the optimizer changed the weights in memory
# (torch's optimizer hook), with the checkpoint fully written under its temporary name just
# before the rename (the store's own atomic folder, held open), or with the checkpoint in place
# and its history row not yet written: the worst moments to die.
CHILD = textwrap.dedent(
    """
    import asyncio, contextlib, sys, time
    from pathlib import Path

    from torch.optim.optimizer import register_optimizer_step_post_hook

    import journeyman as jm
    from journeyman.store import ModelStore
    import journeyman.store as store_module
    from journeyman.backend.training.trainer import Trainer
    from journeyman.config import TrainConfig
    from tests.faults.test_trainer_faults import groups_for

    root, marker, moment = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    trainer = Trainer("smollm2-135m", ModelStore("test", "agent", root=root), threads=1)
    trainer.load()
    config = TrainConfig(loss="dapo", learning_rate=5e-4)
    asyncio.run(trainer.train(groups_for(trainer.tokenizer, 0), config))

    def hold(where):
        marker.write_text(where)
        time.sleep(600)

    layer = trainer.model.get_base_model().get_decoder().layers[-1]
    if moment == "forward":
        layer.register_forward_hook(lambda *args: hold("forward"))
    elif moment == "backward":
        layer.register_full_backward_hook(lambda *args: hold("backward"))
    elif moment == "optimizer":
        register_optimizer_step_post_hook(lambda *args: hold("optimizer"))
    elif moment == "history":
        trainer.store.append_history = lambda row: hold("history")
    else:
        atomic_dir = store_module.atomic_dir

        @contextlib.contextmanager
        def held_open(path):
            with atomic_dir(path) as folder:
                yield folder
                hold(str(folder))

        store_module.atomic_dir = held_open
    asyncio.run(trainer.train(groups_for(trainer.tokenizer, 1), config))
    """
)


def groups_for(tokenizer: Any, variant: int) -> list[jm.TrajectoryGroup]:
    return _groups(tokenizer, variant)


def _content(groups: list[jm.TrajectoryGroup]) -> list[list[tuple[Any, float | None]]]:
    return [[(t.conversation, t.reward) for t in group] for group in groups]


def _trainer(root: Path) -> Trainer:
    trainer = Trainer("smollm2-135m", ModelStore("test", "agent", root=root), threads=1)
    trainer.load()
    return trainer


def _lora(trainer: Trainer) -> dict[str, Any]:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" in n}


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The LoRA weights after steps 1 and 2 trained without interruption."""
    straight = _trainer(tmp_path_factory.mktemp("straight"))
    for variant in (0, 1):
        asyncio.run(straight.train(groups_for(straight.tokenizer, variant), CONFIG))
    return _lora(straight)


@pytest.mark.parametrize("moment", ["forward", "backward", "optimizer", "checkpoint", "history"])
async def test_trainer_killed_mid_step_resumes_the_exact_step(
    moment: str, tmp_path: Path, straight_run: dict[str, Any]
) -> None:
    root, marker = tmp_path / "killed", tmp_path / "held"
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(repo), "HF_HUB_OFFLINE": "1"}
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(root), str(marker), moment], env=env, start_new_session=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while not marker.exists():
            assert child.poll() is None, child.stdout.read().decode()[-3000:]  # type: ignore[union-attr]
            assert time.monotonic() < deadline, f"the child never reached step 2's {moment}"
            time.sleep(0.1)
        os.killpg(child.pid, signal.SIGKILL)
        assert child.wait(30) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()

    store = ModelStore("test", "agent", root=root)
    if moment == "history":  # the step completed; only its history row was lost
        assert marker.read_text() == "history" and store.checkpoint_steps() == [0, 1, 2]
        assert [r["step"] for r in store.read_history()] == [1]
        resumed = _trainer(root)
        assert resumed.step == 2
        rows = store.read_history()
        assert [r["step"] for r in rows] == [1, 2] and rows[-1]["recovered"] == 1
        assert "train/loss" in rows[-1]  # the step's own metrics, kept in its checkpoint
        assert store.steps("train") == [0, 1] and "interrupted" not in store.splits()
        resumed_lora = _lora(resumed)
        assert all(torch.allclose(straight_run[n], resumed_lora[n], atol=1e-6, rtol=0) for n in straight_run)
        return
    if moment == "checkpoint":
        leftover = Path(marker.read_text())
        assert leftover.is_dir() and leftover.name.startswith(".0002.")  # complete, but never renamed
    else:
        assert marker.read_text() == moment
    assert store.checkpoint_steps() == [0, 1]  # no partial checkpoint is visible
    assert [r["step"] for r in store.read_history()] == [1]
    assert store.steps("train") == [0, 1]  # step 2's trajectories were on disk before it died
    saved = store.load_groups("train", 1)
    resumed = _trainer(root)
    assert resumed.step == 1
    assert _content(saved) == _content(groups_for(resumed.tokenizer, 1))
    # never trained on: set aside, so the step's file holds only what the retried step trains on
    assert store.steps("train") == [0] and store.load_groups("interrupted", 1) == saved

    result = await resumed.train(saved, CONFIG)
    assert result.step == 2 and store.checkpoint_steps() == [0, 1, 2]
    assert [r["step"] for r in store.read_history()] == [1, 2]
    assert store.load_groups("train", 1) == saved  # the retried step's data is stored once
    resumed_lora = _lora(resumed)
    assert all(torch.allclose(straight_run[n], resumed_lora[n], atol=1e-6, rtol=0) for n in straight_run)


# The child runs in a mount namespace of its own, with the store on a tmpfs of 256 MiB: after
# step 1 it fills the disk, leaving room for step 2's trajectories (and, for "optimizer", for its
# adapter too), so a real ENOSPC hits while step 2's checkpoint is written; then it frees the space
# and trains step 2 again. It reports what it saw as JSON, and the LoRA weights go outside the tmpfs.
FULL_DISK_CHILD = textwrap.dedent(
    """
    import asyncio, json, os, sys
    from pathlib import Path

    from safetensors.torch import save_file

    import journeyman as jm
    from journeyman.store import ModelStore
    from journeyman.backend.training.trainer import ADAPTER, Trainer
    from journeyman.config import TrainConfig
    from tests.faults.test_trainer_faults import _lora, groups_for

    root, where, out = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
    trainer = Trainer("smollm2-135m", ModelStore("test", "agent", root=root), threads=1)
    trainer.load()
    store = trainer.store
    config = TrainConfig(loss="dapo", learning_rate=5e-4)
    asyncio.run(trainer.train(groups_for(trainer.tokenizer, 0), config))
    adapter = sum(f.stat().st_size for f in (store.checkpoint_path(1) / ADAPTER).rglob("*") if f.is_file())
    room = 256 * 1024 + (adapter if where == "optimizer" else 0)
    free = os.statvfs(root).f_bavail * os.statvfs(root).f_frsize
    with open(root / "filler", "wb") as filler:
        os.posix_fallocate(filler.fileno(), 0, free - room)
    report = {"adapter_bytes": adapter, "room": room}
    groups = groups_for(trainer.tokenizer, 1)
    try:
        asyncio.run(trainer.train(groups, config))
        report["error"] = None
    except Exception as error:
        report["error"] = [type(error).__name__, str(error)]
    report["step"] = trainer.step
    report["checkpoints"] = store.checkpoint_steps()
    report["hidden"] = sorted(p.name for p in store.checkpoints_path.iterdir() if p.name.startswith("."))
    report["history"] = [r["step"] for r in store.read_history()]
    report["groups_kept"] = store.load_groups("train", 1) == groups
    (root / "filler").unlink()
    result = asyncio.run(trainer.train(groups, config))
    report["retried"] = [result.step, store.checkpoint_steps(), [r["step"] for r in store.read_history()]]
    save_file(_lora(trainer), str(out))
    print("REPORT " + json.dumps(report))
    """
)


@pytest.mark.parametrize("where", ["adapter", "optimizer"])
def test_a_full_disk_at_checkpoint_is_a_clear_error_and_the_step_can_be_retried(
    where: str, tmp_path: Path, straight_run: dict[str, Any]
) -> None:
    from safetensors.torch import load_file

    root, out = tmp_path / "store", tmp_path / "lora.safetensors"
    root.mkdir()
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(repo), "HF_HUB_OFFLINE": "1"}
    # root may make a mount namespace directly; anyone else through a user namespace of their own
    unshare = ["unshare", "--mount"] if os.geteuid() == 0 else ["unshare", "--map-root-user", "--mount"]
    script = f'mount -t tmpfs -o size=256m tmpfs "$1" && exec "{sys.executable}" -c "$2" "$1" "$3" "$4"'
    done = subprocess.run(
        [*unshare, "sh", "-c", script, "sh", str(root), FULL_DISK_CHILD, where, str(out)],
        env=env, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, (
        "the test needs a tmpfs in a mount namespace of its own (unshare --mount, or user namespaces):\n"
        + done.stdout[-3000:] + done.stderr[-3000:]
    )  # fmt: skip
    (line,) = [x for x in done.stdout.splitlines() if x.startswith("REPORT ")]
    report = json.loads(line.removeprefix("REPORT "))
    assert report["error"] is not None, f"the step fit in {report['room']} bytes"
    kind, message = report["error"]
    assert kind == "StorageError" and "No space left on device" in message and "Free disk space" in message, (
        message
    )
    assert (
        report["step"] == 1 and report["checkpoints"] == [0, 1] and report["hidden"] == []
    )  # nothing partial
    assert report["history"] == [1] and report["groups_kept"]  # the step's data is kept for the retry
    assert report["retried"] == [2, [0, 1, 2], [1, 2]]  # space freed: the same call now succeeds ...
    lora = load_file(str(out))
    assert all(
        torch.allclose(straight_run[n], lora[n], atol=1e-6, rtol=0) for n in straight_run
    )  # ... exactly
