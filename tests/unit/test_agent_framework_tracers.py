"""AgentsTracer and PydanticAITracer against a scripted model behind the real gateway: what a
run becomes, and that a failure inside a tracer never reaches the agent (the real model's runs
are in tests/integration/test_agents_sdk_capture.py and test_pydantic_ai_capture.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from agents import (
    Agent,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_trace_processors,
)
from openai import AsyncOpenAI
from pydantic_ai import Agent as PydanticAgent
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider

import journeyman as jm
from journeyman.backend.serving.gateway import GatewayThread
from journeyman.integrations import openai_agents, pydantic_ai
from journeyman.integrations.openai_agents import AgentsTracer
from journeyman.integrations.pydantic_ai import PydanticAITracer
from tests.scripted_agent import ScriptedModel
from tests.scripted_upstream import ScriptedServer, gateway_to, serve

QUESTION = "What is 2 plus 3?"


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@pytest.fixture
def scripted(tmp_path: Path) -> Iterator[GatewayThread]:
    """The real gateway in front of a model that calls ``add`` and then states its result."""
    set_trace_processors([])
    upstream = serve(ScriptedModel().app())
    gateway = gateway_to(ScriptedServer(upstream.base_url, log_dir=tmp_path), tmp_path)
    yield gateway
    gateway.stop()
    upstream.stop()


def _sdk_run(gateway: GatewayThread, api: str) -> Any:
    client = AsyncOpenAI(base_url=f"{gateway.base_url}/v1", api_key="-", max_retries=0)
    model = OpenAIChatCompletionsModel("m", client) if api == "chat" else OpenAIResponsesModel("m", client)
    agent = Agent(name="calc", instructions="Add.", tools=[function_tool(add)], model=model)
    return asyncio.run(Runner.run(agent, QUESTION))


def _check(trajectory: jm.Trajectory, gateway: GatewayThread) -> None:
    assert trajectory.metrics["llm_calls"] == trajectory.metrics["token_exact_calls"] == 2
    assert [m.role for m in trajectory.messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert trajectory.messages[3].content == "5" and trajectory.messages[4].content == "The answer is 5."
    for turn in trajectory.model_turns:
        record = gateway.gateway.records.get(turn.completion_id or "")
        assert record is not None and turn.completion_token_ids == record.choices[0].completion_token_ids


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_an_agents_sdk_run_becomes_a_token_exact_trajectory(scripted: GatewayThread, api: str) -> None:
    with AgentsTracer(f"{scripted.base_url}/v1", raise_error=True) as tracer:
        result = _sdk_run(scripted, api)
    assert result.final_output == "The answer is 5."
    _check(tracer.trajectory, scripted)
    assert tracer.trajectory.name == "calc" and tracer.trajectory.metrics["handoffs"] == 0


def test_a_failing_span_handler_never_reaches_the_agent(
    scripted: GatewayThread, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(self: Any, span: Any) -> None:
        raise RuntimeError("tracer bug")

    monkeypatch.setattr(openai_agents.AgentsTracer, "_on_span_end", broken)
    with AgentsTracer(f"{scripted.base_url}/v1") as tracer:
        result = _sdk_run(scripted, "chat")
    assert result.final_output == "The answer is 5."  # the run is untouched
    assert tracer.errors >= 2 and tracer.trajectory.metrics["llm_calls"] == 0


def test_a_pydantic_ai_run_becomes_a_token_exact_trajectory(scripted: GatewayThread) -> None:
    provider = OpenAIProvider(base_url=f"{scripted.base_url}/v1", api_key="-")
    agent = PydanticAgent(OpenAIChatModel("m", provider=provider), instructions="Add.", tools=[add])
    with PydanticAITracer(raise_error=True) as tracer:  # no URL: each reply names its provider_url
        result = agent.run_sync(QUESTION)
    assert result.output == "The answer is 5."
    _check(tracer.trajectory, scripted)
    assert tracer.trajectory.metrics["tool_calls"] == 1 and tracer.messages == result.all_messages()


def test_a_pydantic_ai_tracer_failure_never_reaches_the_agent(
    scripted: GatewayThread, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: Any) -> Any:
        raise RuntimeError("tracer bug")

    monkeypatch.setattr(pydantic_ai, "_calls", broken)
    provider = OpenAIProvider(base_url=f"{scripted.base_url}/v1", api_key="-")
    agent = PydanticAgent(OpenAIChatModel("m", provider=provider), instructions="Add.", tools=[add])
    with PydanticAITracer() as tracer:
        result = agent.run_sync(QUESTION)
    assert result.output == "The answer is 5." and tracer.errors == 1
    with pytest.raises(jm.ConfigError, match="block exits"):
        tracer.trajectory  # noqa: B018 - nothing was built
