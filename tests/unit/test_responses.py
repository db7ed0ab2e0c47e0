"""The Responses API at the gateway: requests translated onto chat, answers and streams translated
back (checked by the real OpenAI client's own types), and records kept as for chat."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from journeyman.backend.serving.gateway import GatewayThread
from journeyman.errors import InvalidDataError
from journeyman.responses import chat_request, input_messages
from tests.scripted_upstream import Reply, ScriptedUpstream

TOOL = {
    "type": "function",
    "name": "add",
    "description": "Add two numbers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}},
    "strict": False,
}


def _completion(message: dict[str, Any], finish: str = "stop", cid: str = "chatcmpl-7") -> dict[str, Any]:
    return {
        "id": cid,
        "object": "chat.completion",
        "created": 0,
        "model": "base",
        "prompt_token_ids": [1, 2, 3],
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", **message},
                "finish_reason": finish,
                "token_ids": [40, 41],
                "logprobs": {"content": [{"token": "a", "logprob": -0.5}, {"token": "b", "logprob": -0.25}]},
            }
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
    }


def test_input_items_become_the_chat_messages_the_model_sees() -> None:
    items = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "input_text", "text": "3+4?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me add."}]},
        {"type": "function_call", "call_id": "c1", "name": "add", "arguments": '{"a":3,"b":4}'},
        {"type": "function_call", "call_id": "c2", "name": "add", "arguments": '{"a":1,"b":1}'},
        {"type": "function_call_output", "call_id": "c1", "output": "7"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "2"}]},
        {"type": "function_call", "call_id": "c3", "name": "add", "arguments": "{}"},
    ]
    assert input_messages(items, "You add.") == [
        {"role": "system", "content": "You add."},
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "3+4?"},
        {
            "role": "assistant",
            "content": "Let me add.",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a":3,"b":4}'}},
                {"id": "c2", "type": "function", "function": {"name": "add", "arguments": '{"a":1,"b":1}'}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "7"},
        {"role": "tool", "tool_call_id": "c2", "content": "2"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c3", "type": "function", "function": {"name": "add", "arguments": "{}"}}],
        },
    ]


def test_request_options_carry_over_and_hosted_tools_are_refused() -> None:
    body = {
        "model": "m",
        "input": "hi",
        "tools": [TOOL],
        "tool_choice": {"type": "function", "name": "add"},
        "max_output_tokens": 9,
        "temperature": 0.5,
        "text": {"format": {"type": "json_schema", "name": "out", "schema": {"type": "object"}}},
    }
    chat = chat_request(body)
    assert chat["max_tokens"] == 9 and chat["temperature"] == 0.5
    assert chat["tools"][0]["function"]["name"] == "add"
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "add"}}
    assert chat["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "out", "schema": {"type": "object"}},
    }
    with pytest.raises(InvalidDataError, match="function tools only, not 'web_search'"):
        chat_request({"model": "m", "input": "hi", "tools": [{"type": "web_search"}]})
    with pytest.raises(InvalidDataError, match="item_reference"):
        input_messages([{"type": "item_reference", "id": "x"}])


def _client(gateway: GatewayThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.base_url + "/v1", api_key="none", max_retries=0)


def test_a_response_is_run_as_chat_and_recorded_token_exact(
    upstream: tuple[ScriptedUpstream, str], gateway: GatewayThread
) -> None:
    script, _ = upstream
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a":3,"b":4}'}}
    script.replies.append(Reply(body=_completion({"content": None, "tool_calls": [call]}, "tool_calls")))
    response = _client(gateway).responses.create(
        model="base", instructions="You add.", input="3+4?", tools=[TOOL], max_output_tokens=20
    )
    assert response.id == "resp_7" and response.status == "completed"
    [item] = response.output
    assert item.type == "function_call" and item.call_id == "call_1" and item.arguments == '{"a":3,"b":4}'
    assert response.usage is not None and response.usage.output_tokens == 2
    sent = script.received[0]
    assert sent["messages"] == [
        {"role": "system", "content": "You add."},
        {"role": "user", "content": "3+4?"},
    ]
    assert sent["logprobs"] is True and sent["return_token_ids"] is True and sent["max_tokens"] == 20
    record = gateway.gateway.records.get("resp_7")
    assert record is not None and record.kind == "response"
    assert record.messages == sent["messages"] and record.tools == sent["tools"]
    assert record.prompt_token_ids == [1, 2, 3]
    assert record.choices[0].completion_token_ids == [40, 41] and record.choices[0].logprobs == [-0.5, -0.25]
    assert record.choices[0].message is not None and record.choices[0].message.tool_calls is not None

    # the next turn by previous_response_id: the gateway rebuilds the conversation from its record
    script.replies.append(Reply(body=_completion({"content": "7"}, cid="chatcmpl-8")))
    second = _client(gateway).responses.create(
        model="base",
        previous_response_id=response.id,
        input=[{"type": "function_call_output", "call_id": "call_1", "output": "7"}],
    )
    assert second.output_text == "7"
    assert [m["role"] for m in script.received[1]["messages"]] == ["system", "user", "assistant", "tool"]
    assert script.received[1]["messages"][2]["tool_calls"][0]["id"] == "call_1"
    with pytest.raises(openai.NotFoundError, match="send the whole conversation"):
        _client(gateway).responses.create(model="base", previous_response_id="resp_nope", input="hi")
    with pytest.raises(openai.BadRequestError, match="function tools only"):
        _client(gateway).responses.create(model="base", input="hi", tools=[{"type": "web_search"}])
    with pytest.raises(openai.BadRequestError, match="no input"):
        _client(gateway).responses.create(model="base", instructions="Be brief.", input=[])


def test_a_response_carries_its_rollout_id(
    upstream: tuple[ScriptedUpstream, str], gateway: GatewayThread
) -> None:
    script, _ = upstream
    script.replies.append(Reply(body=_completion({"content": "hi"})))
    client = openai.OpenAI(base_url=f"{gateway.base_url}/r/run-1/v1", api_key="none", max_retries=0)
    response = client.responses.create(model="base", input="hi")
    assert [r.completion_id for r in gateway.gateway.records.for_rollout("run-1")] == [response.id]


def _chunk(delta: dict[str, Any], ids: list[int], finish: str | None = None, **top: Any) -> dict[str, Any]:
    logprobs = {"content": [{"token": "t", "logprob": -0.1} for _ in ids]}
    choice = {"index": 0, "delta": delta, "finish_reason": finish, "token_ids": ids, "logprobs": logprobs}
    return {"id": "chatcmpl-9", "object": "chat.completion.chunk", "choices": [choice], **top}


def test_a_streamed_response_sends_the_events_the_client_parses(
    upstream: tuple[ScriptedUpstream, str], gateway: GatewayThread
) -> None:
    script, _ = upstream
    call = {"index": 0, "id": "call_2", "type": "function", "function": {"name": "add", "arguments": "{}"}}
    script.replies.append(
        Reply(
            chunks=[
                _chunk({"role": "assistant", "content": ""}, [], prompt_token_ids=[5, 6]),
                _chunk({"content": "Adding"}, [50]),
                _chunk({"content": " now."}, [51, 52]),
                _chunk({"tool_calls": [call]}, [53], "tool_calls"),
                {"id": "chatcmpl-9", "choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 4}},
            ]
        )
    )
    with _client(gateway).responses.stream(model="base", input="add", tools=[TOOL]) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Adding now."
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert final.id == "resp_9" and final.output_text == "Adding now."
    assert [i.type for i in final.output] == ["message", "function_call"]
    assert final.usage is not None and final.usage.output_tokens == 4
    assert script.received[0]["stream_options"] == {"include_usage": True}
    record = gateway.gateway.records.get("resp_9")
    assert record is not None and record.kind == "response" and record.stream
    assert record.prompt_token_ids == [5, 6] and record.choices[0].completion_token_ids == [50, 51, 52, 53]


def test_a_chat_message_carries_its_completion_id(
    upstream: tuple[ScriptedUpstream, str], gateway: GatewayThread
) -> None:
    script, _ = upstream
    script.replies.append(Reply(body=_completion({"content": "hello"})))
    completion = _client(gateway).chat.completions.create(
        model="base", messages=[{"role": "user", "content": "hi"}]
    )
    assert completion.choices[0].message.model_dump()["id"] == completion.id == "chatcmpl-7"
