"""The demo's task: a LangGraph ReAct agent answers arithmetic questions with its tools.

Questions (sums of 3-digit numbers, products of 2-digit ones, half as word problems), the three
tools (add, multiply and a distraction), the agent with its worked examples, the programmatic
check that scores a run, and the rubrics a judge gets instead. ``journeyman demo`` trains on it;
``examples/langgraph_calculator`` is the same task as a script to copy.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal

import journeyman as jm
from journeyman.errors import MissingDependencyError

try:
    from langchain.agents import create_agent
    from langchain.agents.middleware import AgentMiddleware, ModelRequest, ModelResponse
    from langchain_core.messages import AIMessage, AnyMessage, HumanMessage, SystemMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langgraph.errors import GraphRecursionError
except ImportError as error:  # pragma: no cover - the extra is missing
    raise MissingDependencyError(error.name or "langgraph", "langgraph", "the demo") from error

from journeyman.integrations.langgraph import TrajectoryTracer

__all__ = [
    "DEMO_RUBRICS",
    "SYSTEM",
    "TOOLS",
    "WORKED_EXAMPLES",
    "Scenario",
    "build_agent",
    "make_scenarios",
    "rollout",
    "score",
    "worked_plan",
]

Op = Literal["add", "multiply"]


@dataclass(frozen=True)
class Scenario:
    question: str
    op: Op
    a: int
    b: int
    kind: Literal["arithmetic", "word"]

    @property
    def answer(self) -> int:
        return self.a + self.b if self.op == "add" else self.a * self.b


_ARITHMETIC = {
    "add": ["What is {a} plus {b}?", "What is {a} + {b}?", "Add {a} and {b}."],
    "multiply": ["What is {a} times {b}?", "What is {a} * {b}?", "Multiply {a} by {b}."],
}
_WORD = {
    "add": [
        "{name} has {a} stamps and buys {b} more. How many stamps does {name} have now?",
        "A library had {a} books and received {b} new ones. How many books does it have?",
        "A farm picked {a} apples in the morning and {b} in the afternoon. How many apples in all?",
    ],
    "multiply": [
        "A box holds {a} pencils. How many pencils are in {b} boxes?",
        "{name} reads {a} pages a day for {b} days. How many pages is that?",
        "A bus has {a} rows of {b} seats. How many seats does it have?",
    ],
}
_NAMES = ["Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Goran", "Hana"]


def make_scenarios(n: int, seed: int, word_share: float = 0.5) -> list[Scenario]:
    """``n`` questions, half additions of 3-digit numbers and half products of 2-digit ones
    (too hard for a 135M model in its head); ``word_share`` of them as word problems."""
    rng = random.Random(seed)
    scenarios = []
    for i in range(n):
        op: Op = "add" if i % 2 == 0 else "multiply"
        a, b = (
            (rng.randint(101, 999), rng.randint(101, 999))
            if op == "add"
            else (rng.randint(12, 99), rng.randint(12, 99))
        )
        kind: Literal["arithmetic", "word"] = "word" if rng.random() < word_share else "arithmetic"
        template = rng.choice((_WORD if kind == "word" else _ARITHMETIC)[op])
        scenarios.append(Scenario(template.format(a=a, b=b, name=rng.choice(_NAMES)), op, a, b, kind))
    return scenarios


@tool
def add(a: int, b: int) -> int:
    """Add two integers and return the sum."""
    return a + b


@tool
def multiply(a: int, b: int) -> int:
    """Multiply two integers and return the product."""
    return a * b


@tool
def get_weather(city: str) -> str:
    """The current weather in a city."""
    return f"It is sunny and 21 degrees in {city}."


TOOLS = [add, multiply, get_weather]
SYSTEM = "You are a calculator assistant. Always call a tool to compute, then state the answer."

_DEMO_SUCCESS = """\
- The task is one arithmetic question, and the agent must compute with its tools. It succeeds only if it \
called add or multiply with the question's own numbers and its final message states the number in that \
call's <tool> result.
- Only a <tool> block is a tool result. A number the agent wrote itself, even one that looks like a \
calculation or a tool response, is not: do not redo the arithmetic, check that the final number is copied \
from the <tool> result of the right call.
- An attempt that ends without a final answer, keeps calling tools, uses other numbers or the wrong \
operation, or states another number has failed, however it reads."""

DEMO_RUBRIC = (
    _DEMO_SUCCESS
    + """
