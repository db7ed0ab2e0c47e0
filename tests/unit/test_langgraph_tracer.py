"""TrajectoryTracer on real LangGraph agents, against the real gateway in front of a scripted model."""

from __future__ import annotations

import asyncio
import operator
import threading
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Annotated, Any, TypedDict

import pytest
from langchain_core.messages import AnyMessage, HumanMessage, SystemMessage
from langchain_core.runnables import RunnableConfig
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages
from langgraph.prebuilt import ToolNode, create_react_agent
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

import journeyman as jm
from journeyman.backend.serving.gateway import Gateway, GatewayThread, RecordLog
from journeyman.backend.serving.router import Router
from journeyman.integrations.capture import gateway_records, http_records
from journeyman.integrations.langgraph import TrajectoryTracer
from journeyman.messages import ModelTurn
from journeyman.records import in_process_records
from journeyman.trajectory import History
from tests.scripted_agent import ScriptedModel
from tests.scripted_upstream import ScriptedServer, serve

pytestmark = pytest.mark.filterwarnings("ignore:create_react_agent has been moved")


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@tool
def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    if a == 13:
        raise ValueError("13 is unlucky")
    return a * b


@pytest.fixture
def scripted(tmp_path: Path) -> Iterator[tuple[ScriptedModel, GatewayThread]]:
    model = ScriptedModel()
    upstream = serve(model.app())
    tmp = tmp_path
    gateway = GatewayThread(
        Gateway(Router(ScriptedServer(upstream.base_url, log_dir=tmp)), RecordLog(tmp / "records.jsonl"))
    ).start()
    yield model, gateway
    gateway.stop()
    upstream.stop()


def _llm(gateway: GatewayThread) -> ChatOpenAI:
    return ChatOpenAI(model="m", base_url=f"{gateway.base_url}/v1", api_key="-", temperature=0, max_retries=0)


def _agent(gateway: GatewayThread) -> Any:
    return create_react_agent(_llm(gateway), [add, multiply])


def _question(a: int, b: int, op: str = "plus") -> dict[str, Any]:
    return {"messages": [("user", f"What is {a} {op} {b}?")]}


def _check_react(trajectory: jm.Trajectory, gateway: GatewayThread, a: int, b: int) -> None:
    """Two token-exact turns: the tool call, then the answer with the tool's result before it."""
    assert [m.role for m in trajectory.messages] == ["user", "assistant", "tool", "assistant"]
    first, second = trajectory.model_turns
    assert first.message.tool_calls is not None
    assert first.message.tool_calls[0].function.parsed_arguments() == {"a": a, "b": b}
    assert trajectory.messages[2].content == str(a + b)
    assert second.message.content == f"The answer is {a + b}."
    for turn in trajectory.model_turns:
        assert turn.completion_id is not None
        record = gateway.gateway.records.get(turn.completion_id)
        assert record is not None and turn.is_token_exact
        assert turn.prompt_token_ids == record.prompt_token_ids
        assert turn.completion_token_ids == record.choices[0].completion_token_ids
        assert turn.logprobs == record.choices[0].logprobs
    # What the trajectory says the model saw before each turn is what the gateway received.
    for index, item in enumerate(trajectory.conversation):
        if isinstance(item, ModelTurn):
            record = gateway.gateway.records.get(item.completion_id or "")
            assert record is not None and record.messages is not None
            assert History(conversation=record.messages).messages == trajectory.messages[:index]
    assert trajectory.tools is not None and {t.function.name for t in trajectory.tools} == {"add", "multiply"}
    assert trajectory.metrics["token_exact_calls"] == 2 and trajectory.metrics["calls_without_tokens"] == 0
    assert trajectory.finished_at is not None


