"""``journeyman demo``: teach the embedded SmolLM2-135M a LangGraph calculator task on CPU.

A LangGraph ReAct agent answers arithmetic questions and word problems with three tools (add,
multiply and a distraction), served by vLLM through the capture gateway and captured by the
one-line :class:`~journeyman.integrations.langgraph.TrajectoryTracer`. The demo evaluates on a
held-out set, runs GRPO steps (groups of rollouts per question, reward 1 for the right final
number), redeploys the adapter after each step, evaluates again and prints the two side by side.

What the base model does (bench/results.md): with no worked examples in the prompt it never
calls a tool, so the prompt carries four; at temperature 0.7 about a third of samples then call
the right tool and state its result, which gives GRPO groups with both successes and failures.
Qwen2.5-Coder-0.5B calls the right tool zero-shot but then calls again on the tool's result
instead of answering, in every sampled run: zero-shot groups alone have no success to learn
from. So by default half of each step's groups carry the worked examples (``worked_share``),
where it answers a quarter of the time, and what it learns there can carry over to the zero-shot
prompt: in one 30-minute run it did within 4 steps, in another it did not (bench/results.md).
Mixing both prompts inside a group teaches the wrong thing instead: the zero-shot rollouts, failing
beside the successes with examples, are pushed away from calling a tool at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import random
import re
import statistics
import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Literal, get_args

import journeyman as jm
from journeyman.errors import ConfigError, JourneymanError, MissingDependencyError
from journeyman.ruler import RewardFrom

try:
    import httpx
    from langchain_core.messages import AIMessage, AnyMessage, HumanMessage, SystemMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langgraph.errors import GraphRecursionError

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from langgraph.prebuilt import create_react_agent
except ImportError as error:  # pragma: no cover - the extra is missing
    raise MissingDependencyError(error.name or "langgraph", "langgraph", "the demo") from error

from journeyman.integrations.langgraph import TrajectoryTracer

__all__ = ["DemoConfig", "Scenario", "make_scenarios", "rollout", "run_demo", "score"]

Op = Literal["add", "multiply"]


# The task -------------------------------------------------------------------------------------


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

DEFAULT_JUDGE_MODEL = "qwen2.5-coder-1.5b"
"""The demo's local judge: with verdicts, it ranked 87% of the demo's pairs right, the smaller
models at most 72%, and 30 minutes trained on its verdicts (each group's best attempts rewarded)
took held-out success from 37% to 95% (bench/results.md)."""

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
(the 1.5B judge gave "23 * 22 = 56" written without a tool 0.94, and taught the policy to skip tools)."""

DEMO_VERDICT_RUBRIC = """\
- The task is one arithmetic question, and the agent must compute with its tools. It achieved the goal only if it \
called the question's operation (add for a sum, multiply for a product) with the question's own numbers, and its \
final message states the number that call returned.
- An attempt that got no tool result, ends without a final answer, uses other numbers or the wrong operation, or \
states another number did not achieve it, however it reads."""
"""The same for verdicts, which end with the attempt's outcome (the request, each tool call with its
result, the final message): the rubric names the operation, since with "add or multiply" the 1.5B passed products
answering sums (P(yes) 0.94)."""

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


def build_agent(llm: ChatOpenAI, *, worked_examples: bool = True) -> Any:
    """The ReAct agent: the system prompt, the worked examples, then the conversation so far."""
    shots = WORKED_EXAMPLES if worked_examples else []

    def prompt(state: dict[str, Any]) -> list[AnyMessage]:
        return [SystemMessage(SYSTEM), *shots, *state["messages"]]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # create_react_agent moved to langchain.agents (same graph)
        return create_react_agent(llm, TOOLS, prompt=prompt)


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


# The run --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DemoConfig:
    steps: int = 100
    """Training steps."""
    max_train_minutes: float | None = 30.0
    """Stop training once this much time went into it (then evaluate as usual)."""
    scenarios_per_step: int = 4
    group_size: int = 8
    train_scenarios: int = 256
    val_scenarios: int = 40
    val_samples: int = 4
    """Samples per held-out question at the training temperature (greedy is one more)."""
    temperature: float = 0.7
    max_tokens: int = 48
    learning_rate: float = 5e-4
    loss: Literal["grpo", "dr_grpo", "dapo", "gspo", "cispo"] = "dapo"
    rank: int = 8
    gradient_checkpointing: bool | None = None
    """Recompute activations in the backward pass. None: on for models other than SmolLM2 and
    whenever a judge has a server of its own: the 0.5B's fp32 activations for a 4096-token
    micro-batch take ~10 GB, which next to its vLLM server ran a 24 GiB machine out of memory,
    and SmolLM2's training step (8.7 GB) beside the 1.5B judge's fp32 server (11.7 GB) and the
    policy's (4.8 GB) did the same (bench/results.md)."""
    shaping: float = 0.0
    judge: Literal["none", "ruler"] = "none"
    """``ruler``: an LLM judge ranks each training group, and its score is the reward."""
    judge_model: str | None = None
    """The judge: with ``judge_base_url``, the model name that endpoint serves; else a local model
    (an embedded alias, a folder or a hub name) on a vLLM server of its own beside the policy's, or
    the policy's own base model, which the policy's server answers as well. None:
    :data:`DEFAULT_JUDGE_MODEL`, which calibration on the demo's groups favours (bench/results.md)."""
    judge_base_url: str | None = None
    """An OpenAI-compatible endpoint for the judge (key: $JOURNEYMAN_JUDGE_API_KEY or $OPENAI_API_KEY)."""
    judge_method: Literal["scores", "verdict", "pairwise"] = "verdict"
    """``scores``: RULER, the whole group in one prompt; ``verdict``: each trajectory alone, scored
    by the judge's P(yes); ``pairwise``: every pair in both orders (``journeyman.ruler``)."""
    judge_reference: bool = False
    """Before judging a group, the judge writes how its question should be done (which tool, which
    numbers), and checks each attempt against that (``ruler_score_group(reference=True)``)."""
    judge_reward: RewardFrom = "best"
    """What the reward is made of: the judge's score, each attempt's rank in its group by score,
    or 1 for the group's best attempts and 0 for the rest (``ruler_score_group(reward_from=...)``).
    ``best``: with the 1.5B's verdicts, 30 minutes took held-out success from 37% to 95%, where its
    scores collapsed the policy to calling ``multiply`` for every question (38% to 50%) and so did
    its ranks within 11 steps: the judge puts the right operation above the wrong one, but only by
    P(yes) 0.96 to 0.95 (bench/results.md)."""
    judge_anyway: bool = False
    """Train with the judge even when, calibrated on the first step's groups against the
    programmatic check, it ranks no better than chance (the demo stops otherwise)."""
    reward_weight: float = 0.0
    """With a judge: reward = judge score + reward_weight x the programmatic reward (1 right, 0 wrong)."""
    scale_rewards: Literal["group", "batch", "none"] | None = None
    """Divide advantages by the group's reward std, the batch's, or nothing (None: the trainer's
    default, ``group``). Measured on the demo's groups with the 1.5B judge's verdicts, group
    scaling gave advantages closer to the programmatic check's (cosine 0.62) than batch scaling
    (0.40): the judge ranks within a group well, but its P(yes) is high for most attempts, so the
    size of a group's spread says little (calibration's advantage alignment; bench/results.md)."""
    langfuse: bool = False
    """Export every trajectory (rollouts, evaluations) with its scores to Langfuse ($LANGFUSE_* keys)."""
    seed: int = 0
    merge_adapters: bool | None = None
    """Serve each step merged into vLLM's weights rather than as a LoRA adapter (faster on CPU).
    None: only for SmolLM2. A server without LoRA compiles its graphs at every start on CPU
    (vLLM 0.32's compile cache fails to load there): about 6 minutes for the 0.5B on 2 cores, so
    other models are served as LoRA adapters (eager) unless this says otherwise."""
    project: str = "demo"
    name: str | None = None
    """Model name (default: calc-<date>-<time>, a fresh run each time)."""
    root: Path | None = None
    base_model: str = "smollm2-135m"
    """An embedded alias (``journeyman model list``), a Hugging Face folder or a hub name."""
    worked_share: float | None = None
    """Share of each step's training groups with the four worked examples in the prompt; the others
    see the system prompt and tools only (zero-shot). None: 1 for SmolLM2, which calls no tool
    without them; 0.5 for other models: Qwen2.5 calls tools zero-shot but never answers after the
    result there, and can learn that from the groups with examples (the module's docstring)."""
    zero_shot_eval: bool = True
    """Also evaluate with no worked examples in the prompt, sampled and greedily (the prompt that
    is not trained on, when training uses worked examples)."""
    progress: bool = True

    def __post_init__(self) -> None:
        checks = [
            (self.steps >= 0, "steps must be >= 0"),
            (self.max_train_minutes is None or self.max_train_minutes > 0, "max_train_minutes must be > 0"),
            (self.group_size >= 2, "group_size must be >= 2 (GRPO compares the rollouts of a group)"),
            (min(self.scenarios_per_step, self.val_scenarios, self.val_samples, self.max_tokens, self.rank) >= 1,
             "scenarios_per_step, val_scenarios, val_samples, max_tokens and rank must be >= 1"),
            (self.train_scenarios >= self.scenarios_per_step, "train_scenarios must be >= scenarios_per_step"),
            (self.temperature >= 0 and self.learning_rate > 0, "temperature must be >= 0 and learning_rate > 0"),
            (self.loss in ("grpo", "dr_grpo", "dapo", "gspo", "cispo"), f"unknown loss {self.loss!r}: grpo, dr_grpo, dapo, gspo or cispo"),
            (self.judge in ("none", "ruler"), f"unknown judge {self.judge!r}: none or ruler"),
            (self.reward_weight >= 0, "reward_weight must be >= 0"),
            (self.scale_rewards in (None, "group", "batch", "none"), f"unknown scale_rewards {self.scale_rewards!r}: group, batch or none"),
            (self.worked_share is None or 0 <= self.worked_share <= 1, "worked_share must be between 0 and 1"),
            (self.judge == "ruler" or (self.judge_model is None and self.judge_base_url is None),
             "judge_model and judge_base_url need judge='ruler' (--judge ruler)"),
            (self.judge_reward in get_args(RewardFrom), f"unknown judge_reward {self.judge_reward!r}: score, rank or best"),
            (self.judge_method in DEMO_RUBRICS, f"unknown judge_method {self.judge_method!r}: scores, verdict or pairwise"),
            (self.judge_base_url is None or self.judge_model is not None,
             "judge_base_url needs judge_model (--judge-model): the model name that endpoint serves"),
        ]  # fmt: skip
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)