- Every success must score clearly higher than every failure; among successes, fewer tool calls and words score higher."""
)
"""The demo's rubric for RULER scores: it says what success is, and how to check it without arithmetic
(else a small judge believes an answer written without a tool, such as "23 * 22 = 56", and teaches the
policy to skip tools)."""

DEMO_VERDICT_RUBRIC = """\
- The task is one arithmetic question, and the agent must compute with its tools. It achieved the goal only if it \
called the question's operation (add for a sum, multiply for a product) with the question's own numbers, and its \
final message states the number that call returned.
- An attempt that got no tool result, ends without a final answer, uses other numbers or the wrong operation, or \
states another number did not achieve it, however it reads."""
"""The same for verdicts, which end with the attempt's outcome (the request, each tool call with its
result, the final message): the rubric names the operation, since with "add or multiply" a small judge passes
products answering sums."""

DEMO_PAIRWISE_RUBRIC = (
    _DEMO_SUCCESS
    + """
- An attempt that succeeds is better than one that fails; between two that both succeed or both fail, the one \
with fewer tool calls and words is better."""
)
"""The same for pairwise comparisons."""

DEMO_RUBRICS = {"scores": DEMO_RUBRIC, "verdict": DEMO_VERDICT_RUBRIC, "pairwise": DEMO_PAIRWISE_RUBRIC}
"""The demo's rubric for each way of judging."""


def _worked(question: str, name: str, a: int, b: int, call_id: str) -> list[AnyMessage]:
    result = a + b if name == "add" else a * b
    call = {"name": name, "args": {"a": a, "b": b}, "id": call_id, "type": "tool_call"}
    return [
        HumanMessage(question),
        AIMessage("", tool_calls=[call]),
        ToolMessage(str(result), tool_call_id=call_id),
        AIMessage(f"The answer is {result}."),
    ]


# Four worked conversations: without them the base model never calls a tool.
WORKED_EXAMPLES: list[AnyMessage] = [
    *_worked("What is 12 times 7?", "multiply", 12, 7, "call_ex1"),
    *_worked(
        "Sam has 235 marbles and finds 148 more. How many marbles does Sam have?", "add", 235, 148, "call_ex2"
    ),
    *_worked("What is 35 plus 48?", "add", 35, 48, "call_ex3"),
    *_worked("A crate holds 24 bottles. How many bottles are in 16 crates?", "multiply", 24, 16, "call_ex4"),
]


class _WorkedExamples(AgentMiddleware):
    """Shows the model the worked examples after the system prompt, without adding them to the state."""

    def wrap_model_call(self, request: ModelRequest, handler: Callable[[ModelRequest], ModelResponse]) -> Any:
        return handler(request.override(messages=[*WORKED_EXAMPLES, *request.messages]))

    async def awrap_model_call(
        self, request: ModelRequest, handler: Callable[[ModelRequest], Awaitable[ModelResponse]]
    ) -> Any:
        return await handler(request.override(messages=[*WORKED_EXAMPLES, *request.messages]))


