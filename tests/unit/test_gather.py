from __future__ import annotations

import asyncio
import io

import pytest
import rich
from rich.console import Console

import journeyman as jm
from journeyman.errors import RolloutError
from journeyman.gather import retry


async def rollout(reward: float, fail: bool = False, delay: float = 0.0) -> jm.Trajectory:
    await asyncio.sleep(delay)
    if fail:
        raise ConnectionError(f"rollout {reward} lost its connection")
    return jm.Trajectory(conversation=[{"role": "user", "content": str(reward)}], reward=reward)


async def test_a_group_of_coroutines_is_awaitable_and_keeps_failures() -> None:
    group = jm.TrajectoryGroup([rollout(1.0), rollout(0.0, fail=True), rollout(0.5)])
    assert group.trajectories == []
    done = await group
    assert done is group
    assert sorted(t.reward or 0 for t in group) == [0.5, 1.0]
    (failure,) = group.failures
    assert (failure.type, failure.stage) == ("ConnectionError", "rollout")
    assert "lost its connection" in failure.message and failure.traceback
    assert await group is group  # awaiting again runs nothing twice
    assert len(group) == 2


async def test_a_group_keeps_its_rollouts_in_the_order_given_not_the_order_they_finished() -> None:
    # the last rollout finishes first: a seeded run must judge and train on the same batch each time
    group = await jm.TrajectoryGroup(
        [rollout(float(r), fail=(r == 2), delay=0.02 * (4 - r)) for r in range(5)]
    )
    assert [t.reward for t in group] == [0.0, 1.0, 3.0, 4.0]
    assert len(group.failures) == 1


async def test_a_cancelled_group_keeps_the_rollouts_that_finished() -> None:
    finished = asyncio.Event()

    async def first() -> jm.Trajectory:
        trajectory = await rollout(0.0)
        finished.set()  # the group has its result as soon as this returns: no await in between
        return trajectory

    group = jm.TrajectoryGroup([first(), rollout(1.0, delay=60)])
    task = asyncio.ensure_future(group)
    await asyncio.wait_for(finished.wait(), timeout=60)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert [t.reward for t in group] == [0.0]


async def test_gather_keeps_order_and_counts_failures_under_the_limit() -> None:
    groups = await jm.gather_trajectory_groups(
        (
            jm.TrajectoryGroup(rollout(r, fail=(r == 2 and i == 0), delay=0.01 * (3 - r)) for i in range(4))
            for r in range(3)
        ),
        max_exceptions=0.25,
        progress=False,
    )
    assert [{t.reward for t in g} for g in groups] == [
        {0.0},
        {1.0},
        {2.0},
    ]  # the order given, not finish order
    assert [len(g.failures) for g in groups] == [0, 0, 1]


@pytest.mark.parametrize("limit", [0, 1, 0.1])
async def test_too_many_failures_stop_the_gather(limit: float) -> None:
    with pytest.raises(RolloutError, match=r"rollouts failed, more than max_exceptions allows"):
        await jm.gather_trajectory_groups(
            [jm.TrajectoryGroup([rollout(1.0, fail=True), rollout(2.0, fail=True), rollout(3.0)])],
            max_exceptions=limit,
            progress=False,
        )


@pytest.mark.parametrize(("limit", "failed"), [(2, 2), (1.0, 3), (0.7, 2)])
async def test_an_int_counts_failures_and_a_float_is_a_share(limit: float, failed: int) -> None:
    """An int counts rollouts, a float is a share of them: 1.0 lets every rollout fail, where it
    once meant one failure."""
    (group,) = await jm.gather_trajectory_groups(
        [jm.TrajectoryGroup([rollout(float(i), fail=i < failed) for i in range(3)])],
        max_exceptions=limit,
        progress=False,
    )
    assert len(group.failures) == failed and len(group) == 3 - failed


@pytest.mark.parametrize("limit", [-1, -0.5, 1.5])
async def test_a_max_exceptions_that_is_no_count_or_share_is_refused(limit: float) -> None:
    with pytest.raises(jm.ConfigError, match=r"a count .* or a share"):
        await jm.gather_trajectory_groups([], max_exceptions=limit)


async def test_after_each_can_rescore_drop_or_fail() -> None:
    async def judge(group: jm.TrajectoryGroup) -> jm.TrajectoryGroup | None:
        first = group.trajectories[0].reward
        if first == 0.0:
            return None  # drop
        if first == 2.0:
            raise TimeoutError("judge timed out")
        for trajectory in group:
            trajectory.reward = 10 * (trajectory.reward or 0)
        return group

    groups = await jm.gather_trajectory_groups(
        [jm.TrajectoryGroup([rollout(float(r))]) for r in range(3)], after_each=judge, progress=False
    )
    assert [g.trajectories[0].reward for g in groups] == [10.0, 2.0]
    assert [f.stage for f in groups[1].failures] == ["reward"]


async def test_a_rollout_returning_something_else_is_a_recorded_failure() -> None:
    async def bad() -> str:
        return "not a trajectory"

    (group,) = await jm.gather_trajectory_groups(
        [jm.TrajectoryGroup([bad()])], max_exceptions=1, progress=False
    )
    assert group.failures[0].type == "InvalidDataError" and "returned str" in group.failures[0].message


async def test_progress_display_shows_the_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    # The display draws on rich's global console; one that is no terminal gets the last frame only.
    screen = io.StringIO()
    monkeypatch.setattr(rich, "_console", Console(file=screen, width=120, force_terminal=False))
    groups = await jm.gather_trajectory_groups(
        [jm.TrajectoryGroup([rollout(1.0), rollout(0.0), rollout(2.0, fail=True)])],
        max_exceptions=1,
        description="step 7",
    )
    assert groups[0].reward == 0.5
    (line,) = screen.getvalue().splitlines()
    assert line.startswith("step 7 ") and " 3/3 reward 0.500  failed 1 " in line, line


async def test_retry_async_and_sync() -> None:
    calls = {"async": 0, "sync": 0}

    @retry(max_attempts=3, delay=0.001)
    async def flaky() -> str:
        calls["async"] += 1
        if calls["async"] < 3:
            raise ConnectionError("again")
        return "ok"

    @retry(max_attempts=2, delay=0.001, exceptions=(ValueError,))
    def always_fails() -> None:
        calls["sync"] += 1
        raise ValueError("no")

    assert await flaky() == "ok" and calls["async"] == 3
    with pytest.raises(ValueError, match="no"):
        always_fails()
    assert calls["sync"] == 2


def test_iterate_dataset_resumes_with_the_same_items() -> None:
    items = list(range(10))
    full = list(jm.iterate_dataset(items, per_step=3, epochs=2, seed=7))
    assert [b.step for b in full] == [0, 1, 2, 3, 4, 5]  # 3 full steps per epoch, the rest dropped
    assert [b.epoch for b in full] == [0, 0, 0, 1, 1, 1]
    assert all(len(b.items) == 3 for b in full)
    assert len({i for b in full[:3] for i in b.items}) == 9  # no repeats within an epoch
    resumed = list(jm.iterate_dataset(items, per_step=3, epochs=2, seed=7, initial_step=4))
    assert resumed == full[4:]
    with pytest.raises(ValueError, match="cannot fill one step"):
        list(jm.iterate_dataset([1], per_step=2))
