"""Walking a dataset in training steps, resumable from the model's step."""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

__all__ = ["DatasetBatch", "iterate_dataset"]

T = TypeVar("T")


@dataclass(frozen=True)
class DatasetBatch(Generic[T]):
    items: list[T]
    step: int
    """The training step this batch is for (``await model.get_step()`` when resuming)."""
    epoch: int
    epoch_step: int


def iterate_dataset(
    items: Sequence[T], *, per_step: int = 1, epochs: int = 1, initial_step: int = 0, seed: int | None = 0
) -> Iterator[DatasetBatch[T]]:
    """Yield ``per_step`` items per training step, shuffled per epoch (deterministically for a
    seed), starting at ``initial_step``: resuming after a restart continues with the same items
    the uninterrupted run would have seen. A last partial batch of an epoch is dropped."""
    if per_step < 1 or epochs < 1 or initial_step < 0:
        raise ValueError("per_step and epochs must be >= 1 and initial_step >= 0")
    steps_per_epoch = len(items) // per_step
    if steps_per_epoch == 0:
        raise ValueError(f"{len(items)} items cannot fill one step of {per_step}")
    for epoch in range(epochs):
        order = list(range(len(items)))
        if seed is not None:
            random.Random(seed + epoch).shuffle(order)
        for epoch_step in range(steps_per_epoch):
            step = epoch * steps_per_epoch + epoch_step
            if step < initial_step:
                continue
            chosen = order[epoch_step * per_step : (epoch_step + 1) * per_step]
            yield DatasetBatch([items[i] for i in chosen], step, epoch, epoch_step)
