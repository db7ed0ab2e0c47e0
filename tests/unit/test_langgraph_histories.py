"""How captured calls are chained into histories (the part shared by every integration)."""

from __future__ import annotations

import logging

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from journeyman.integrations.capture import Call, HttpRecords, ToolRun, build_trajectory, gateway_root
from journeyman.messages import ToolResult
from tests.scripted_upstream import serve

USER = {"role": "user", "content": "What is 2 plus 3?"}
CALL = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a":2,"b":3}'}}


def test_calls_that_continue_a_conversation_extend_it() -> None:
    first = Call(
        messages=[USER], reply={"role": "assistant", "content": None, "tool_calls": [CALL]}, started=1
    )
    # The framework re-sends the assistant turn with other JSON spacing and an empty content.
    resent = {**CALL, "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
    second = Call(
        messages=[
            USER,
            {"role": "assistant", "content": "", "tool_calls": [resent]},
            {"role": "tool", "tool_call_id": "c1", "content": "5"},
        ],
        reply={"role": "assistant", "content": "5"},
        started=2,
    )
    trajectory = build_trajectory([second, first])  # out of order: sorted by start
    assert [m.role for m in trajectory.messages] == ["user", "assistant", "tool", "assistant"]
    assert not trajectory.additional_histories
    assert trajectory.metrics["calls_without_tokens"] == 2


def test_a_diverging_call_starts_another_history() -> None:
    main = Call(messages=[USER], reply={"role": "assistant", "content": "5"}, name="agent", started=1)
    summary = Call(
        messages=[{"role": "system", "content": "Summarise."}, USER],
        reply={"role": "assistant", "content": "sum"},
        name="summarise",
        started=2,
    )
    retry = Call(messages=[USER], reply={"role": "assistant", "content": "five"}, name="agent", started=3)
    trajectory = build_trajectory([main, summary, retry])
    assert [h.name for h in trajectory.histories] == ["agent", "summarise", "agent"]
    assert [h.messages[-1].content for h in trajectory.histories] == ["5", "sum", "five"]


def test_failed_calls_and_unanswered_tool_results_are_kept() -> None:
    asked = Call(
        messages=[USER], reply={"role": "assistant", "content": None, "tool_calls": [CALL]}, started=1
    )
    failed = Call(messages=[USER], error="APIConnectionError: refused", started=2)
    tool = ToolRun(name="add", tool_call_id="c1", error="ValueError: no")
    trajectory = build_trajectory([asked, failed], [tool])
    assert trajectory.messages[-1] == ToolResult(tool_call_id="c1", content="Error: ValueError: no")
    assert trajectory.metrics["llm_errors"] == 1 and trajectory.metrics["tool_errors"] == 1
    assert any("refused" in line for line in trajectory.logs)


def test_gateway_root() -> None:
    assert gateway_root("http://h:1/v1") == "http://h:1"
    assert gateway_root("http://h:1/r/run-7/v1/") == "http://h:1"
    assert gateway_root("https://api.example.com/v1") == "https://api.example.com"


def test_a_message_outside_the_schema_is_left_out_and_counted() -> None:
    odd = {"role": "function", "name": "old_style", "content": "42"}
    call = Call(messages=[USER, odd], reply={"role": "assistant", "content": "42"})
    trajectory = build_trajectory([call])
    assert [m.role for m in trajectory.messages] == ["user", "assistant"]
    assert trajectory.metrics["invalid_messages"] == 1 and any("left out" in line for line in trajectory.logs)


def test_a_refused_record_lookup_warns_once_and_is_not_repeated(caplog: pytest.LogCaptureFixture) -> None:
    seen: list[str] = []

    async def refuse(request: Request) -> Response:
        seen.append(request.url.path)
        return JSONResponse({"error": "unauthorized"}, status_code=401)

    server = serve(Starlette(routes=[Route("/records/{id}", refuse)]))
    try:
        records = HttpRecords(f"{server.base_url}/r/run-1/v1")
        with caplog.at_level(logging.WARNING):
            assert records.get("chatcmpl-1") is None and records.get("chatcmpl-2") is None
        assert seen == ["/records/chatcmpl-1"] and records.is_gateway is False
        assert "api_key=" in caplog.text
    finally:
        server.stop()
