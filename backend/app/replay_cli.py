"""``journeyman replay``: train a model on the inputs of production runs, optionally gated."""

from __future__ import annotations

import asyncio
import importlib
import inspect
import random
import sys
from collections.abc import Awaitable, Callable
from datetime import datetime
from pathlib import Path
from typing import Annotated, cast

import typer

import journeyman as jm
from journeyman.errors import ConfigError
from journeyman.gate import Gate, promote_if_better
from journeyman.judge import Method
from journeyman.loop import StepReport
from journeyman.replay import (
    Scenario,
    label_trajectory,
    read_scenarios,
    scenario_labels,
    scenarios_from_trajectories,
    split_held_out,
    write_scenarios,
)
from journeyman.replay import replay as replay_scenarios
from journeyman.store import ModelStore

from .cli_runs import Root

Agent = Callable[[Scenario, jm.TrainableModel], Awaitable[jm.Trajectory]]


def replay(
    project: str,
    model: str,
    agent: Annotated[
        str,
        typer.Option(
            help="module:function, an async (scenario: journeyman.replay.Scenario, model: jm.TrainableModel) -> jm.Trajectory "
            "that runs your agent against model (model.openai_client(), model.inference_name) and may set "
            "the reward. The current folder is importable."
        ),
    ],
    scenarios: Annotated[Path | None, typer.Option(help="JSONL of scenarios (read_scenarios).")] = None,
    langfuse_tag: Annotated[
        list[str] | None,
        typer.Option(help="Read scenarios from Langfuse traces with these tags (repeatable)."),
    ] = None,
    langfuse_from: Annotated[
        datetime | None, typer.Option(help="Traces started at or after this time.")
    ] = None,
    langfuse_to: Annotated[datetime | None, typer.Option(help="Traces started before this time.")] = None,
    langfuse_score: Annotated[
        str, typer.Option(help="The trace score kept as the production score.")
    ] = "reward",
    min_score: Annotated[
        float | None, typer.Option(help="Only scenarios whose production score is at least this.")
    ] = None,
    sample: Annotated[
        int | None, typer.Option(help="At most this many scenarios, drawn with --seed.")
    ] = None,
    base_model: Annotated[
        str, typer.Option(help="The base model (an embedded alias or a folder).")
    ] = "smollm2-135m",
    n: Annotated[int, typer.Option(help="Attempts per scenario (the group size).")] = 8,
    per_step: Annotated[int, typer.Option(help="Scenarios per training step.")] = 4,
    steps: Annotated[int, typer.Option(help="Training steps.")] = 1,
    held_out: Annotated[float, typer.Option(help="Share of scenarios kept apart for the gate.")] = 0.1,
    gate: Annotated[
        bool,
        typer.Option(
            help="Train with promote=False and promote a step only if it does no worse on the held-out "
            "scenarios than the promoted one (needs rewards from --agent)."
        ),
    ] = False,
    min_delta: Annotated[float, typer.Option(help="The gate's margin: candidate - promoted >= this.")] = 0.0,
    judge_model: Annotated[
        str | None,
        typer.Option(
            help="Score each group with this local judge model (RULER) instead of --agent's rewards."
        ),
    ] = None,
    judge_method: Annotated[str, typer.Option(help="scores, verdict or pairwise.")] = "verdict",
    learning_rate: Annotated[float, typer.Option(help="Adam learning rate.")] = 5e-5,
    seed: Annotated[int, typer.Option(help="Seeds the sample and the held-out split.")] = 0,
    root: Root = None,
) -> None:
    """Replay production inputs against the trainable model, n attempts each, and train on them."""
    found = _scenarios(scenarios, langfuse_tag, langfuse_from, langfuse_to, langfuse_score)
    if min_score is not None:
        found = [s for s in found if s.score is not None and s.score >= min_score]
    if sample is not None and len(found) > sample:
        found = random.Random(seed).sample(found, sample)
    train, held = split_held_out(found, held_out, seed=seed)
    if not train:
        raise ConfigError(f"no scenarios left to train on ({len(found)} found, {len(held)} held out)")
    if gate and not held:
        raise ConfigError("--gate needs held-out scenarios: raise --held-out or give more scenarios")
    typer.echo(f"{len(found)} scenarios: {len(train)} to train on, {len(held)} held out")
    attempt = _import_agent(agent)
    store = ModelStore(project, model, root=root)
    store.path.mkdir(parents=True, exist_ok=True)
    write_scenarios(store.path / "replay-train.jsonl", train)
    write_scenarios(store.path / "replay-held-out.jsonl", held)
    asyncio.run(
        _run(
            store, base_model, attempt, train, held, n=n, per_step=per_step, steps=steps, gate=gate,
            min_delta=min_delta, judge_model=judge_model, judge_method=judge_method, learning_rate=learning_rate,
        )
    )  # fmt: skip