@dataclass
class Evaluation:
    """Held-out results of one model version."""

    step: int
    sampled: dict[str, float] = field(default_factory=dict)
    greedy: dict[str, float] = field(default_factory=dict)
    zero_shot: dict[str, float] = field(default_factory=dict)
    """Greedy, with no worked examples."""
    zero_shot_sampled: dict[str, float] = field(default_factory=dict)
    """At the training temperature, with no worked examples."""


_EVALUATION_FIELDS = {
    "val": "sampled",
    "val_greedy": "greedy",
    "val_zero_shot_sampled": "zero_shot_sampled",
    "val_zero_shot": "zero_shot",
}


def _share(value: float | None) -> str:
    """A rate for the progress line; "-" when the step had no such question."""
    return "   -" if value is None else f"{value:.2f}"


def summarize(groups: Sequence[jm.TrajectoryGroup]) -> dict[str, float]:
    """Success, tool-call validity (and failures) over the groups, word problems separately."""
    trajectories = [t for g in groups for t in g]
    row = {"failures": float(sum(len(g.failures) for g in groups)), "n": float(len(trajectories))}
    if not trajectories:
        return row
    for key in ("success", "tool_call", "valid_tool_call", "right_tool_call"):
        row[key] = statistics.fmean(t.metrics.get(key, 0.0) for t in trajectories)
    judged = [t.metrics["ruler_score"] for t in trajectories if "ruler_score" in t.metrics]
    if judged:
        row["ruler_score"] = statistics.fmean(judged)
    for kind in ("word", "arithmetic"):
        chosen = [t.metrics.get("success", 0.0) for t in trajectories if t.metadata.get("kind") == kind]
        if chosen:
            row[f"success_{kind}"] = statistics.fmean(chosen)
    zero_shot = [
        t.metrics.get("success", 0.0) for t in trajectories if t.metadata.get("worked_examples") is False
    ]
    if zero_shot and len(zero_shot) < len(trajectories):  # a mixed step: the zero-shot prompt's own rate
        row["success_zero_shot"] = statistics.fmean(zero_shot)
    return row


