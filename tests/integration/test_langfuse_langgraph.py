"""A LangGraph agent on the real vLLM server, traced only by Langfuse's own LangChain
``CallbackHandler``, sent to the Langfuse-API-compatible test server, read back as a trajectory
(the same with a scripted chat model: tests/unit/test_langfuse_langgraph.py)."""

from __future__ import annotations

from collections.abc import Callable

from langchain.agents import create_agent
from langchain.agents.middleware import ModelRequest, ModelResponse, wrap_model_call
from langchain_core.messages import convert_to_openai_messages
from langfuse import Langfuse

from journeyman.backend.serving.vllm import VLLMServer
from journeyman.integrations.langfuse import import_trajectories
from tests.integration.conftest import SERVED_BASE
from tests.langfuse_server import LangfuseServer
from tests.unit import test_langfuse_langgraph as scripted
from tests.unit.test_langfuse_langgraph import add_and_finish, comparable, run_traced

server, client = scripted.server, scripted.client  # the fixtures: a test server, and a client of it


@wrap_model_call
def tool_required(request: ModelRequest, handler: Callable[[ModelRequest], ModelResponse]) -> ModelResponse:
    return handler(request.override(tool_choice="required"))


def test_a_langgraph_agent_on_the_real_vllm_server(
    vllm_server: VLLMServer, server: LangfuseServer, client: Langfuse
) -> None:
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(
        base_url=f"{vllm_server.base_url}/v1",
        api_key="unused",
        model=SERVED_BASE,
        temperature=0,
        max_tokens=48,
    )
    # tool_choice="required" makes the 135M model call the tool; return_direct ends the run on its result.
    agent = create_agent(chat, [add_and_finish], middleware=[tool_required])
    state = run_traced(agent, "What is 12 plus 30?", server, session="vllm")
    client.flush()

    (trajectory,) = import_trajectories(client, session_id="vllm")
    expected = convert_to_openai_messages(state)
    assert comparable(trajectory.openai_messages()) == comparable(expected)  # type: ignore[arg-type]
    (turn,) = trajectory.model_turns
    assert turn.model == SERVED_BASE and turn.message.tool_calls
    assert turn.message.tool_calls[0].function.name == "add_and_finish"
    assert trajectory.tools is not None and trajectory.tools[0].function.name == "add_and_finish"
    assert trajectory.openai_messages()[-1]["role"] == "tool"
