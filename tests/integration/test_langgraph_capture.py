"""TrajectoryTracer on real LangGraph agents calling the real vLLM server through the gateway."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from langchain.agents import create_agent
from langchain.agents.middleware import ModelRequest, ModelResponse, wrap_model_call
from langchain_core.messages import AIMessage, AnyMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.runnables import RunnableConfig
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.errors import GraphRecursionError
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.prebuilt import create_react_agent

import journeyman as jm
from journeyman.backend.serving.gateway import GatewayThread
from journeyman.integrations.langgraph import TrajectoryTracer
from journeyman.messages import ModelTurn, ToolResult
from journeyman.trajectory import History
from tests.integration.conftest import SERVED_BASE, Served, each_family
from tests.integration.test_serving import _rendered

pytestmark = pytest.mark.filterwarnings("ignore:create_react_agent has been moved")


@tool
def add(a: int, b: int) -> int:
    """Add two integers and return the result."""
    return a + b


@tool
def multiply(a: int, b: int) -> int:
    """Multiply two integers and return the result."""
    return a * b


@tool("add")
def broken_add(a: int, b: int) -> int:
    """Add two integers and return the result."""
    raise RuntimeError("the adding machine is out of order")


@tool("multiply")
def broken_multiply(a: int, b: int) -> int:
    """Multiply two integers and return the result."""
    raise RuntimeError("the adding machine is out of order")


def _example(question: str, name: str, a: int, b: int, result: int, call_id: str) -> list[AnyMessage]:
    call = {"name": name, "args": {"a": a, "b": b}, "id": call_id, "type": "tool_call"}
    return [
        HumanMessage(question),
        AIMessage("", tool_calls=[call]),
        ToolMessage(str(result), tool_call_id=call_id),
        AIMessage(f"The answer is {result}."),
    ]


# Worked examples make the 135M model call tools (without them it never does: ../shared/FACTS.md).
FEW_SHOT: list[AnyMessage] = [
    SystemMessage("You are a calculator. Always call a tool, then state the answer."),
    *_example("What is 12 times 7?", "multiply", 12, 7, 84, "call_ex1"),
    *_example("What is 35 plus 48?", "add", 35, 48, 83, "call_ex2"),
    *_example("What is 9 times 13?", "multiply", 9, 13, 117, "call_ex3"),
]


ROLES = {"system": "system", "human": "user", "ai": "assistant", "tool": "tool"}


def _few_shot(state: dict[str, Any]) -> list[AnyMessage]:
    return [*FEW_SHOT, *state["messages"]]


def _llm(gateway: GatewayThread, seed: int = 0, model: str = SERVED_BASE) -> ChatOpenAI:
    return ChatOpenAI(
        model=model,
        base_url=f"{gateway.base_url}/v1",
        api_key="-",
        temperature=0.7,
        seed=seed,
        max_tokens=48,
        max_retries=0,
        timeout=300,
    )


def _blank(messages: list[Any]) -> list[Any]:
    """The messages with an empty assistant content as null (a reply of only tool calls comes back
    from vLLM with ``""``, and some frameworks send it back as ``null``: the same rendering)."""
    return [
        m.model_copy(update={"content": None}) if m.role == "assistant" and m.content == "" else m
        for m in messages
    ]


def check_token_exact(history: History, gateway: GatewayThread, tokenizer: Any) -> None:
    """Each turn: the gateway received the history's messages before it, its prompt tokens are
    their rendering with the tools, and its completion tokens decode to the turn's text."""
    tools = [t.model_dump(exclude_none=True) for t in history.tools] if history.tools else None
    conversation = history.openai_messages()
    assert history.model_turns
    for index, item in enumerate(history.conversation):
        if not isinstance(item, ModelTurn):
            continue
        assert item.is_token_exact and item.completion_id is not None
        record = gateway.gateway.records.get(item.completion_id)
        assert record is not None and record.messages is not None
        assert _blank(History(conversation=record.messages).messages) == _blank(history.messages[:index])
        assert (
            item.prompt_token_ids
            == record.prompt_token_ids
            == _rendered(tokenizer, conversation[:index], tools)
        )
        assert item.completion_token_ids == record.choices[0].completion_token_ids
        assert item.logprobs is not None and len(item.logprobs) == len(item.completion_token_ids or [])
        text = tokenizer.decode(item.completion_token_ids, skip_special_tokens=True)
        invalid = record.choices[0].invalid_tool_calls or []
        if item.message.tool_calls:
            assert all(call.function.name in text for call in item.message.tool_calls)
        elif invalid:  # calls whose arguments are not an object: the gateway wrote them as text
            assert all(call.function.name in text for call in invalid)
            assert all(call.function.arguments in (item.message.content or "") for call in invalid)
        else:
            assert text == item.message.content