class Demo:
    """The demo's state: backend, model, agents. ``await Demo(config).run()``."""

    def __init__(self, config: DemoConfig) -> None:
        self.config = config
        self.name = config.name or datetime.now().strftime("calc-%Y%m%d-%H%M%S")
        self.train_set = make_scenarios(config.train_scenarios, seed=config.seed)
        self.val_set = make_scenarios(config.val_scenarios, seed=config.seed + 10_000)
        self.http: httpx.AsyncClient | None = None
        self.records: Any = None
        self.console: Any = None
        share = config.worked_share
        if share is None:  # SmolLM2 calls no tool without the worked examples
            share = 1.0 if config.base_model == "smollm2-135m" else 0.5
        self.worked_share = share

    def _llm(self, model: jm.TrainableModel, temperature: float) -> ChatOpenAI:
        assert self.http is not None
        return ChatOpenAI(
            model=model.inference_name,
            base_url=model.inference_base_url,
            api_key=model.inference_api_key or "-",
            temperature=temperature,
            max_tokens=self.config.max_tokens,
            disable_streaming=True,  # one response per call: nothing to stream in a batch run
            max_retries=1,
            timeout=600,
            http_async_client=self.http,
        )

    @property
    def judge_model(self) -> str:
        c = self.config
        return c.judge_model or DEFAULT_JUDGE_MODEL

    @property
    def gradient_checkpointing(self) -> bool:
        """``DemoConfig.gradient_checkpointing``, or on unless the model is SmolLM2 with no judge server."""
        c = self.config
        if c.gradient_checkpointing is not None:
            return c.gradient_checkpointing
        own_judge_server = c.judge == "ruler" and c.judge_base_url is None and not self.judge_is_policy_base
        return c.base_model != "smollm2-135m" or own_judge_server

    @property
    def judge_is_policy_base(self) -> bool:
        """The local judge is the policy's base model, answered by the policy's own server."""
        c = self.config
        return c.judge_base_url is None and self.judge_model == c.base_model

    async def _judge(self, model: jm.TrainableModel, backend: Any) -> jm.Judge:
        c = self.config
        if c.judge_base_url is not None:
            key = os.environ.get("JOURNEYMAN_JUDGE_API_KEY") or os.environ.get("OPENAI_API_KEY")
            return jm.Judge(c.judge_model, base_url=c.judge_base_url, api_key=key)
        if self.judge_is_policy_base:  # the base weights on the demo's own server, through the gateway
            return await backend.judge(model)
        with self.console.status(f"starting the judge's vLLM server with {self.judge_model} ..."):
            return await backend.judge(model, self.judge_model, timeout=900, temperature=0.0)

    async def _calibrate(
        self, model: jm.TrainableModel, judge: jm.Judge, groups: list[jm.TrajectoryGroup]
    ) -> None:
        """Rank the first step's groups with the judge against the programmatic check; stop when
        it ranks no better than chance (unless ``judge_anyway``)."""
        c = self.config
        with self.console.status(
            f"calibrating the judge {judge.name} on the first step's {len(groups)} groups ..."
        ):
            report = await jm.calibrate_judge(
                groups, judge, method=c.judge_method, rubric=self.rubric, reference=c.judge_reference
            )
        path = report.save(model.store.path / "judge_calibration.json")
        self.console.print(f"judge calibration (truth: the programmatic check; {path}):\n{report.table()}")
        if report.pairs == 0:
            self.console.print(
                "no group of the first step has both successes and failures: nothing to calibrate on"
            )
        elif not report.better_than_chance() and not c.judge_anyway:
            raise JourneymanError(
                f"the judge {judge.name} ranks the first step's attempts no better than chance "
                f"(pairwise accuracy {report.pairwise_accuracy:.0%} on {report.pairs} pairs, sign test "
                f"p = {report.p_value:.2g}), so training on its scores would not teach: use a bigger judge "
                "(--judge-model qwen2.5-coder-1.5b, or --judge-base-url for a hosted one), --judge-method verdict, "
                "or --judge-anyway to train with it regardless"
            )

    @property
    def rubric(self) -> str:
        return DEMO_RUBRICS[self.config.judge_method]

    async def _groups(
        self,
        agents: Sequence[Any],
        scenarios: Sequence[Scenario],
        n: int,
        description: str,
        *,
        after_each: Any = None,
    ) -> list[jm.TrajectoryGroup]:
        """A group of ``n`` rollouts for each scenario, by the agent in the same place."""
        return await jm.gather_trajectory_groups(
            (
                jm.TrajectoryGroup(
                    rollout(agent, s, shaping=self.config.shaping, records=self.records) for _ in range(n)
                )
                for agent, s in zip(agents, scenarios, strict=True)
            ),
            max_exceptions=0.1,
            after_each=after_each,
            description=description,
            progress=self.config.progress,
        )  # exported to Langfuse (with split and step) by model.log and model.train

    async def evaluate(self, model: jm.TrainableModel, label: str) -> Evaluation:
        """Held-out success at the training temperature and greedily, with worked examples in the
        prompt, and (``zero_shot_eval``) without them."""
        c = self.config
        step = await model.get_step()
        result = Evaluation(step)
        prompts = [True, False] if c.zero_shot_eval or 0 < self.worked_share < 1 else [self.worked_share == 1]
        for shots in prompts:
            tag = "" if shots else " (no examples)"
            sampled = await self._groups(
                [build_agent(self._llm(model, c.temperature), worked_examples=shots)] * len(self.val_set),
                self.val_set,
                c.val_samples,
                f"eval {label}{tag} (T={c.temperature})",
            )
            greedy = await self._groups(
                [build_agent(self._llm(model, 0.0), worked_examples=shots)] * len(self.val_set),
                self.val_set,
                1,
                f"eval {label}{tag} (greedy)",
            )
            splits = ("val", "val_greedy") if shots else ("val_zero_shot_sampled", "val_zero_shot")
            for groups, split in zip((sampled, greedy), splits, strict=True):
                row = summarize(groups)
                setattr(result, _EVALUATION_FIELDS[split], row)
                await model.log(
                    groups,
                    split=split,
                    metrics={f"{split}/{k}": v for k, v in row.items()},
                    langfuse=c.langfuse,
                )
        return result

    async def run(self) -> dict[str, Any]:
        from rich.console import Console

        from .local import LocalBackend

        c = self.config
        console = self.console = Console()
        started = time.monotonic()
        model = jm.TrainableModel(
            name=self.name,
            project=c.project,
            base_model=c.base_model,
            root=c.root,
            lora=jm.LoRAConfig(rank=c.rank, alpha=2.0 * c.rank),
        )
        train_config = jm.TrainConfig(
            learning_rate=c.learning_rate,
            loss=c.loss,
            seed=c.seed,
            gradient_checkpointing=self.gradient_checkpointing,
            scale_rewards=c.scale_rewards,
        )
        console.print(
            f"[bold]journeyman demo[/bold]: teaching {c.base_model} a LangGraph calculator task "
            f"({_prompt(self.worked_share)}) -> {model.store.path}"
        )
        if c.langfuse:  # fail now, not with a warning per export after vLLM started
            from journeyman.integrations.langfuse import LangfuseExporter

            LangfuseExporter(project=c.project, model=self.name).check()
        merge = c.merge_adapters if c.merge_adapters is not None else c.base_model == "smollm2-135m"
        if c.judge == "ruler" and self.judge_is_policy_base and merge:
            merge = False  # merged weights replace the base model, and the local judge is the base model
            console.print("the judge is the local base model: serving adapters with LoRA, not merged")
        console.print(f"starting vLLM with {c.base_model} (one to three minutes on 2 cores) ...")
        async with (
            LocalBackend(root=c.root, merge_adapters=merge) as backend,
            httpx.AsyncClient(
                timeout=600, limits=httpx.Limits(max_connections=512, max_keepalive_connections=64)
            ) as self.http,
        ):
            await model.register(backend)
            self.records = backend.records
            after_each, judge = None, None
            if c.judge == "ruler":
                judge = await self._judge(model, backend)
                after_each = functools.partial(
                    jm.ruler_score_group, judge=judge, reward_weight=c.reward_weight, rubric=self.rubric,
                    method=c.judge_method, reference=c.judge_reference, reward_from=c.judge_reward,
                )  # fmt: skip
                console.print(f"judge: RULER ({c.judge_method}) with {judge.model} at {judge.base_url}")
            calibrated = judge is None
            console.print(f"vLLM ready after {time.monotonic() - started:.0f} s")
            before = await self.evaluate(model, "before")
            console.print(f"before: {_line(before)}")
            train_started = time.monotonic()
            llm = self._llm(model, c.temperature)
            agents = {shots: build_agent(llm, worked_examples=shots) for shots in (True, False)}
            # In the generated order (add, multiply, add, ...): every step sees both operations. Shuffled
            # steps of four questions were sometimes all products, and the next step called multiply for sums.
            for batch in jm.iterate_dataset(
                self.train_set,
                per_step=c.scenarios_per_step,
                epochs=100,
                initial_step=await model.get_step(),
                seed=None,
            ):
                spent = (time.monotonic() - train_started) / 60
                if batch.step >= c.steps or (
                    c.max_train_minutes is not None and spent >= c.max_train_minutes
                ):
                    break
                t0 = time.monotonic()
                groups = await self._groups(
                    [agents[shots] for shots in worked_plan(len(batch.items), self.worked_share)],
                    batch.items,
                    c.group_size,
                    f"step {batch.step + 1}/{c.steps} rollouts",
                    after_each=after_each if calibrated else None,
                )
                if not calibrated:  # the first step's groups still hold the programmatic rewards
                    assert judge is not None and after_each is not None
                    await self._calibrate(model, judge, groups)
                    groups = [await after_each(group) for group in groups]
                    calibrated = True
                rollout_s = time.monotonic() - t0
                stats = summarize(groups)
                with console.status(f"step {batch.step + 1}/{c.steps}: training on {len(groups)} groups ..."):
                    result = await model.train(groups, train_config, langfuse=c.langfuse)
                model.store.append_history(
                    {
                        "step": batch.step,
                        "split": "rollouts",
                        **{f"rollouts/{k}": v for k, v in stats.items()},
                        "rollouts/seconds": rollout_s,
                        **(
                            {
                                "rollouts/judge_seconds": sum(
                                    float(g.metrics.get("judge/seconds", 0.0)) for g in groups
                                )
                            }
                            if judge is not None
                            else {}
                        ),
                        "elapsed_s": time.monotonic() - train_started,
                    }
                )
                console.print(
                    f"step {result.step:>3}  success {stats.get('success', 0):.2f}  "
                    f"word {_share(stats.get('success_word'))}  valid calls {stats.get('valid_tool_call', 0):.2f}  "
                    + (
                        f"zero-shot {stats['success_zero_shot']:.2f}  "
                        if "success_zero_shot" in stats
                        else ""
                    )
                    + f"rollouts {rollout_s:.0f} s  train {time.monotonic() - t0 - rollout_s:.0f} s  "
                    f"elapsed {(time.monotonic() - train_started) / 60:.1f} min"
                )
            train_minutes = (time.monotonic() - train_started) / 60
            after = await self.evaluate(model, "after")
        png = plot_demo(
            model.store.read_history(), model.store.path / "demo_curve.png", title=f"{c.project}/{self.name}"
        )
        console.print(_table(before, after, c.temperature))
        summary = (
            f"held-out success {before.sampled.get('success', 0):.0%} -> {after.sampled.get('success', 0):.0%} "
            f"(T={c.temperature}), greedy {before.greedy.get('success', 0):.0%} -> {after.greedy.get('success', 0):.0%}, "
            f"word problems {before.sampled.get('success_word', 0):.0%} -> {after.sampled.get('success_word', 0):.0%}, "
            + (
                f"no worked examples {before.zero_shot_sampled.get('success', 0):.0%} -> "
                f"{after.zero_shot_sampled.get('success', 0):.0%} (T={c.temperature}) "
                if c.zero_shot_eval
                else ""
            )
            + f"after {after.step - before.step} steps in {train_minutes:.1f} min of training ({(time.monotonic() - started) / 60:.1f} min in all)"
        )
        console.print(f"[bold green]{summary}[/bold green]")
        console.print(
            f"reward curve: {png}\ntrajectories: {model.store.path} (journeyman trajectories show {c.project} {self.name})"
        )
        report = {
            "config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(c).items()},
            "name": self.name,
            "worked_share": self.worked_share,
            "before": asdict(before),
            "after": asdict(after),
            "train_minutes": train_minutes,
            "total_minutes": (time.monotonic() - started) / 60,
            "png": str(png),
            "summary": summary,
        }
        (model.store.path / "demo_report.json").write_text(json.dumps(report, indent=2))
        return report


