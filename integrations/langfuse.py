"""Langfuse: every trajectory as a trace to inspect; recorded traces back as training data.

Export (the Langfuse client reads ``LANGFUSE_PUBLIC_KEY``, ``LANGFUSE_SECRET_KEY`` and
``LANGFUSE_BASE_URL`` when none is given)::

    from journeyman.integrations.langfuse import export_group, import_trajectories

    export_group(group, project="demo", model="calc-agent", step=3, split="train")
    trajectories = import_trajectories(session_id="demo/calc-agent")

One trace per trajectory, its id derived from the trajectory id (exporting again targets the same
trace). The root is an ``agent`` observation; under it one ``generation`` per model turn (served
model and adapter version, input messages, output message with tool calls, token usage, sampling
parameters) followed by one ``tool`` observation per tool call; each extra history is an
``agent`` branch of its own. Session = the training run (``project/model``); tags name project,
model, step, split and group. The reward and the numeric metrics are scores; the judge's
explanation (``trajectory.metadata["judge_explanation"]``) is the reward score's comment.
Everything a lossless import needs (token ids, logprobs, exact metadata) rides along under the
``journeyman`` metadata key, so an exported group imports back equal.

Import reads traces through the SDK's read API (``GET /api/public/v2/observations`` and
``GET /api/public/v3/scores``) and also understands traces recorded by other instrumentation,
such as Langfuse's own LangChain ``CallbackHandler``: the generations give the messages and tool
calls, ``tool`` observations the tool results, scores the reward.

With no Langfuse reachable, export logs a warning, records a ``Failure`` (stage ``export``) on
the group and returns: rollouts and training go on.
"""

from __future__ import annotations

import logging
import os
import time
import weakref
from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any, TypedDict, Unpack

from journeyman.errors import ConfigError, InvalidDataError, MissingDependencyError
from journeyman.trajectory import Trajectory, TrajectoryGroup

try:
    from langfuse import Langfuse, get_client, propagate_attributes
except ImportError as error:  # pragma: no cover - depends on the installed extras
    raise MissingDependencyError("langfuse", "langfuse", "Langfuse export and import") from error

from journeyman.integrations._langfuse_fetch import find_traces, observations, trace_scores
from journeyman.integrations._langfuse_read import (
    JUDGE_EXPLANATION,
    KEY,
    REWARD_SCORE,
    SCHEMA,
    trajectory_from_observations,
)
from journeyman.integrations._langfuse_spans import (
    export_history,
    final_message,
    history_info,
    payload,
    prompt_of,
)

__all__ = [
    "JUDGE_EXPLANATION",
    "REWARD_SCORE",
    "LangfuseExporter",
    "export_group",
    "export_trajectories",
    "import_trajectories",
    "trace_id",
    "trajectory_from_observations",
]

logger = logging.getLogger(__name__)

_CHECK_SECONDS = 30.0
_checked: weakref.WeakKeyDictionary[Langfuse, tuple[float, str | None]] = weakref.WeakKeyDictionary()
"""Each client's last connection check (time, problem), forgotten with the client: keyed by id(),
a new client made where a dropped one lived would inherit its answer."""


def trace_id(trajectory_id: str) -> str:
    """The Langfuse trace id (32 hex digits) of a trajectory: the same id always gives the same trace."""
    return Langfuse.create_trace_id(seed=trajectory_id)