def _first_tool_run(
    gateway: GatewayThread,
    tools: list[Any],
    tracer: TrajectoryTracer,
    question: str,
    make_agent: Callable[[ChatOpenAI, list[Any]], Any] | None = None,
    streamed: list[Any] | None = None,
    model: str = SERVED_BASE,
    raised: type[Exception] = GraphRecursionError,
) -> tuple[dict[str, Any], jm.Trajectory]:
    """Seeded runs until the model calls a tool (it does in about a third of samples).

    With ``streamed``, the agent runs with ``stream`` and the message chunks it yields land there.
    A run may end in ``raised`` (by default the recursion limit: the 135M can loop), kept as the
    result's ``error``; any other exception fails the test.
    """
    make_agent = make_agent or (lambda llm, tools: create_react_agent(llm, tools, prompt=_few_shot))
    stopped = []  # seeds whose run raised ``raised``
    for seed in range(24):
        agent = make_agent(_llm(gateway, seed, model), tools)
        config: RunnableConfig = {"callbacks": [tracer], "recursion_limit": 8}
        inputs = {"messages": [HumanMessage(question)]}
        try:
            if streamed is None:
                result = agent.invoke(inputs, config=config)
            else:
                streamed.clear()
                for mode, data in agent.stream(inputs, config=config, stream_mode=["messages", "values"]):
                    if mode == "messages":
                        streamed.append(data[0])
                    else:
                        result = data
        except raised as error:
            result = {"error": error}
            stopped.append(seed)
        trajectory = tracer.trajectory
        if trajectory.metrics.get("tool_calls"):  # calls the model made (the worked examples hold some too)
            return result, trajectory
    pytest.fail(f"no tool call in 24 seeded runs (seeds {stopped} raised {raised.__name__})")


@each_family
def test_react_agent_with_two_tools_is_captured_token_exact(served: Served) -> None:
    gateway, tokenizer = served.gateway, served.tokenizer
    tracer = TrajectoryTracer(raise_error=True)
    result, trajectory = _first_tool_run(
        gateway, [add, multiply], tracer, "What is 23 plus 19?", model=served.name
    )
    assert tracer.errors == 0
    check_token_exact(trajectory, gateway, tokenizer)
    assert {t.function.name for t in trajectory.tools or []} == {"add", "multiply"}
    assert "error" not in result, result.get("error")
    # The captured conversation is the agent's own, with the tool results it got.
    assert [(m.role, m.content or "") for m in trajectory.messages] == [
        (ROLES[m.type], m.content) for m in _few_shot(result)
    ]
    tool_messages = [m for m in result["messages"] if m.type == "tool"]
    assert tool_messages and trajectory.metrics["tool_calls"] == len(tool_messages)
    assert trajectory.metrics["calls_without_tokens"] == 0


@wrap_model_call
def worked_examples(request: ModelRequest, handler: Callable[[ModelRequest], ModelResponse]) -> ModelResponse:
    """Show the model the worked examples (after the system prompt), without adding them to the state."""
    return handler(request.override(messages=[*FEW_SHOT[1:], *request.messages]))


def _langchain_agent(llm: ChatOpenAI, tools: list[Any]) -> Any:
    return create_agent(llm, tools, system_prompt=FEW_SHOT[0].text, middleware=[worked_examples])


def test_create_agent_with_two_tools_is_captured_token_exact(gateway: GatewayThread, tokenizer: Any) -> None:
    """LangChain 1.x ``create_agent``: the model sees a system prompt and examples from middleware."""
    tracer = TrajectoryTracer(raise_error=True)
    result, trajectory = _first_tool_run(
        gateway, [add, multiply], tracer, "What is 23 plus 19?", make_agent=_langchain_agent
    )
    assert tracer.errors == 0 and "error" not in result, result.get("error")
    check_token_exact(trajectory, gateway, tokenizer)
    assert trajectory.name == "model"
    assert {t.function.name for t in trajectory.tools or []} == {"add", "multiply"}
    # What the model saw: the system prompt and the middleware's examples, then the agent's state.
    assert [(m.role, m.content or "") for m in trajectory.messages] == [
        (ROLES[m.type], m.content) for m in [*FEW_SHOT, *result["messages"]]
    ]
    assert len(result["messages"]) < len(trajectory.messages)  # the examples never entered the state
    tool_messages = [m for m in result["messages"] if m.type == "tool"]
    assert tool_messages and trajectory.metrics["tool_calls"] == len(tool_messages)
    captured = {m.tool_call_id: m.content for m in trajectory.messages if isinstance(m, ToolResult)}
    assert all(captured[m.tool_call_id] == m.content for m in tool_messages)
    assert trajectory.metrics["calls_without_tokens"] == 0
    assert trajectory.metrics["token_exact_calls"] == trajectory.metrics["llm_calls"] >= 2


