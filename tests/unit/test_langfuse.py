"""Langfuse export with the real SDK and an in-memory span exporter: the trace's structure,
attributes and ids exactly as they would go over the wire. And the read side on its own."""

from __future__ import annotations

import gc
import json
import logging
import subprocess
import sys
import textwrap
import time
import uuid
import weakref
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest
from langfuse import Langfuse
from langfuse.api import ObservationV2
from langfuse.api.core.pydantic_utilities import parse_obj_as
from langfuse.api.scores.types.score_v3 import ScoreV3_Numeric
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import journeyman as jm
from journeyman.errors import InvalidDataError
from journeyman.integrations.langfuse import (
    JUDGE_EXPLANATION,
    LangfuseExporter,
    trace_id,
    trajectory_from_observations,
)
from journeyman.trajectory import History
from tests.langfuse_server import LangfuseServer
from tests.logs import reaching_caplog


def sample_trajectory(reward: float | None = 1.0) -> jm.Trajectory:
    """Two model turns with a tool call between them, a trailing user message and a branch."""
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
    return jm.Trajectory(
        name="calc",
        conversation=[
            {"role": "system", "content": "You add numbers with the add tool."},
            {"role": "user", "content": "What is 2+3?"},
            {
                "type": "model_turn",
                "message": {"role": "assistant", "content": None, "tool_calls": [call]},
                "model": "calc-agent@3",
                "completion_id": "chatcmpl-1",
                "prompt_token_ids": [1, 2, 3, 4],
                "completion_token_ids": [5, 6],
                "logprobs": [-0.25, None],
                "finish_reason": "tool_calls",
                "sampling": {"temperature": 0.7, "max_tokens": 64, "stop": ["</s>"], "logprobs": True},
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "5"},
            {
                "type": "model_turn",
                "message": {"role": "assistant", "content": "2+3 is 5."},
                "model": "calc-agent@3",
                "prompt_token_ids": [1, 2, 3, 4, 5, 6, 7],
                "completion_token_ids": [8, 9, 10],
                "logprobs": [-0.5, -0.1, -0.01],
            },
            {"role": "user", "content": "Thanks!"},
        ],
        tools=[
            {
                "type": "function",
                "function": {
                    "name": "add",
                    "description": "Add two integers.",
                    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}},
                },
            }
        ],
        additional_histories=[
            History(
                name="summariser",
                conversation=[
                    {"role": "user", "content": "Summarise: 2+3=5"},
                    {
                        "type": "model_turn",
                        "message": {"role": "assistant", "content": "Added."},
                        "model": "base",
                    },
                ],
            )
        ],
        reward=reward,
        metrics={"tool_calls": 1, "solved": True, "seconds": 1.5},
        metadata={JUDGE_EXPLANATION: "Called the tool once and answered right.", "scenario": "add-2-3"},
        logs=["judge: best of the group"],
        timings={"rollout": 1.25},
        initial_policy_version=3,
        final_policy_version=3,
    ).finish()


