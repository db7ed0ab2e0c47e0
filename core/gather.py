"""Running rollouts: groups of them at once, failures recorded as data, progress shown.

::

    groups = await jm.gather_trajectory_groups(
        (jm.TrajectoryGroup(rollout(model, s) for _ in range(8)) for s in scenarios),
        max_exceptions=0.1,
    )

A rollout that raises is not lost and does not stop the batch: its exception is recorded on its
group (type, message, traceback) and counted. Only when more rollouts fail than
``max_exceptions`` allows (an int counts rollouts, a float is a share of all of them: 1.0 lets
every one fail) does the gather stop, raising :class:`~journeyman.errors.RolloutError` that
names the failures.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import statistics
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, ParamSpec, TypeVar, overload

from journeyman import plugins
from journeyman.errors import ConfigError, InvalidDataError, RolloutError
from journeyman.trajectory import Trajectory, TrajectoryGroup, first_error, rollout_observer

__all__ = ["gather_trajectory_groups", "retry"]

logger = logging.getLogger(__name__)

AfterEach = Callable[[TrajectoryGroup], Awaitable[TrajectoryGroup | list[TrajectoryGroup] | None]]


@dataclass
class _Gather:
    """Shared by the groups of one gather: counts and the progress display. The groups report
    each rollout to it (it is their :class:`~journeyman.trajectory.RolloutObserver`)."""

    total: int
    limit: int | float
    finished: int = 0
    failed: int = 0
    rewards: list[float] = field(default_factory=list)
    progress: Any = None
    task: Any = None

    def allowed(self) -> int:
        return int(self.limit * self.total) if isinstance(self.limit, float) else self.limit

    def update(self) -> None:
        if self.progress is not None:
            reward = f"{statistics.fmean(self.rewards):.3f}" if self.rewards else "-"
            self.progress.update(self.task, completed=self.finished, reward=reward, failed=self.failed)

    def rollout_finished(self, trajectory: Trajectory | None, error: Exception | None) -> None:
        self.finished += 1
        if trajectory is not None and trajectory.reward is not None:
            self.rewards.append(trajectory.reward)
        if error is not None:
            self.failed += 1
        self.update()
        if error is not None and self.failed > self.allowed():
            raise RolloutError(
                f"{self.failed} rollouts failed, more than max_exceptions allows "
                f"({self.allowed()} of {self.total}); last: {type(error).__name__}: {error}. "
                "Raise max_exceptions to carry on past failures (they stay recorded on their groups)."
            ) from error


async def gather_trajectory_groups(
    groups: Iterable[TrajectoryGroup | Awaitable[TrajectoryGroup]],
    *,
    max_exceptions: int | float = 0,
    after_each: AfterEach | None = None,
    description: str = "gather",
    progress: bool = True,
    langfuse: Any = False,
) -> list[TrajectoryGroup]:
    """Run every group's rollouts concurrently; return the groups in the order given.

    ``after_each`` runs on each group as soon as its rollouts are done (a judge, say); it may
    return the group, a list of groups, or None to drop it. If it raises, the failure is
    recorded on the group (stage ``"reward"``) and the group is kept unscored.

    ``langfuse``: True (client from the environment), a ``langfuse.Langfuse`` client or a
    ``LangfuseExporter`` exports each group to Langfuse as soon as it is finished; an export
    failure is recorded on the group (stage ``"export"``) and the gather goes on.
    """
    items = list(groups)
    if max_exceptions < 0 or (isinstance(max_exceptions, float) and max_exceptions > 1):
        raise ConfigError(
            f"max_exceptions must be a count (an int >= 0) or a share of the rollouts (a float from 0 to 1), "
            f"got {max_exceptions!r}"
        )
    exporter = plugins.exporter("langfuse", langfuse) if langfuse else None
    total = sum(len(g._pending) if isinstance(g, TrajectoryGroup) else 1 for g in items)
    state = _Gather(total=total, limit=max_exceptions)
    token = rollout_observer.set(state)
    display = _progress(description) if progress else None
    try:
        if display is not None:
            state.progress, state.task = (
                display,
                display.add_task(description, total=total, reward="-", failed=0),
            )
            display.start()

        async def run(item: TrajectoryGroup | Awaitable[TrajectoryGroup]) -> list[TrajectoryGroup]:
            group = await item
            if not isinstance(group, TrajectoryGroup):
                raise InvalidDataError(
                    f"gather_trajectory_groups got {type(group).__name__}, not a TrajectoryGroup"
                )
            finished = await _after(group)
            if exporter is not None:
                await plugins.export_groups(exporter, finished)
            return finished

        async def _after(group: TrajectoryGroup) -> list[TrajectoryGroup]:
            if after_each is None:
                return [group]
            try:
                result = await after_each(group)
            except Exception as error:
                group.record_failure(error, stage="reward")
                return [group]
            if result is None:
                return []
            return result if isinstance(result, list) else [result]

        async with asyncio.TaskGroup() as tasks:
            running = [tasks.create_task(run(item)) for item in items]
    except* RolloutError as errors:
        raise first_error(errors) from None
    finally:
        rollout_observer.reset(token)
        if display is not None:
            display.stop()
    return [group for task in running for group in task.result()]


def _progress(description: str) -> Any:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(
        TextColumn(f"[bold]{description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("reward {task.fields[reward]}  failed {task.fields[failed]}"),
        TimeElapsedColumn(),
        transient=False,
    )


P = ParamSpec("P")
R = TypeVar("R")


@overload
def retry(function: Callable[P, R], /) -> Callable[P, R]: ...
@overload
def retry(
    *,
    max_attempts: int = 3,
    delay: float = 0.25,
    backoff: float = 2.0,
    exceptions: tuple[type[BaseException], ...] = (Exception,),
) -> Callable[[Callable[P, R]], Callable[P, R]]: ...


def retry(
    function: Callable[P, R] | None = None,
    /,
    *,
    max_attempts: int = 3,
    delay: float = 0.25,
    backoff: float = 2.0,
    exceptions: tuple[type[BaseException], ...] = (Exception,),
) -> Any:
    """Retry a sync or async function on ``exceptions`` with exponential backoff; logs each retry."""
    if max_attempts < 1:
        raise ValueError("max_attempts must be at least 1")

    def waits(fn: Callable[..., Any]) -> Iterator[Callable[[BaseException], float]]:
        """One callable per attempt: given the attempt's error, it re-raises on the last
        attempt, else logs and returns the seconds to wait before the next."""
        wait = delay
        for attempt in range(1, max_attempts + 1):

            def failed(error: BaseException, attempt: int = attempt, wait: float = wait) -> float:
                if attempt == max_attempts:
                    raise error
                logger.warning(
                    "%s failed (%r); retry %d of %d in %.2f s",
                    fn.__name__,
                    error,
                    attempt,
                    max_attempts - 1,
                    wait,
                )
                return wait

            yield failed
            wait *= backoff

    def decorate(fn: Callable[P, R]) -> Callable[P, R]:
        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def async_wrapper(*args: P.args, **kwargs: P.kwargs) -> Any:
                for failed in waits(fn):
                    try:
                        return await fn(*args, **kwargs)
                    except exceptions as error:
                        await asyncio.sleep(failed(error))
                raise AssertionError("unreachable")

            return async_wrapper  # type: ignore[return-value]

        @functools.wraps(fn)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            for failed in waits(fn):
                try:
                    return fn(*args, **kwargs)
                except exceptions as error:
                    time.sleep(failed(error))
            raise AssertionError("unreachable")

        return wrapper

    return decorate(function) if function is not None else decorate
