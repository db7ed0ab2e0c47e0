"""An OpenAI Agents SDK agent with a handoff and tools, captured with AgentsTracer and trained.

A Triage agent hands each question to a Calculator agent (tools ``add`` and ``multiply``), which
answers. The agents talk the Responses API (the SDK's default) to journeyman's gateway, which
runs each call as the chat completion it amounts to and records its exact tokens. One line,
``with AgentsTracer() as tracer:``, turns a run into a trajectory: the Triage's call and the
Calculator's calls are two histories, the handoff between them in its metadata. The reward: 1 for
the right number in the final answer, 0.1 for a tool call with the question's numbers.

    python examples/openai_agents_calculator/openai_agents_calculator.py            # 10 steps
    python examples/openai_agents_calculator/openai_agents_calculator.py --steps 1 --questions 2 --group-size 2
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import random
from pathlib import Path
from typing import Any

from agents import (
    Agent,
    MaxTurnsExceeded,
    ModelSettings,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_trace_processors,
)
from openai import AsyncOpenAI

import journeyman as jm
from journeyman.backend import LocalBackend
from journeyman.integrations.openai_agents import AgentsTracer

set_trace_processors([])  # send the SDK's traces nowhere but AgentsTracer (OpenAI's is not reachable)


@function_tool
def add(a: int, b: int) -> int:
    """Add two integers and return the result."""
    return a + b


@function_tool
def multiply(a: int, b: int) -> int:
    """Multiply two integers and return the result."""
    return a * b


def questions(count: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    items = []
    for number in range(count):
        a, b = rng.randint(11, 99), rng.randint(11, 99)
        op, answer = ("times", a * b) if number % 2 else ("plus", a + b)
        items.append(
            {"id": f"q{number}", "question": f"What is {a} {op} {b}?", "numbers": [a, b], "answer": answer}
        )
    return items


def make_agent(model: jm.TrainableModel, args: argparse.Namespace) -> Agent[Any]:
    client = AsyncOpenAI(base_url=model.inference_base_url, api_key=model.inference_api_key or "-")
    served = OpenAIResponsesModel(model.inference_name, client)  # the plain name follows the newest adapter
    # The first turn of each agent must call a tool (or hand off): the 135M rarely does unasked.
    # The SDK sets tool_choice back to auto once a tool ran, so the Calculator ends with text.
    settings = ModelSettings(tool_choice="required", max_tokens=args.max_tokens, temperature=args.temperature)
    calculator = Agent(
        name="Calculator",
        instructions="You compute with the add and multiply tools, then state the result.",
        tools=[add, multiply],
        model=served,
        model_settings=settings,
    )
    return Agent(
        name="Triage",
        instructions="Hand every arithmetic question to the Calculator.",
        handoffs=[calculator],
        model=served,
        model_settings=settings,
    )


async def rollout(
    model: jm.TrainableModel, scenario: dict[str, Any], args: argparse.Namespace
) -> jm.Trajectory:
    """One run as a trajectory; an error of the run's own (not a turn limit) is recorded by the loop."""
    output = ""
    # Responses calls do not name their endpoint in the SDK's traces: the tracer is told the gateway.
    with AgentsTracer(model.inference_base_url) as tracer:
        try:
            result = await Runner.run(make_agent(model, args), scenario["question"], max_turns=args.max_turns)
            output = str(result.final_output)
        except MaxTurnsExceeded:  # the 135M can keep calling tools: no answer, reward 0
            pass
    trajectory = tracer.trajectory
    trajectory.metadata["scenario_id"] = scenario["id"]
    trajectory.metadata["final_output"] = output
    trajectory.metrics["tracer_errors"] = tracer.errors
    return trajectory


def reward(trajectory: jm.Trajectory, scenario: dict[str, Any]) -> float:
    """1 for the right number in the final answer, 0.1 for a Calculator call with the question's numbers."""
    if str(scenario["answer"]) in str(trajectory.metadata["final_output"]):
        return 1.0
    for message in trajectory.additional_histories[0].messages if trajectory.additional_histories else []:
        for call in getattr(message, "tool_calls", None) or []:
            try:
                arguments = json.loads(call.function.arguments)
            except ValueError:
                continue
            if isinstance(arguments, dict) and sorted(arguments.values()) == sorted(scenario["numbers"]):
                return 0.1
    return 0.0


async def main(args: argparse.Namespace, backend: Any = None) -> dict[str, Any]:
    """Train; returns what a test checks: the model, the loop's result and the report of each step.
    ``backend``: a LocalBackend to share (default: one of its own, closed at the end). Run again,
    it goes on after the last checkpoint."""
    if backend is None:
        async with LocalBackend(root=args.root) as own:
            return await main(args, own)
    model = jm.TrainableModel(name=args.name, project="examples", base_model=args.base_model, root=args.root)
    await model.register(backend)
    steps: list[Any] = []
    result = await jm.TrainingLoop(
        model,
        functools.partial(rollout, args=args),
        questions(args.questions * args.steps, args.seed),
        reward=reward,
        group_size=args.group_size,
        scenarios_per_step=args.questions,
        steps=args.steps,
        config=jm.TrainConfig(learning_rate=args.learning_rate),
        max_exceptions=args.max_failures,
        seed=args.seed,
        on_step_end=steps.append,
    ).run()
    return {"model": model, "result": result, "steps": steps}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--questions", type=int, default=4, help="questions per step")
    parser.add_argument("--group-size", type=int, default=4, help="runs per question")
    parser.add_argument("--max-turns", type=int, default=4, help="model calls per run, handoff included")
    parser.add_argument("--max-tokens", type=int, default=48, help="longest reply per model call")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--max-failures", type=float, default=0.25, help="share of rollouts allowed to fail")
    parser.add_argument("--learning-rate", type=float, default=5e-5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--name", default="agents-calc")
    parser.add_argument("--base-model", default="smollm2-135m")
    parser.add_argument("--root", type=Path, default=Path(".journeyman"))
    return parser.parse_args(argv)


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