def capturing_client(base_url: str, public_key: str) -> tuple[Langfuse, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    client = Langfuse(
        public_key=public_key,  # clients are cached per public key: one per test
        secret_key="sk-lf-test",
        base_url=base_url,
        span_exporter=exporter,
        tracer_provider=TracerProvider(),
    )
    return client, exporter


@pytest.fixture
def captured() -> Iterator[tuple[Langfuse, InMemorySpanExporter]]:
    """Spans captured in memory; scores (REST) go to the loopback test server."""
    with LangfuseServer(public_key=f"pk-{uuid.uuid4().hex}") as server:
        client, exporter = capturing_client(server.base_url, server.public_key)
        yield client, exporter
        client.shutdown()
        assert server.errors == []


def spans_by_name(exporter: InMemorySpanExporter) -> dict[str, list[ReadableSpan]]:
    spans: dict[str, list[ReadableSpan]] = {}
    for span in exporter.get_finished_spans():
        spans.setdefault(span.name, []).append(span)
    return spans


def attr(span: ReadableSpan, key: str) -> Any:
    assert span.attributes is not None
    return span.attributes.get(key)


def test_a_trajectory_becomes_one_trace_with_its_turns_tools_and_branches(
    captured: tuple[Langfuse, InMemorySpanExporter],
) -> None:
    client, exporter = captured
    trajectory = sample_trajectory()
    exporter_ = LangfuseExporter(
        client, project="demo", model="calc-agent", split="train", check_connection=False
    )
    (tid,) = exporter_.export_trajectories([trajectory], group_id="g-1", step=3)

    assert tid == trace_id(trajectory.id) == Langfuse.create_trace_id(seed=trajectory.id)
    spans = exporter.get_finished_spans()
    assert {format(s.context.trace_id, "032x") for s in spans} == {tid}
    by_name = spans_by_name(exporter)
    (root,) = by_name["calc"]
    (branch,) = by_name["summariser"]
    generations = [s for s in spans if attr(s, "langfuse.observation.type") == "generation"]
    (tool,) = by_name["add"]
    assert len(spans) == 6 and len(generations) == 3

    assert attr(root, "langfuse.observation.type") == "agent"
    assert attr(root, "langfuse.internal.as_root") is True
    assert json.loads(attr(root, "langfuse.observation.input")) == trajectory.openai_messages()[:2]
    assert json.loads(attr(root, "langfuse.observation.output")) == {"role": "user", "content": "Thanks!"}
    for span in spans:  # trace-level attributes reach every observation
        assert attr(span, "session.id") == "demo/calc-agent"
        assert set(attr(span, "langfuse.trace.tags")) == {
            "project:demo",
            "model:calc-agent",
            "step:3",
            "split:train",
            "group:g-1",
        }

    first, second = sorted(
        (g for g in generations if g.parent == root.context), key=lambda s: s.start_time or 0
    )
    assert all(g.parent is not None and g.parent.span_id == root.context.span_id for g in (first, second))
    assert attr(first, "langfuse.observation.model.name") == "calc-agent@3"
    assert json.loads(attr(first, "langfuse.observation.input")) == trajectory.openai_messages()[:2]
    output = json.loads(attr(first, "langfuse.observation.output"))
    assert output["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a": 2, "b": 3}'}
    assert json.loads(attr(first, "langfuse.observation.usage_details")) == {"input": 4, "output": 2}
    assert json.loads(attr(first, "langfuse.observation.model.parameters")) == {
        "temperature": 0.7,
        "max_tokens": 64,
        "stop": '["</s>"]',
        "logprobs": "true",
    }
    # JSON text of our own inside the JSON the SDK writes: exact whatever the SDK's serializer does.
    turn = json.loads(json.loads(attr(first, "langfuse.observation.metadata.journeyman")))
    assert turn["index"] == 2 and turn["turn"]["logprobs"] == [-0.25, None]
    assert len(json.loads(attr(second, "langfuse.observation.input"))) == 4  # the conversation so far

    assert tool.parent is not None and tool.parent.span_id == root.context.span_id
    assert attr(tool, "langfuse.observation.type") == "tool"
    assert json.loads(attr(tool, "langfuse.observation.input")) == {"a": 2, "b": 3}
    assert attr(tool, "langfuse.observation.output") == "5"

    assert branch.parent is not None and branch.parent.span_id == root.context.span_id
    (branch_turn,) = [
        g for g in generations if g.parent is not None and g.parent.span_id == branch.context.span_id
    ]
    assert attr(branch_turn, "langfuse.observation.model.name") == "base"


def test_the_same_trajectory_always_maps_to_the_same_trace(
    captured: tuple[Langfuse, InMemorySpanExporter],
) -> None:
    client, _ = captured
    trajectory = sample_trajectory()
    exporter = LangfuseExporter(client, check_connection=False)
    first = exporter.export_trajectories([trajectory])
    again = exporter.export_trajectories([trajectory.model_copy(deep=True)])
    other = exporter.export_trajectories([sample_trajectory()])
    assert first == again != other


def test_an_unreachable_server_is_a_warning_and_a_recorded_failure(caplog: pytest.LogCaptureFixture) -> None:
    client, exporter = capturing_client("http://127.0.0.1:9", f"pk-{uuid.uuid4().hex}")  # a closed port
    group = jm.TrajectoryGroup([sample_trajectory(), sample_trajectory(0.0)])
    # The exporter's warning reaches caplog whatever logging set-up an earlier test left behind
    # (once, in a whole `make test` on one host, it did not; alone and in the unit tier it does).
    log = "journeyman.integrations.langfuse"
    with reaching_caplog("journeyman"), caplog.at_level(logging.WARNING, logger=log):
        assert LangfuseExporter(client).export_group(group) == []
    (failure,) = group.failures
    assert failure.stage == "export" and failure.type == "ConnectionError"
    assert (
        "cannot reach Langfuse" in failure.message and "2 trajectories were not exported" in failure.message
    )
    assert any(
        r.name == log and "Langfuse export" in r.message and r.levelname == "WARNING" for r in caplog.records
    )
    assert exporter.get_finished_spans() == ()
    assert len(group) == 2  # nothing lost
    client.shutdown()


def test_a_connection_check_is_forgotten_with_its_client() -> None:
    """The check is cached per client for 30 s; a client made after another was dropped must not
    inherit its answer (a cache keyed by id() would hand it over when the address is reused)."""
    from journeyman.integrations import langfuse as module

    client, _ = capturing_client("http://127.0.0.1:9", f"pk-{uuid.uuid4().hex}")
    assert "ConnectError" in (module._connection_problem(client) or "")
    assert client in module._checked
    client.shutdown()
    # Held here, the clients earlier tests left cannot go during the count, whenever they are collected.
    others = [other for other in module._checked if other is not client]
    dropped = weakref.ref(client)
    del client
    deadline = time.monotonic() + 10
    while dropped() is not None and time.monotonic() < deadline:  # in case a thread lets go of it late
        gc.collect()
        time.sleep(0.01)
    assert dropped() is None, "the connection check keeps its client alive"
    assert len(module._checked) == len(others)


# The read side on its own: observations as the SDK parses them from GET /api/public/v2/observations.


def observation(**fields: Any) -> ObservationV2:
    base = {"projectId": "p", "startTime": datetime.now(UTC).isoformat(), "type": "SPAN"}
    return parse_obj_as(ObservationV2, base | fields)  # as the SDK parses API answers


def test_openai_style_generations_rebuild_messages_tool_calls_and_results() -> None:
    """The shapes the OpenAI wrapper records: OpenAI messages in, the choice's message out."""
    t0 = "2026-01-01T00:00:00.000Z"
    call = {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": '{"q": "x"'}}
    prompt = [{"role": "user", "content": "find x"}]
    observations = [
        observation(id="r", traceId="t", type="SPAN", name="job", isRootObservation=True, startTime=t0),
        observation(
            id="g1",
            traceId="t",
            parentObservationId="r",
            type="GENERATION",
            model="gpt-x",
            input=json.dumps(prompt),
            output=json.dumps({"role": "assistant", "content": None, "tool_calls": [call]}),
            modelParameters={"temperature": "0.2"},
            startTime="2026-01-01T00:00:01.000Z",
        ),
        observation(
            id="t1",
            traceId="t",
            parentObservationId="r",
            type="TOOL",
            output=json.dumps("no such x"),
            metadata={"tool_call_id": '"c1"'},
            startTime="2026-01-01T00:00:02.000Z",
        ),
    ]
    scores = [
        parse_obj_as(
            ScoreV3_Numeric,
            {
                "dataType": "NUMERIC",
                "value": 0.25,
                "id": "s",
                "projectId": "p",
                "name": "user-feedback",
                "source": "ANNOTATION",
                "timestamp": t0,
                "environment": "default",
                "createdAt": t0,
                "updatedAt": t0,
                "comment": "wrong tool input",
            },
        )
    ]
    trajectory = trajectory_from_observations(observations, scores, reward_score="user-feedback")
    assert trajectory.id == "t" and trajectory.name == "job"
    assert trajectory.openai_messages() == [
        *prompt,
        {"role": "assistant", "tool_calls": [call]},  # malformed arguments kept as written
        {"role": "tool", "tool_call_id": "c1", "content": "no such x"},
    ]
    (turn,) = trajectory.model_turns
    assert turn.model == "gpt-x" and turn.sampling == {"temperature": "0.2"}
    assert trajectory.reward == 0.25
    assert trajectory.metadata[JUDGE_EXPLANATION] == "wrong tool input"


def test_a_generation_that_does_not_continue_the_conversation_starts_another_history() -> None:
    def generation(id: str, second: int, messages: list[dict[str, Any]], answer: str) -> ObservationV2:
        return observation(
            id=id,
            traceId="t",
            parentObservationId="r",
            type="GENERATION",
            input=json.dumps(messages),
            output=json.dumps({"role": "assistant", "content": answer}),
            startTime=f"2026-01-01T00:00:0{second}.000Z",
        )

    ask = [{"role": "user", "content": "plan"}]
    observations = [
        observation(id="r", traceId="t", name="crew", startTime="2026-01-01T00:00:00.000Z"),
        generation("a", 1, ask, "step 1"),
        generation("b", 2, [{"role": "user", "content": "summarise the plan"}], "short"),
        generation(
            "c",
            3,
            [*ask, {"role": "assistant", "content": "step 1"}, {"role": "user", "content": "go"}],
            "ok",
        ),
    ]
    trajectory = trajectory_from_observations(observations)
    assert [m["content"] for m in trajectory.openai_messages()] == ["plan", "step 1", "go", "ok"]
    assert len(trajectory.model_turns) == 2
    (other,) = trajectory.additional_histories
    assert [m["content"] for m in other.openai_messages()] == ["summarise the plan", "short"]
    assert trajectory.reward is None


def test_an_empty_trace_is_a_clear_error() -> None:
    with pytest.raises(InvalidDataError, match="without observations"):
        trajectory_from_observations([])


def test_without_the_sdk_the_error_names_the_extra() -> None:
    script = textwrap.dedent(
        """
        import sys

        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] == "langfuse":
                    raise ImportError("blocked for this test")

        sys.meta_path.insert(0, Block())
        import journeyman
        try:
            import journeyman.integrations.langfuse
        except journeyman.MissingDependencyError as error:
            print(error)
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert 'pip install "./journeyman[langfuse]"' in result.stdout
