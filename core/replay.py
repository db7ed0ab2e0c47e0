"""Production inputs as training groups: replay each one several times against the trainable model.

GRPO learns from several attempts at the same task, and a production trace is one attempt. A
:class:`Scenario` is what a trace started from: its system and user turns up to the first model
reply, and the tools it offered. :func:`scenarios_from_trajectories` takes them from imported
traces (``journeyman.integrations.langfuse.import_trajectories``, filtered by tags, time and
score) or any stored trajectories, dropping repeats; :func:`read_scenarios` from a JSONL file.
:func:`replay` runs the user's own agent ``n`` times on each, and every trajectory of a group
names the trace it came from (``metadata["source_trace"]``)::

    from journeyman.replay import replay, scenarios_from_trajectories, split_held_out

    scenarios = scenarios_from_trajectories(import_trajectories(tags=["prod"], from_time=...))
    train, held_out = split_held_out(scenarios, share=0.1)
    groups = await replay(train[:32], agent, n=8, after_each=judge)
    await model.train(groups)
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from journeyman._deprecated import callable_module
from journeyman.errors import InvalidDataError
from journeyman.gather import AfterEach, gather_trajectory_groups
from journeyman.trajectory import JsonScalar, Trajectory, TrajectoryGroup

__all__ = [
    "Scenario", "label_trajectory", "read_scenarios", "replay", "scenario_labels", "scenario_of",
    "scenarios_from_trajectories", "split_held_out", "write_scenarios",
]  # fmt: skip

_OPENING_ROLES = ("system", "developer", "user")


@dataclass(frozen=True)
class Scenario:
    """What one production run started from."""

    messages: tuple[dict[str, Any], ...]
    """The system and user turns before the first model reply, as OpenAI chat messages."""
    tools: tuple[dict[str, Any], ...] | None = None
    """The tools the run offered (OpenAI tool schemas), if any."""
    source: str | None = None
    """The production trace it came from (a Langfuse trace id, or a trajectory id)."""
    score: float | None = None
    """The production run's own score (a user's feedback, say), kept as data."""
    metadata: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)

    @property
    def id(self) -> str:
        """The same for the same messages and tools, wherever they came from (the dedupe key)."""
        text = json.dumps([list(self.messages), list(self.tools or [])], sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    @property
    def prompt(self) -> str:
        """The last user turn's text (what most agents take as their input)."""
        for message in reversed(self.messages):
            if message.get("role") == "user":
                content = message.get("content")
                if isinstance(content, str):
                    return content
                return "".join(p.get("text", "") for p in content or [] if isinstance(p, dict))
        return ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id, "messages": list(self.messages), "tools": list(self.tools) if self.tools else None,
            "source": self.source, "score": self.score, "metadata": self.metadata,
        }  # fmt: skip


def scenario_of(trajectory: Trajectory) -> Scenario:
    """The opening of ``trajectory``'s conversation (its system and user turns before the first
    model reply) and its tools; the source is its Langfuse trace id when it was imported."""
    opening = []
    for message in trajectory.openai_messages():
        if message.get("role") not in _OPENING_ROLES:
            break
        opening.append(message)
    if not any(m.get("role") == "user" for m in opening):
        raise InvalidDataError(f"trajectory {trajectory.id} opens with no user turn: nothing to replay")
    tools = tuple(t.model_dump(exclude_none=True) for t in trajectory.tools) if trajectory.tools else None
    source = trajectory.metadata.get("langfuse_trace_id") or trajectory.id
    return Scenario(tuple(opening), tools, str(source), trajectory.reward)


def scenarios_from_trajectories(
    trajectories: Iterable[Trajectory], *, skip_invalid: bool = True
) -> list[Scenario]:
    """One scenario per distinct opening, in first-seen order; ``metadata["duplicates"]`` counts the
    traces that repeated it. Trajectories without a user turn are skipped (or raise, with
    ``skip_invalid=False``)."""
    found: dict[str, Scenario] = {}
    for trajectory in trajectories:
        try:
            scenario = scenario_of(trajectory)
        except InvalidDataError:
            if skip_invalid:
                continue
            raise
        if scenario.id in found:
            found[scenario.id].metadata["duplicates"] = found[scenario.id].metadata.get("duplicates", 0) + 1
        else:
            found[scenario.id] = scenario
    return list(found.values())


