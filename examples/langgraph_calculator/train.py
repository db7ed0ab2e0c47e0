"""Teach a LangGraph ReAct agent to use its calculator tools, on CPU, with the embedded 135M model.

    python examples/langgraph_calculator/train.py              # 16 steps of 8 questions x 8 attempts
    python examples/langgraph_calculator/train.py --steps 1 --scenarios-per-step 2 --group-size 2 --val 2

Copy it and swap in your own agent, scenarios and reward. The journeyman part is three lines: the
chat model (`chat_model(model)`), the tracer in `rollout`, and the loop in `main`. The questions
come from the package (the demo's generator); everything you would write yourself is here.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import re
from typing import Any

from langchain.agents import create_agent
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langgraph.errors import GraphRecursionError

import journeyman as jm
from journeyman.backend import LocalBackend
from journeyman.backend.app.calculator import DEMO_RUBRICS, Scenario, make_scenarios
from journeyman.integrations.langgraph import TrajectoryTracer, chat_model

# 1. The agent you already have: a ReAct graph with two calculator tools and a distraction. ------


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


SYSTEM = "You are a calculator assistant. Always call a tool to compute, then state the answer."


def worked(question: str, name: str, a: int, b: int) -> list[Any]:
    """One worked conversation: without a few, a 135M model never calls a tool."""
    call = {"name": name, "args": {"a": a, "b": b}, "id": f"call_{name}_{a}", "type": "tool_call"}
    result = a + b if name == "add" else a * b
    return [HumanMessage(question), AIMessage("", tool_calls=[call]),
            ToolMessage(str(result), tool_call_id=call["id"]), AIMessage(f"The answer is {result}.")]  # fmt: skip


WORKED = [
    *worked("What is 12 times 7?", "multiply", 12, 7),
    *worked("Sam has 235 marbles and finds 148 more. How many marbles does Sam have?", "add", 235, 148),
    *worked("What is 35 plus 48?", "add", 35, 48),
    *worked("A crate holds 24 bottles. How many bottles are in 16 crates?", "multiply", 24, 16),
]


def build_agent(llm: Any) -> Any:
    return create_agent(llm, [add, multiply, get_weather], system_prompt=SYSTEM)


# 2. The reward: 1 when the agent's final message states the right number. ---------------------


def reward(trajectory: jm.Trajectory, scenario: Scenario) -> float:
    final = trajectory.messages[-1]
    stated = str(final.content or "") if final.role == "assistant" and not final.tool_calls else ""
    success = scenario.answer in [int(n.replace(",", "")) for n in re.findall(r"-?\d[\d,]*", stated)]
    asked = max(i for i, m in enumerate(trajectory.messages) if m.role == "user")  # after the worked ones
    calls = [c for m in trajectory.messages[asked:] if m.role == "assistant" for c in m.tool_calls or []]
    trajectory.metrics.update(success=float(success), tool_call=float(bool(calls)))  # held-out val/success
    return float(success)


# 3. One run of the agent, traced: the chat model and the tracer are journeyman's two lines. ------


async def rollout(model: jm.TrainableModel, scenario: Scenario, max_tokens: int = 64) -> jm.Trajectory:
    llm = chat_model(model, temperature=0.7, max_tokens=max_tokens)  # a ChatOpenAI on the model trained
    tracer = TrajectoryTracer()  # records every model call, token for token
    config = {"callbacks": [tracer], "recursion_limit": 6}
    with contextlib.suppress(GraphRecursionError):  # it kept calling tools: scored as a wrong answer
        await build_agent(llm).ainvoke(
            {"messages": [*WORKED, HumanMessage(scenario.question)]}, config=config
        )
    trajectory = tracer.trajectory
    trajectory.metadata["question"] = scenario.question
    return trajectory


# 4. The training loop: held-out success before and after, GRPO steps, resume on a second run. -


async def main(args: argparse.Namespace, backend: Any = None) -> dict[str, Any]:
    """Train; returns what a test checks: the model, the loop's result (its evaluations) and the
    report of each step. ``backend``: a LocalBackend to share (default: one of its own). Run it
    again with the same --name and --root and it goes on where it stopped."""
    if backend is None:
        async with LocalBackend(root=args.root, dtype=args.serving_dtype) as own:
            return await main(args, own)
    model = jm.TrainableModel(name=args.name, project="examples", base_model="smollm2-135m", root=args.root)
    await model.register(backend)
    judge = None
    if args.judge_model:  # an LLM judge on a vLLM server of its own, its verdicts beside the reward
        served = await backend.start_judge(args.judge_model, temperature=0.0)  # the same verdicts each time
        judge = jm.JudgeReward(served, rubric=DEMO_RUBRICS["verdict"], reward_weight=1.0)
    steps: list[Any] = []

    async def sampled(model: jm.TrainableModel, scenario: Scenario) -> jm.Trajectory:
        return await rollout(model, scenario, args.max_tokens)

    result = await jm.TrainingLoop(
        model,
        sampled,
        make_scenarios(args.train, seed=0),
        reward=reward,
        judge=judge,
        group_size=args.group_size,
        scenarios_per_step=args.scenarios_per_step,
        steps=args.steps,
        seed=args.seed,  # the data order, and each rollout's sampling seed (chat_model passes it on)
        config=jm.TrainConfig(learning_rate=args.learning_rate, loss="dapo"),
        evals=[jm.EvalSet("val", make_scenarios(args.val, seed=1), samples=args.val_samples)],
        on_step_end=steps.append,
    ).run()
    before, after = (rows["val"].get("val/success", 0.0) for rows in (result.before, result.after))
    print(
        f"held-out success: {before:.0%} -> {after:.0%}; trajectories and checkpoints in {model.store.path}"
    )
    return {"model": model, "result": result, "steps": steps}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--scenarios-per-step", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--train", type=int, default=256, help="training questions")
    parser.add_argument("--val", type=int, default=32, help="held-out questions")
    parser.add_argument("--val-samples", type=int, default=4)
    parser.add_argument("--learning-rate", type=float, default=2e-4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0, help="data order and each rollout's sampling seed")
    parser.add_argument("--judge-model", default=None, help="also score with this LLM judge (its own vLLM)")
    parser.add_argument(
        "--serving-dtype", default=None, help="vLLM's --dtype (float32: batch-invariant on CPU)"
    )
    parser.add_argument("--name", default="calc-agent")
    parser.add_argument("--root", default=None, help="store root (default: ./.journeyman)")
    return parser.parse_args(argv)


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
