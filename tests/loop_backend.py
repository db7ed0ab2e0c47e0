"""A backend whose "training" only counts steps: enough to drive ``jm.TrainingLoop`` in unit tests.

It keeps what a real backend keeps in the model's store (the train split's groups, a ``train``
history row, a checkpoint folder per step), so resume, best-checkpoint and restore logic read the
same files they read after a LocalBackend, and it reports the serving state a test scripts.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import journeyman as jm
from journeyman.model import Registration, ServingState, TrainResult


class CountingBackend:
    def __init__(self, train_seconds: float = 0.0) -> None:
        self.step = 0
        self.train_seconds = train_seconds
        self.trained: list[list[jm.TrajectoryGroup]] = []
        self.state = ServingState()
        self.fail_next_train: BaseException | None = None
        self.waited: list[bool] = []
        """``judges`` of each ``wait_serving`` call."""

    async def register(self, model: jm.TrainableModel) -> Registration:
        latest = model.store.latest_checkpoint()
        self.step = latest[0] if latest else 0
        return Registration(base_url="http://127.0.0.1:9/v1", api_key="-", step=self.step)

    async def get_step(self, model: jm.TrainableModel) -> int:
        return self.step

    async def train(
        self, model: jm.TrainableModel, groups: Sequence[jm.TrajectoryGroup], config: Any, **_: Any
    ) -> TrainResult:
        if self.fail_next_train is not None:
            error, self.fail_next_train = self.fail_next_train, None
            raise error
        await asyncio.sleep(self.train_seconds)
        model.store.save_groups(groups, "train", self.step)
        self.step += 1
        with model.store.write_checkpoint(self.step) as folder:
            (folder / "adapter.txt").write_text(str(self.step))
        self.trained.append(list(groups))
        model.store.append_history({"step": self.step, "split": "train", "loss": 0.0})
        return TrainResult(step=self.step, metrics={"loss": 0.0})

    async def list_checkpoints(self, model: jm.TrainableModel) -> list[int]:
        return model.store.checkpoint_steps()

    async def delete_checkpoints(
        self, model: jm.TrainableModel, best_metric: str | None, *, higher_is_better: bool = True
    ) -> list[int]:
        return model.store.prune_checkpoints(best_metric, higher_is_better=higher_is_better)

    async def serving_state(self) -> ServingState:
        return self.state

    async def wait_serving(self, timeout: float = 900.0, *, judges: bool = False) -> None:
        self.waited.append(judges)
        self.state = (
            replace(self.state, judge_down=False) if judges else replace(self.state, policy_down=False)
        )

    def viewer_url(self, model: jm.TrainableModel) -> str | None:
        return None