class LangfuseExporter:
    """Exports trajectories to one Langfuse project; never raises into a rollout or training step.

    ``client``: a ``langfuse.Langfuse`` (default: the one for ``$LANGFUSE_PUBLIC_KEY``, configured
    from the environment; else ``langfuse.get_client()``). ``session_id`` defaults to ``project/model``. ``check_connection`` asks the
    server once (``auth_check``, cached 30 s) before exporting, so an unreachable server costs one
    warning instead of silently dropped spans.
    """

    def __init__(
        self,
        client: Langfuse | None = None,
        *,
        project: str | None = None,
        model: str | None = None,
        session_id: str | None = None,
        split: str | None = None,
        tags: Sequence[str] = (),
        check_connection: bool = True,
    ) -> None:
        self.client = client if client is not None else default_client()
        self.project, self.model, self.split, self.tags = project, model, split, list(tags)
        self.session_id = session_id or (f"{project}/{model}" if project and model else None)
        self.check_connection = check_connection

    def export_group(
        self, group: TrajectoryGroup, *, step: int | None = None, split: str | None = None
    ) -> list[str]:
        """Export every trajectory of ``group``; returns the trace ids. A failure is recorded on the group."""
        try:
            return self._export(group.trajectories, group_id=group.id, step=step, split=split)
        except Exception as error:
            group.record_failure(error, stage="export")
            logger.warning(
                "Langfuse export of group %s failed: %s: %s", group.id, type(error).__name__, error
            )
            return []

    def export_trajectories(
        self,
        trajectories: Iterable[Trajectory],
        *,
        group_id: str | None = None,
        step: int | None = None,
        split: str | None = None,
    ) -> list[str]:
        """Export trajectories; returns their trace ids (none when Langfuse is unreachable)."""
        try:
            return self._export(list(trajectories), group_id=group_id, step=step, split=split)
        except Exception as error:
            logger.warning("Langfuse export failed: %s: %s", type(error).__name__, error)
            return []

    def check(self) -> None:
        """Raise :class:`ConfigError` now if Langfuse cannot be reached (before a long run starts,
        rather than a warning at each export)."""
        problem = _connection_problem(self.client)
        if problem is not None:
            raise ConfigError(f"cannot reach Langfuse: {problem}. {_CHECK_SETTINGS}")

    def _export(
        self, trajectories: list[Trajectory], *, group_id: str | None, step: int | None, split: str | None
    ) -> list[str]:
        if self.check_connection:
            problem = _connection_problem(self.client)
            if problem is not None:
                raise ConnectionError(
                    f"cannot reach Langfuse: {problem}. {len(trajectories)} "
                    f"trajectories were not exported; rollouts and training go on. {_CHECK_SETTINGS}"
                )
        split = split or self.split
        tags = [
            *(f"{name}:{value}" for name, value in self._labels(step, split, group_id) if value is not None),
            *self.tags,
        ]
        ids = [self._export_one(t, group_id=group_id, tags=tags) for t in trajectories]
        self.client.flush()
        return ids

    def _labels(self, step: int | None, split: str | None, group_id: str | None) -> list[tuple[str, Any]]:
        return [
            ("project", self.project),
            ("model", self.model),
            ("step", step),
            ("split", split),
            ("group", group_id),
        ]

    def _export_one(self, trajectory: Trajectory, *, group_id: str | None, tags: list[str]) -> str:
        tid = trace_id(trajectory.id)
        main, *branches = trajectory.histories
        info = {
            "schema": SCHEMA,
            "history": 0,
            "group_id": group_id,
            "trajectory": trajectory.model_dump(
                mode="json",
                include={
                    "id",
                    "metrics",
                    "metadata",
                    "logs",
                    "started_at",
                    "finished_at",
                    "timings",
                    "initial_policy_version",
                    "final_policy_version",
                },
            ),
            **history_info(main),
        }
        with propagate_attributes(
            session_id=self.session_id, tags=tags or None, trace_name=trajectory.name or "trajectory"
        ):
            root = self.client.start_observation(
                trace_context={"trace_id": tid},
                as_type="agent",
                name=trajectory.name or "trajectory",
                input=prompt_of(main),
                output=final_message(main),
                metadata={KEY: payload(info)},
            )
            export_history(root, main)
            for index, history in enumerate(branches, start=1):
                branch = root.start_observation(
                    as_type="agent",
                    name=history.name or f"history-{index}",
                    input=prompt_of(history),
                    output=final_message(history),
                    metadata={KEY: payload({"schema": SCHEMA, "history": index, **history_info(history)})},
                )
                export_history(branch, history)
                branch.end()
            root.end()
        self._score(trajectory, tid)
        return tid

    def _score(self, trajectory: Trajectory, tid: str) -> None:
        if trajectory.reward is not None:
            explanation = trajectory.metadata.get(JUDGE_EXPLANATION)
            self.client.create_score(
                name=REWARD_SCORE,
                value=trajectory.reward,
                trace_id=tid,
                score_id=_score_id(tid, REWARD_SCORE),
                data_type="NUMERIC",
                comment=explanation if isinstance(explanation, str) else None,
            )
        for name, value in trajectory.metrics.items():
            if name == REWARD_SCORE:
                continue  # the reward's own score; the metric still travels in the metadata
            self.client.create_score(
                name=name,
                value=float(value),
                trace_id=tid,
                score_id=_score_id(tid, name),
                data_type="BOOLEAN" if isinstance(value, bool) else "NUMERIC",
            )