def _prompt(worked_share: float) -> str:
    if worked_share in (0, 1):
        return "with worked examples" if worked_share else "zero-shot"
    return f"{worked_share:.0%} of the groups with worked examples, the others zero-shot"


def _line(evaluation: Evaluation) -> str:
    s, g = evaluation.sampled, evaluation.greedy
    return (
        f"success {s.get('success', 0):.0%} (word {s.get('success_word', 0):.0%}), "
        f"valid tool calls {s.get('valid_tool_call', 0):.0%}, greedy {g.get('success', 0):.0%}"
    )


def _table(before: Evaluation, after: Evaluation, temperature: float) -> Any:
    from rich.table import Table

    table = Table(title="held-out evaluation", title_justify="left")
    table.add_column("")
    table.add_column(f"before (step {before.step})", justify="right")
    table.add_column(f"after (step {after.step})", justify="right")
    rows = [
        (f"success, T={temperature}", "sampled", "success"),
        ("  arithmetic", "sampled", "success_arithmetic"),
        ("  word problems", "sampled", "success_word"),
        ("valid tool call", "sampled", "valid_tool_call"),
        ("right tool and numbers", "sampled", "right_tool_call"),
        ("success, greedy", "greedy", "success"),
        ("  word problems, greedy", "greedy", "success_word"),
        (f"success with no worked examples, T={temperature}", "zero_shot_sampled", "success"),
        ("  word problems", "zero_shot_sampled", "success_word"),
        ("calls a tool with no worked examples (greedy)", "zero_shot", "tool_call"),
        ("success with no worked examples (greedy)", "zero_shot", "success"),
        ("rollout failures", "sampled", "failures"),
    ]
    for label, part, key in rows:
        values = [getattr(e, part).get(key) for e in (before, after)]
        if all(v is None for v in values):
            continue
        cells = ["-" if v is None else (f"{v:.0f}" if key == "failures" else f"{v:.0%}") for v in values]
        table.add_row(label, *cells)
    return table


