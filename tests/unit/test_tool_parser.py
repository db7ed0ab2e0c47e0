"""The ``journeyman`` vLLM tool parser's parsing (no vLLM needed), and the forms it names in its
ids reaching the gateway's records and the trajectories' counts."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from journeyman.backend.serving.answers import tool_call_forms
from journeyman.backend.serving.gateway import GatewayThread
from journeyman.backend.serving.vllm_plugin.journeyman_tool_parser import (
    FORMS,
    ParsedToolCalls,
    form_of_tool_call_id,
    parse_tool_calls,
    tool_call_id,
)
from journeyman.integrations.capture import Call, build_trajectory, join_records
from journeyman.records import TOOL_CALL_FORMS
from tests.scripted_upstream import Reply, ScriptedUpstream

TOOLS = {"add", "multiply"}
MUL = '{"name": "multiply", "arguments": {"a": 47, "b": 86}}'
ADD = '{"name": "add", "arguments": {"a": 1, "b": 2}}'
MUL_ARGS, ADD_ARGS = '{"a": 47, "b": 86}', '{"a": 1, "b": 2}'


def _parse(text: str) -> ParsedToolCalls:
    return parse_tool_calls(text, TOOLS)


# Tagged: exactly vLLM's hermes parser -------------------------------------------------------


def test_a_tagged_call() -> None:
    assert _parse(f"<tool_call>\n{MUL}\n</tool_call>") == ParsedToolCalls(
        None, [("multiply", MUL_ARGS)], ["tagged"]
    )


def test_several_tagged_calls_keep_the_text_before_the_first_and_drop_the_rest() -> None:
    text = f"Let me compute.\n<tool_call>{MUL}</tool_call>\n<tool_call>{ADD}</tool_call>\nDone: 4042"
    assert _parse(text) == ParsedToolCalls(
        "Let me compute.\n", [("multiply", MUL_ARGS), ("add", ADD_ARGS)], ["tagged", "tagged"]
    )


def test_a_tag_left_open_runs_to_the_end_and_names_are_not_checked() -> None:
    """As in hermes: a tagged call is a call even for a tool the request does not have."""
    text = '<tool_call>{"name": "divide", "arguments": {"a": 1}}'
    assert _parse(text) == ParsedToolCalls(None, [("divide", '{"a": 1}')], ["tagged"])


@pytest.mark.parametrize(
    "text",
    [
        "<tool_call>{not json}</tool_call>",
        f"<tool_call>{MUL}</tool_call><tool_call>{{bad</tool_call>",  # one bad region: all content
        '<tool_call>{"name": "add", "parameters": {"a": 1}}</tool_call>',  # hermes needs "arguments"
        '<tool_call>{"name": 3, "arguments": {}}</tool_call>',
        "<tool_call>[1, 2]</tool_call>",
        "<tool_call></tool_call>",
        f"{MUL} <tool_call>oops",  # a tag decides the form: no bare fallback
    ],
)
def test_a_tagged_call_that_is_not_valid_leaves_all_the_text_as_content(text: str) -> None:
    assert _parse(text) == ParsedToolCalls(text)


# Bare and fenced ----------------------------------------------------------------------------


def test_a_bare_call() -> None:
    assert _parse(MUL) == ParsedToolCalls(None, [("multiply", MUL_ARGS)], ["bare"])


def test_a_bare_call_in_text_keeps_the_text_before_it() -> None:
    text = f"To find the product I will call the tool: {MUL} and then report 4042."
    assert _parse(text) == ParsedToolCalls(
        "To find the product I will call the tool: ", [("multiply", MUL_ARGS)], ["bare"]
    )


def test_several_bare_calls_and_a_list() -> None:
    assert _parse(f"{MUL}\n{ADD}") == ParsedToolCalls(
        None, [("multiply", MUL_ARGS), ("add", ADD_ARGS)], ["bare", "bare"]
    )
    assert _parse(f"[{MUL}, {ADD}]") == ParsedToolCalls(
        None, [("multiply", MUL_ARGS), ("add", ADD_ARGS)], ["bare", "bare"]
    )


@pytest.mark.parametrize("language", ["json", "JSON", ""])
def test_a_fenced_call(language: str) -> None:
    text = f"Here is the call:\n```{language}\n{MUL}\n```\nThe answer will follow."
    assert _parse(text) == ParsedToolCalls("Here is the call:\n", [("multiply", MUL_ARGS)], ["fenced"])


def test_a_fence_may_hold_a_list_or_several_objects_and_be_left_open() -> None:
    both = ParsedToolCalls(None, [("multiply", MUL_ARGS), ("add", ADD_ARGS)], ["fenced", "fenced"])
    assert _parse(f"```json\n[{MUL}, {ADD}]\n```") == both
    assert _parse(f"```json\n{MUL}\n{ADD}\n```") == both
    assert _parse(f"```json\n{MUL}") == ParsedToolCalls(None, [("multiply", MUL_ARGS)], ["fenced"])


def test_fenced_and_bare_calls_in_one_text_keep_their_order_and_forms() -> None:
    text = f"{ADD}\n```json\n{MUL}\n```"
    assert _parse(text) == ParsedToolCalls(
        None, [("add", ADD_ARGS), ("multiply", MUL_ARGS)], ["bare", "fenced"]
    )


def test_parameters_is_accepted_for_arguments() -> None:
    text = '{"name": "add", "parameters": {"a": 1, "b": 2}}'
    assert _parse(text) == ParsedToolCalls(None, [("add", ADD_ARGS)], ["bare"])
    both = '{"name": "add", "arguments": {"a": 1, "b": 2}, "parameters": {"x": 0}}'
    assert _parse(both).calls == [("add", ADD_ARGS)]  # "arguments" wins


@pytest.mark.parametrize(
    "text",
    [
        '{"name": "divide", "arguments": {"a": 1, "b": 2}}',  # not one of the request's tools
        f"```json\n{MUL}\nnot json\n```",  # a fence that holds more than calls
        f"```python\n{MUL}\n```",  # another language: code, not a call
        '{"result": 4042}',
        '{"name": "add"}',  # neither arguments nor parameters
        '{"name": ["add"], "arguments": {}}',
        f"[{MUL}, 5]",  # a list that is not all calls
        f'{{"answer": {MUL}}}',  # a call inside JSON that is not a call
        '{"name": "add", "arguments": {"a": 1,}}',  # invalid JSON
        '{"name": "multiply", "arguments": {"a": 47, "b": 86}',  # cut short
        "The product of 47 and 86 is 4042. {",
        "[" * 5000,
        "",
    ],
)
def test_json_that_is_not_a_call_stays_content_unchanged(text: str) -> None:
    assert _parse(text) == ParsedToolCalls(text)


def test_no_call_is_bare_or_fenced_without_tools() -> None:
    assert parse_tool_calls(MUL, set()) == ParsedToolCalls(MUL)


@pytest.mark.parametrize(
    ("text", "arguments"),
    [
        ('{"name": "add", "arguments": [3, 4]}', "[3, 4]"),
        ('{"name": "add", "arguments": "3, 4"}', '"3, 4"'),
        ('<tool_call>{"name": "add", "arguments": [3, 4]}</tool_call>', "[3, 4]"),
        ('{"name": "add", "arguments": {"x": "π"}}', '{"x": "π"}'),  # not ASCII-escaped, as hermes
    ],
)
def test_arguments_are_passed_on_as_written(text: str, arguments: str) -> None:
    """Arguments that are not an object are still a call: the gateway returns it as text and
    counts it in ``invalid_tool_calls``, as for hermes."""
    assert _parse(text).calls == [("add", arguments)]


# Ids name the form ---------------------------------------------------------------------------


def test_ids_name_the_form_the_gateway_reads() -> None:
    assert FORMS == TOOL_CALL_FORMS
    ids = [tool_call_id(form) for form in FORMS]
    assert len(set(ids)) == 3 and all(i.startswith(f"call_{f}_") for i, f in zip(ids, FORMS, strict=True))
    assert [form_of_tool_call_id(i) for i in ids] == list(FORMS)
    calls = [{"id": i} for i in [*ids, "chatcmpl-tool-0a1b", ""]]
    assert tool_call_forms(calls) == [*FORMS, None, None]
    assert tool_call_forms([{"id": "chatcmpl-tool-0a1b"}]) is None and tool_call_forms(None) is None
    assert form_of_tool_call_id("call_other_abc") is None and form_of_tool_call_id(None) is None


# The gateway records the forms; trajectories count them --------------------------------------


def _call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _completion(
    completion_id: str, calls: list[dict[str, Any]], content: str | None = None
) -> dict[str, Any]:
    return {
        "id": completion_id,
        "object": "chat.completion",
        "model": "base",
        "prompt_token_ids": [9, 8],
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": content, "tool_calls": calls},
                "finish_reason": "tool_calls" if calls else "stop",
                "token_ids": [5, 6, 7],
                "logprobs": {"content": [{"token": "x", "logprob": -0.5} for _ in range(3)]},
            }
        ],
    }


BODY: dict[str, Any] = {
    "model": "base",
    "messages": [{"role": "user", "content": "What is 47 times 86?"}],
    "tools": [{"type": "function", "function": {"name": n}} for n in sorted(TOOLS)],
}


def test_the_gateway_records_each_calls_form_and_leaves_the_tokens_alone(
    upstream: tuple[ScriptedUpstream, str], gateway: GatewayThread
) -> None:
    script, _ = upstream
    bare, fenced, tagged = tool_call_id("bare"), tool_call_id("fenced"), tool_call_id("tagged")
    script.replies += [
        Reply(
            body=_completion(
                "cmpl-forms",
                [
                    _call(bare, "multiply", MUL_ARGS),
                    _call(fenced, "add", "[3, 4]"),
                    _call(tagged, "add", ADD_ARGS),
                ],
            )
        ),
        Reply(body=_completion("cmpl-hermes", [_call("chatcmpl-tool-0a1b", "add", ADD_ARGS)])),
        Reply(body=_completion("cmpl-text", [], content="4042")),
    ]
    for _ in range(3):
        assert httpx.post(f"{gateway.base_url}/v1/chat/completions", json=BODY).status_code == 200

    record = gateway.gateway.records.get("cmpl-forms")
    assert record is not None
    choice = record.choices[0]
    # In the server's order, the call returned as text (list arguments) included.
    assert choice.tool_call_forms == ["bare", "fenced", "tagged"]
    assert choice.message is not None and [c.id for c in choice.message.tool_calls or []] == [bare, tagged]
    assert [c.id for c in choice.invalid_tool_calls or []] == [fenced]
    assert choice.completion_token_ids == [5, 6, 7] and choice.logprobs == [-0.5] * 3
    assert record.prompt_token_ids == [9, 8]
    for other in ("cmpl-hermes", "cmpl-text"):  # another parser's ids, no calls: nothing recorded
        found = gateway.gateway.records.get(other)
        assert found is not None and found.choices[0].tool_call_forms is None


def test_a_streamed_call_records_its_form(
    upstream: tuple[ScriptedUpstream, str], gateway: GatewayThread
) -> None:
    script, _ = upstream
    call_id = tool_call_id("tagged")

    def chunk(delta: dict[str, Any], ids: list[int], finish: str | None = None) -> dict[str, Any]:
        choice = {"index": 0, "delta": delta, "finish_reason": finish, "token_ids": ids}
        return {"id": "cmpl-stream", "object": "chat.completion.chunk", "choices": [choice]}

    first = {"index": 0, "id": call_id, "type": "function", "function": {"name": "add", "arguments": ""}}
    script.replies.append(
        Reply(
            chunks=[
                chunk({"role": "assistant", "content": ""}, []),
                chunk({"tool_calls": [first]}, [10, 11]),
                chunk({"tool_calls": [{"index": 0, "function": {"arguments": ADD_ARGS}}]}, [12]),
                chunk({}, [2], finish="tool_calls"),
            ]
        )
    )
    with httpx.stream("POST", f"{gateway.base_url}/v1/chat/completions", json={**BODY, "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data:")]
    assert lines[-1] == "data: [DONE]"
    relayed = [json.loads(line[5:]) for line in lines[:-1]]
    assert relayed[1]["choices"][0]["delta"]["tool_calls"][0]["id"] == call_id  # the client sees the id
    record = gateway.gateway.records.get("cmpl-stream")
    assert record is not None and record.stream
    assert record.choices[0].tool_call_forms == ["tagged"]
    assert record.choices[0].completion_token_ids == [10, 11, 12, 2]


def test_trajectories_count_the_forms_zero_included(
    upstream: tuple[ScriptedUpstream, str], gateway: GatewayThread
) -> None:
    script, _ = upstream
    script.replies += [
        Reply(body=_completion("cmpl-1", [_call(tool_call_id("bare"), "multiply", MUL_ARGS)])),
        Reply(
            body=_completion(
                "cmpl-2",
                [_call(tool_call_id("bare"), "add", ADD_ARGS), _call(tool_call_id("fenced"), "add", "6")],
            )
        ),
        Reply(body=_completion("cmpl-3", [], content="4042")),
    ]
    messages: list[dict[str, Any]] = list(BODY["messages"])
    calls = []
    for _ in range(3):
        reply = httpx.post(
            f"{gateway.base_url}/v1/chat/completions", json={**BODY, "messages": messages}
        ).json()
        message = reply["choices"][0]["message"]
        calls.append(Call(list(messages), BODY["tools"], reply=message, completion_id=reply["id"]))
        messages = [*messages, {k: v for k, v in message.items() if v is not None}]
        for call in message.get("tool_calls") or []:
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": "4042"})
    assert join_records(calls, gateway.gateway.records) == 0
    metrics = build_trajectory(calls).metrics
    assert {k: metrics[k] for k in ("tool_calls_tagged", "tool_calls_bare", "tool_calls_fenced")} == {
        "tool_calls_tagged": 0,
        "tool_calls_bare": 2,
        "tool_calls_fenced": 1,  # the call with non-object arguments counts in its form too
    }
    assert metrics["invalid_tool_calls"] == 1 and metrics["token_exact_calls"] == 3

    untracked = build_trajectory([Call(list(BODY["messages"]), reply={"content": "hi"})])
    assert all(untracked.metrics[f"tool_calls_{form}"] == 0 for form in TOOL_CALL_FORMS)
