"""Tracer overhead: the same agent runs with and without journeyman's tracer.

Two set-ups, each alternating traced and untraced runs so both see the same machine state:

1. an in-process scripted chat model (no network): what the callbacks and the trajectory
   building cost per LLM call, with nothing else to hide behind;
2. a ReAct agent (``create_agent``, ``ChatOpenAI``) calling the real gateway in front of
   a scripted OpenAI-compatible model: per run, including the record lookups (the RecordLog
   given, the gateway found in process by its URL, and over HTTP from a gateway the tracer
   cannot find in process).

3. the same question to an OpenAI Agents SDK agent (Chat Completions and Responses models) and
   a PydanticAI agent through the real gateway, with and without ``AgentsTracer`` /
   ``PydanticAITracer`` (records read in process, as under LocalBackend).

Target: <= 1 ms per LLM call and <= 2% of run time.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_trace_processors,
)
from langchain.agents import create_agent
from langchain_core.language_models.fake_chat_models import FakeMessagesListChatModel
from langchain_core.messages import AIMessage, HumanMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, MessagesState, StateGraph
from openai import AsyncOpenAI
from pydantic_ai import Agent as PydanticAgent
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider

from bench.common import machine, table
from journeyman.backend.serving.gateway import Gateway, GatewayThread, RecordLog
from journeyman.backend.serving.router import Router
from journeyman.integrations.langgraph import TrajectoryTracer
from journeyman.integrations.openai_agents import AgentsTracer
from journeyman.integrations.pydantic_ai import PydanticAITracer
from tests.scripted_agent import ScriptedModel
from tests.scripted_upstream import ScriptedServer, serve


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def in_process_graph(calls: int) -> Any:
    """A loop of ``calls`` chat-model calls, each followed by a tool call."""
    model = FakeMessagesListChatModel(responses=[AIMessage("thinking")])

    def think(state: MessagesState) -> dict[str, Any]:
        return {"messages": [model.invoke(state["messages"])]}

    def act(state: MessagesState) -> dict[str, Any]:
        return {"messages": [HumanMessage(str(add.invoke({"a": len(state["messages"]), "b": 1})))]}

    def more(state: MessagesState) -> str:
        return "act" if len(state["messages"]) < 2 * calls else END

    builder = StateGraph(MessagesState)
    builder.add_node("think", think)
    builder.add_node("act", act)
    builder.add_edge(START, "think")
    builder.add_conditional_edges("think", more, ["act", END])
    builder.add_edge("act", "think")
    return builder.compile()


def alternate(
    run: Callable[[list[Any]], None], tracer: Callable[[], Any], runs: int
) -> tuple[list[float], list[float]]:
    plain, traced = [], []
    for _ in range(3):
        run([])
        run([tracer()])
    for _ in range(runs):
        start = time.perf_counter()
        run([])
        plain.append(time.perf_counter() - start)
        start = time.perf_counter()
        run([tracer()])
        traced.append(time.perf_counter() - start)
    return plain, traced


def agent_runs(url: str) -> dict[str, tuple[Callable[[], Any], Callable[[], Any]]]:
    """Per framework: a run of the calculator question (two LLM calls), and its tracer."""
    loop = asyncio.new_event_loop()
    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0)
    sdk_add = function_tool(add.func)  # type: ignore[arg-type]
    question = "What is 2 plus 3?"

    def sdk(model: Any) -> Callable[[], Any]:
        agent = Agent(name="calc", tools=[sdk_add], model=model, model_settings=ModelSettings(max_tokens=16))
        return lambda: loop.run_until_complete(Runner.run(agent, question))

    provider = OpenAIProvider(base_url=f"{url}/v1", api_key="-")
    pydantic = PydanticAgent(OpenAIChatModel("m", provider=provider), tools=[add.func])  # type: ignore[list-item]
    return {
        "OpenAI Agents SDK, Chat Completions model": (
            sdk(OpenAIChatCompletionsModel("m", client)),
            lambda: AgentsTracer(f"{url}/v1"),
        ),
        "OpenAI Agents SDK, Responses model": (
            sdk(OpenAIResponsesModel("m", client)),
            lambda: AgentsTracer(f"{url}/v1"),
        ),
        "PydanticAI, Chat Completions model": (
            lambda: loop.run_until_complete(pydantic.run(question)),
            PydanticAITracer,
        ),
    }


def traced_by(run: Callable[[], Any]) -> Callable[[list[Any]], None]:
    """``run`` in the shape :func:`alternate` takes: inside the tracer's block when one is given."""

    def once(tracers: list[Any]) -> None:
        with tracers[0] if tracers else contextlib.nullcontext():
            run()

    return once


