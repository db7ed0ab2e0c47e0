"""Opt-in: the round trip against a real Langfuse (Cloud, or self-hosted >= 4.59 for SDK 5).

Runs only when LANGFUSE_PUBLIC_KEY, LANGFUSE_SECRET_KEY and LANGFUSE_HOST (or LANGFUSE_BASE_URL)
are set; it writes two traces in a fresh session of that project. This is the check of the test
server's mapping against the real one: record the server version it passed with.
"""

from __future__ import annotations

import os
import time
import uuid

import pytest
from langfuse import Langfuse

import journeyman as jm
from journeyman.errors import InvalidDataError
from journeyman.integrations.langfuse import export_group, import_trajectories
from tests.unit.test_langfuse import sample_trajectory

HOST = os.environ.get("LANGFUSE_BASE_URL") or os.environ.get("LANGFUSE_HOST")
pytestmark = pytest.mark.skipif(
    not (os.environ.get("LANGFUSE_PUBLIC_KEY") and os.environ.get("LANGFUSE_SECRET_KEY") and HOST),
    reason="set LANGFUSE_PUBLIC_KEY, LANGFUSE_SECRET_KEY and LANGFUSE_HOST to run against a real Langfuse",
)


def test_round_trip_through_a_real_langfuse() -> None:
    client = Langfuse(base_url=HOST)
    try:
        group = jm.TrajectoryGroup([sample_trajectory(1.0), sample_trajectory(0.0)])
        project = f"journeyman-test-{uuid.uuid4().hex[:8]}"
        ids = export_group(group, client, project=project, model="calc-agent", step=0, split="test")
        assert group.failures == [] and len(ids) == 2
        deadline, found = time.monotonic() + 180, []
        while time.monotonic() < deadline:  # ingestion is asynchronous on a real server
            try:
                found = import_trajectories(client, trace_ids=ids)
            except InvalidDataError:
                found = []
            if len(found) == 2 and all(t.reward is not None for t in found):
                break
            time.sleep(5)
        assert found == group.trajectories
        by_session = import_trajectories(client, session_id=f"{project}/calc-agent")
        assert sorted(t.id for t in by_session) == sorted(t.id for t in group)
    finally:
        client.shutdown()
