"""@trainable on plain OpenAI-SDK agents, against the real gateway in front of a scripted model."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from openai import AsyncOpenAI, OpenAI

import journeyman as jm
from journeyman.backend.serving.gateway import Gateway, GatewayThread, RecordLog
from journeyman.backend.serving.router import Router
from journeyman.integrations.trainable import trainable
from journeyman.model import Registration
from tests.scripted_agent import ScriptedModel
from tests.scripted_upstream import ScriptedServer, serve

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            },
        },
    }
]


class _GatewayBackend:
    """Registers models with a running gateway (the part of a backend @trainable relies on)."""

    def __init__(self, gateway: GatewayThread) -> None:
        self.gateway = gateway

    async def register(self, model: jm.TrainableModel) -> Registration:
        return Registration(base_url=f"{self.gateway.base_url}/v1", api_key="-", step=0)


@pytest.fixture
def scripted(tmp_path: Path) -> Iterator[tuple[ScriptedModel, str, GatewayThread]]:
    model = ScriptedModel()
    upstream = serve(model.app())
    gateway = GatewayThread(
        Gateway(
            Router(ScriptedServer(upstream.base_url, log_dir=tmp_path)), RecordLog(tmp_path / "records.jsonl")
        )
    ).start()
    yield model, upstream.base_url, gateway
    gateway.stop()
    upstream.stop()


async def _registered(gateway: GatewayThread, tmp_path: Path) -> jm.TrainableModel:
    model = jm.TrainableModel(name="calc", project="test", base_model="smollm2-135m", root=tmp_path)
    await model.register(_GatewayBackend(gateway))  # type: ignore[arg-type]
    return model


async def calculator(scenario: dict[str, Any], client: AsyncOpenAI) -> float:
    """A plain OpenAI-SDK tool loop: ask, run the tool call, ask again, score the answer."""
    messages: list[Any] = [{"role": "user", "content": scenario["question"]}]
    response = await client.chat.completions.create(messages=messages, tools=TOOLS, temperature=0)  # type: ignore[call-overload]
    message = response.choices[0].message
    messages.append(message)
    for call in message.tool_calls or []:
        arguments = json.loads(call.function.arguments)
        messages.append(
            {"role": "tool", "tool_call_id": call.id, "content": str(arguments["a"] + arguments["b"])}
        )
    response = await client.chat.completions.create(messages=messages, tools=TOOLS, temperature=0)  # type: ignore[call-overload]
    return float(response.choices[0].message.content == f"The answer is {scenario['answer']}.")


def _check(trajectory: jm.Trajectory, gateway: GatewayThread, question: str, answer: int) -> None:
    assert [m.role for m in trajectory.messages] == ["user", "assistant", "tool", "assistant"]
    assert trajectory.messages[0].content == question and trajectory.messages[2].content == str(answer)
    assert trajectory.reward == 1.0 and trajectory.tools is not None
    for turn in trajectory.model_turns:
        record = gateway.gateway.records.get(turn.completion_id or "")
        assert record is not None and turn.is_token_exact
        assert record.rollout_id == trajectory.metadata["rollout_id"]
        assert turn.prompt_token_ids == record.prompt_token_ids
        assert turn.completion_token_ids == record.choices[0].completion_token_ids
    records = gateway.gateway.records.for_rollout(str(trajectory.metadata["rollout_id"]))
    assert [r.completion_id for r in records] == [t.completion_id for t in trajectory.model_turns]


async def test_async_agent_gives_a_token_exact_trajectory(scripted: Any, tmp_path: Path) -> None:
    _, _, gateway = scripted
    agent = jm.trainable(await _registered(gateway, tmp_path))(calculator)
    trajectory = await agent({"id": 7, "question": "What is 2 plus 3?", "answer": 5})
    _check(trajectory, gateway, "What is 2 plus 3?", 5)
    assert trajectory.metadata["scenario_id"] == 7 and trajectory.finished_at is not None
    assert trajectory.metrics["token_exact_calls"] == 2 and "rollout" in trajectory.timings


async def test_sync_agent_and_reward_function(scripted: Any, tmp_path: Path) -> None:
    _, _, gateway = scripted

    def sync_agent(scenario: dict[str, Any], client: OpenAI) -> str:
        messages: list[Any] = [{"role": "user", "content": scenario["question"]}]
        first = client.chat.completions.create(messages=messages, tools=TOOLS)  # type: ignore[call-overload]
        call = first.choices[0].message.tool_calls[0]
        arguments = json.loads(call.function.arguments)
        messages += [
            first.choices[0].message,
            {"role": "tool", "tool_call_id": call.id, "content": str(sum(arguments.values()))},
        ]
        stream = client.chat.completions.create(messages=messages, tools=TOOLS, stream=True)  # type: ignore[call-overload]
        return "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)

    agent = trainable(
        await _registered(gateway, tmp_path), reward=lambda s, out: out.endswith(f"{s['answer']}.")
    )(sync_agent)
    trajectory = await agent({"question": "What is 4 plus 4?", "answer": 8})
    _check(trajectory, gateway, "What is 4 plus 4?", 8)


async def test_async_stream_is_assembled(scripted: Any, tmp_path: Path) -> None:
    _, _, gateway = scripted

    async def streaming(scenario: dict[str, Any], client: AsyncOpenAI) -> float:
        messages: list[Any] = [{"role": "user", "content": scenario["question"]}]
        stream = await client.chat.completions.create(messages=messages, tools=TOOLS, stream=True)  # type: ignore[call-overload]
        async with stream:
            chunks = [chunk async for chunk in stream]
        calls = [c for chunk in chunks for choice in chunk.choices for c in choice.delta.tool_calls or []]
        return float(calls[0].function.name == "add")

    trajectory = await jm.trainable(await _registered(gateway, tmp_path))(streaming)(
        {"question": "What is 2 plus 3?"}
    )
    (turn,) = trajectory.model_turns
    assert trajectory.reward == 1.0 and turn.is_token_exact
    assert turn.message.tool_calls is not None and turn.message.tool_calls[0].function.parsed_arguments() == {
        "a": 2,
        "b": 3,
    }
    record = gateway.gateway.records.get(turn.completion_id or "")
    assert (
        record is not None
        and record.stream
        and turn.completion_token_ids == record.choices[0].completion_token_ids
    )


async def test_plain_model_captures_messages_without_tokens(scripted: Any, tmp_path: Path) -> None:
    _, upstream_url, _ = scripted
    model = jm.Model(name="external", project="test", inference_base_url=f"{upstream_url}/v1", root=tmp_path)
    trajectory = await jm.trainable(model)(calculator)({"question": "What is 1 plus 1?", "answer": 2})
    assert [m.role for m in trajectory.messages] == ["user", "assistant", "tool", "assistant"]
    assert trajectory.reward == 1.0
    assert not any(t.is_token_exact for t in trajectory.model_turns)
    assert trajectory.metrics["calls_without_tokens"] == 2


async def test_concurrent_rollouts_are_kept_apart(scripted: Any, tmp_path: Path) -> None:
    _, _, gateway = scripted
    agent = jm.trainable(await _registered(gateway, tmp_path))(calculator)
    scenarios = [{"question": f"What is {i} plus {2 * i}?", "answer": 3 * i} for i in range(12)]
    trajectories = await asyncio.gather(*(agent(s) for s in scenarios))
    for scenario, trajectory in zip(scenarios, trajectories, strict=True):
        _check(trajectory, gateway, scenario["question"], scenario["answer"])


async def test_group_records_rollout_and_reward_failures(scripted: Any, tmp_path: Path) -> None:
    _, _, gateway = scripted
    model = await _registered(gateway, tmp_path)
    attempts = 0

    async def flaky(scenario: dict[str, Any], client: AsyncOpenAI) -> float:
        nonlocal attempts
        attempts += 1
        if attempts == 2:
            raise TimeoutError("the tool server hung")
        return await calculator(scenario, client)

    def judge(scenario: dict[str, Any], output: float) -> float:
        raise ValueError("the judge gave up")

    group = await jm.trainable(model)(flaky).group(
        {"id": "s", "question": "What is 2 plus 2?", "answer": 4}, n=4
    )
    assert len(group) == 3 and group.metadata["scenario_id"] == "s"
    assert [f.type for f in group.failures] == ["TimeoutError"]
    assert group.failures[0].stage == "rollout" and "hung" in group.failures[0].message

    judged = jm.trainable(model, reward=judge)(calculator)
    group = await judged.group({"id": "s", "question": "What is 2 plus 2?", "answer": 4}, n=3)
    assert len(group) == 3 and all(t.reward is None for t in group)
    assert {f.stage for f in group.failures} == {"reward"} and len(group.failures) == 3
    assert {f.trajectory_id for f in group.failures} == {t.id for t in group}
    with pytest.raises(ValueError, match="judge gave up"):
        await judged({"id": "s", "question": "What is 2 plus 2?", "answer": 4})


async def test_groups_run_under_gather(scripted: Any, tmp_path: Path) -> None:
    _, _, gateway = scripted
    agent = jm.trainable(await _registered(gateway, tmp_path))(calculator)
    scenarios = [{"id": i, "question": f"What is {i} plus 1?", "answer": i + 1} for i in range(3)]
    groups = await jm.gather_trajectory_groups((agent.group(s, n=2) for s in scenarios), progress=False)
    assert [len(g) for g in groups] == [2, 2, 2] and [g.reward for g in groups] == [1.0, 1.0, 1.0]


def test_bad_arguments_are_clear_errors() -> None:
    with pytest.raises(jm.ConfigError, match=r"needs a jm\.Model"):
        jm.trainable("gpt-4")  # type: ignore[arg-type]
    model = jm.Model(name="m", project="p", inference_base_url="http://127.0.0.1:9/v1")
    with pytest.raises(jm.ConfigError, match="at least one"):
        jm.trainable(model)(calculator).group({}, n=0)
