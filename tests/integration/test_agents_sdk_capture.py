"""AgentsTracer on real OpenAI Agents SDK runs against the real vLLM server through the gateway,
with the SDK's Chat Completions and Responses models, streamed and not."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
from agents import (
    Agent,
    MaxTurnsExceeded,
    ModelBehaviorError,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_trace_processors,
    set_tracing_disabled,
)
from openai import AsyncOpenAI

import journeyman as jm
from journeyman.backend.serving.gateway import GatewayThread
from journeyman.integrations.openai_agents import AgentsTracer
from tests.integration.conftest import SERVED_BASE
from tests.integration.test_langgraph_capture import check_token_exact

CALC = "You add numbers with the add tool."


def _settings(seed: int) -> ModelSettings:
    """The 135M calls a tool when it must: the first turn requires one, and the SDK sets
    tool_choice back to auto after a tool ran, so the run ends with a text answer. Each request
    carries ``seed`` (vLLM's seeded sampling): a run samples the same path every time."""
    return ModelSettings(tool_choice="required", max_tokens=64, temperature=0.7, extra_body={"seed": seed})


SETTINGS = _settings(0)
HANDOFF_SEED = 0
"""A seed with which triage hands the run to calc, which then calls the model itself (here: 4
calls; with seed 5 triage answered at once)."""
CONCURRENT_SEEDS = (0, 1, 2)
"""Seeds with which each of the three concurrent runs calls the model at least twice (here: 4, 2
and 2 calls, the same in every batch the runs shared)."""


@function_tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@function_tool(name_override="add")
def broken_add(a: int, b: int) -> int:
    """Add two integers."""
    raise RuntimeError("the adding machine is out of order")


@pytest.fixture(scope="module", autouse=True)
def _no_export() -> Iterator[None]:
    """No trace goes to OpenAI's backend (none is reachable); AgentsTracer adds its own processor."""
    set_trace_processors([])
    yield


def _model(gateway: GatewayThread, api: str) -> Any:
    client = AsyncOpenAI(base_url=f"{gateway.base_url}/v1", api_key="-", max_retries=0)
    if api == "chat":
        return OpenAIChatCompletionsModel(SERVED_BASE, client)
    return OpenAIResponsesModel(SERVED_BASE, client)


async def _run(agent: Agent[Any], question: str, stream: bool) -> bool:
    """Run the agent; whether the SDK stopped it at a reply cut by ``max_tokens``."""
    try:
        if stream:
            result = Runner.run_streamed(agent, question, max_turns=4)
            async for _ in result.stream_events():
                pass
        else:
            await Runner.run(agent, question, max_turns=4)
    except MaxTurnsExceeded:  # the 135M can keep calling tools; the run is still worth having
        pass
    except ModelBehaviorError as error:  # a streamed Responses run ends at an incomplete reply
        if "max_output_tokens" not in str(error):
            raise
        return True
    return False


def _traced(gateway: GatewayThread, agent: Agent[Any], stream: bool, tries: int = 4) -> AgentsTracer:
    """The tracer of a run whose model answered after the tool's result, trying seeds 0, 1, ... in
    turn. Sampled at T=0.7, the 135M now and then stops short of that: a streamed Responses run
    ends at a reply cut by ``max_tokens`` (the tracer counts that call as failed), or its first
    reply is taken as the final answer (vLLM's Responses API applies only ``tool_choice="auto"``,
    vllm-project/vllm#23227, so ``required`` does not hold it to a tool call there)."""
    for seed in range(tries):
        with _tracer(gateway) as tracer:
            cut = asyncio.run(_run(agent.clone(model_settings=_settings(seed)), "What is 3 plus 4?", stream))
        metrics = tracer.trajectory.metrics
        if cut:
            assert metrics["llm_errors"] == 1, metrics  # the cut call is recorded as failed, not dropped
        elif metrics["llm_calls"] >= 2:
            return tracer
    raise AssertionError(f"{tries} runs in a row ended at their first reply")


def _tracer(gateway: GatewayThread) -> AgentsTracer:
    return AgentsTracer(f"{gateway.base_url}/v1", raise_error=True)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("api", ["chat", "responses"])
def test_a_tool_using_run_is_captured_token_exact(
    gateway: GatewayThread, tokenizer: Any, api: str, stream: bool
) -> None:
    agent = Agent(
        name="calc", instructions=CALC, tools=[add], model=_model(gateway, api), model_settings=SETTINGS
    )
    tracer = _traced(gateway, agent, stream)
    trajectory = tracer.trajectory
    assert tracer.errors == 0 and not trajectory.additional_histories
    assert trajectory.name == "calc" and trajectory.metrics["tool_calls"] >= 1
    assert trajectory.metrics["llm_calls"] == trajectory.metrics["token_exact_calls"] >= 2
    check_token_exact(trajectory, gateway, tokenizer)
    assert [m.role for m in trajectory.messages[:4]] == ["system", "user", "assistant", "tool"]
    assert trajectory.messages[3].content == "7" or trajectory.metrics["tool_calls"] > 1
    records = [gateway.gateway.records.get(turn.completion_id or "") for turn in trajectory.model_turns]
    assert {r.kind for r in records if r is not None} == {"chat" if api == "chat" else "response"}


def test_a_handoff_becomes_a_second_history(gateway: GatewayThread, tokenizer: Any) -> None:
    model, settings = _model(gateway, "chat"), _settings(HANDOFF_SEED)
    calc = Agent(name="calc", instructions=CALC, tools=[add], model=model, model_settings=settings)
    triage = Agent(
        name="triage",
        instructions="Hand questions to calc.",
        handoffs=[calc],
        model=model,
        model_settings=settings,
    )
    with _tracer(gateway) as tracer:
        asyncio.run(_run(triage, "What is 3 plus 4?", False))
    trajectory = tracer.trajectory
    assert trajectory.metadata["handoffs"] == "triage -> calc" and trajectory.metrics["handoffs"] == 1
    assert "triage handed the run to calc" in trajectory.logs
    assert [trajectory.name, *(h.name for h in trajectory.additional_histories)] == ["triage", "calc"]
    for history in [trajectory, *trajectory.additional_histories]:
        check_token_exact(history, gateway, tokenizer)
    [handed] = trajectory.model_turns
    assert handed.message.tool_calls and handed.message.tool_calls[0].function.name == "transfer_to_calc"
    calc_history = trajectory.additional_histories[0]
    assert calc_history.messages[0].content == CALC and calc_history.model_turns


def test_a_tool_that_raises_is_recorded_and_the_run_goes_on(gateway: GatewayThread) -> None:
    agent = Agent(
        name="calc",
        instructions=CALC,
        tools=[broken_add],
        model=_model(gateway, "responses"),
        model_settings=SETTINGS,
    )
    trajectory = _traced(gateway, agent, True).trajectory
    assert trajectory.metrics["tool_errors"] >= 1 and trajectory.metrics["llm_calls"] >= 2
    assert any("out of order" in line for line in trajectory.logs)
    [first_result] = [m for m in trajectory.messages if m.role == "tool"][:1]
    assert "error" in str(first_result.content).lower()  # the model saw the SDK's error message


def test_concurrent_runs_are_kept_apart(gateway: GatewayThread) -> None:
    questions = [f"What is {a} plus {a + 1}?" for a in (2, 5, 11)]

    async def one(question: str, seed: int) -> jm.Trajectory:
        agent = Agent(
            name="calc",
            instructions=CALC,
            tools=[add],
            model=_model(gateway, "chat"),
            model_settings=_settings(seed),
        )
        with _tracer(gateway) as tracer:
            await _run(agent, question, False)
        return tracer.trajectory

    async def all_of() -> list[jm.Trajectory]:
        return list(
            await asyncio.gather(*(one(q, s) for q, s in zip(questions, CONCURRENT_SEEDS, strict=True)))
        )

    trajectories = asyncio.run(all_of())
    assert [t.messages[1].content for t in trajectories] == questions
    ids = [{turn.completion_id for turn in t.model_turns} for t in trajectories]
    assert all(ids) and not (ids[0] & ids[1] or ids[0] & ids[2] or ids[1] & ids[2])
    for question, seed, trajectory in zip(questions, CONCURRENT_SEEDS, trajectories, strict=True):
        assert trajectory.metrics["token_exact_calls"] == trajectory.metrics["llm_calls"] >= 2
        for turn in trajectory.model_turns:  # each call asked its own question, with its run's seed
            record = gateway.gateway.records.get(turn.completion_id or "")
            assert record is not None and record.messages is not None
            assert record.messages[1]["content"] == question and record.sampling["seed"] == seed


def test_with_tracing_disabled_the_tracer_says_so(gateway: GatewayThread) -> None:
    agent = Agent(
        name="calc",
        instructions=CALC,
        model=_model(gateway, "chat"),
        model_settings=ModelSettings(max_tokens=8),
    )
    set_tracing_disabled(True)
    try:
        with AgentsTracer(f"{gateway.base_url}/v1") as tracer:
            asyncio.run(Runner.run(agent, "Hi"))
    finally:
        set_tracing_disabled(False)
    assert tracer.errors == 1 and tracer.trajectory.metrics["llm_calls"] == 0
