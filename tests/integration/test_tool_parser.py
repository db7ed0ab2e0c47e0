"""The ``journeyman`` tool parser in vLLM: tagged calls exactly as hermes, and the bare JSON calls
that Qwen2.5-Coder-0.5B writes zero-shot, parsed by the real server and recorded by the gateway."""

from __future__ import annotations

import json
import subprocess
import textwrap
from typing import Any

import openai
import pytest

from journeyman.backend.serving.families import TOOL_PARSER_PLUGIN
from journeyman.backend.serving.gateway import GatewayThread
from journeyman.backend.serving.vllm import VLLMServer
from journeyman.backend.serving.vllm_plugin.journeyman_tool_parser import (
    form_of_tool_call_id,
    parse_tool_calls,
)
from journeyman.backend.settings import vllm_python
from journeyman.integrations.capture import Call, build_trajectory, join_records
from tests.integration.test_serving import TOOLS

NAMES = {"add", "multiply"}
QUESTIONS = [("multiply", 47, 86), ("add", 123, 456), ("multiply", 12, 34)]


def _messages(name: str, a: int, b: int) -> list[dict[str, Any]]:
    return [{"role": "user", "content": f"What is {a} {'times' if name == 'multiply' else 'plus'} {b}?"}]


# Tagged calls: the same as vLLM's hermes parser, non-streaming and streaming (no server) -------

_COMPARE = textwrap.dedent(
    """
    import json, sys
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.tool_parsers.abstract_tool_parser import ToolParserManager
    from vllm.tool_parsers.hermes_tool_parser import Hermes2ProToolParser

    ToolParserManager.import_tool_parser(sys.argv[1])
    parsers = {"hermes": Hermes2ProToolParser, "ours": ToolParserManager.get_tool_parser("journeyman")}
    request = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], tools=json.loads(sys.argv[2]))

    class Tokenizer:  # the parsers need one, and one that is not Mistral's
        def get_vocab(self):
            return {}

    def full(parser, text):
        info = parser.extract_tool_calls(text, request)
        calls = [[c.function.name, c.function.arguments] for c in info.tool_calls]
        return {"called": info.tools_called, "content": info.content, "calls": calls}, [c.id for c in info.tool_calls]

    def streamed(parser, text, step=3):
        content, calls, previous = "", {}, ""
        for end in range(step, len(text) + step, step):
            current = text[:end]
            delta = parser.extract_tool_calls_streaming(previous, current, current[len(previous):], [], [], [], request)
            previous = current
            for call in (delta.tool_calls if delta else None) or []:
                slot = calls.setdefault(call.index, {"id": None, "name": "", "arguments": ""})
                slot["id"] = call.id or slot["id"]
                slot["name"] += (call.function.name if call.function else None) or ""
                slot["arguments"] += (call.function.arguments if call.function else None) or ""
            content += (delta.content if delta else None) or ""
        slots = [c for _, c in sorted(calls.items())]
        return {"content": content, "calls": [[c["name"], c["arguments"]] for c in slots]}, [c["id"] for c in slots]

    results = []
    for text in json.load(sys.stdin):
        results.append({
            name: {"full": full(cls(Tokenizer()), text), "streamed": streamed(cls(Tokenizer()), text)}
            for name, cls in parsers.items()
        })
    json.dump(results, sys.stdout)
    """
)

MUL = '{"name": "multiply", "arguments": {"a": 47, "b": 86}}'
TAGGED = [
    f"<tool_call>\n{MUL}\n</tool_call>",
    f'Let me compute.\n<tool_call>{MUL}</tool_call>\n<tool_call>{{"name": "add", "arguments": {{}}}}</tool_call>',
    f"<tool_call>{MUL}</tool_call> The answer is 4042.",
    f"<tool_call>{MUL}",  # left open
    '<tool_call>{"name": "divide", "arguments": {"x": "π"}}</tool_call>',  # not a request tool
    '<tool_call>{"name": "add", "arguments": [3, 4]}</tool_call>',
    "<tool_call>{not json}</tool_call>",
    '<tool_call>{"name": "add", "parameters": {}}</tool_call>',
    "Just text, 4042.",
]
UNTAGGED = [MUL, f"```json\n{MUL}\n```"]


