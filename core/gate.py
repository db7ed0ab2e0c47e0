"""Promote a trained step only when it is no worse than the one production is served.

A step trained with ``model.train(groups, promote=False)`` is served as ``name@step`` at once,
while the plain name, which production calls, stays on the promoted step.
:func:`promote_if_better` evaluates both on the same held-out scenarios, with the caller's own
evaluation function, and moves the plain name only when the candidate's mean is at least the
promoted step's plus ``min_delta``::

    result = await model.train(groups, promote=False)

    async def evaluate(model_name: str) -> list[jm.TrajectoryGroup]:
        return await jm.gather_trajectory_groups(
            jm.TrajectoryGroup(rollout(s, model_name) for _ in range(2)) for s in held_out
        )

    decision = await promote_if_better(model, result.step, evaluate, Gate(min_delta=-0.02))

Every decision, held or promoted, is recorded in the model's ``promotions.jsonl`` with both means.
"""

from __future__ import annotations

import statistics
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from journeyman.errors import ConfigError
from journeyman.trajectory import Trajectory, TrajectoryGroup

if TYPE_CHECKING:
    from journeyman.model import TrainableModel

__all__ = ["Gate", "GateDecision", "promote_canary_if_better", "promote_if_better"]

Evaluate = Callable[[str], Awaitable[Iterable[Trajectory | TrajectoryGroup]]]
"""Runs the held-out scenarios against a served model name; returns the scored trajectories."""


@dataclass(frozen=True)
class Gate:
    """When a candidate step may replace the promoted one."""

    metric: str = "reward"
    """``reward``, or a key of the trajectories' ``metrics`` (higher is better)."""
    min_delta: float = 0.0
    """The candidate's mean minus the promoted step's must be at least this; a small negative
    value tolerates noise, a positive one asks for a clear gain."""
    samples: int | None = None
    """Trajectories each side must have (the first ``samples`` are used); None: all returned."""

    def __post_init__(self) -> None:
        if self.samples is not None and self.samples < 1:
            raise ConfigError(f"Gate.samples must be at least 1 (or None for all), got {self.samples}")


@dataclass(frozen=True)
class GateDecision:
    """What the gate measured and decided."""

    promoted: bool
    step: int
    """The candidate."""
    incumbent_step: int
    """The step the plain name served during the evaluation."""
    candidate: float
    incumbent: float
    delta: float
    min_delta: float
    metric: str
    samples: tuple[int, int]
    """Trajectories scored for (candidate, incumbent)."""

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "samples": list(self.samples)}


async def promote_if_better(
    model: TrainableModel, step: int, evaluate: Evaluate, gate: Gate | None = None
) -> GateDecision:
    """Evaluate ``name@step`` and the promoted step with ``evaluate``; promote ``step`` when it passes.

    The candidate is evaluated first, then the plain name (the promoted step, as production gets
    it). The decision is recorded in either case (``hold`` when the plain name stays).
    """
    gate = gate or Gate()
    incumbent_step = await model.promoted_step()
    if step == incumbent_step:
        raise ConfigError(f"step {step} is already promoted; train a new step with promote=False to gate it")
    candidate = _values(await evaluate(f"{model.name}@{step}"), gate, f"{model.name}@{step}")
    incumbent = _values(await evaluate(model.name), gate, f"{model.name} (step {incumbent_step})")
    return await _decide(model, step, incumbent_step, candidate, incumbent, gate)


async def promote_canary_if_better(
    model: TrainableModel,
    step: int,
    results: Iterable[Trajectory | TrajectoryGroup],
    gate: Gate | None = None,
) -> GateDecision:
    """Decide a canary (:meth:`~journeyman.TrainableModel.canary`) from the scored rollouts it
    split: those whose last model turn ``step`` answered against those the promoted step answered.
    Promotes ``step`` or ends the canary; the decision is recorded either way."""
    gate = gate or Gate()
    incumbent_step = await model.promoted_step()
    trajectories = _flatten(results)
    candidate = _values(
        [t for t in trajectories if t.final_policy_version == step], gate, f"{model.name}@{step}"
    )
    incumbent = _values(
        [t for t in trajectories if t.final_policy_version == incumbent_step],
        gate,
        f"{model.name} (step {incumbent_step})",
    )
    return await _decide(model, step, incumbent_step, candidate, incumbent, gate)


async def _decide(
    model: TrainableModel,
    step: int,
    incumbent_step: int,
    candidate: list[float],
    incumbent: list[float],
    gate: Gate,
) -> GateDecision:
    delta = statistics.fmean(candidate) - statistics.fmean(incumbent)
    decision = GateDecision(
        delta >= gate.min_delta, step, incumbent_step, statistics.fmean(candidate), statistics.fmean(incumbent),
        delta, gate.min_delta, gate.metric, (len(candidate), len(incumbent)),
    )  # fmt: skip
    action = "promote" if decision.promoted else "hold"
    await model.backend.promote(model, step, action=action, by="gate", gate=decision.to_dict())
    return decision


def _flatten(results: Iterable[Trajectory | TrajectoryGroup]) -> list[Trajectory]:
    return [t for item in results for t in (item if isinstance(item, TrajectoryGroup) else [item])]


def _values(results: Iterable[Trajectory | TrajectoryGroup], gate: Gate, what: str) -> list[float]:
    values = []
    for trajectory in _flatten(results):
        value = trajectory.reward if gate.metric == "reward" else trajectory.metrics.get(gate.metric)
        if value is not None:
            values.append(float(value))
    if gate.samples is not None:
        if len(values) < gate.samples:
            raise ConfigError(
                f"the gate needs {gate.samples} scored trajectories of {what}, the evaluation returned "
                f"{len(values)} with a {gate.metric!r}; run more held-out scenarios or lower Gate.samples"
            )
        values = values[: gate.samples]
    if not values:
        raise ConfigError(
            f"the evaluation of {what} returned no trajectory with a {gate.metric!r} to gate on"
        )
    return values