def test_invoke_react_agent(scripted: tuple[ScriptedModel, GatewayThread]) -> None:
    _, gateway = scripted
    tracer = TrajectoryTracer(raise_error=True)
    result = _agent(gateway).invoke(_question(2, 3), config={"callbacks": [tracer]})
    assert result["messages"][-1].content == "The answer is 5."
    _check_react(tracer.trajectory, gateway, 2, 3)
    assert tracer.errors == 0 and len(tracer.trajectories) == 1


def test_result_is_the_same_with_and_without_the_tracer(
    scripted: tuple[ScriptedModel, GatewayThread],
) -> None:
    _, gateway = scripted
    agent = _agent(gateway)
    plain = agent.invoke(_question(4, 5))
    traced = agent.invoke(_question(4, 5), config={"callbacks": [TrajectoryTracer(raise_error=True)]})
    strip = [(type(m).__name__, m.content) for m in plain["messages"]]
    assert strip == [(type(m).__name__, m.content) for m in traced["messages"]]


async def test_ainvoke_with_in_process_records(scripted: tuple[ScriptedModel, GatewayThread]) -> None:
    _, gateway = scripted
    tracer = TrajectoryTracer(gateway.gateway.records, raise_error=True)
    run_id = uuid.uuid4()
    config: RunnableConfig = {"callbacks": [tracer], "run_id": run_id, "metadata": {"scenario": "s1"}}
    await _agent(gateway).ainvoke(_question(6, 7), config=config)
    trajectory = tracer.trajectory_for(run_id)
    _check_react(trajectory, gateway, 6, 7)
    assert trajectory.metadata["scenario"] == "s1" and trajectory.metadata["run_id"] == str(run_id)


class _ThreadNoting:
    """A record source that notes the threads it is read on."""

    def __init__(self, records: RecordLog) -> None:
        self.records, self.threads = records, set[int]()

    def get(self, completion_id: str) -> Any:
        self.threads.add(threading.get_ident())
        return self.records.get(completion_id)


async def test_an_async_run_reads_its_records_off_the_event_loop(
    scripted: tuple[ScriptedModel, GatewayThread],
) -> None:
    """The tracer runs inline, on the loop's thread in an async run: a root run's end, which reads
    the records (over HTTP from a remote gateway, a round trip), runs on a worker thread instead,
    and the trajectory is complete when ``ainvoke`` returns. A sync run inside the loop works too."""
    _, gateway = scripted
    records = _ThreadNoting(gateway.gateway.records)
    tracer = TrajectoryTracer(records, raise_error=True)
    await _agent(gateway).ainvoke(_question(6, 7), config={"callbacks": [tracer]})
    _check_react(tracer.trajectory, gateway, 6, 7)
    assert records.threads and threading.get_ident() not in records.threads
    _agent(gateway).invoke(_question(2, 3), config={"callbacks": [tracer]})  # sync, from inside the loop
    _check_react(tracer.trajectory, gateway, 2, 3)


def test_stream_and_astream(scripted: tuple[ScriptedModel, GatewayThread]) -> None:
    _, gateway = scripted
    agent, tracer = _agent(gateway), TrajectoryTracer(raise_error=True)
    updates = list(agent.stream(_question(1, 2), config={"callbacks": [tracer]}))
    assert len(updates) == 3
    _check_react(tracer.trajectory, gateway, 1, 2)

    async def run() -> None:
        async for _ in agent.astream(_question(3, 4), config={"callbacks": [tracer]}, stream_mode="values"):
            pass

    asyncio.run(run())
    _check_react(tracer.trajectory, gateway, 3, 4)