def test_tagged_calls_parse_exactly_as_hermes_and_untagged_ones_only_in_full_responses() -> None:
    completed = subprocess.run(
        [str(vllm_python()), "-c", _COMPARE, str(TOOL_PARSER_PLUGIN), json.dumps(TOOLS)],
        input=json.dumps(TAGGED + UNTAGGED),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    results = json.loads(completed.stdout)
    for text, result in zip(TAGGED, results[: len(TAGGED)], strict=True):
        (hermes, _), (ours, our_ids) = result["hermes"]["full"], result["ours"]["full"]
        assert ours == hermes, text
        (hermes_stream, _), (ours_stream, stream_ids) = (
            result["hermes"]["streamed"],
            result["ours"]["streamed"],
        )
        assert ours_stream == hermes_stream, text
        assert all(form_of_tool_call_id(i) == "tagged" for i in our_ids + stream_ids), (our_ids, stream_ids)
    for text, form, result in zip(UNTAGGED, ["bare", "fenced"], results[len(TAGGED) :], strict=True):
        (hermes, _), (ours, our_ids) = result["hermes"]["full"], result["ours"]["full"]
        assert hermes["calls"] == [] and hermes["content"] == text
        assert ours == {"called": True, "content": None, "calls": [["multiply", '{"a": 47, "b": 86}']]}
        assert [form_of_tool_call_id(i) for i in our_ids] == [form]
        # Streaming is hermes's: the JSON arrives as content.
        assert (
            result["ours"]["streamed"] == result["hermes"]["streamed"] == [{"content": text, "calls": []}, []]
        )


# The real server with Qwen2.5-Coder-0.5B, zero-shot ------------------------------------------


@pytest.fixture
def server(qwen_server: VLLMServer) -> VLLMServer:
    """The run's shared Qwen2.5-Coder-0.5B server; its tool parser is ``auto``, i.e. journeyman's."""
    assert "--tool-parser-plugin" in qwen_server.command()
    return qwen_server


@pytest.fixture
def gateway(qwen_gateway: GatewayThread) -> GatewayThread:
    return qwen_gateway


@pytest.fixture
def tokenizer(qwen_tokenizer: Any) -> Any:
    return qwen_tokenizer


def _form_written(raw: str) -> str:
    return "tagged" if "<tool_call>" in raw else "fenced" if "```" in raw else "bare"


@pytest.mark.parametrize(("name", "a", "b"), QUESTIONS)
def test_zero_shot_untagged_calls_come_back_as_tool_calls(
    server: VLLMServer, tokenizer: Any, name: str, a: int, b: int
) -> None:
    """Greedy, the model writes the call as bare JSON: no ``<tool_call>`` tag, so vLLM's hermes
    parser (which looks for nothing else) would return it as text."""
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="-", max_retries=0)
    response = client.chat.completions.create(
        model="qwen",
        messages=_messages(name, a, b),  # type: ignore[arg-type]
        tools=TOOLS,  # type: ignore[arg-type]
        temperature=0,
        max_tokens=96,
        extra_body={"return_token_ids": True},
    )
    choice = response.choices[0]
    raw = tokenizer.decode(choice.model_extra["token_ids"], skip_special_tokens=True)
    assert "<tool_call>" not in raw, f"the model used the tags this time, nothing to show: {raw!r}"
    (call,) = choice.message.tool_calls or []
    assert call.function.name == name and json.loads(call.function.arguments) == {"a": a, "b": b}, raw
    assert form_of_tool_call_id(call.id) == _form_written(raw)
    assert choice.finish_reason == "tool_calls" and not choice.message.content


def test_the_gateway_records_the_form_and_the_sampled_tokens(
    server: VLLMServer, gateway: GatewayThread, tokenizer: Any
) -> None:
    name, a, b = QUESTIONS[0]
    messages = _messages(name, a, b)
    body: dict[str, Any] = {"model": "qwen", "tools": TOOLS, "temperature": 0, "max_tokens": 96}
    direct = openai.OpenAI(base_url=server.base_url + "/v1", api_key="-", max_retries=0)
    expected = direct.chat.completions.create(
        messages=messages, extra_body={"return_token_ids": True}, **body
    )
    client = openai.OpenAI(base_url=gateway.base_url + "/v1", api_key="-", max_retries=0)
    response = client.chat.completions.create(messages=messages, **body)

    record = gateway.gateway.records.get(response.id)
    assert record is not None
    choice = record.choices[0]
    (call,) = response.choices[0].message.tool_calls or []
    raw = tokenizer.decode(choice.completion_token_ids or [], skip_special_tokens=True)
    assert choice.tool_call_forms == [form_of_tool_call_id(call.id)] == [_form_written(raw)]
    assert choice.completion_token_ids == expected.choices[0].model_extra["token_ids"]  # greedy: the same
    assert record.prompt_token_ids == expected.model_extra["prompt_token_ids"]
    assert len(choice.logprobs or []) == len(choice.completion_token_ids or [])
    # The record's tokens hold the call that reached the client.
    assert parse_tool_calls(raw, NAMES).calls == [(call.function.name, call.function.arguments)]

    calls = [Call(messages, TOOLS, reply=response.choices[0].message.model_dump(), completion_id=response.id)]
    assert join_records(calls, gateway.gateway.records) == 0
    metrics = build_trajectory(calls).metrics
    form = _form_written(raw)
    assert metrics[f"tool_calls_{form}"] == 1
    assert sum(metrics[f"tool_calls_{f}"] for f in ("tagged", "bare", "fenced")) == 1


def test_sampled_calls_are_what_the_sampled_text_holds(gateway: GatewayThread, tokenizer: Any) -> None:
    """At temperature 0.7 the model varies the form and the text around it: whatever it writes,
    the client's calls and content and the record's forms follow from the sampled tokens."""
    client = openai.OpenAI(base_url=gateway.base_url + "/v1", api_key="-", max_retries=0)
    for (name, a, b), seed in zip(QUESTIONS[:2], (1, 2), strict=True):
        response = client.chat.completions.create(
            model="qwen",
            messages=_messages(name, a, b),  # type: ignore[arg-type]
            tools=TOOLS,  # type: ignore[arg-type]
            temperature=0.7,
            seed=seed,
            n=2,
            max_tokens=96,
        )
        record = gateway.gateway.records.get(response.id)
        assert record is not None and len(record.choices) == 2
        for sent, kept in zip(response.choices, record.choices, strict=True):
            raw = tokenizer.decode(kept.completion_token_ids or [], skip_special_tokens=True)
            parsed = parse_tool_calls(raw, NAMES)
            objects = [isinstance(json.loads(arguments), dict) for _, arguments in parsed.calls]
            calls = sent.message.tool_calls or []  # the gateway returns the others as text
            assert [(c.function.name, c.function.arguments) for c in calls] == [
                call for call, is_object in zip(parsed.calls, objects, strict=True) if is_object
            ], raw
            assert [form_of_tool_call_id(c.id) for c in calls] == [
                form for form, is_object in zip(parsed.forms, objects, strict=True) if is_object
            ]
            assert kept.tool_call_forms == (parsed.forms or None)
            if not parsed.calls:
                assert sent.message.content == raw
            elif all(objects):
                assert (sent.message.content or "").strip() == (parsed.content or "").strip()
