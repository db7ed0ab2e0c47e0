"""The trainer killed mid-step, and the disk filling up under it: no partial checkpoint, exact resume.

Runs the real trainer on the embedded model (a few seconds a step on CPU); heavy: run it under
the lock.
"""

from __future__ import annotations

import errno
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
from journeyman.backend.trainer import Trainer
from journeyman.config import TrainConfig
from tests.integration.test_trainer import _groups

CONFIG = TrainConfig(loss="dapo", learning_rate=5e-4)

# The child trains step 1, then step 2 stalls with its checkpoint fully written under the
# temporary name, just before the rename: the worst moment to die.
CHILD = textwrap.dedent(
    """
    import asyncio, contextlib, sys, time
    from pathlib import Path

    import journeyman as jm
    import journeyman.store as store_module
    from journeyman.backend.trainer import Trainer
    from journeyman.config import TrainConfig
    from tests.faults.test_trainer_faults import groups_for

    root, marker = Path(sys.argv[1]), Path(sys.argv[2])
    trainer = Trainer("smollm2-135m", jm.ModelStore("test", "agent", root=root), threads=1)
    trainer.load()
    config = TrainConfig(loss="dapo", learning_rate=5e-4)
    asyncio.run(trainer.train(groups_for(trainer.tokenizer, 0), config))
    atomic_dir = store_module.atomic_dir

    @contextlib.contextmanager
    def stalled(path):
        with atomic_dir(path) as folder:
            yield folder
            marker.write_text(str(folder))
            time.sleep(600)

    store_module.atomic_dir = stalled
    asyncio.run(trainer.train(groups_for(trainer.tokenizer, 1), config))
    """
)


def groups_for(tokenizer: Any, variant: int) -> list[jm.TrajectoryGroup]:
    return _groups(tokenizer, variant)


def _content(groups: list[jm.TrajectoryGroup]) -> list[list[tuple[Any, float | None]]]:
    return [[(t.conversation, t.reward) for t in group] for group in groups]


def _trainer(root: Path) -> Trainer:
    trainer = Trainer("smollm2-135m", jm.ModelStore("test", "agent", root=root), threads=1)
    trainer.load()
    return trainer


def _lora(trainer: Trainer) -> dict[str, Any]:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" in n}


async def test_trainer_killed_mid_checkpoint_resumes_the_exact_step(tmp_path: Path) -> None:
    root, marker = tmp_path / "killed", tmp_path / "stalled"
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(repo), "HF_HUB_OFFLINE": "1"}
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(root), str(marker)], env=env, start_new_session=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while not marker.exists():
            assert child.poll() is None, child.stdout.read().decode()[-3000:]  # type: ignore[union-attr]
            assert time.monotonic() < deadline, "the child never reached the step-2 checkpoint"
            time.sleep(0.1)
        os.killpg(child.pid, signal.SIGKILL)
        assert child.wait(30) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()

    store = jm.ModelStore("test", "agent", root=root)
    leftover = Path(marker.read_text())
    assert leftover.is_dir() and leftover.name.startswith(".0002.")  # complete, but never renamed
    assert store.checkpoint_steps() == [0, 1]  # no partial checkpoint is visible
    assert [r["step"] for r in store.read_history()] == [1]
    assert store.steps("train") == [0, 1]  # step 2's trajectories were on disk before it died
    saved = store.load_groups("train", 1)
    resumed = _trainer(root)
    assert resumed.step == 1
    assert _content(saved) == _content(groups_for(resumed.tokenizer, 1))

    result = await resumed.train(saved, CONFIG)
    assert result.step == 2 and store.checkpoint_steps() == [0, 1, 2]
    assert [r["step"] for r in store.read_history()] == [1, 2]
    assert store.load_groups("train", 1) == saved  # the retried step's data is stored once

    straight = _trainer(tmp_path / "straight")
    for variant in (0, 1):
        await straight.train(groups_for(straight.tokenizer, variant), CONFIG)
    a, b = _lora(straight), _lora(resumed)
    assert all(torch.allclose(a[n], b[n], atol=1e-6, rtol=0) for n in a)  # the same step as never killed


async def test_disk_full_at_checkpoint_is_a_clear_error_and_the_step_can_be_retried(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    trainer = _trainer(tmp_path)
    groups = groups_for(trainer.tokenizer, 0)
    real_replace = os.replace

    def disk_full(src: Any, dst: Any) -> None:
        if Path(dst).name == "0001":
            raise OSError(errno.ENOSPC, "No space left on device")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", disk_full)
    with pytest.raises(jm.StorageError, match=r"No space left on device.*Free disk space"):
        await trainer.train(groups, CONFIG)
    assert trainer.step == 0 and trainer.store.checkpoint_steps() == [0]
    assert trainer.store.read_history() == []
    assert not [p for p in trainer.store.checkpoints_path.iterdir() if p.name.startswith(".")]
    assert trainer.store.load_groups("train", 0) == groups  # the data of the step is kept

    monkeypatch.undo()  # space freed: the same call now succeeds, from the last saved weights
    result = await trainer.train(groups, CONFIG)
    assert result.step == 1 and trainer.store.checkpoint_steps() == [0, 1]
    assert trainer.store.load_groups("train", 0) == groups
    reference = _trainer(tmp_path / "reference")
    await reference.train(groups, CONFIG)
    a, b = _lora(reference), _lora(trainer)
    assert all(torch.allclose(a[n], b[n], atol=1e-6, rtol=0) for n in a)
