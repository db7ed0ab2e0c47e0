"""A judge calibration's report: per group and over all groups, with its table and JSON form.

:func:`journeyman.calibration.calibrate_judge` fills it; the module docstring there says what each
measure means. The two statistics it rests on, GRPO's group advantages and Kendall's tau-b, are here
too, torch-free (the trainer's advantages are tested equal to :func:`group_advantages`).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from itertools import combinations
from pathlib import Path
from typing import Any

from journeyman.config import Scale
from journeyman.ruler import Method, RewardFrom, judged_rewards

__all__ = ["Calibration", "GroupCalibration", "group_advantages", "kendall_tau"]

_TABLE_SCALES: tuple[tuple[Scale, str], ...] = (
    ("group", "scaled by group std"),
    ("none", "unscaled or batch-scaled"),
)


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
    probe_scores: list[tuple[float, float]] = field(default_factory=list)
    """For each probe judged beside the group (``calibrate_judge(probes=True)``), the success's
    score and its probe's, from the same presentation."""

    @property
    def probes(self) -> int:
        return len(self.probe_scores)

    @property
    def probes_below(self) -> int:
        """Made-up answers that scored below the success they were made from."""
        return sum(probe < success for success, probe in self.probe_scores)

    @property
    def probes_tied(self) -> int:
        return sum(probe == success for success, probe in self.probe_scores)

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
    def probe_accuracy(self) -> float | None:
        """The share of probes scored below their success (a tie counts half); None
        without probes."""
        probes = self._sum("probes")
        return None if not probes else (self._sum("probes_below") + self._sum("probes_tied") / 2) / probes

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

    def fewest_pairs(self, alpha: float = 0.05) -> int:
        """The fewest decided pairs with which :meth:`better_than_chance` can hold at all (every one
        ordered right has p = 2**-n): 5 at the default ``alpha``."""
        return math.floor(math.log2(1 / alpha)) + 1

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
        rewards made of the scores as in ``judge_group(reward_from=...)``; None when either is
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
                "position_consistency", "first_position_bias", "p_value", "probe_accuracy",
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
                "probes": group.probes,
                "probes_below": group.probes_below,
                "probes_tied": group.probes_tied,
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
        if probes := self._sum("probes"):
            pairs = [pair for group in self.groups for pair in group.probe_scores]
            lines.append(
                f"probes (a success's answer without the tool calls before it, or its calls without the answer): "
                f"{self._sum('probes_below')} of {probes} scored below their success, {self._sum('probes_tied')} tied "
                f"(mean score {sum(s for s, _ in pairs) / probes:.2f} against {sum(p for _, p in pairs) / probes:.2f})"
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