def test_token_streamed_calls_are_token_exact(scripted: tuple[ScriptedModel, GatewayThread]) -> None:
    """The gateway tags each streamed delta with the completion id; langchain-openai keeps it as
    the message id (it drops the chunks' own ``id``), so the tracer joins streamed calls too."""
    _, gateway = scripted
    agent, tracer = _agent(gateway), TrajectoryTracer(raise_error=True)
    chunks = list(agent.stream(_question(2, 2), config={"callbacks": [tracer]}, stream_mode="messages"))
    _check_react(tracer.trajectory, gateway, 2, 2)
    # LangChain ends each call's stream with an empty chunk of its own (chunk_position "last").
    streamed = [m for m, _ in chunks if m.type == "AIMessageChunk" and m.chunk_position != "last"]
    assert len(streamed) == 6  # 3 chunks a call, not one message per call
    assert {m.id for m in streamed} == {t.completion_id for t in tracer.trajectory.model_turns}

    async def run() -> None:
        async for _ in agent.astream(_question(3, 4), config={"callbacks": [tracer]}, stream_mode="messages"):
            pass

    asyncio.run(run())
    _check_react(tracer.trajectory, gateway, 3, 4)


def test_token_streamed_calls_to_another_endpoint_are_flagged(
    scripted: tuple[ScriptedModel, GatewayThread],
) -> None:
    """Without the gateway a streamed reply has only LangChain's own id: messages kept, calls flagged."""
    _, gateway = scripted
    direct = gateway.gateway.router.server.base_url
    llm = ChatOpenAI(model="m", base_url=f"{direct}/v1", api_key="-", temperature=0, max_retries=0)
    tracer = TrajectoryTracer(raise_error=True)
    agent = create_react_agent(llm, [add])
    assert list(agent.stream(_question(2, 2), config={"callbacks": [tracer]}, stream_mode="messages"))
    trajectory = tracer.trajectory
    assert [m.role for m in trajectory.messages] == ["user", "assistant", "tool", "assistant"]
    assert trajectory.metrics["calls_without_tokens"] == 2
    assert not any(t.is_token_exact or t.completion_id for t in trajectory.model_turns)
    assert any("no gateway record" in line for line in trajectory.logs)


def test_token_streaming_with_streaming_disabled_stays_token_exact(
    scripted: tuple[ScriptedModel, GatewayThread],
) -> None:
    """``disable_streaming=True``: one response per call, and messages mode streams whole messages."""
    _, gateway = scripted
    llm = ChatOpenAI(
        model="m", base_url=f"{gateway.base_url}/v1", api_key="-", max_retries=0, disable_streaming=True
    )
    tracer = TrajectoryTracer(raise_error=True)
    agent = create_react_agent(llm, [add, multiply])
    chunks = list(agent.stream(_question(2, 2), config={"callbacks": [tracer]}, stream_mode="messages"))
    assert len(chunks) == 3
    _check_react(tracer.trajectory, gateway, 2, 2)


async def test_sixteen_concurrent_runs_do_not_mix(scripted: tuple[ScriptedModel, GatewayThread]) -> None:
    _, gateway = scripted
    agent, tracer = _agent(gateway), TrajectoryTracer(raise_error=True)
    runs = {uuid.uuid4(): (i, i + 10) for i in range(16)}
    await asyncio.gather(
        *(
            agent.ainvoke(_question(a, b), config={"callbacks": [tracer], "run_id": run_id})
            for run_id, (a, b) in runs.items()
        )
    )
    assert len(tracer.trajectories) == 16
    ids = set()
    for run_id, (a, b) in runs.items():
        trajectory = tracer.trajectory_for(run_id)
        _check_react(trajectory, gateway, a, b)
        assert trajectory.messages[0].content == f"What is {a} plus {b}?"
        ids.update(t.completion_id for t in trajectory.model_turns)
    assert len(ids) == 32


def test_tool_error_raises_as_before_and_is_recorded(scripted: tuple[ScriptedModel, GatewayThread]) -> None:
    _, gateway = scripted
    agent, tracer = _agent(gateway), TrajectoryTracer(raise_error=True)
    with pytest.raises(ValueError, match="13 is unlucky"):
        agent.invoke(_question(13, 2, "times"))
    with pytest.raises(ValueError, match="13 is unlucky"):
        agent.invoke(_question(13, 2, "times"), config={"callbacks": [tracer]})
    trajectory = tracer.trajectory
    assert trajectory.metrics["tool_errors"] == 1 and trajectory.metrics["llm_calls"] == 1
    assert "ValueError: 13 is unlucky" in str(trajectory.metadata["error"])
    assert [m.role for m in trajectory.messages] == ["user", "assistant", "tool"]
    assert trajectory.messages[2].content == "Error: ValueError: 13 is unlucky"