def test_token_streamed_calls_are_captured_token_exact(gateway: GatewayThread, tokenizer: Any) -> None:
    """``streaming=True`` under ``stream(stream_mode="messages")``: the caller gets the reply token
    by token, and each call is still joined to its record (the gateway tags each delta with the id)."""

    def streaming_agent(llm: ChatOpenAI, tools: list[Any]) -> Any:
        return create_react_agent(llm.model_copy(update={"streaming": True}), tools, prompt=_few_shot)

    tracer, streamed = TrajectoryTracer(raise_error=True), []
    result, trajectory = _first_tool_run(
        gateway, [add, multiply], tracer, "What is 23 plus 19?", streaming_agent, streamed
    )
    assert tracer.errors == 0 and "error" not in result, result.get("error")
    check_token_exact(trajectory, gateway, tokenizer)
    assert trajectory.metrics["calls_without_tokens"] == 0
    assert [(m.role, m.content or "") for m in trajectory.messages] == [
        (ROLES[m.type], m.content) for m in _few_shot(result)
    ]
    chunks = [m for m in streamed if m.type == "AIMessageChunk" and m.chunk_position != "last"]
    turns = trajectory.model_turns
    assert len(chunks) > len(turns) + 2  # streamed token by token
    assert {m.id for m in chunks} == {t.completion_id for t in turns}
    for turn in turns:  # the streamed pieces add up to each call's text
        text = "".join(str(m.content) for m in chunks if m.id == turn.completion_id)
        assert text == (turn.message.content or "")


def test_tool_error_from_a_real_run_is_recorded(gateway: GatewayThread, tokenizer: Any) -> None:
    tracer = TrajectoryTracer(raise_error=True)
    result, trajectory = _first_tool_run(
        gateway, [broken_add, broken_multiply], tracer, "What is 23 plus 19?", raised=RuntimeError
    )
    assert isinstance(result["error"], RuntimeError)  # the agent's own behaviour: the error propagates
    assert trajectory.metrics["tool_errors"] == 1
    assert "out of order" in str(trajectory.metadata["error"])
    assert trajectory.messages[-1].role == "tool" and "out of order" in str(trajectory.messages[-1].content)
    check_token_exact(trajectory, gateway, tokenizer)


def test_hand_built_graph_with_sub_graph_and_sub_agent(gateway: GatewayThread, tokenizer: Any) -> None:
    llm = _llm(gateway, seed=1)
    solver = create_react_agent(llm, [add, multiply], prompt=_few_shot)
    helper = create_react_agent(llm, [add, multiply], prompt=_few_shot)

    def plan(state: MessagesState) -> dict[str, Any]:
        llm.invoke([SystemMessage("Say in one sentence how to solve the question."), *state["messages"]])
        return {}

    def delegate(state: MessagesState, config: RunnableConfig) -> dict[str, Any]:
        helper.invoke({"messages": [HumanMessage("What is 5 times 6?")]}, config)
        return {}

    builder = StateGraph(MessagesState)
    builder.add_node("plan", plan)
    builder.add_node("solve", solver)
    builder.add_node("delegate", delegate)
    builder.add_edge(START, "plan")
    builder.add_edge("plan", "solve")
    builder.add_edge("solve", "delegate")
    builder.add_edge("delegate", END)
    tracer = TrajectoryTracer(raise_error=True)
    config: RunnableConfig = {"callbacks": [tracer], "recursion_limit": 30}
    builder.compile().invoke({"messages": [HumanMessage("What is 8 plus 9?")]}, config=config)

    trajectory = tracer.trajectory
    planner, solving, helping = trajectory.histories
    assert planner.name == "plan" and [m.role for m in planner.messages] == ["system", "user", "assistant"]
    assert solving.name == "agent" and solving.messages[len(FEW_SHOT)].content == "What is 8 plus 9?"
    assert helping.messages[len(FEW_SHOT)].content == "What is 5 times 6?"
    for history in trajectory.histories:
        check_token_exact(history, gateway, tokenizer)


async def test_sixteen_concurrent_runs_through_one_tracer(gateway: GatewayThread, tokenizer: Any) -> None:
    tracer = TrajectoryTracer(raise_error=True)
    questions = {uuid.uuid4(): f"What is {10 + i} plus {i * 3}?" for i in range(16)}

    async def run(run_id: uuid.UUID, question: str, seed: int) -> None:
        agent = create_react_agent(_llm(gateway, seed), [add, multiply], prompt=_few_shot)
        config: RunnableConfig = {"callbacks": [tracer], "run_id": run_id, "recursion_limit": 8}
        await agent.ainvoke({"messages": [HumanMessage(question)]}, config=config)

    results = await asyncio.gather(
        *(run(run_id, q, seed) for seed, (run_id, q) in enumerate(questions.items())), return_exceptions=True
    )
    # Every run finishes, or stopped at the recursion limit (the 135M can call tools in a loop).
    failed = {i: r for i, r in enumerate(results) if isinstance(r, BaseException)}
    assert all(isinstance(r, GraphRecursionError) for r in failed.values()), failed
    assert len(tracer.trajectories) == 16
    seen: set[str] = set()
    for run_id, question in questions.items():
        trajectory = tracer.trajectory_for(run_id)
        assert trajectory.messages[len(FEW_SHOT)].content == question
        assert not trajectory.additional_histories
        check_token_exact(trajectory, gateway, tokenizer)
        ids = {t.completion_id or "" for t in trajectory.model_turns}
        assert not ids & seen
        seen |= ids
