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
import functools
import json
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args

import journeyman as jm
from journeyman.config import LossType, Scale
from journeyman.errors import ConfigError, JourneymanError, MissingDependencyError
from journeyman.ruler import RewardFrom

try:
    import httpx
    from langchain_openai import ChatOpenAI
except ImportError as error:  # pragma: no cover - the extra is missing
    raise MissingDependencyError(error.name or "langgraph", "langgraph", "the demo") from error

from .calculator import DEMO_RUBRICS, Scenario, build_agent, make_scenarios, rollout, worked_plan
from .demo_report import (
    EVALUATION_FIELDS,
    Evaluation,
    evaluation_line,
    evaluation_table,
    prompt_line,
    share,
    summarize,
    summary_line,
)
from .plots import plot_demo

if TYPE_CHECKING:
    from ..local import LocalBackend

__all__ = ["DEFAULT_JUDGE_MODEL", "Demo", "DemoConfig", "run_demo"]


DEFAULT_JUDGE_MODEL = "qwen2.5-coder-1.5b"
"""The demo's local judge: with verdicts, it ranked 87% of the demo's pairs right, the smaller
models at most 72%, and 30 minutes trained on its verdicts (each group's best attempts rewarded)
took held-out success from 37% to 95% (bench/results.md)."""


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
    loss: LossType = "dapo"
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
    scale_rewards: Scale | None = None
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
            (self.loss in get_args(LossType), f"unknown loss {self.loss!r}: {', '.join(get_args(LossType))}"),
            (self.judge in ("none", "ruler"), f"unknown judge {self.judge!r}: none or ruler"),
            (self.reward_weight >= 0, "reward_weight must be >= 0"),
            (self.scale_rewards is None or self.scale_rewards in get_args(Scale),
             f"unknown scale_rewards {self.scale_rewards!r}: {', '.join(get_args(Scale))}"),
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


