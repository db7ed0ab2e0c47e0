"""Reading traces from a Langfuse server, page by page: the traces a filter finds, each trace's
observations and its trace-level scores. :mod:`journeyman.integrations._langfuse_read` turns
what these return into trajectories."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from langfuse import Langfuse

from ._langfuse_read import KEY

__all__ = ["find_traces", "observations", "trace_scores"]

_OBSERVATION_FIELDS = "core,basic,time,io,metadata,model,usage,trace_context"


def find_traces(
    client: Langfuse,
    session_id: str | None,
    tags: Sequence[str] | None,
    name: str | None,
    from_time: datetime | None,
    to_time: datetime | None,
    limit: int,
) -> list[str]:
    # One structured filter: when `filter` is given, Langfuse ignores the single query parameters.
    filters: list[dict[str, Any]] = [
        {"type": "boolean", "column": "isRootObservation", "operator": "=", "value": True}
    ]
    if session_id is not None:
        filters.append({"type": "string", "column": "sessionId", "operator": "=", "value": session_id})
    if tags:
        filters.append({"type": "arrayOptions", "column": "tags", "operator": "all of", "value": list(tags)})
    if name is not None:
        filters.append({"type": "string", "column": "traceName", "operator": "=", "value": name})
    if from_time is not None:
        filters.append(
            {"type": "datetime", "column": "startTime", "operator": ">=", "value": from_time.isoformat()}
        )
    if to_time is not None:
        filters.append(
            {"type": "datetime", "column": "startTime", "operator": "<", "value": to_time.isoformat()}
        )
    ids: dict[str, None] = {}
    cursor = None
    while len(ids) < limit:
        page = client.api.observations.get_many(
            fields="core", filter=json.dumps(filters), limit=min(1000, limit), cursor=cursor
        )
        ids.update((o.trace_id, None) for o in page.data if o.trace_id)
        cursor = page.meta.cursor
        if not cursor or not page.data:
            break
    return list(ids)[:limit]


def observations(client: Langfuse, tid: str) -> list[Any]:
    observations: list[Any] = []
    cursor = None
    while True:
        page = client.api.observations.get_many(
            trace_id=tid,
            fields=_OBSERVATION_FIELDS,
            expand_metadata=f"{KEY},tool_call_id",
            limit=1000,
            cursor=cursor,
        )
        observations.extend(page.data)
        cursor = page.meta.cursor
        if not cursor or not page.data:
            return observations


def trace_scores(client: Langfuse, trace_ids: list[str]) -> dict[str, list[Any]]:
    found: dict[str, list[Any]] = {}
    for start in range(0, len(trace_ids), 50):
        chunk = trace_ids[start : start + 50]
        cursor = None
        while True:
            page = client.api.scores.get_many(
                trace_id=",".join(chunk), fields="details,subject", limit=100, cursor=cursor
            )
            for score in page.data:
                # Trace-level scores only: a score on one observation does not rate the trajectory.
                if score.subject is not None and score.subject.kind == "trace":
                    found.setdefault(score.subject.id, []).append(score)
            cursor = page.meta.cursor
            if not cursor or not page.data:
                break
    return found