def runner(agent: Any, inputs: Any) -> Callable[[list[Any]], None]:
    return lambda callbacks: agent.invoke(inputs, config={"callbacks": callbacks})


def row(name: str, plain: list[float], traced: list[float], calls: int) -> tuple[str, ...]:
    base, with_tracer = statistics.median(plain), statistics.median(traced)
    added = with_tracer - base
    return (
        name,
        f"{base * 1000:.2f}",
        f"{with_tracer * 1000:.2f}",
        f"{added / calls * 1000:.3f}",
        f"{added / base * 100:.1f}%",
    )


def measure(runs: int, calls: int) -> str:
    rows = []
    graph = in_process_graph(calls)
    inputs = {"messages": [HumanMessage("go")]}
    plain, traced = alternate(
        lambda cb: graph.invoke(inputs, config={"callbacks": cb}), TrajectoryTracer, runs
    )
    rows.append(row(f"in-process scripted model, {calls} LLM + {calls - 1} tool calls", plain, traced, calls))

    model = ScriptedModel()
    upstream = serve(model.app())
    question = {"messages": [("user", "What is 2 plus 3?")]}
    with tempfile.TemporaryDirectory() as tmp:
        records = RecordLog(Path(tmp) / "records.jsonl")
        server = ScriptedServer(upstream.base_url, log_dir=Path(tmp))
        with GatewayThread(Gateway(Router(server), records)) as gateway:
            llm = ChatOpenAI(model="m", base_url=f"{gateway.base_url}/v1", api_key="-", max_retries=0)
            react = runner(create_agent(llm, [add]), question)
            plain, traced = alternate(react, lambda: TrajectoryTracer(records), runs)
            rows.append(
                row("ReAct agent via the gateway, its RecordLog given (2 LLM calls)", plain, traced, 2)
            )
            plain, traced = alternate(react, TrajectoryTracer, runs)
            rows.append(
                row("ReAct agent via the gateway, found in process by URL (2 LLM calls)", plain, traced, 2)
            )
            set_trace_processors([])  # the Agents SDK's exporter to OpenAI off, in both arms
            for name, (run, tracer) in agent_runs(gateway.base_url).items():
                plain, traced = alternate(traced_by(run), tracer, runs)
                rows.append(row(f"{name} via the gateway (2 LLM calls)", plain, traced, 2))
        # The same gateway served as a plain ASGI app: not registered, so read as one in another
        # process would be (one GET /records?completion_id=... per run), yet sharing this process.
        http_log = RecordLog(Path(tmp) / "http.jsonl")
        http_gateway = serve(Gateway(Router(server), http_log).app)
        llm = ChatOpenAI(model="m", base_url=f"{http_gateway.base_url}/v1", api_key="-", max_retries=0)
        react = runner(create_agent(llm, [add]), question)
        plain, traced = alternate(react, TrajectoryTracer, runs)
        rows.append(row("ReAct agent via the gateway, records over HTTP (2 LLM calls)", plain, traced, 2))
        http_gateway.stop()
        records.close()
        http_log.close()
    upstream.stop()
    return (
        f"### Tracer overhead (median of {runs} alternating runs; {machine()})\n\n"
        + table(["agent", "untraced ms", "traced ms", "added ms per LLM call", "added share"], rows)
        + "\n"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--calls", type=int, default=10)
    arguments = parser.parse_args()
    print(measure(arguments.runs, arguments.calls))
