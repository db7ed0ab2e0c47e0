"""A PydanticAI agent with tools and a typed answer, captured with PydanticAITracer and trained.

The agent has the tools ``add`` and ``multiply`` and must answer with an ``int`` (PydanticAI's
output tool), so every turn of the 135M is a tool call. One line, ``with PydanticAITracer() as
tracer:``, turns a run into a token-exact trajectory through journeyman's gateway. The reward: 1
for the right number, 0.1 for an answer of the right type that is wrong, 0 for a run that ended
without one (its request limit, or a tool retried too often).

    python examples/pydantic_ai_calculator/pydantic_ai_calculator.py               # 10 steps
    python examples/pydantic_ai_calculator/pydantic_ai_calculator.py --steps 1 --questions 2 --group-size 2
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import random
from pathlib import Path
from typing import Any

from pydantic_ai import Agent, ModelSettings, UnexpectedModelBehavior, UsageLimitExceeded
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider
from pydantic_ai.usage import UsageLimits

import journeyman as jm
from journeyman.backend import LocalBackend
from journeyman.integrations.pydantic_ai import PydanticAITracer


def add(a: int, b: int) -> int:
    """Add two integers and return the result."""
    return a + b


def multiply(a: int, b: int) -> int:
    """Multiply two integers and return the result."""
    return a * b


def questions(count: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    items = []
    for number in range(count):
        a, b = rng.randint(11, 99), rng.randint(11, 99)
        op, answer = ("times", a * b) if number % 2 else ("plus", a + b)
        items.append({"id": f"q{number}", "question": f"What is {a} {op} {b}?", "answer": answer})
    return items


def make_agent(model: jm.TrainableModel, args: argparse.Namespace) -> Agent[None, int]:
    provider = OpenAIProvider(base_url=model.inference_base_url, api_key=model.inference_api_key or "-")
    return Agent(
        OpenAIChatModel(model.inference_name, provider=provider),  # the plain name follows the newest adapter
        output_type=int,
        instructions="Compute with the add and multiply tools, then give the result.",
        tools=[add, multiply],
        model_settings=ModelSettings(max_tokens=args.max_tokens, temperature=args.temperature),
    )


async def rollout(
    model: jm.TrainableModel, scenario: dict[str, Any], args: argparse.Namespace
) -> jm.Trajectory:
    """One run as a trajectory; an error of the run's own (not a limit) is recorded by the loop."""
    output: int | None = None
    with PydanticAITracer() as tracer:
        try:
            result = await make_agent(model, args).run(
                scenario["question"], usage_limits=UsageLimits(request_limit=args.max_requests)
            )
            output = result.output
        except (UsageLimitExceeded, UnexpectedModelBehavior):  # no answer: reward 0
            pass
    trajectory = tracer.trajectory
    trajectory.metadata["scenario_id"] = scenario["id"]
    trajectory.metadata["final_output"] = output
    trajectory.metrics["answered"] = output is not None
    trajectory.metrics["tracer_errors"] = tracer.errors
    return trajectory


def reward(trajectory: jm.Trajectory, scenario: dict[str, Any]) -> float:
    """1 for the right number, 0.1 for an ``int`` that is wrong, 0 for no answer."""
    output = trajectory.metadata["final_output"]
    return 0.0 if output is None else 1.0 if output == scenario["answer"] else 0.1


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
    parser.add_argument("--max-requests", type=int, default=4, help="model calls per run")
    parser.add_argument("--max-tokens", type=int, default=48, help="longest reply per model call")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--max-failures", type=float, default=0.25, help="share of rollouts allowed to fail")
    parser.add_argument("--learning-rate", type=float, default=5e-5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--name", default="pydantic-calc")
    parser.add_argument("--base-model", default="smollm2-135m")
    parser.add_argument("--root", type=Path, default=Path(".journeyman"))
    return parser.parse_args(argv)


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