def test_tool_error_handled_by_the_agent_is_recorded(scripted: tuple[ScriptedModel, GatewayThread]) -> None:
    _, gateway = scripted
    agent = create_react_agent(_llm(gateway), ToolNode([add, multiply], handle_tool_errors=True))
    tracer = TrajectoryTracer(raise_error=True)
    plain = agent.invoke(_question(13, 2, "times"))
    traced = agent.invoke(_question(13, 2, "times"), config={"callbacks": [tracer]})
    assert [m.content for m in plain["messages"]][1:] == [m.content for m in traced["messages"]][1:]
    trajectory = tracer.trajectory
    assert trajectory.metrics["tool_errors"] == 1 and "error" not in trajectory.metadata
    assert any("13 is unlucky" in line for line in trajectory.logs)
    assert [m.role for m in trajectory.messages] == ["user", "assistant", "tool", "assistant"]
    assert "13 is unlucky" in str(trajectory.messages[2].content)


def test_dropped_connection_raises_as_before_and_is_recorded() -> None:
    llm = ChatOpenAI(model="m", base_url="http://127.0.0.1:9/v1", api_key="-", max_retries=0, timeout=2)
    agent, tracer = create_react_agent(llm, [add]), TrajectoryTracer(raise_error=True)
    with pytest.raises(Exception) as plain:
        agent.invoke(_question(1, 1))
    with pytest.raises(Exception) as traced:
        agent.invoke(_question(1, 1), config={"callbacks": [tracer]})
    assert type(plain.value) is type(traced.value)
    trajectory = tracer.trajectory
    assert trajectory.metrics["llm_errors"] == 1 and trajectory.metrics["llm_calls"] == 0
    assert type(traced.value).__name__ in str(trajectory.metadata["error"])
    assert any("failed" in line for line in trajectory.logs)


class _BrokenRecords:
    def get(self, completion_id: str) -> Any:
        return "not a record"


def test_a_tracer_bug_never_reaches_the_agent(scripted: tuple[ScriptedModel, GatewayThread]) -> None:
    _, gateway = scripted
    tracer = TrajectoryTracer(_BrokenRecords())
    result = _agent(gateway).invoke(_question(2, 3), config={"callbacks": [tracer]})
    assert result["messages"][-1].content == "The answer is 5."
    assert tracer.errors == 1
    with pytest.raises(jm.ConfigError, match="no traced run has finished"):
        _ = tracer.trajectory
    with pytest.raises(AttributeError):
        _agent(gateway).invoke(
            _question(2, 3), config={"callbacks": [TrajectoryTracer(_BrokenRecords(), raise_error=True)]}
        )


class _State(TypedDict):
    messages: Annotated[list[AnyMessage], add_messages]
    notes: Annotated[list[str], operator.add]


