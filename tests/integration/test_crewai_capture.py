"""CrewTracer on a real two-agent CrewAI crew calling the real vLLM server through the gateway."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import pytest

from tests.integration.conftest import Served, each_family
from tests.integration.test_langgraph_capture import check_token_exact

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

# The 135M model calls a tool only after worked example conversations (../shared/FACTS.md), and
# CrewAI writes the conversation itself. So its task description holds three example exchanges
# as ChatML turns, each user turn worded the way CrewAI words its task: 7 of 8 seeds call a tool.
# Qwen2.5 calls tools zero-shot: its task is the question alone.
_CRITERIA = (
    "\n\nThis is the expected criteria for your final answer: A number\n"
    "you MUST return the actual complete content as the final answer, not a summary."
)


def _example(question: str, name: str, a: int, b: int, result: int) -> str:
    call = json.dumps({"name": name, "arguments": {"a": a, "b": b}})
    return (
        f"{question}{_CRITERIA}<|im_end|>\n<|im_start|>assistant\n<tool_call>\n{call}\n</tool_call><|im_end|>\n"
        f"<|im_start|>user\n<tool_response>\n{result}\n</tool_response><|im_end|>\n"
        f"<|im_start|>assistant\nThe answer is {result}.<|im_end|>\n<|im_start|>user\n\nCurrent Task: "
    )


_FEW_SHOT = (
    _example("What is 12 times 7?", "multiply", 12, 7, 84)
    + _example("What is 35 plus 48?", "add", 35, 48, 83)
    + _example("What is 9 times 13?", "multiply", 9, 13, 117)
)


def question(family: str) -> str:
    return (_FEW_SHOT if family == "smollm2-135m" else "") + "What is 23 plus 19?"


@pytest.fixture
def crewai(served: Served, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """CrewAI offline under a temporary HOME (it writes there even on import); servers start first."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("CREWAI_DISABLE_TELEMETRY", "true")
    monkeypatch.setenv("CREWAI_TRACING_ENABLED", "false")
    monkeypatch.chdir(tmp_path)
    return importlib.import_module("crewai")


def _crew(crewai: Any, served: Served, seed: int) -> Any:
    from crewai.tools import tool

    @tool("add")
    def add(a: int, b: int) -> int:
        """Add two integers and return the result."""
        return a + b

    @tool("multiply")
    def multiply(a: int, b: int) -> int:
        """Multiply two integers and return the result."""
        return a * b

    llm = crewai.LLM(
        model=f"openai/{served.name}",
        base_url=f"{served.gateway.base_url}/v1",
        api_key="-",
        temperature=0.7,
        seed=seed,
        max_tokens=48,
    )
    calculator = crewai.Agent(
        role="Calculator",
        goal="Compute with tools",
        backstory="Careful.",
        llm=llm,
        tools=[add, multiply],
        max_iter=3,
    )
    writer = crewai.Agent(role="Writer", goal="Report results", backstory="Brief.", llm=llm, max_iter=2)
    tasks = [
        crewai.Task(description=question(served.family), expected_output="A number", agent=calculator),
        crewai.Task(
            description="Report the result in one sentence.", expected_output="A sentence", agent=writer
        ),
    ]
    return crewai.Crew(agents=[calculator, writer], tasks=tasks)


@each_family
def test_two_agent_crew_with_a_tool_is_captured_token_exact(crewai: Any, served: Served) -> None:
    from journeyman.integrations.crewai import CrewTracer

    for seed in range(12):
        crew = _crew(crewai, served, seed)
        with CrewTracer(raise_error=True, crew=crew) as tracer:
            crew.kickoff()
        assert tracer.errors == 0, (
            f"seed {seed}: the tracer failed {tracer.errors} times"
        )  # every run, not the last
        trajectory = tracer.trajectory
        if trajectory.metrics["tool_calls"]:
            break
    else:
        pytest.fail("no crew run called a tool in 12 seeds")
    names = [h.name for h in trajectory.histories]
    assert names[0] == "Calculator" and names[-1] == "Writer" and set(names) == {"Calculator", "Writer"}
    calculator = trajectory.histories[0]
    assert calculator.tools is not None and {t.function.name for t in calculator.tools} == {"add", "multiply"}
    assert any(m.role == "tool" for m in calculator.messages)
    assert trajectory.metrics["calls_without_tokens"] == 0
    for history in trajectory.histories:
        check_token_exact(history, served.gateway, served.tokenizer)