class _ToolWait(AgentMiddleware):
    """Each tool call waits ``seconds`` first, as a real agent waits on an API (the answer is the same)."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def wrap_tool_call(self, request: Any, handler: Callable[[Any], Any]) -> Any:
        time.sleep(self.seconds)
        return handler(request)

    async def awrap_tool_call(self, request: Any, handler: Callable[[Any], Awaitable[Any]]) -> Any:
        await asyncio.sleep(self.seconds)
        return await handler(request)


def build_agent(llm: ChatOpenAI, *, worked_examples: bool = True, tool_seconds: float = 0.0) -> Any:
    """The ReAct agent: the system prompt, the worked examples, then the conversation so far (the
    same requests, turn by turn, as LangGraph's older ``create_react_agent`` with a prompt function).
    ``tool_seconds``: each tool call waits that long first."""
    middleware: list[AgentMiddleware] = [_WorkedExamples()] if worked_examples else []
    if tool_seconds > 0:
        middleware.append(_ToolWait(tool_seconds))
    return create_agent(llm, TOOLS, system_prompt=SystemMessage(SYSTEM), middleware=middleware)


def score(trajectory: jm.Trajectory, scenario: Scenario, shaping: float = 0.0) -> jm.Trajectory:
    """Reward 1 when the final answer holds the right number (``shaping`` for the right tool call
    otherwise), and the metrics the demo reports."""
    everything = trajectory.messages
    asked = [i for i, m in enumerate(everything) if m.role == "user" and m.content == scenario.question]
    messages = everything[asked[-1] + 1 :] if asked else everything  # after the worked examples
    calls = [c for m in messages if m.role == "assistant" for c in (m.tool_calls or [])]
    results = [m for m in messages if m.role == "tool"]
    errors = sum(str(m.content).startswith("Error") for m in results)
    right = False
    for call in calls:
        try:
            args = json.loads(call.function.arguments)
        except ValueError:
            continue
        if call.function.name == scenario.op and isinstance(args, dict):
            right = right or sorted(map(str, args.values())) == sorted([str(scenario.a), str(scenario.b)])
    last = messages[-1] if messages else None
    final = (
        str(last.content or "")
        if last is not None and last.role == "assistant" and not last.tool_calls
        else ""
    )
    numbers = [int(n.replace(",", "")) for n in re.findall(r"-?\d[\d,]*", final)]
    success = scenario.answer in numbers
    trajectory.reward = 1.0 if success else (shaping if right else 0.0)
    trajectory.metrics.update(
        success=float(success),
        tool_call=float(bool(calls)),
        valid_tool_call=float(bool(calls) and errors == 0 and len(results) == len(calls)),
        right_tool_call=float(right),
        turns=float(len(trajectory.model_turns)),
    )
    trajectory.metadata.update(
        question=scenario.question,
        kind=scenario.kind,
        op=scenario.op,
        answer=scenario.answer,
        worked_examples=bool(asked and asked[-1] > 1),
    )  # the question comes after the system prompt, or after the worked examples too
    return trajectory


def worked_plan(n: int, share: float) -> list[bool]:
    """Which of a step's ``n`` questions get the worked examples: the first ``round(n x share)``
    (at least one of each prompt when ``share`` is strictly between 0 and 1). The questions
    alternate sums and products, so with 4 a step and a share of 0.5 each prompt gets both."""
    k = round(n * share)
    if 0 < share < 1 and n >= 2:
        k = min(max(k, 1), n - 1)
    return [i < k for i in range(n)]


async def rollout(
    agent: Any, scenario: Scenario, *, shaping: float = 0.0, max_turns: int = 3, records: Any = None
) -> jm.Trajectory:
    """One run of the agent on one question, captured token-exact and scored. ``records``: the
    gateway's record log when it runs in this process (else the tracer asks the gateway over HTTP)."""
    tracer = TrajectoryTracer(records)
    config: dict[str, Any] = {"callbacks": [tracer], "recursion_limit": 2 * max_turns}
    with contextlib.suppress(GraphRecursionError):  # it kept calling tools: a wrong answer, in the logs
        await agent.ainvoke({"messages": [HumanMessage(scenario.question)]}, config=config)
    return score(tracer.trajectory, scenario, shaping)
