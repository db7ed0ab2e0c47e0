"""Teach a LangGraph ReAct agent to use its calculator tools, on CPU, with the embedded 135M model.

    python examples/langgraph_calculator/train.py              # ~30 min on 2 cores
    python examples/langgraph_calculator/train.py --steps 1 --scenarios-per-step 2 --group-size 2 --val 2

Copy it and swap in your own agent, scenarios and reward: the journeyman part is the tracer line
in `rollout` and the loop in `main`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import re
import statistics
import warnings

import httpx
from langchain_core.messages import AIMessage, AnyMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.errors import GraphRecursionError

import journeyman as jm
from journeyman.backend import LocalBackend
from journeyman.integrations.langgraph import TrajectoryTracer

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # moved to langchain.agents.create_agent; same graph
    from langgraph.prebuilt import create_react_agent


# 1. The agent you already have: tools, a prompt, a ReAct graph. ------------------------------


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


def worked(question: str, name: str, a: int, b: int, result: int) -> list[AnyMessage]:
    call = {"name": name, "args": {"a": a, "b": b}, "id": f"call_{a}_{b}", "type": "tool_call"}
    return [
        HumanMessage(question),
        AIMessage("", tool_calls=[call]),
        ToolMessage(str(result), tool_call_id=call["id"]),
        AIMessage(f"The answer is {result}."),
    ]


# A 135M model calls tools only after seeing worked examples.
PROMPT: list[AnyMessage] = [
    SystemMessage("You are a calculator assistant. Always call a tool to compute, then state the answer."),
    *worked("What is 12 times 7?", "multiply", 12, 7, 84),
    *worked("Sam has 235 marbles and finds 148 more. How many marbles does Sam have?", "add", 235, 148, 383),
    *worked("What is 35 plus 48?", "add", 35, 48, 83),
    *worked("A crate holds 24 bottles. How many bottles are in 16 crates?", "multiply", 24, 16, 384),
]


def make_agent(llm: ChatOpenAI):  # type: ignore[no-untyped-def]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return create_react_agent(
            llm, [add, multiply, get_weather], prompt=lambda s: [*PROMPT, *s["messages"]]
        )


# 2. Scenarios and a reward. ---------------------------------------------------------------------


def questions(n: int, seed: int) -> list[tuple[str, int]]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        if i % 2 == 0:
            a, b = rng.randint(101, 999), rng.randint(101, 999)
            text = rng.choice(
                [
                    f"What is {a} plus {b}?",
                    f"A library had {a} books and received {b} new ones. How many books does it have?",
                ]
            )
            out.append((text, a + b))
        else:
            a, b = rng.randint(12, 99), rng.randint(12, 99)
            text = rng.choice(
                [f"What is {a} times {b}?", f"A box holds {a} pencils. How many pencils are in {b} boxes?"]
            )
            out.append((text, a * b))
    return out


async def rollout(agent, question: str, answer: int) -> jm.Trajectory:  # type: ignore[no-untyped-def]
    tracer = TrajectoryTracer()  # the one line: every model call captured token-exact
    config = {"callbacks": [tracer], "recursion_limit": 6}
    with contextlib.suppress(GraphRecursionError):  # it kept calling tools: scored as a wrong answer
        await agent.ainvoke({"messages": [HumanMessage(question)]}, config=config)
    trajectory = tracer.trajectory
    last = trajectory.messages[-1]
    final = str(last.content or "") if last.role == "assistant" else ""
    numbers = [int(n.replace(",", "")) for n in re.findall(r"\d[\d,]*", final)]
    trajectory.reward = 1.0 if answer in numbers else 0.0
    return trajectory


# 3. The training loop. -------------------------------------------------------------------------


async def main(args: argparse.Namespace) -> None:
    model = jm.TrainableModel(name=args.name, project="examples", base_model="smollm2-135m", root=args.root)
    async with LocalBackend(root=args.root) as backend, httpx.AsyncClient(timeout=600) as http:
        await model.register(backend)
        llm = ChatOpenAI(
            model=model.inference_name,  # the plain name follows the newest adapter
            base_url=model.inference_base_url,
            api_key="local",
            temperature=0.7,
            max_tokens=args.max_tokens,
            disable_streaming=True,  # one response per call: nothing to stream in a batch run
            http_async_client=http,
        )
        agent = make_agent(llm)
        train, val = questions(args.train, seed=0), questions(args.val, seed=1)

        async def evaluate() -> float:
            groups = await jm.gather_trajectory_groups(
                (jm.TrajectoryGroup(rollout(agent, q, a) for _ in range(args.val_samples)) for q, a in val),
                description="eval",
            )
            await model.log(groups, split="val")
            return statistics.fmean(t.reward or 0.0 for g in groups for t in g)

        before = await evaluate()
        for batch in jm.iterate_dataset(
            train, per_step=args.scenarios_per_step, initial_step=await model.get_step()
        ):
            if batch.step >= args.steps:
                break
            groups = await jm.gather_trajectory_groups(
                (
                    jm.TrajectoryGroup(rollout(agent, q, a) for _ in range(args.group_size))
                    for q, a in batch.items
                ),
                max_exceptions=0.1,
                description=f"step {batch.step + 1}",
            )
            result = await model.train(groups, jm.TrainConfig(learning_rate=args.learning_rate, loss="dapo"))
            print(f"step {result.step}: reward {result.metrics.get('reward/mean', 0):.2f}")
        after = await evaluate()
    print(
        f"held-out success: {before:.0%} -> {after:.0%}; trajectories and checkpoints in {model.store.path}"
    )


if __name__ == "__main__":
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
    parser.add_argument("--name", default="calc-agent")
    parser.add_argument("--root", default=None, help="store root (default: ./.journeyman)")
    asyncio.run(main(parser.parse_args()))