def read_scenarios(path: str | Path) -> list[Scenario]:
    """Scenarios from JSONL: each line ``{"messages": [...], "tools": [...]?, "source": ...?, "score": ...?}``
    (or ``{"prompt": "..."}`` for one user turn); repeats are dropped."""
    path = Path(path)
    scenarios: dict[str, Scenario] = {}
    for number, line in enumerate(path.read_text().split("\n"), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            messages = row.get("messages") or [{"role": "user", "content": row["prompt"]}]
            if not isinstance(messages, list) or not all(
                isinstance(m, dict) and "role" in m for m in messages
            ):
                raise ValueError("'messages' must be a list of chat messages")
            score = row.get("score")
            scenario = Scenario(
                tuple(messages), tuple(row["tools"]) if row.get("tools") else None, row.get("source"),
                None if score is None else float(score), dict(row.get("metadata") or {}),
            )  # fmt: skip
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            raise InvalidDataError(
                f'{path}, line {number}: expected {{"messages": [...]}} or {{"prompt": "..."}} ({error})'
            ) from None
        scenarios.setdefault(scenario.id, scenario)
    return list(scenarios.values())


def write_scenarios(path: str | Path, scenarios: Iterable[Scenario]) -> Path:
    path = Path(path)
    path.write_text("".join(json.dumps(s.to_dict()) + "\n" for s in scenarios))
    return path


def split_held_out(
    scenarios: Sequence[Scenario], share: float = 0.1, *, seed: int = 0
) -> tuple[list[Scenario], list[Scenario]]:
    """(train, held out): ``share`` of the scenarios kept apart for evaluation (and gating), chosen
    by their ids and ``seed``, so the same scenario lands on the same side in every run."""
    if not 0 <= share < 1:
        raise InvalidDataError(f"the held-out share is from 0 up to (not including) 1, got {share}")
    order = sorted(scenarios, key=lambda s: random.Random(f"{seed}:{s.id}").random())
    count = round(len(order) * share)
    held = {s.id for s in order[:count]}
    return [s for s in scenarios if s.id not in held], [s for s in scenarios if s.id in held]


def scenario_labels(scenario: Scenario) -> dict[str, JsonScalar]:
    """A replayed group's labels: its scenario's id and the production trace it came from."""
    labels: dict[str, JsonScalar] = {"scenario_id": scenario.id}
    if scenario.source is not None:
        labels["source_trace"] = scenario.source
    return labels


def label_trajectory(trajectory: Trajectory, scenario: Scenario) -> Trajectory:
    """``trajectory`` with its scenario's id, source trace and production score in its metadata."""
    trajectory.metadata.update(scenario_labels(scenario))
    if scenario.score is not None:
        trajectory.metadata["production_score"] = scenario.score
    return trajectory


async def replay(
    scenarios: Iterable[Scenario],
    agent: Callable[[Scenario], Awaitable[Trajectory]],
    *,
    n: int = 8,
    max_exceptions: int | float = 0.1,
    after_each: AfterEach | None = None,
    progress: bool = True,
) -> list[TrajectoryGroup]:
    """Run ``agent`` ``n`` times on each scenario, a group per scenario, concurrently.

    ``agent(scenario)`` is the user's own agent (a ``@jm.trainable`` function, or a rollout
    that runs a LangGraph or CrewAI agent with the tracer) calling the trainable model; it
    returns the attempt's trajectory. Each trajectory gets ``metadata["source_trace"]``,
    ``["scenario_id"]`` and, when the production run had one, ``["production_score"]``.
    ``after_each`` scores each group as it finishes (a RULER judge, a reward function); failures
    are recorded on their groups (see :func:`~journeyman.gather_trajectory_groups`).
    """
    if n < 1:
        raise InvalidDataError(f"n (attempts per scenario) must be at least 1, got {n}")

    async def attempt(scenario: Scenario) -> Trajectory:
        return label_trajectory(await agent(scenario), scenario)

    by_group = {}
    for scenario in scenarios:
        group = TrajectoryGroup(attempt(scenario) for _ in range(n))
        by_group[id(group)] = (group, scenario)

    async def label(group: TrajectoryGroup) -> TrajectoryGroup | list[TrajectoryGroup] | None:
        group.metadata.update(scenario_labels(by_group[id(group)][1]))
        return group if after_each is None else await after_each(group)

    return await gather_trajectory_groups(
        [group for group, _ in by_group.values()], max_exceptions=max_exceptions, after_each=label,
        description="replay", progress=progress,
    )  # fmt: skip


callable_module(__name__, replay, "journeyman.replay.replay(...)")  # jm.replay(...) of 0.1