def test_hand_built_graph_with_sub_graph_and_sub_agent(scripted: tuple[ScriptedModel, GatewayThread]) -> None:
    """A planner node, a react sub-graph node sharing the messages, and a sub-agent with its own."""
    _, gateway = scripted
    llm = _llm(gateway)
    solver = create_react_agent(llm, [add, multiply])
    helper = create_react_agent(llm, [add, multiply], name="helper")

    def plan(state: _State) -> dict[str, Any]:
        reply = llm.invoke([SystemMessage("Plan the work."), *state["messages"]])
        return {"notes": [str(reply.content)]}

    def delegate(state: _State, config: RunnableConfig) -> dict[str, Any]:
        result = helper.invoke({"messages": [HumanMessage("What is 5 times 6?")]}, config)
        return {"notes": [str(result["messages"][-1].content)]}

    builder = StateGraph(_State)
    builder.add_node("plan", plan)
    builder.add_node("solve", solver)
    builder.add_node("delegate", delegate)
    builder.add_edge(START, "plan")
    builder.add_edge("plan", "solve")
    builder.add_edge("solve", "delegate")
    builder.add_edge("delegate", END)
    graph = builder.compile()

    tracer = TrajectoryTracer(raise_error=True)
    result = graph.invoke(
        {"messages": [HumanMessage("What is 8 plus 9?")], "notes": []}, config={"callbacks": [tracer]}
    )
    assert result["notes"] == ["I do not know.", "The answer is 30."]
    trajectory = tracer.trajectory
    histories = trajectory.histories
    assert len(histories) == 3, [h.name for h in histories]
    planner, main, sub = histories[0], histories[1], histories[2]
    assert [m.role for m in planner.messages] == ["system", "user", "assistant"]
    assert [m.role for m in main.messages] == ["user", "assistant", "tool", "assistant"]
    assert main.messages[-1].content == "The answer is 17." and main.name == "agent"
    assert sub.messages[0].content == "What is 5 times 6?" and sub.messages[-1].content == "The answer is 30."
    assert all(t.is_token_exact for h in histories for t in h.model_turns)
    assert trajectory.metrics["llm_calls"] == 5 and trajectory.metrics["tool_calls"] == 2


def test_calls_to_another_endpoint_keep_messages_and_are_flagged(
    scripted: tuple[ScriptedModel, GatewayThread],
) -> None:
    """A model served without the gateway: messages captured, no token ids, endpoint remembered."""
    _, gateway = scripted
    direct = gateway.gateway.router.server.base_url  # the scripted model itself, no gateway in front
    llm = ChatOpenAI(model="m", base_url=f"{direct}/v1", api_key="-", temperature=0, max_retries=0)
    tracer = TrajectoryTracer(raise_error=True)
    create_react_agent(llm, [add]).invoke(_question(2, 3), config={"callbacks": [tracer]})
    trajectory = tracer.trajectory
    assert [m.role for m in trajectory.messages] == ["user", "assistant", "tool", "assistant"]
    assert trajectory.messages[-1].content == "The answer is 5."
    assert trajectory.metrics["calls_without_tokens"] == 2 and trajectory.metrics["token_exact_calls"] == 0
    assert all(
        t.completion_id and t.completion_id.startswith("chatcmpl-scripted") for t in trajectory.model_turns
    )
    assert sum("no gateway record" in line for line in trajectory.logs) == 2
    assert http_records(f"{direct}/v1").is_gateway is False


