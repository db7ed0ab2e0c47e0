"""Gateway behaviour that needs exact control of the upstream: errors, streams, records."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from journeyman.backend.serving.gateway import ROLLOUT_HEADER, GatewayThread, RecordLog
from journeyman.backend.serving.router import Router
from journeyman.records import (
    ChoiceRecord,
    CompletionRecord,
    in_process_records,
    register_in_process,
    unregister_in_process,
)
from tests.scripted_upstream import Reply, ScriptedServer, ScriptedUpstream, gateway_to

MESSAGES = [{"role": "user", "content": "hi"}]


def _chunk(
    delta: dict[str, Any], *, ids: list[int], lps: list[float], finish: str | None = None, **top: Any
) -> dict[str, Any]:
    logprobs = {
        "content": [{"token": f"token_id:{i}", "logprob": lp} for i, lp in zip(ids, lps, strict=True)]
    }
    choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish, "token_ids": ids}
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "choices": [choice], **top}


def test_streamed_parallel_tool_calls_are_assembled(
    upstream: tuple[ScriptedUpstream, str], gateway: GatewayThread
) -> None:
    script, _ = upstream
    script.replies.append(
        Reply(
            chunks=[
                _chunk({"role": "assistant", "content": ""}, ids=[], lps=[], prompt_token_ids=[1, 2, 3]),
                _chunk(
                    {
                        "tool_calls": [
                            {
                                "index": 0,
                                "id": "c1",
                                "type": "function",
                                "function": {"name": "add", "arguments": ""},
                            }
                        ]
                    },
                    ids=[10, 11],
                    lps=[-0.1, -0.2],
                ),
                _chunk(
                    {"tool_calls": [{"index": 0, "function": {"arguments": '{"a": 1, '}}]},
                    ids=[12],
                    lps=[-0.3],
                ),
                _chunk(
                    {"tool_calls": [{"index": 0, "function": {"arguments": '"b": 2}'}}]}, ids=[13], lps=[-0.4]
                ),
                _chunk(
                    {
                        "tool_calls": [
                            {
                                "index": 1,
                                "id": "c2",
                                "type": "function",
                                "function": {"name": "multiply", "arguments": "{}"},
                            }
                        ]
                    },
                    ids=[14, 15],
                    lps=[-0.5, -0.6],
                ),
                _chunk({}, ids=[2], lps=[-0.7], finish="tool_calls"),
            ]
        )
    )
    body = {
        "model": "base",
        "messages": MESSAGES,
        "stream": True,
        "tools": [{"type": "function", "function": {"name": "add"}}],
    }
    with httpx.stream(
        "POST", f"{gateway.base_url}/v1/chat/completions", json=body, headers={ROLLOUT_HEADER: "r-1"}
    ) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line.startswith("data:")]
    assert lines[-1] == "data: [DONE]"
    relayed = [json.loads(line[5:]) for line in lines[:-1]]
    assert all("token_ids" not in c["choices"][0] and c["choices"][0]["logprobs"] is None for c in relayed)
    assert "prompt_token_ids" not in relayed[0]
    assert all(c["choices"][0]["delta"]["id"] == "chatcmpl-1" for c in relayed)  # for langchain-openai
    assert relayed[1]["choices"][0]["delta"]["tool_calls"][0]["id"] == "c1"
    record = gateway.gateway.records.get("chatcmpl-1")
    assert record is not None and record.rollout_id == "r-1" and record.stream
    assert record.prompt_token_ids == [1, 2, 3]
    (choice,) = record.choices
    assert choice.completion_token_ids == [10, 11, 12, 13, 14, 15, 2]
    assert choice.logprobs == [-0.1, -0.2, -0.3, -0.4, -0.5, -0.6, -0.7]
    assert choice.finish_reason == "tool_calls"
    assert choice.message is not None and choice.message.content is None
    calls = [(c.id, c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
    assert calls == [("c1", "add", '{"a": 1, "b": 2}'), ("c2", "multiply", "{}")]
    assert not {"authorization", "x-api-key"} & set(script.headers[0])  # the client's credentials stay here
    sent = script.received[0]
    assert (sent["logprobs"], sent["return_token_ids"], sent["model"]) == (True, True, "base")


def test_several_choices_are_recorded_separately(
    upstream: tuple[ScriptedUpstream, str], gateway: GatewayThread
) -> None:
    script, _ = upstream
    choices = [
        {
            "index": i,
            "message": {"role": "assistant", "content": text},
            "finish_reason": "stop",
            "token_ids": ids,
            "logprobs": {"content": [{"token": "x", "logprob": -1.0} for _ in ids]},
        }
        for i, (text, ids) in enumerate([("a", [5, 2]), ("bc", [6, 7, 2])])
    ]
    script.replies.append(
        Reply(
            body={
                "id": "cmpl-n",
                "object": "chat.completion",
                "choices": choices,
                "prompt_token_ids": [9],
                "usage": {"total_tokens": 6},
            }
        )
    )
    response = httpx.post(
        f"{gateway.base_url}/r/run-7/v1/chat/completions",
        json={"model": "base", "messages": MESSAGES, "n": 2},
    )
    data = response.json()
    assert "prompt_token_ids" not in data and all("token_ids" not in c for c in data["choices"])
    assert [c["logprobs"] for c in data["choices"]] == [None, None]
    record = gateway.gateway.records.get("cmpl-n")
    assert record is not None and record.rollout_id == "run-7" and record.sampling == {"n": 2}
    assert [(c.index, c.completion_token_ids) for c in record.choices] == [(0, [5, 2]), (1, [6, 7, 2])]
    assert record.model_turn(1).message.content == "bc"
    listed = httpx.get(f"{gateway.base_url}/records", params={"completion_id": ["cmpl-n", "unknown"]})
    assert [r["completion_id"] for r in listed.json()["records"]] == ["cmpl-n"]
    assert httpx.get(f"{gateway.base_url}/records?rollout_id=run-7").json()["records"][0]["choices"]
    unasked = httpx.get(f"{gateway.base_url}/records")
    assert unasked.status_code == 400 and "completion_id=" in unasked.json()["error"]["message"]


@pytest.mark.parametrize(
    ("body", "headers", "status", "message"),
    [
        (b"{not json", {}, 400, "not JSON"),
        (b"[1, 2]", {}, 400, "a 'model' string"),
        (b'{"messages": []}', {}, 400, "a 'model' string"),
        (b'{"model": "base"}', {ROLLOUT_HEADER: "bad id/with slash"}, 400, "rollout id"),
    ],
)
def test_bad_requests_get_json_errors(
    gateway: GatewayThread, body: bytes, headers: dict[str, str], status: int, message: str
) -> None:
    response = httpx.post(f"{gateway.base_url}/v1/chat/completions", content=body, headers=headers)
    assert response.status_code == status
    assert message in response.json()["error"]["message"]


def test_upstream_errors_pass_through(upstream: tuple[ScriptedUpstream, str], gateway: GatewayThread) -> None:
    script, _ = upstream
    script.replies.append(
        Reply(body={"error": {"message": "The model `nope` does not exist.", "code": 404}}, status=404)
    )
    response = httpx.post(
        f"{gateway.base_url}/v1/chat/completions", json={"model": "nope", "messages": MESSAGES}
    )
    assert response.status_code == 404 and "does not exist" in response.json()["error"]["message"]
    assert len(gateway.gateway.records) == 0


def test_server_not_running_is_503(tmp_path: Path) -> None:
    with gateway_to(
        ScriptedServer("http://127.0.0.1:9", running=False, log_dir=tmp_path), tmp_path
    ) as gateway:
        response = httpx.post(
            f"{gateway.base_url}/v1/chat/completions", json={"model": "base", "messages": MESSAGES}
        )
        assert response.status_code == 503 and "not running" in response.json()["error"]["message"]
        assert httpx.get(f"{gateway.base_url}/health").json() == {"status": "degraded", "upstream": False}


def test_unreachable_upstream_is_502_and_the_gateway_stays_up(tmp_path: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed_port = sock.getsockname()[1]
    server = ScriptedServer(f"http://127.0.0.1:{closed_port}", log_dir=tmp_path)
    with gateway_to(server, tmp_path) as gateway:
        for _ in range(2):
            response = httpx.post(
                f"{gateway.base_url}/v1/chat/completions", json={"model": "base", "messages": MESSAGES}
            )
            assert response.status_code == 502
            assert "could not reach the inference server" in response.json()["error"]["message"]
        assert gateway.gateway.router.in_flight("base") == 0


def test_slow_upstream_is_504(upstream: tuple[ScriptedUpstream, str], tmp_path: Path) -> None:
    script, url = upstream
    script.replies.append(Reply(hang=True))
    with gateway_to(ScriptedServer(url, log_dir=tmp_path), tmp_path, timeout=0.5) as gateway:
        response = httpx.post(
            f"{gateway.base_url}/v1/chat/completions",
            json={"model": "base", "messages": MESSAGES},
            timeout=30,
        )
        assert response.status_code == 504 and "timed out" in response.json()["error"]["message"]


def _record(index: int, rollout: str | None) -> CompletionRecord:
    from datetime import UTC, datetime

    now = datetime.now(UTC)
    return CompletionRecord(
        completion_id=f"c{index}",
        rollout_id=rollout,
        requested_model="m",
        served_model="m",
        choices=[ChoiceRecord(completion_token_ids=[index])],
        started_at=now,
        finished_at=now,
        upstream_seconds=0.0,
    )


def test_record_log_keeps_memory_bounded_and_finds_old_records_on_disk(tmp_path: Path) -> None:
    log = RecordLog(tmp_path / "records.jsonl", max_in_memory=5)
    for index in range(20):
        log.append(_record(index, f"r{index % 3}"))
    assert len(log._recent) == 5 and len(log) == 20
    found = log.get("c2")
    assert found is not None and found.choices[0].completion_token_ids == [2]  # evicted: read from the file
    assert [r.completion_id for r in log.for_rollout("r1")] == [f"c{i}" for i in range(1, 20, 3)]
    assert log.get("nope") is None
    lines = (tmp_path / "records.jsonl").read_text().splitlines()
    assert [json.loads(line)["completion_id"] for line in lines] == [f"c{i}" for i in range(20)]
    log.close()


def test_record_log_is_thread_safe(tmp_path: Path) -> None:
    log = RecordLog(tmp_path / "records.jsonl", max_in_memory=1000)

    def writer(offset: int) -> None:
        for index in range(offset, offset + 100):
            log.append(_record(index, f"t{offset}"))

    threads = [threading.Thread(target=writer, args=(k * 100,)) for k in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(log) == 400
    for k in range(4):
        assert len(log.for_rollout(f"t{k * 100}")) == 100
    assert len((tmp_path / "records.jsonl").read_text().splitlines()) == 400
    log.close()


def test_in_process_registry_matches_loopback_addresses_and_keeps_hosts_apart(tmp_path: Path) -> None:
    records, other = RecordLog(tmp_path / "a.jsonl"), RecordLog(tmp_path / "b.jsonl")
    register_in_process("http://0.0.0.0:18765", records)  # a gateway listening on every interface
    try:
        for url in ("http://127.0.0.1:18765/v1", "http://localhost:18765", "http://[::1]:18765/r/x/v1"):
            assert in_process_records(url) is records
        for url in ("http://10.1.2.3:18765", "http://127.0.0.1:18766", "http://localhost"):
            assert in_process_records(url) is None
        unregister_in_process("http://localhost:18765", other)  # not the one registered: kept
        assert in_process_records("http://127.0.0.1:18765") is records
    finally:
        unregister_in_process("http://127.0.0.1:18765", records)
    assert in_process_records("http://127.0.0.1:18765") is None
    records.close()
    other.close()


def test_router_resolves_aliases_and_versions(tmp_path: Path) -> None:
    router = Router(ScriptedServer("http://x", log_dir=tmp_path))
    asyncio.run(router.deploy("agent", None, 0))
    assert router.resolve("agent") == ("base", 0)
    assert router.resolve("agent@3") == ("agent@3", 3)
    assert router.resolve("base") == ("base", None)
    assert router.resolve("other@2") == ("other@2", None)
    with pytest.raises(Exception, match="at least 1"):
        Router(ScriptedServer("http://x", log_dir=tmp_path), keep_versions=0)


def _tool_call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def test_tool_calls_with_non_object_arguments_reach_the_client_as_text(
    upstream: tuple[ScriptedUpstream, str], gateway: GatewayThread
) -> None:
    """What vLLM's hermes parser returns for ``"arguments": [3, 4]`` makes langchain-openai raise
    inside the agent; through the gateway the agent gets the call as text, and the record keeps it."""
    from langchain_openai import ChatOpenAI

    script, upstream_url = upstream
    body = {
        "id": "cmpl-list",
        "object": "chat.completion",
        "model": "base",
        "prompt_token_ids": [9, 8],
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        _tool_call("c1", "add", "[3, 4]"),
                        _tool_call("c2", "add", '{"a": 3, "b": 4}'),
                    ],
                },
                "finish_reason": "tool_calls",
                "token_ids": [5, 6, 7],
                "logprobs": {"content": [{"token": "x", "logprob": -0.5} for _ in range(3)]},
            }
        ],
    }
    script.replies.append(Reply(body=json.loads(json.dumps(body))))
    with pytest.raises(ValueError, match="valid dictionary"):  # what the agent saw without the gateway
        ChatOpenAI(model="base", base_url=upstream_url + "/v1", api_key="-", max_retries=0).invoke(
            "add 3 and 4"
        )

    only_list = json.loads(json.dumps(body))
    only_list["id"] = "cmpl-only-list"
    only_list["choices"][0]["message"].update(content="Sure.", tool_calls=[_tool_call("c3", "multiply", "6")])
    script.replies += [Reply(body=body), Reply(body=only_list)]
    chat = ChatOpenAI(model="base", base_url=gateway.base_url + "/v1", api_key="-", max_retries=0)
    both = chat.invoke("add 3 and 4")
    assert [(c["name"], c["args"]) for c in both.tool_calls] == [("add", {"a": 3, "b": 4})]
    assert both.content == '{"name": "add", "arguments": [3, 4]}'
    alone = chat.invoke("multiply")
    assert alone.tool_calls == [] and alone.content == 'Sure.\n{"name": "multiply", "arguments": 6}'
    assert alone.response_metadata["finish_reason"] == "stop"

    for completion_id, invalid in [("cmpl-list", [("c1", "[3, 4]")]), ("cmpl-only-list", [("c3", "6")])]:
        record = gateway.gateway.records.get(completion_id)
        assert record is not None
        choice = record.choices[0]
        assert [(c.id, c.function.arguments) for c in choice.invalid_tool_calls or []] == invalid
        assert choice.completion_token_ids == [5, 6, 7] and choice.logprobs == [-0.5] * 3  # tokens unchanged
    record = gateway.gateway.records.get("cmpl-only-list")
    assert record is not None and record.model_turn().message.content == alone.content
