"""A judge that is down or never answers: retried, then recorded; never trained on with made-up scores."""

from __future__ import annotations

import asyncio
import functools
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

import journeyman as jm
from journeyman.judge import Judge, judge_group


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A server that accepts connections and never answers."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(16)
        accepted: list[socket.socket] = []
        stop = threading.Event()

        def accept() -> None:
            server.settimeout(0.1)
            while not stop.is_set():
                try:
                    accepted.append(server.accept()[0])
                except TimeoutError:
                    continue

        thread = threading.Thread(target=accept, daemon=True)
        thread.start()
        yield server.getsockname()[1]
        stop.set()
        thread.join()
        for connection in accepted:
            connection.close()


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _group() -> jm.TrajectoryGroup:
    return jm.TrajectoryGroup(
        jm.Trajectory(
            conversation=[{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": answer}],
            reward=reward,
        )
        for answer, reward in [("4", 1.0), ("5", 0.0)]
    )


@pytest.mark.parametrize(
    ("fault", "why"), [("down", "could not reach judge 'judge'"), ("silent", "did not answer within 1.0 s")]
)
async def test_a_judge_that_is_down_or_silent_is_retried_then_recorded(
    fault: str, why: str, silent_port: int, tmp_path: Path
) -> None:
    port = _closed_port() if fault == "down" else silent_port
    judge = Judge("judge", base_url=f"http://127.0.0.1:{port}/v1", timeout=1.0, max_retries=1,
                     retry_delay=0.1, cache_dir=tmp_path)  # fmt: skip

    async def rollout(trajectory: jm.Trajectory) -> jm.Trajectory:
        return trajectory

    groups = await asyncio.wait_for(  # the judge's timeout x attempts bound it: a hang fails here
        jm.gather_trajectory_groups(
            [jm.TrajectoryGroup(rollout(t) for t in _group())],
            after_each=functools.partial(judge_group, judge=judge, method="scores"),
            progress=False,
        ),
        timeout=120,
    )
    (group,) = groups
    (failure,) = group.failures
    assert failure.stage == "judge" and failure.type == "JudgeError"
    assert "for 2 trajectories in 2 attempts: attempt 1: " in failure.message, failure.message
    assert failure.message.count(why) == 2, failure.message  # each attempt's own reason
    assert [t.reward for t in group] == [None, None]  # not trained on with invented scores
    assert sorted(t.metrics["programmatic_reward"] for t in group) == [0.0, 1.0]  # the earlier reward is kept


async def test_the_configured_fallback_is_used_and_marked(tmp_path: Path) -> None:
    judge = Judge("judge", base_url=f"http://127.0.0.1:{_closed_port()}/v1", timeout=1.0, max_retries=0,
                     cache_dir=tmp_path)  # fmt: skip
    group = await judge_group(_group(), judge=judge, fallback=0.5)
    assert [t.reward for t in group] == [0.5, 0.5]
    assert group.failures and group.failures[0].stage == "judge"
