"""Judge calibration: how far a judge's ranking of a group can be trusted, before it trains a model.

Give groups whose trajectories carry a known reward (a programmatic check, or labels a person
gave) and a judge::

    report = await jm.calibrate_judge(groups, judge, orders=3)
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
import math
import random
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from itertools import combinations
from pathlib import Path
from typing import Any

from journeyman.config import Scale
from journeyman.errors import ConfigError, InvalidDataError, JudgeError
from journeyman.judge import Judge
from journeyman.ruler import Method, RewardFrom, judge_trajectories, judged_rewards
from journeyman.trajectory import Trajectory, TrajectoryGroup

__all__ = ["Calibration", "GroupCalibration", "calibrate_judge", "group_advantages", "known_reward"]

_TABLE_SCALES: tuple[tuple[Scale, str], ...] = (
    ("group", "scaled by group std"),
    ("none", "unscaled or batch-scaled"),
)


def known_reward(trajectory: Trajectory) -> float | None:
    """The reward a trajectory had before any judge scored it (the default truth)."""
    value = trajectory.metrics.get("programmatic_reward", trajectory.reward)
    return None if value is None else float(value)


@dataclass
class GroupCalibration:
    """One group's calibration."""

    group_id: str
    trajectories: int
    """Trajectories with a known reward (the others are left out)."""
    presentations: int = 0
    """Presentations the judge scored (``orders`` less those that failed)."""
    pairs: int = 0
    """Pairs whose known rewards differ."""
    correct: int = 0
    wrong: int = 0
    ties: int = 0
    """Pairs with different known rewards that the judge scored equal."""
    kendall_tau: float | None = None
    consistent_pairs: int = 0
    different_pairs: int = 0
    """Pairs of trajectories with different content: what ``position_consistency`` is counted over."""
    first_position_bias: float | None = None
    calls: int = 0
    cached: int = 0
    """Presentations answered from the judge's cache (they cost no time)."""
    seconds: float = 0.0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    errors: list[str] = field(default_factory=list)
    """Why each failed presentation failed."""
    scores: list[float] = field(default_factory=list)
    """Each trajectory's mean judged score, in the group's order."""
    rewards: list[float] = field(default_factory=list)
    """Each trajectory's known reward, in the group's order."""

    @property
    def pairwise_accuracy(self) -> float | None:
        return None if not self.pairs else (self.correct + self.ties / 2) / self.pairs

    @property
    def position_consistency(self) -> float | None:
        return (
            None
            if not self.different_pairs or self.presentations < 2
            else self.consistent_pairs / self.different_pairs
        )


