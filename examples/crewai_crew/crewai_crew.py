"""A two-agent CrewAI crew with tools, captured with CrewTracer and trained on RULER scores.

A Calculator agent (tools ``add`` and ``multiply``) works out a question, a Writer agent reports
the result in a sentence. ``CrewTracer`` records each crew run as one trajectory with one history
per agent, token-exact through journeyman's gateway. There is no reward function: the local base
model judges each group of crew runs side by side (RULER), and GRPO trains on its scores.

    python examples/crewai_crew/crewai_crew.py                     # 10 steps, groups of 4
    python examples/crewai_crew/crewai_crew.py --steps 1 --group-size 2 --questions 2 --max-tokens 48
"""

from __future__ import annotations

import os

# CrewAI phones home by default (and waits ~13 s for it at exit when offline).
os.environ.setdefault("CREWAI_DISABLE_TELEMETRY", "true")
os.environ.setdefault("CREWAI_TRACING_ENABLED", "false")

import argparse
import asyncio
import functools
import json
import logging
import random
from pathlib import Path
from typing import Any

import crewai
from crewai.tools import tool

import journeyman as jm
from journeyman.backend import LocalBackend
from journeyman.integrations.crewai import CrewTracer, crew_llm
from journeyman.judge import DEFAULT_RUBRIC

# CrewAI warns on every call to a model it has no tokenizer for ("approximate input token count").
logging.getLogger("crewai.llms.base_llm").setLevel(logging.ERROR)


@tool("add")
def add(a: int, b: int) -> int:
    """Add two integers and return the result."""
    return a + b


@tool("multiply")
def multiply(a: int, b: int) -> int:
    """Multiply two integers and return the result."""
    return a * b


# The 135M model calls a tool only after worked example conversations, and CrewAI writes the
# conversation itself. So its task description carries example exchanges as ChatML turns, each
# user turn worded the way CrewAI words a task (tests/integration/test_crewai_capture.py).
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


WORKED_EXAMPLES = (
    _example("What is 12 times 7?", "multiply", 12, 7, 84)
    + _example("What is 35 plus 48?", "add", 35, 48, 83)
    + _example("What is 9 times 13?", "multiply", 9, 13, 117)
)

RUBRIC = (
    DEFAULT_RUBRIC
    + "\n- The Calculator must use a tool with the numbers of the question; the Writer must state its exact result."
)


def questions(count: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    items = []
    for number in range(count):
        a, b = rng.randint(11, 99), rng.randint(11, 99)
        if number % 2:
            items.append({"id": f"q{number}", "question": f"What is {a} times {b}?", "answer": a * b})
        else:
            items.append({"id": f"q{number}", "question": f"What is {a} plus {b}?", "answer": a + b})
    return items


def make_crew(model: jm.TrainableModel, question: str, args: argparse.Namespace) -> crewai.Crew:
    llm = crew_llm(model, temperature=args.temperature, max_tokens=args.max_tokens)  # the model trained
    calculator = crewai.Agent(
        role="Calculator",
        goal="Compute with tools",
        backstory="Careful.",
        llm=llm,
        tools=[add, multiply],
        max_iter=3,
    )
    writer = crewai.Agent(role="Writer", goal="Report results", backstory="Brief.", llm=llm, max_iter=2)
    shots = WORKED_EXAMPLES if model.base_model == "smollm2-135m" else ""
    tasks = [
        crewai.Task(description=shots + question, expected_output="A number", agent=calculator),
        crewai.Task(
            description="Report the result in one sentence.", expected_output="A sentence", agent=writer
        ),
    ]
    return crewai.Crew(agents=[calculator, writer], tasks=tasks)


def run_crew(model: jm.TrainableModel, scenario: dict[str, Any], args: argparse.Namespace) -> jm.Trajectory:
    """One crew run as a trajectory. A crew that raises raises here: the loop records it."""
    crew = make_crew(model, scenario["question"], args)
    with CrewTracer(crew=crew) as tracer:
        output = crew.kickoff()
    trajectory = tracer.trajectory
    trajectory.metadata["scenario_id"] = scenario["id"]
    trajectory.metadata["final_output"] = str(output)
    trajectory.metrics["tracer_errors"] = tracer.errors
    return trajectory


async def rollout(
    model: jm.TrainableModel, scenario: dict[str, Any], args: argparse.Namespace
) -> jm.Trajectory:
    return await asyncio.to_thread(run_crew, model, scenario, args)  # CrewAI's kickoff blocks


def right_number(trajectory: jm.Trajectory, scenario: dict[str, Any]) -> float:
    """Not the reward (RULER's score is): kept as ``programmatic_reward`` to compare with the judge,
    and mixed in with ``--reward-weight``."""
    return float(str(scenario["answer"]) in str(trajectory.metadata["final_output"]))


async def main(args: argparse.Namespace, backend: Any = None) -> dict[str, Any]:
    """Train; returns what a test checks: the model, the loop's result and the report of each step.
    ``backend``: a LocalBackend to share (default: one of its own, closed at the end). Run again,
    it goes on after the last checkpoint."""
    if backend is None:
        async with LocalBackend(root=args.root) as own:
            return await main(args, own)
    model = jm.TrainableModel(name=args.name, project="examples", base_model=args.base_model, root=args.root)
    await model.register(backend)
    # The base model, answered by the policy's own server, unless --judge-model names another.
    judge = await backend.judge(
        model, args.judge_model, explanation_max_chars=100, timeout=300, cache_dir=args.root / "judge_cache"
    )
    steps: list[Any] = []
    async with judge:
        result = await jm.TrainingLoop(
            model,
            functools.partial(rollout, args=args),
            questions(args.questions * args.steps, args.seed),
            reward=right_number,
            judge=jm.JudgeReward(  # RULER: the group in one prompt, its scores the reward
                judge,
                rubric=RUBRIC,
                method=args.judge_method,
                reward_from=args.judge_reward,
                reward_weight=args.reward_weight,
            ),
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
    parser.add_argument("--questions", type=int, default=2, help="questions per step")
    parser.add_argument("--group-size", type=int, default=4, help="crew runs per question")
    parser.add_argument("--max-tokens", type=int, default=64, help="longest reply per model call")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument(
        "--reward-weight",
        type=float,
        default=0.0,
        help="weight of the right-number check beside RULER's score",
    )
    parser.add_argument("--max-failures", type=float, default=0.25, help="share of rollouts allowed to fail")
    parser.add_argument("--learning-rate", type=float, default=5e-5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--name", default="crew")
    parser.add_argument("--base-model", default="smollm2-135m")
    parser.add_argument(
        "--judge-model", help="the judge: a local model on a vLLM server of its own (default: the base model)"
    )
    parser.add_argument("--judge-method", choices=["auto", "scores", "verdict", "pairwise"], default="scores")
    parser.add_argument(
        "--judge-reward",
        choices=["score", "rank", "best"],
        default="score",
        help="what the judge's scores become",
    )
    parser.add_argument("--root", type=Path, default=Path(".journeyman"))
    return parser.parse_args(argv)


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