def _scenarios(
    path: Path | None, tags: list[str] | None, start: datetime | None, end: datetime | None, score: str
) -> list[Scenario]:
    if (path is None) == (not tags and start is None and end is None):
        raise ConfigError(
            "give --scenarios FILE or Langfuse filters (--langfuse-tag, --langfuse-from/--langfuse-to)"
        )
    if path is not None:
        return read_scenarios(path)
    from journeyman.integrations.langfuse import import_trajectories

    traces = import_trajectories(tags=tags, from_time=start, to_time=end, reward_score=score)
    return scenarios_from_trajectories(traces)


def _import_agent(spec: str) -> Agent:
    module_name, _, name = spec.partition(":")
    if not module_name or not name:
        raise ConfigError(f"--agent must be module:function, got {spec!r}")
    sys.path.insert(0, str(Path.cwd()))
    try:
        function = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as error:
        raise ConfigError(f"cannot import --agent {spec}: {error}") from error
    if not inspect.iscoroutinefunction(function):
        raise ConfigError(f"--agent {spec} must be an async function (scenario, model) -> jm.Trajectory")
    return cast(Agent, function)


async def _run(
    store: ModelStore, base_model: str, attempt: Agent, train: list[Scenario], held: list[Scenario],
    *, n: int, per_step: int, steps: int, gate: bool, min_delta: float, judge_model: str | None,
    judge_method: str, learning_rate: float,
) -> None:  # fmt: skip
    from journeyman.backend import LocalBackend

    async with LocalBackend(root=store.root) as backend:
        model = jm.TrainableModel(
            name=store.model, project=store.project, base_model=base_model, root=store.root
        )
        await model.register(backend)
        judge = None
        if judge_model is not None:
            judge = jm.JudgeReward(await backend.judge(model, judge_model), method=cast(Method, judge_method))

        async def evaluate(name: str) -> list[jm.TrajectoryGroup]:
            served = model.model_copy(update={"inference_model_name": name})
            return await replay_scenarios(held, lambda s: attempt(s, served), n=1, progress=False)

        async def rollout(model: jm.TrainableModel, scenario: Scenario) -> jm.Trajectory:
            return label_trajectory(await attempt(scenario, model), scenario)

        async def step_end(report: StepReport) -> None:
            rewards = [t.reward for g in report.groups for t in g if t.reward is not None]
            line = (
                f"step {report.step}: {sum(len(g) for g in report.groups)} attempts, reward {_mean(rewards)}"
            )
            if gate:
                decision = await promote_if_better(model, report.step, evaluate, Gate(min_delta=min_delta))
                verdict = "promoted" if decision.promoted else f"held (step {decision.incumbent_step} stays)"
                line += f"; held out {decision.candidate:.3f} vs {decision.incumbent:.3f}: {verdict}"
            typer.echo(line)

        await jm.TrainingLoop(
            model, rollout, train, group_size=n, scenarios_per_step=min(per_step, len(train)),
            steps=await model.get_step() + steps,  # each call trains `steps` more, in the same order
            config=jm.TrainConfig(learning_rate=learning_rate), promote=not gate, judge=judge,
            labels=scenario_labels, on_step_end=step_end, step_lines=False,
        ).run()  # fmt: skip


def _mean(values: list[float]) -> str:
    return f"{sum(values) / len(values):.3f}" if values else "-"
