"""What the demo shows: held-out evaluations, the progress line, the before/after table, the curve."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import journeyman as jm

__all__ = ["EVALUATION_FIELDS", "Evaluation", "summarize"]


@dataclass
class Evaluation:
    """Held-out results of one model version."""

    step: int
    sampled: dict[str, float] = field(default_factory=dict)
    greedy: dict[str, float] = field(default_factory=dict)
    zero_shot: dict[str, float] = field(default_factory=dict)
    """Greedy, with no worked examples."""
    zero_shot_sampled: dict[str, float] = field(default_factory=dict)
    """At the training temperature, with no worked examples."""


EVALUATION_FIELDS = {
    "val": "sampled",
    "val_greedy": "greedy",
    "val_zero_shot_sampled": "zero_shot_sampled",
    "val_zero_shot": "zero_shot",
}


def share(value: float | None) -> str:
    """A rate for the progress line; "-" when the step had no such question."""
    return "   -" if value is None else f"{value:.2f}"


def summarize(groups: Sequence[jm.TrajectoryGroup]) -> dict[str, float]:
    """Success, tool-call validity (and failures) over the groups, word problems separately."""
    trajectories = [t for g in groups for t in g]
    row = {"failures": float(sum(len(g.failures) for g in groups)), "n": float(len(trajectories))}
    if not trajectories:
        return row
    for key in ("success", "tool_call", "valid_tool_call", "right_tool_call"):
        row[key] = statistics.fmean(t.metrics.get(key, 0.0) for t in trajectories)
    judged = [t.metrics["ruler_score"] for t in trajectories if "ruler_score" in t.metrics]
    if judged:
        row["ruler_score"] = statistics.fmean(judged)
    for kind in ("word", "arithmetic"):
        chosen = [t.metrics.get("success", 0.0) for t in trajectories if t.metadata.get("kind") == kind]
        if chosen:
            row[f"success_{kind}"] = statistics.fmean(chosen)
    zero_shot = [
        t.metrics.get("success", 0.0) for t in trajectories if t.metadata.get("worked_examples") is False
    ]
    if zero_shot and len(zero_shot) < len(trajectories):  # a mixed step: the zero-shot prompt's own rate
        row["success_zero_shot"] = statistics.fmean(zero_shot)
    return row


def prompt_line(worked_share: float) -> str:
    if worked_share in (0, 1):
        return "with worked examples" if worked_share else "zero-shot"
    return f"{worked_share:.0%} of the groups with worked examples, the others zero-shot"


def evaluation_line(evaluation: Evaluation) -> str:
    s, g = evaluation.sampled, evaluation.greedy
    return (
        f"success {s.get('success', 0):.0%} (word {s.get('success_word', 0):.0%}), "
        f"valid tool calls {s.get('valid_tool_call', 0):.0%}, greedy {g.get('success', 0):.0%}"
    )


def evaluation_table(before: Evaluation, after: Evaluation, temperature: float) -> Any:
    from rich.table import Table

    table = Table(title="held-out evaluation", title_justify="left")
    table.add_column("")
    table.add_column(f"before (step {before.step})", justify="right")
    table.add_column(f"after (step {after.step})", justify="right")
    rows = [
        (f"success, T={temperature}", "sampled", "success"),
        ("  arithmetic", "sampled", "success_arithmetic"),
        ("  word problems", "sampled", "success_word"),
        ("valid tool call", "sampled", "valid_tool_call"),
        ("right tool and numbers", "sampled", "right_tool_call"),
        ("success, greedy", "greedy", "success"),
        ("  word problems, greedy", "greedy", "success_word"),
        (f"success with no worked examples, T={temperature}", "zero_shot_sampled", "success"),
        ("  word problems", "zero_shot_sampled", "success_word"),
        ("calls a tool with no worked examples (greedy)", "zero_shot", "tool_call"),
        ("success with no worked examples (greedy)", "zero_shot", "success"),
        ("rollout failures", "sampled", "failures"),
    ]
    for label, part, key in rows:
        values = [getattr(e, part).get(key) for e in (before, after)]
        if all(v is None for v in values):
            continue
        cells = ["-" if v is None else (f"{v:.0f}" if key == "failures" else f"{v:.0%}") for v in values]
        table.add_row(label, *cells)
    return table


def summary_line(before: Evaluation, after: Evaluation, temperature: float, zero_shot: bool) -> str:
    """The demo's last line: held-out success before and after, each way it was measured."""
    line = (
        f"held-out success {before.sampled.get('success', 0):.0%} -> {after.sampled.get('success', 0):.0%} "
        f"(T={temperature}), greedy {before.greedy.get('success', 0):.0%} -> {after.greedy.get('success', 0):.0%}, "
        f"word problems {before.sampled.get('success_word', 0):.0%} -> {after.sampled.get('success_word', 0):.0%}, "
    )
    if zero_shot:
        line += (
            f"no worked examples {before.zero_shot_sampled.get('success', 0):.0%} -> "
            f"{after.zero_shot_sampled.get('success', 0):.0%} (T={temperature}) "
        )
    return line
