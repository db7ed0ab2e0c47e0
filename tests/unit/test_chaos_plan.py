"""bench.chaos's plan: which step and phase each fault waits for."""

from __future__ import annotations

import pytest

from bench.chaos import AT_ONCE, FIXED_PHASE, KINDS, plan


@pytest.mark.parametrize("seed", range(5))
def test_faults_take_steps_of_their_own_while_there_are_steps_enough(seed: int) -> None:
    faults = plan(10, 26, list(KINDS), seed=seed, max_delay=8.0)
    assert [f.kind for f in faults] == [*KINDS, *KINDS]  # kinds in turn
    steps = [f.step for f in faults]
    assert [f.planned_step for f in faults] == steps  # kept when a fault slips to a later step
    assert steps == sorted(steps) and len(set(steps)) == 10 and all(0 <= s < 26 for s in steps)
    for fault in faults:
        assert fault.phase == FIXED_PHASE.get(fault.kind, fault.phase)
        # A train or deploy phase can last a tenth of a second: those faults go in at once, and
        # the judge's server dies as the rollouts begin (judged later, a fast step's groups were
        # judged before it died).
        if fault.phase == "rollouts" and fault.kind not in AT_ONCE:
            assert 0 <= fault.delay <= 8.0
        else:
            assert fault.delay == 0.0


def test_more_faults_than_steps_share_steps() -> None:
    faults = plan(5, 2, ["vllm"], seed=0, max_delay=1.0)
    assert len(faults) == 5 and {f.step for f in faults} <= {0, 1}


def test_the_same_seed_plans_the_same_run() -> None:
    assert plan(5, 5, list(KINDS), seed=3, max_delay=4.0) == plan(5, 5, list(KINDS), seed=3, max_delay=4.0)
