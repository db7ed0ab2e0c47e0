"""Teach a LangGraph ReAct agent to use its calculator tools, on CPU, with the embedded 135M model.

    python examples/langgraph_calculator/train.py              # 16 steps of 8 questions x 8 attempts
    python examples/langgraph_calculator/train.py --steps 1 --scenarios-per-step 2 --group-size 2 --val 2

Copy it and swap in your own agent, scenarios and reward (here the demo's task, imported from
journeyman.backend.app.calculator): the journeyman part is the tracer line in `rollout` and the
loop in `main`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from typing import Any

import httpx
from langchain_core.messages import HumanMessage
from langchain_openai import ChatOpenAI
from langgraph.errors import GraphRecursionError

import journeyman as jm
from journeyman.backend import LocalBackend
from journeyman.backend.app.calculator import DEMO_RUBRICS, Scenario, build_agent, make_scenarios, score
from journeyman.integrations.langgraph import TrajectoryTracer

# 1. The agent you already have, its scenarios and its check: the demo's calculator task
#    (journeyman/backend/app/calculator.py): a ReAct graph with add, multiply and a distraction
#    tool, four worked examples in its prompt, arithmetic questions, reward 1 for the right number.


def reward(trajectory: jm.Trajectory, scenario: Scenario) -> float:
    return score(trajectory, scenario).reward or 0.0  # also sets the metrics: success, tool calls...


# 2. The one journeyman line: the tracer captures every model call token-exact. ----------------


async def rollout(agent, scenario: Scenario) -> jm.Trajectory:  # type: ignore[no-untyped-def]
    tracer = TrajectoryTracer()
    config = {"callbacks": [tracer], "recursion_limit": 6}
    with contextlib.suppress(GraphRecursionError):  # it kept calling tools: scored as a wrong answer
        await agent.ainvoke({"messages": [HumanMessage(scenario.question)]}, config=config)
    return tracer.trajectory


# 3. The training loop: held-out success before and after, GRPO steps, resume on a second run. -


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
    if args.judge_model:  # an LLM judge on a vLLM server of its own, its score beside the check's reward
        rubric = DEMO_RUBRICS["verdict"]  # each attempt alone, scored by the judge's P(yes)
        served = await backend.start_judge(args.judge_model, temperature=0.0)  # the same scores each time
        judge = jm.JudgeReward(served, rubric=rubric, method="verdict", reward_from="best", reward_weight=1.0)
    steps: list[Any] = []
    async with httpx.AsyncClient(timeout=600) as http:
        llm = ChatOpenAI(
            model=model.inference_name,  # the plain name follows the newest adapter
            base_url=model.inference_base_url,
            api_key="local",
            temperature=0.7,
            max_tokens=args.max_tokens,
            disable_streaming=True,  # one response per call: nothing to stream in a batch run
            http_async_client=http,
        )

        async def sampled(model: jm.TrainableModel, scenario: Scenario) -> jm.Trajectory:
            info = jm.rollout_info()  # each rollout samples with a seed of its own: a rerun draws the same
            seeded = llm.model_copy(update={"seed": info.seed}) if info is not None else llm
            return await rollout(build_agent(seeded), scenario)

        result = await jm.TrainingLoop(
            model,
            sampled,
            make_scenarios(args.train, seed=0),
            reward=reward,
            judge=judge,
            group_size=args.group_size,
            scenarios_per_step=args.scenarios_per_step,
            steps=args.steps,
            seed=args.seed,
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