class ExportOptions(TypedDict, total=False):
    """Where exported traces are filed (see :class:`LangfuseExporter`)."""

    project: str | None
    model: str | None
    session_id: str | None
    tags: Sequence[str]
    check_connection: bool


def export_group(
    group: TrajectoryGroup,
    client: Langfuse | None = None,
    *,
    step: int | None = None,
    split: str | None = None,
    **options: Unpack[ExportOptions],
) -> list[str]:
    """Export a group's trajectories as traces; returns the trace ids (see :class:`LangfuseExporter`)."""
    return LangfuseExporter(client, **options).export_group(group, step=step, split=split)


def export_trajectories(
    trajectories: Iterable[Trajectory],
    client: Langfuse | None = None,
    *,
    group_id: str | None = None,
    step: int | None = None,
    split: str | None = None,
    **options: Unpack[ExportOptions],
) -> list[str]:
    """Export trajectories as traces; returns the trace ids (see :class:`LangfuseExporter`)."""
    exporter = LangfuseExporter(client, **options)
    return exporter.export_trajectories(trajectories, group_id=group_id, step=step, split=split)


def exporter_for(target: Any, **labels: Any) -> LangfuseExporter:
    """The exporter behind ``langfuse=`` on gather/train (the ``journeyman.exporters`` entry point):
    ``target`` is True (the client from the environment) or a Langfuse client; an exporter already
    made is used as it is by :func:`journeyman.plugins.exporter` and never reaches here."""
    return LangfuseExporter(None if target is True else target, **labels)


def import_trajectories(
    client: Langfuse | None = None,
    *,
    trace_ids: Iterable[str] | None = None,
    session_id: str | None = None,
    tags: Sequence[str] | None = None,
    name: str | None = None,
    from_time: datetime | None = None,
    to_time: datetime | None = None,
    reward_score: str = REWARD_SCORE,
    limit: int = 1000,
) -> list[Trajectory]:
    """Rebuild trajectories from Langfuse traces: given ids, or found by session, tags (all of them),
    trace name and start-time window. The score named ``reward_score`` becomes the reward."""
    client = client if client is not None else default_client()
    if trace_ids is not None:
        ids = list(dict.fromkeys(trace_ids))
    else:
        if session_id is None and not tags and name is None and from_time is None and to_time is None:
            raise InvalidDataError(
                "import_trajectories needs trace_ids or a filter (session_id, tags, name, from_time, "
                "to_time): reading a whole project is rarely what you want"
            )
        ids = find_traces(client, session_id, tags, name, from_time, to_time, limit)
    scores = trace_scores(client, ids)
    trajectories = []
    for tid in ids:
        found = observations(client, tid)
        if not found:
            raise InvalidDataError(
                f"trace {tid} has no observations in Langfuse: check the id and the project of the keys "
                "(a trace sent seconds ago may still be in ingestion)"
            )
        trajectories.append(trajectory_from_observations(found, scores.get(tid, []), reward_score))
    return trajectories


# Export helpers ------------------------------------------------------------------------------


_CHECK_SETTINGS = "Check LANGFUSE_BASE_URL and the keys (LANGFUSE_PUBLIC_KEY, LANGFUSE_SECRET_KEY), or pass a configured client."


def default_client() -> Langfuse:
    """The client meant when none is given: the one for ``$LANGFUSE_PUBLIC_KEY`` when it is set
    (made from the environment), else ``langfuse.get_client()``.

    ``get_client()`` alone is not enough: once a process holds clients for two projects it returns
    a disabled client, and with one it returns that one, whatever the environment says.
    """
    if os.environ.get("LANGFUSE_PUBLIC_KEY"):
        return Langfuse()  # the SDK keeps one set of resources per public key: this reuses it
    return get_client()


def _connection_problem(client: Langfuse) -> str | None:
    now = time.monotonic()
    cached = _checked.get(client)
    if cached is not None and now - cached[0] < _CHECK_SECONDS:
        return cached[1]
    try:
        problem = None if client.auth_check() else "the client is disabled (no public key?)"
    except Exception as error:
        problem = f"{type(error).__name__}: {error}"
    _checked[client] = (now, problem)
    return problem


def _score_id(tid: str, name: str) -> str:
    # Deterministic, so exporting again updates the score instead of adding another.
    return Langfuse.create_trace_id(seed=f"{tid}:{name}")
