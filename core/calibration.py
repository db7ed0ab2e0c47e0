"""Judge calibration: how far a judge's ranking of a group can be trusted, before it trains a model.

Give groups whose trajectories carry a known reward (a programmatic check, or labels a person
gave) and a judge::

    from journeyman.calibration import calibrate_judge

    report = await calibrate_judge(groups, judge, orders=3)
    print(report.table())
    report.save("calibration.json")
    if not report.better_than_chance():
        ...  # do not train on this judge

Each group is shown to the judge in ``orders`` presentations: as given, then shuffled, each with
another trajectory first. A trajectory's judged score is its mean over the presentations. What is
measured, per group and over all of them:

- ``pairwise_accuracy``: over pairs of trajectories whose known rewards differ, the share the judge
  orders the same way (a tie counts half, as a coin would). Chance is 0.5.
- ``kendall_tau``: Kendall's tau-b between the known rewards and the judged scores, per group
  (None where either is constant), and its mean.
- ``position_consistency``: over pairs of different trajectories, the share the judge orders the
  same way in every presentation (its agreement with itself when only the order changes).
- ``first_position_bias``: how much higher a trajectory scores when it is shown first than its
  mean over all presentations. 0 for a judge that reads content only.
- ``advantage_alignment``: the cosine between the GRPO advantages the judged scores give and those
  the known rewards give, over every trajectory of every group (groups where the known reward is
  constant included: there any judged advantage is noise). 1: a training step on the judge moves
  the model as one on the known reward would; 0: unrelated. With ``scale="group"`` each group's
  advantages are divided by its std, as the trainer does by default; with ``"none"`` they are not
  (``"batch"`` divides all by one number, so its cosine is the same). ``noise_share`` is the part
  of the judged advantages' squared sum that falls in groups whose known rewards are all equal.
  The same cosine is reported with the rewards made of ranks or of the best attempts
  (``ruler_score_group(reward_from=...)``), so calibration can choose between them.
- ties, failed presentations (the judge's errors, recorded and counted, never raised), judge calls,
  seconds and tokens.

No peer framework calibrates its judge; OpenPipe ART's RULER is trusted as it comes.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable, Iterable, Sequence
from itertools import combinations
from typing import Any

from journeyman.calibration_report import Calibration, GroupCalibration, group_advantages, kendall_tau
from journeyman.errors import ConfigError, InvalidDataError, JudgeError
from journeyman.judge_client import Judge
from journeyman.judge_probes import probes as probes_of
from journeyman.ruler import Method, judge_trajectories, method_for
from journeyman.trajectory import Trajectory, TrajectoryGroup

__all__ = [
    "Calibration",
    "GroupCalibration",
    "calibrate_judge",
    "group_advantages",
    "kendall_tau",
    "known_reward",
]


def known_reward(trajectory: Trajectory) -> float | None:
    """The reward a trajectory had before any judge scored it (the default truth)."""
    value = trajectory.metrics.get("programmatic_reward", trajectory.reward)
    return None if value is None else float(value)


async def calibrate_judge(
    groups: Iterable[TrajectoryGroup],
    judge: Judge,
    *,
    orders: int | None = None,
    rubric: str | None = None,
    method: Method = "auto",
    criteria: Sequence[str] | None = None,
    reference: bool = False,
    truth: Callable[[Trajectory], float | None] = known_reward,
    seed: int = 0,
    probes: bool = False,
) -> Calibration:
    """Judge each group in ``orders`` presentations and compare the scores with ``truth``.

    ``method``, ``rubric``, ``criteria`` and ``reference`` are :func:`~journeyman.ruler.judge_trajectories`' own. ``orders``
    defaults to 3 for ``scores``, 1 for ``verdict``, which judges each trajectory alone (where
    order cannot matter). The report's ``method`` is the one used (what ``auto`` became).

    ``truth`` gives each trajectory's known reward (default: its programmatic reward, kept in
    ``metrics["programmatic_reward"]`` once a judge has scored it, else its ``reward``);
    trajectories without one are left out. Groups are judged one after another, a group's
    presentations at once (within ``judge.max_concurrency``), so each group's seconds are its own.
    A presentation the judge fails (:class:`~journeyman.errors.JudgeError`) is recorded in the
    group's ``errors`` and counted; the others still count.

    ``probes``: also judge, beside each group, the probes of each success (its final answer without
    the work before it, that answer as text when it was a tool call, and the work without the answer:
    :func:`~journeyman.judge_probes.probes`), in one more presentation, and count how often the
    success scores higher. A judge that trains a
    policy must score low what the policy can learn to do, not only rank what it does now.
    """
    if orders is None:
        orders = 3 if method_for(judge, method) == "scores" else 1
    if orders < 1:
        raise ConfigError(f"orders must be >= 1 (presentations of each group), got {orders}")
    judging = {"rubric": rubric, "method": method, "criteria": criteria, "reference": reference}
    report = Calibration(
        judge=judge.name,
        orders=orders,
        groups=[],
        method=method,
        criteria=None if criteria is None else list(criteria),
        reference=reference,
    )
    start = time.perf_counter()
    for group in groups:
        if not isinstance(group, TrajectoryGroup):
            raise InvalidDataError(f"calibrate_judge takes TrajectoryGroups, got a {type(group).__name__}")
        known = [(t, r) for t in group.trajectories if (r := truth(t)) is not None]
        if len(known) < 2:
            report.skipped.append(f"{group.id}: {len(known)} trajectory(ies) with a known reward, 2 needed")
            continue
        calibrated = await _calibrate_group(group.id, known, judge, orders, judging, seed)
        if probes:
            await _probe_group(calibrated, known, judge, judging)
        report.groups.append(calibrated)
    report.seconds = time.perf_counter() - start
    report.method = method_for(judge, method)
    return report


def presentation_orders(n: int, orders: int, rng: random.Random) -> list[list[int]]:
    """The given order, then shuffles, each with another trajectory first while there is one."""
    result = [list(range(n))]
    while len(result) < orders:
        order = list(range(n))
        rng.shuffle(order)
        firsts = {o[0] for o in result}
        if len(firsts) < n and order[0] in firsts:  # put an index not yet shown first in front
            swap = order.index(rng.choice([i for i in range(n) if i not in firsts]))
            order[0], order[swap] = order[swap], order[0]
        result.append(order)
    return result


async def _calibrate_group(
    group_id: str,
    known: list[tuple[Trajectory, float]],
    judge: Judge,
    orders: int,
    judging: dict[str, Any],
    seed: int,
) -> GroupCalibration:
    trajectories = [t for t, _ in known]
    rewards = [r for _, r in known]
    n = len(trajectories)
    result = GroupCalibration(group_id, n, rewards=rewards)
    calls, prompt_tokens, completion_tokens = judge.calls, judge.prompt_tokens, judge.completion_tokens
    start = time.perf_counter()

    async def present(order: list[int]) -> list[float] | str:
        try:
            shown = [trajectories[i] for i in order]
            judgement = await judge_trajectories(shown, judge=judge, **judging)
        except JudgeError as error:
            return f"{type(error).__name__}: {error}"
        result.cached += judgement.cached
        scores = [0.0] * n
        for position, index in enumerate(order):
            scores[index] = judgement.scores[position].score
        return scores

    plans = presentation_orders(n, orders, random.Random(f"{seed}:{group_id}"))
    answers = await asyncio.gather(*(present(order) for order in plans))
    result.seconds = time.perf_counter() - start
    result.calls = judge.calls - calls
    result.prompt_tokens = judge.prompt_tokens - prompt_tokens
    result.completion_tokens = judge.completion_tokens - completion_tokens
    result.errors = [answer for answer in answers if isinstance(answer, str)]
    scored = [
        (order, answer) for order, answer in zip(plans, answers, strict=True) if not isinstance(answer, str)
    ]
    result.presentations = len(scored)
    if not scored:
        return result
    mean = [sum(answer[i] for _, answer in scored) / len(scored) for i in range(n)]
    result.scores = mean
    distinct = [_content(trajectory) for trajectory in trajectories]
    for i, j in combinations(range(n), 2):
        if rewards[i] != rewards[j]:
            result.pairs += 1
            judged = (mean[i] > mean[j]) - (mean[i] < mean[j])
            if judged == 0:
                result.ties += 1
            elif judged == ((rewards[i] > rewards[j]) - (rewards[i] < rewards[j])):
                result.correct += 1
            else:
                result.wrong += 1
        if distinct[i] != distinct[j]:
            result.different_pairs += 1
            signs = {(answer[i] > answer[j]) - (answer[i] < answer[j]) for _, answer in scored}
            result.consistent_pairs += len(signs) == 1
    result.kendall_tau = kendall_tau(rewards, mean)
    if len(scored) > 1:
        result.first_position_bias = sum(answer[order[0]] - mean[order[0]] for order, answer in scored) / len(
            scored
        )
    return result


async def _probe_group(
    result: GroupCalibration, known: list[tuple[Trajectory, float]], judge: Judge, judging: dict[str, Any]
) -> None:
    """Judge the group with the probes of each success after it; record
    how each scored against its success, in the same presentation."""
    top = max(r for _, r in known)
    if top == min(r for _, r in known):
        return  # no success to tell apart from a failure
    made = [(i, copy) for i, (t, r) in enumerate(known) if r == top for copy in probes_of(t)]
    if not made:
        return
    shown = [t for t, _ in known] + [copy for _, copy in made]
    start = time.perf_counter()
    try:
        judgement = await judge_trajectories(shown, judge=judge, **judging)
    except JudgeError as error:
        result.errors.append(f"probes: {type(error).__name__}: {error}")
        return
    finally:
        result.seconds += time.perf_counter() - start
    scores = [score.score for score in judgement.scores]
    result.probe_scores = [(scores[i], scores[len(known) + k]) for k, (i, _) in enumerate(made)]


def _content(trajectory: Trajectory) -> str:
    """What the judge is shown of a trajectory: its histories' messages and tools."""
    histories = [
        [history.openai_messages(), [tool.model_dump(exclude_none=True) for tool in history.tools or []]]
        for history in trajectory.histories
    ]
    return json.dumps(histories, sort_keys=True, default=str)