@dataclass
class Calibration:
    """A judge's calibration over many groups: see the module's docstring for each measure."""

    judge: str
    orders: int
    groups: list[GroupCalibration]
    method: Method = "scores"
    criteria: list[str] | None = None
    """The yes/no questions a verdict judge was asked instead of whether the goal was achieved."""
    reference: bool = False
    """The judge wrote how each task should be done before it judged the attempts."""
    skipped: list[str] = field(default_factory=list)
    """Groups left out, and why (fewer than two trajectories with a known reward)."""
    seconds: float = 0.0

    def _sum(self, name: str) -> int:
        return sum(getattr(group, name) for group in self.groups)

    @property
    def pairs(self) -> int:
        return self._sum("pairs")

    @property
    def correct(self) -> int:
        return self._sum("correct")

    @property
    def wrong(self) -> int:
        return self._sum("wrong")

    @property
    def ties(self) -> int:
        return self._sum("ties")

    @property
    def failed(self) -> int:
        """Presentations the judge failed to score."""
        return sum(len(group.errors) for group in self.groups)

    @property
    def pairwise_accuracy(self) -> float | None:
        return None if not self.pairs else (self.correct + self.ties / 2) / self.pairs

    @property
    def kendall_tau(self) -> float | None:
        """The mean of the groups' Kendall tau-b, over the groups where it is defined."""
        taus = [group.kendall_tau for group in self.groups if group.kendall_tau is not None]
        return None if not taus else sum(taus) / len(taus)

    @property
    def position_consistency(self) -> float | None:
        different = self._sum("different_pairs") if self.orders > 1 else 0
        return None if not different else self._sum("consistent_pairs") / different

    @property
    def first_position_bias(self) -> float | None:
        biases = [group.first_position_bias for group in self.groups if group.first_position_bias is not None]
        return None if not biases else sum(biases) / len(biases)

    @property
    def p_value(self) -> float:
        """The sign test: the chance that a coin, deciding the pairs the judge decided (its ties
        left out, as the sign test does), orders at least ``correct`` of them right. A judge that
        ties everything decides nothing: 1."""
        n = self.correct + self.wrong
        return sum(math.comb(n, k) for k in range(self.correct, n + 1)) / 2**n if n else 1.0

    def better_than_chance(self, alpha: float = 0.05) -> bool:
        """Whether the judge orders pairs better than a coin where it orders them at all, at
        significance ``alpha`` (one-sided sign test). Its ties, which teach nothing but mislead
        nowhere, show in ``pairwise_accuracy`` (counted half) and ``ties``."""
        return self.p_value < alpha

    def _advantages(
        self, scale: Scale, reward_from: RewardFrom = "score"
    ) -> tuple[list[float], list[float], list[bool]]:
        """Judged and known advantages of every scored trajectory, and whether its group's known
        rewards vary; the judged rewards made of the scores as ``reward_from`` says."""
        judged: list[float] = []
        known: list[float] = []
        varies: list[bool] = []
        for group in self.groups:
            if not group.scores:
                continue
            judged += group_advantages(judged_rewards(group.scores, reward_from), scale)
            known += group_advantages(group.rewards, scale)
            varies += [len(set(group.rewards)) > 1] * len(group.rewards)
        return judged, known, varies

    def advantage_alignment(self, scale: Scale = "group", reward_from: RewardFrom = "score") -> float | None:
        """The cosine between judged and known advantages (see the module's docstring), the judged
        rewards made of the scores as in ``ruler_score_group(reward_from=...)``; None when either is
        all zero."""
        judged, known, _ = self._advantages(scale, reward_from)
        norm = math.sqrt(sum(a * a for a in judged) * sum(b * b for b in known))
        return None if norm == 0 else sum(a * b for a, b in zip(judged, known, strict=True)) / norm

    def noise_share(self, scale: Scale = "group") -> float | None:
        """The share of the judged advantages' squared sum in groups whose known rewards are equal."""
        judged, _, varies = self._advantages(scale)
        total = sum(a * a for a in judged)
        return (
            None if total == 0 else sum(a * a for a, v in zip(judged, varies, strict=True) if not v) / total
        )

    def to_dict(self) -> dict[str, Any]:
        summary = {
            name: getattr(self, name)
            for name in (
                "pairs", "correct", "wrong", "ties", "failed", "pairwise_accuracy", "kendall_tau",
                "position_consistency", "first_position_bias", "p_value",
            )
        }  # fmt: skip
        for scale, _ in _TABLE_SCALES:
            summary[f"advantage_alignment_{scale}"] = self.advantage_alignment(scale)
            summary[f"noise_share_{scale}"] = self.noise_share(scale)
        for made_of in ("rank", "best"):
            summary[f"advantage_alignment_group_{made_of}"] = self.advantage_alignment("group", made_of)
        groups = [
            {
                **asdict(group),
                "pairwise_accuracy": group.pairwise_accuracy,
                "position_consistency": group.position_consistency,
            }
            for group in self.groups
        ]
        return {"judge": self.judge, "method": self.method, "criteria": self.criteria, "reference": self.reference, "orders": self.orders, "seconds": self.seconds, "summary": summary,
                "skipped": self.skipped, "groups": groups}  # fmt: skip

    def save(self, path: str | Path) -> Path:
        """Write the report as JSON; returns the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path

    def table(self) -> str:
        """The report as a text table: one row per group, then the totals."""
        header = ("group", "n", "pairs", "right", "wrong", "ties", "accuracy", "tau", "consistent", "1st bias",
                  "failed", "s", "tokens in/out")  # fmt: skip
        rows = [
            _row(group.group_id[:12], group, group.pairwise_accuracy, group.position_consistency)
            for group in self.groups
        ]
        rows.append(_row("all", self, self.pairwise_accuracy, self.position_consistency))
        widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
        lines = [
            "  ".join(str(cell).rjust(width) for cell, width in zip(row, widths, strict=True))
            for row in [header, *rows]
        ]
        verdict = "better than chance" if self.better_than_chance() else "NOT better than chance"
        lines.append(
            f"judge {self.judge} ({self.method}), {self.orders} presentation(s) a group: {verdict} (sign test p = {self.p_value:.3g})"
            + (f"; {len(self.skipped)} group(s) skipped" if self.skipped else "")
        )
        lines.append(
            "advantages vs the known reward's: cosine "
            + ", ".join(
                f"{_number(self.advantage_alignment(scale))} ({label}; noise share {_number(self.noise_share(scale))})"
                for scale, label in _TABLE_SCALES
            )
            + "; rewards made of ranks "
            + _number(self.advantage_alignment("group", "rank"))
            + ", of the best 1 and the rest 0 "
            + _number(self.advantage_alignment("group", "best"))
            + " (scaled by group std)"
        )
        return "\n".join(lines)


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _row(name: str, source: Any, accuracy: float | None, consistency: float | None) -> tuple[str, ...]:
    groups = source.groups if isinstance(source, Calibration) else [source]
    failed = sum(len(group.errors) for group in groups)
    seconds = sum(group.seconds for group in groups)
    tokens = f"{sum(g.prompt_tokens for g in groups)}/{sum(g.completion_tokens for g in groups)}"
    n = sum(group.trajectories for group in groups)
    return (name, str(n), str(source.pairs), str(source.correct), str(source.wrong), str(source.ties),
            _number(accuracy), _number(source.kendall_tau), _number(consistency), _number(source.first_position_bias),
            str(failed), f"{seconds:.1f}", tokens)  # fmt: skip


async def calibrate_judge(
    groups: Iterable[TrajectoryGroup],
    judge: Judge,
    *,
    orders: int | None = None,
    rubric: str | None = None,
    method: Method = "scores",
    criteria: Sequence[str] | None = None,
    reference: bool = False,
    truth: Callable[[Trajectory], float | None] = known_reward,
    seed: int = 0,
) -> Calibration:
    """Judge each group in ``orders`` presentations and compare the scores with ``truth``.

    ``method``, ``rubric``, ``criteria`` and ``reference`` are :func:`~journeyman.ruler.judge_trajectories`' own. ``orders``
    defaults to 3 for ``scores``, 1 for ``verdict``, which judges each trajectory alone (where
    order cannot matter).

    ``truth`` gives each trajectory's known reward (default: its programmatic reward, kept in
    ``metrics["programmatic_reward"]`` once a judge has scored it, else its ``reward``);
    trajectories without one are left out. Groups are judged one after another, a group's
    presentations at once (within ``judge.max_concurrency``), so each group's seconds are its own.
    A presentation the judge fails (:class:`~journeyman.errors.JudgeError`) is recorded in the
    group's ``errors`` and counted; the others still count.
    """
    if orders is None:
        orders = 3 if method == "scores" else 1
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
        report.groups.append(await _calibrate_group(group.id, known, judge, orders, judging, seed))
    report.seconds = time.perf_counter() - start
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


def _content(trajectory: Trajectory) -> str:
    """What the judge is shown of a trajectory: its histories' messages and tools."""
    histories = [
        [history.openai_messages(), [tool.model_dump(exclude_none=True) for tool in history.tools or []]]
        for history in trajectory.histories
    ]
    return json.dumps(histories, sort_keys=True, default=str)


def group_advantages(rewards: list[float], scale: Scale = "group", eps: float = 1e-6) -> list[float]:
    """GRPO's advantages of one group, as the trainer computes them: reward less the group's mean,
    divided by the group's std with ``scale="group"``; all 0 when the rewards are equal."""
    mean = sum(rewards) / len(rewards)
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
    if len(rewards) < 2 or std <= eps:
        return [0.0] * len(rewards)
    return [(r - mean) / (std + eps if scale == "group" else 1.0) for r in rewards]


def kendall_tau(x: list[float], y: list[float]) -> float | None:
    """Kendall's tau-b of two equally long lists; None when either is constant."""
    concordant = discordant = tied_x = tied_y = 0
    for i, j in combinations(range(len(x)), 2):
        dx, dy = (x[i] > x[j]) - (x[i] < x[j]), (y[i] > y[j]) - (y[i] < y[j])
        tied_x += dx == 0
        tied_y += dy == 0
        concordant += dx * dy > 0
        discordant += dx * dy < 0
    pairs = len(x) * (len(x) - 1) // 2
    denominator = math.sqrt((pairs - tied_x) * (pairs - tied_y))
    return None if denominator == 0 else (concordant - discordant) / denominator
