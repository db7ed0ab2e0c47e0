"""A LangGraph agent that knows nothing of journeyman, traced only by Langfuse's own LangChain
``CallbackHandler``, sent to the Langfuse-API-compatible test server, read back as a trajectory:
here with LangChain's scripted chat model; on the real vLLM server in the integration tier."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from langchain.agents import create_agent
from langchain_core.language_models.fake_chat_models import FakeMessagesListChatModel
from langchain_core.messages import AIMessage, BaseMessage
from langchain_core.tools import tool
from langchain_core.utils.function_calling import convert_to_openai_tool
from langfuse import Langfuse
from langfuse.langchain import CallbackHandler

from journeyman.integrations.langfuse import import_trajectories
from tests.langfuse_server import LangfuseServer, client_for


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@tool(return_direct=True)
def add_and_finish(a: int, b: int) -> int:
    """Add two integers; the sum is the final answer."""
    return a + b


class ScriptedToolModel(FakeMessagesListChatModel):
    """LangChain's fake chat model, able to take tools the way real chat models do."""

    def bind_tools(self, tools: Any, **kwargs: Any) -> Any:
        return self.bind(tools=[convert_to_openai_tool(t) for t in tools], **kwargs)


@pytest.fixture
def server() -> Iterator[LangfuseServer]:
    with LangfuseServer(public_key=f"pk-{uuid.uuid4().hex}") as server:
        yield server
        assert server.errors == []


@pytest.fixture
def client(server: LangfuseServer) -> Iterator[Langfuse]:
    client = client_for(server)
    yield client
    client.shutdown()


def run_traced(agent: Any, question: str, server: LangfuseServer, session: str) -> list[BaseMessage]:
    handler = CallbackHandler(public_key=server.public_key)
    state = agent.invoke(
        {"messages": [("user", question)]},
        config={
            "callbacks": [handler],
            "metadata": {"langfuse_session_id": session, "langfuse_tags": ["prod"]},
        },
    )
    messages: list[BaseMessage] = state["messages"]
    return messages


def test_a_langgraph_run_recorded_by_the_callback_handler_imports_as_a_trajectory(
    server: LangfuseServer, client: Langfuse
) -> None:
    model = ScriptedToolModel(
        responses=[
            AIMessage(content="", tool_calls=[{"id": "call_1", "name": "add", "args": {"a": 2, "b": 3}}]),
            AIMessage(content="2+3 is 5."),
        ]
    )
    agent = create_agent(model, [add], system_prompt="You add numbers with the add tool.")
    run_traced(agent, "What is 2+3?", server, session="prod-session")
    client.flush()

    (trajectory,) = import_trajectories(client, session_id="prod-session")
    assert trajectory.name == "LangGraph"
    assert trajectory.openai_messages() == [
        {"role": "system", "content": "You add numbers with the add tool."},
        {"role": "user", "content": "What is 2+3?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "add", "arguments": json.dumps({"a": 2, "b": 3})},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "5"},
        {"role": "assistant", "content": "2+3 is 5."},
    ]
    assert len(trajectory.model_turns) == 2 and trajectory.additional_histories == []
    assert trajectory.tools is not None and [t.function.name for t in trajectory.tools] == ["add"]
    assert trajectory.tools[0].function.parameters == convert_to_openai_tool(add)["function"]["parameters"]
    assert trajectory.metadata["langfuse_session_id"] == "prod-session"
    assert trajectory.reward is None  # nobody scored it yet

    # Scored later in Langfuse (a person, an evaluator): the score becomes the reward.
    client.create_score(name="reward", value=1.0, trace_id=trajectory.id, comment="correct")
    client.flush()
    (scored,) = import_trajectories(client, tags=["prod"])
    assert scored.reward == 1.0 and scored.metadata["judge_explanation"] == "correct"
    assert scored.conversation == trajectory.conversation


def test_a_run_that_ends_on_a_tool_keeps_the_tool_result(server: LangfuseServer, client: Langfuse) -> None:
    model = ScriptedToolModel(
        responses=[
            AIMessage(
                content="", tool_calls=[{"id": "c9", "name": "add_and_finish", "args": {"a": 4, "b": 5}}]
            )
        ]
    )
    agent = create_agent(model, [add_and_finish])
    run_traced(agent, "4+5?", server, session="direct")
    client.flush()
    (trajectory,) = import_trajectories(client, session_id="direct")
    assert trajectory.openai_messages()[-1] == {"role": "tool", "tool_call_id": "c9", "content": "9"}


def comparable(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages reduced to what both sides must agree on: roles, text, tool calls, tool results."""
    out = []
    for m in messages:
        calls = [
            (c["id"], c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in m.get("tool_calls") or []
        ]
        out.append(
            {
                "role": m["role"],
                "content": m.get("content") or "",
                "calls": calls,
                "id": m.get("tool_call_id"),
            }
        )
    return out
