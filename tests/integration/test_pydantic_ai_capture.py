"""PydanticAITracer on real PydanticAI runs against the real vLLM server through the gateway,
with its Chat Completions and Responses models, streamed and not, in tasks and in threads."""

from __future__ import annotations

import asyncio
import contextlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from pydantic_ai import Agent, ModelRetry, ModelSettings, UsageLimitExceeded
from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel
from pydantic_ai.providers.openai import OpenAIProvider
from pydantic_ai.usage import UsageLimits

import journeyman as jm
from journeyman.backend.serving.gateway import GatewayThread
from journeyman.integrations.pydantic_ai import PydanticAITracer
from tests.integration.conftest import SERVED_BASE
from tests.integration.test_langgraph_capture import check_token_exact

CALC = "You add numbers with the add tool."
LIMITS = UsageLimits(request_limit=3)
"""An int output makes every turn a tool call (``add`` or the output tool), so the 135M always
calls one; three requests bound a run that keeps adding."""
RETRY_SEED = 0
"""A seed with which the model calls the broken ``add`` (not the output tool at once)."""
HISTORY_SEED = 0
"""A seed with which the tool-less run answers within its request limit (a history to continue)."""
TOOL_SEED = 0
"""A seed with which each tool-using run below calls a tool (here: 3 calls, all tool calls)."""


def _agent(
    gateway: GatewayThread, api: str = "chat", broken: bool = False, tools: bool = True, seed: int = 0
) -> Agent[None, int]:
    """Sampled at T=0.7 with ``seed`` on each request (vLLM's seeded sampling; PydanticAI's own
    ``seed`` setting reaches Chat Completions only): a run takes the same path every time."""
    provider = OpenAIProvider(base_url=f"{gateway.base_url}/v1", api_key="-")
    model: Any = (
        OpenAIChatModel(SERVED_BASE, provider=provider)
        if api == "chat"
        else OpenAIResponsesModel(SERVED_BASE, provider=provider)
    )
    agent = Agent(
        model,
        output_type=int,
        instructions=CALC,
        model_settings=ModelSettings(max_tokens=40, temperature=0.7, extra_body={"seed": seed}),
    )

    def add(a: int, b: int) -> int:
        """Add two integers."""
        if broken:
            raise ModelRetry("the adding machine is out of order")
        return a + b

    if tools:
        agent.tool_plain(retries=LIMITS.request_limit)(add)
    return agent


async def _run(agent: Agent[None, int], question: str, how: str = "run", **kwargs: Any) -> Any:
    try:
        if how == "stream":
            async with agent.run_stream(question, usage_limits=LIMITS, **kwargs) as streamed:
                return await streamed.get_output()
        if how == "iter":
            async with agent.iter(question, usage_limits=LIMITS, **kwargs) as run:
                async for _ in run:
                    pass
                return run.result
        return await agent.run(question, usage_limits=LIMITS, **kwargs)
    except UsageLimitExceeded:  # the 135M can keep adding; the run is still worth having
        return None


@pytest.mark.parametrize("how", ["run", "stream", "iter"])
@pytest.mark.parametrize("api", ["chat", "responses"])
def test_a_tool_using_run_is_captured_token_exact(
    gateway: GatewayThread, tokenizer: Any, api: str, how: str
) -> None:
    with PydanticAITracer(raise_error=True) as tracer:
        asyncio.run(_run(_agent(gateway, api, seed=TOOL_SEED), "What is 3 plus 4?", how))
    trajectory = tracer.trajectory
    assert tracer.errors == 0 and not trajectory.additional_histories
    assert trajectory.metrics["llm_calls"] == trajectory.metrics["token_exact_calls"] >= 1
    assert trajectory.metrics["tool_calls"] >= 1, "no tool call: pick another TOOL_SEED"
    check_token_exact(trajectory, gateway, tokenizer)
    assert [m.role for m in trajectory.messages[:2]] == ["system", "user"]
    records = [gateway.gateway.records.get(turn.completion_id or "") for turn in trajectory.model_turns]
    assert {r.kind for r in records if r is not None} == {"chat" if api == "chat" else "response"}
    assert {r.stream for r in records if r is not None} == {how == "stream"}


def test_a_tool_that_asks_for_a_retry_is_recorded_and_the_run_goes_on(gateway: GatewayThread) -> None:
    with PydanticAITracer(raise_error=True) as tracer:
        asyncio.run(_run(_agent(gateway, broken=True, seed=RETRY_SEED), "What is 3 plus 4?"))
    trajectory = tracer.trajectory
    assert any(m.role == "tool" for m in trajectory.messages), "no add call to fail: pick another RETRY_SEED"
    assert trajectory.metrics["tool_errors"] >= 1 and trajectory.metrics["llm_calls"] >= 2
    assert any("out of order" in line for line in trajectory.logs)
    assert any("out of order" in str(m.content) for m in trajectory.messages if m.role == "tool")


def test_concurrent_runs_in_tasks_and_threads_are_kept_apart(gateway: GatewayThread) -> None:
    questions = [f"What is {a} plus {a + 1}?" for a in (2, 5, 11, 17)]

    async def in_task(question: str) -> jm.Trajectory:
        with PydanticAITracer() as tracer:
            await _run(_agent(gateway), question)
        return tracer.trajectory

    async def tasks() -> list[jm.Trajectory]:
        return list(await asyncio.gather(*(in_task(q) for q in questions[:2])))

    def in_thread(question: str) -> jm.Trajectory:
        with PydanticAITracer() as tracer, contextlib.suppress(UsageLimitExceeded):
            _agent(gateway).run_sync(question, usage_limits=LIMITS)
        return tracer.trajectory

    with ThreadPoolExecutor(2) as pool:
        threaded = pool.map(in_thread, questions[2:])
        trajectories = [*asyncio.run(tasks()), *threaded]
    assert [t.messages[1].content for t in trajectories] == questions
    for question, trajectory in zip(questions, trajectories, strict=True):
        assert trajectory.metrics["token_exact_calls"] == trajectory.metrics["llm_calls"] >= 1
        for turn in trajectory.model_turns:
            record = gateway.gateway.records.get(turn.completion_id or "")
            assert record is not None and record.messages is not None
            assert record.messages[1]["content"] == question


def test_an_earlier_runs_messages_are_context_not_calls(gateway: GatewayThread) -> None:
    agent = _agent(gateway, tools=False, seed=HISTORY_SEED)  # the first call must give the answer
    with PydanticAITracer() as first:
        earlier = asyncio.run(_run(agent, "What is 3 plus 4?"))
    assert earlier is not None, "the first run hit its request limit: pick another HISTORY_SEED"
    with PydanticAITracer() as second:
        asyncio.run(_run(agent, "And 5 plus 6?", message_history=earlier.all_messages()))
    before = {turn.completion_id for turn in first.trajectory.model_turns}
    after = {turn.completion_id for turn in second.trajectory.model_turns}
    assert after and not before & after
    assert "And 5 plus 6?" in [m.content for m in second.trajectory.messages]