class CountingGateway(Gateway):
    """A gateway that counts the record requests it answers (``old``: without batch lookups)."""

    def __init__(self, *args: Any, old: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.old = old
        self.record_requests: list[str] = []

    async def get_record(self, request: Request) -> Response:
        self.record_requests.append("one")
        return await super().get_record(request)

    async def list_records(self, request: Request) -> Response:
        self.record_requests.append("many")
        if self.old:
            return JSONResponse({"error": {"message": "give ?rollout_id=..."}}, status_code=400)
        return await super().list_records(request)


def _counting_gateway(gateway: GatewayThread, tmp_path: Path, old: bool = False) -> CountingGateway:
    return CountingGateway(gateway.gateway.router, RecordLog(tmp_path / "counted.jsonl"), old=old)


def test_a_gateway_in_this_process_is_read_without_http(
    scripted: tuple[ScriptedModel, GatewayThread], tmp_path: Path
) -> None:
    _, scripted_gateway = scripted
    counting = _counting_gateway(scripted_gateway, tmp_path)
    with GatewayThread(counting) as gateway:
        localhost = gateway.base_url.replace("127.0.0.1", "localhost")
        assert in_process_records(localhost) is counting.records
        assert gateway_records(f"{gateway.base_url}/r/run-1/v1") is counting.records
        for records in (None, f"{localhost}/v1"):  # the model's base_url, or the URL given
            tracer = TrajectoryTracer(records, raise_error=True)
            _agent(gateway).invoke(_question(2, 3), config={"callbacks": [tracer]})
            _check_react(tracer.trajectory, gateway, 2, 3)
        assert counting.record_requests == []
    assert in_process_records(gateway.base_url) is None  # stopped: forgotten


@pytest.mark.parametrize("old", [False, True], ids=["batch", "gateway-without-batch"])
def test_a_gateway_in_another_process_is_read_over_http(
    scripted: tuple[ScriptedModel, GatewayThread], tmp_path: Path, old: bool
) -> None:
    """A gateway this process did not start (served as a plain ASGI app here) is asked over HTTP:
    one request for the whole run, or one per call from a gateway without batch lookups."""
    _, scripted_gateway = scripted
    counting = _counting_gateway(scripted_gateway, tmp_path, old)
    server = serve(counting.app)
    try:
        assert in_process_records(server.base_url) is None
        assert gateway_records(f"{server.base_url}/v1") is http_records(f"{server.base_url}/v1")
        tracer = TrajectoryTracer(raise_error=True)
        llm = ChatOpenAI(
            model="m", base_url=f"{server.base_url}/v1", api_key="-", temperature=0, max_retries=0
        )
        create_react_agent(llm, [add, multiply]).invoke(_question(2, 3), config={"callbacks": [tracer]})
        trajectory = tracer.trajectory
        assert counting.record_requests == (["many", "one", "one"] if old else ["many"])
        assert trajectory.metrics["token_exact_calls"] == 2
        for turn in trajectory.model_turns:
            record = counting.records.get(turn.completion_id or "")
            assert record is not None and turn.completion_token_ids == record.choices[0].completion_token_ids
            assert (
                turn.prompt_token_ids == record.prompt_token_ids
                and turn.logprobs == record.choices[0].logprobs
            )
    finally:
        server.stop()


def test_threads_share_one_tracer_and_pop_hands_over(scripted: tuple[ScriptedModel, GatewayThread]) -> None:
    _, gateway = scripted
    agent, tracer = _agent(gateway), TrajectoryTracer(raise_error=True)
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: agent.invoke(_question(i, 1), config={"callbacks": [tracer]}), range(8)))
    trajectories = tracer.pop_trajectories()
    assert sorted(str(t.messages[0].content) for t in trajectories) == sorted(
        f"What is {i} plus 1?" for i in range(8)
    )
    for trajectory in trajectories:
        a = int(str(trajectory.messages[0].content).split()[2])
        _check_react(trajectory, gateway, a, 1)
    assert tracer.trajectories == [] and tracer.errors == 0


def test_a_tool_call_with_list_arguments_ends_the_run_as_text_and_is_counted(
    scripted: tuple[ScriptedModel, GatewayThread],
) -> None:
    """The model writes ``add`` with ``[2, 3]``: the agent run ends normally (an answer to score
    and train against) instead of raising inside langchain-openai, and the trajectory says why."""

    def list_arguments(body: dict[str, Any]) -> dict[str, Any]:
        call = {"id": "", "type": "function", "function": {"name": "add", "arguments": "[2, 3]"}}
        return {"role": "assistant", "content": None, "tool_calls": [call]}

    model, gateway = scripted
    model.policy = list_arguments
    tracer = TrajectoryTracer(raise_error=True)
    result = _agent(gateway).invoke(_question(2, 3), config={"callbacks": [tracer]})
    assert result["messages"][-1].content == '{"name": "add", "arguments": [2, 3]}'
    trajectory = tracer.trajectory
    (turn,) = trajectory.model_turns
    assert turn.is_token_exact and turn.message.tool_calls is None
    assert trajectory.metrics["invalid_tool_calls"] == 1 and trajectory.metrics["llm_errors"] == 0
    assert any("not a JSON object" in line for line in trajectory.logs)