def plot_demo(rows: list[dict[str, Any]], out: Path, title: str = "") -> Path:
    """Rollout success per training step, with the held-out success before and after."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4))
    train = [(r["step"], r["rollouts/success"]) for r in rows if "rollouts/success" in r]
    if train:
        axis.plot(*zip(*train, strict=True), marker="o", label="training rollouts (new questions)")
    zero_shot = [
        (r["step"], r["rollouts/success_zero_shot"]) for r in rows if "rollouts/success_zero_shot" in r
    ]
    if zero_shot:
        axis.plot(*zip(*zero_shot, strict=True), marker=".", label="training rollouts, no worked examples")
    for key, label, marker in [
        ("val/success", "held-out, sampled", "s"),
        ("val_greedy/success", "held-out, greedy", "^"),
        ("val/success_word", "held-out word problems", "v"),
        ("val_zero_shot_sampled/success", "held-out, no worked examples, sampled", "D"),
    ]:
        points = [(r["step"], r[key]) for r in rows if key in r]
        if points:
            axis.plot(*zip(*points, strict=True), marker=marker, linestyle="--", label=label)
    from matplotlib.ticker import MaxNLocator

    axis.xaxis.set_major_locator(MaxNLocator(integer=True))
    axis.set(
        xlabel="model version (training steps done)", ylabel="success rate", ylim=(-0.02, 1.02), title=title
    )
    axis.legend(loc="lower right", fontsize=8)
    figure.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=100)
    plt.close(figure)
    return out


def run_demo(config: DemoConfig) -> dict[str, Any]:
    """Run the demo to the end; returns its report (also written to ``demo_report.json``)."""
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request drowns the progress bars
    return asyncio.run(Demo(config).run())