class Demo:
    """The demo's state: backend, model, agents. ``await Demo(config).run()``."""

    def __init__(self, config: DemoConfig) -> None:
        self.config = config
        self.calibrated = True
        """False until the judge was calibrated on the first step's groups (when there is a judge)."""
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

    async def _judge(self, model: jm.TrainableModel, backend: LocalBackend) -> jm.Judge:
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
                setattr(result, EVALUATION_FIELDS[split], row)
                await model.log(
                    groups,
                    split=split,
                    metrics={f"{split}/{k}": v for k, v in row.items()},
                    langfuse=c.langfuse,
                )
        return result

    def _model(self) -> tuple[jm.TrainableModel, jm.TrainConfig]:
        c = self.config
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
        return model, train_config

    def _merge(self) -> bool:
        c = self.config
        merge = c.merge_adapters if c.merge_adapters is not None else c.base_model == "smollm2-135m"
        if c.judge == "ruler" and self.judge_is_policy_base and merge:
            merge = False  # merged weights replace the base model, and the local judge is the base model
            self.console.print("the judge is the local base model: serving adapters with LoRA, not merged")
        return merge

    async def _judging(self, model: jm.TrainableModel, backend: LocalBackend) -> tuple[jm.Judge | None, Any]:
        """The judge and the ``after_each`` that scores each group with it (None, None without)."""
        c = self.config
        if c.judge != "ruler":
            return None, None
        judge = await self._judge(model, backend)
        after_each = functools.partial(
            jm.ruler_score_group, judge=judge, reward_weight=c.reward_weight, rubric=self.rubric,
            method=c.judge_method, reference=c.judge_reference, reward_from=c.judge_reward,
        )  # fmt: skip
        self.console.print(f"judge: RULER ({c.judge_method}) with {judge.model} at {judge.base_url}")
        self.calibrated = False
        return judge, after_each

    async def run(self) -> dict[str, Any]:
        from rich.console import Console

        from ..local import LocalBackend

        c = self.config
        self.console = Console()
        started = time.monotonic()
        model, train_config = self._model()
        self.console.print(
            f"[bold]journeyman demo[/bold]: teaching {c.base_model} a LangGraph calculator task "
            f"({prompt_line(self.worked_share)}) -> {model.store.path}"
        )
        if c.langfuse:  # fail now, not with a warning per export after vLLM started
            from journeyman.integrations.langfuse import LangfuseExporter

            LangfuseExporter(project=c.project, model=self.name).check()
        merge = self._merge()
        self.console.print(f"starting vLLM with {c.base_model} (one to three minutes on 2 cores) ...")
        async with (
            LocalBackend(root=c.root, merge_adapters=merge) as backend,
            httpx.AsyncClient(
                timeout=600, limits=httpx.Limits(max_connections=512, max_keepalive_connections=64)
            ) as self.http,
        ):
            await model.register(backend)
            self.records = backend.records
            judge, after_each = await self._judging(model, backend)
            self.console.print(f"vLLM ready after {time.monotonic() - started:.0f} s")
            before = await self.evaluate(model, "before")
            self.console.print(f"before: {evaluation_line(before)}")
            train_minutes = await self._train(model, train_config, judge, after_each)
            after = await self.evaluate(model, "after")
        return self._report(model, before, after, train_minutes, started)

    async def _train(
        self, model: jm.TrainableModel, train_config: jm.TrainConfig, judge: jm.Judge | None, after_each: Any
    ) -> float:
        """Train until ``steps`` or ``max_train_minutes``; the minutes it took."""
        c = self.config
        started = time.monotonic()
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
            spent = (time.monotonic() - started) / 60
            if batch.step >= c.steps or (c.max_train_minutes is not None and spent >= c.max_train_minutes):
                break
            step_agents = [agents[shots] for shots in worked_plan(len(batch.items), self.worked_share)]
            await self._step(model, train_config, batch, step_agents, judge, after_each, started)
        return (time.monotonic() - started) / 60

    async def _step(
        self,
        model: jm.TrainableModel,
        train_config: jm.TrainConfig,
        batch: jm.DatasetBatch[Scenario],
        agents: list[Any],
        judge: jm.Judge | None,
        after_each: Any,
        train_started: float,
    ) -> None:
        """One training step: rollouts (judged), the update, a history row and a progress line."""
        c = self.config
        t0 = time.monotonic()
        groups = await self._groups(
            agents, batch.items, c.group_size, f"step {batch.step + 1}/{c.steps} rollouts",
            after_each=after_each if self.calibrated else None,
        )  # fmt: skip
        if not self.calibrated:  # the first step's groups still hold the programmatic rewards
            assert judge is not None and after_each is not None
            await self._calibrate(model, judge, groups)
            groups = [await after_each(group) for group in groups]
            self.calibrated = True
        rollout_s = time.monotonic() - t0
        stats = summarize(groups)
        with self.console.status(f"step {batch.step + 1}/{c.steps}: training on {len(groups)} groups ..."):
            result = await model.train(groups, train_config, langfuse=c.langfuse)
        judged = {"rollouts/judge_seconds": sum(float(g.metrics.get("judge/seconds", 0.0)) for g in groups)}
        model.store.append_history(
            {
                "step": batch.step,
                "split": "rollouts",
                **{f"rollouts/{k}": v for k, v in stats.items()},
                "rollouts/seconds": rollout_s,
                **(judged if judge is not None else {}),
                "elapsed_s": time.monotonic() - train_started,
            }
        )
        zero_shot = f"zero-shot {stats['success_zero_shot']:.2f}  " if "success_zero_shot" in stats else ""
        self.console.print(
            f"step {result.step:>3}  success {stats.get('success', 0):.2f}  "
            f"word {share(stats.get('success_word'))}  valid calls {stats.get('valid_tool_call', 0):.2f}  "
            f"{zero_shot}rollouts {rollout_s:.0f} s  train {time.monotonic() - t0 - rollout_s:.0f} s  "
            f"elapsed {(time.monotonic() - train_started) / 60:.1f} min"
        )

    def _report(
        self,
        model: jm.TrainableModel,
        before: Evaluation,
        after: Evaluation,
        train_minutes: float,
        started: float,
    ) -> dict[str, Any]:
        """Print the table, the summary and where things are; write ``demo_report.json``."""
        c = self.config
        png = plot_demo(
            model.store.read_history(), model.store.path / "demo_curve.png", title=f"{c.project}/{self.name}"
        )
        self.console.print(evaluation_table(before, after, c.temperature))
        summary = summary_line(before, after, c.temperature, c.zero_shot_eval) + (
            f"after {after.step - before.step} steps in {train_minutes:.1f} min of training "
            f"({(time.monotonic() - started) / 60:.1f} min in all)"
        )
        self.console.print(f"[bold green]{summary}[/bold green]")
        self.console.print(
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


def run_demo(config: DemoConfig) -> dict[str, Any]:
    """Run the demo to the end; returns its report (also written to ``demo_report.json``)."""
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request drowns the progress bars
    return asyncio.run(Demo(config).run())
