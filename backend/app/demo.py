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
import time
from collections.abc import Sequence
from dataclasses import asdict
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import journeyman as jm
from journeyman.errors import ConfigError, JourneymanError, MissingDependencyError, RolloutError
from journeyman.store import atomic_write

try:
    import httpx
    from langchain_openai import ChatOpenAI
except ImportError as error:  # pragma: no cover - the extra is missing
    raise MissingDependencyError(error.name or "langgraph", "langgraph", "the demo") from error

from ..serving.vllm_config import VLLMConfig, cuda_available
from .calculator import DEMO_RUBRICS, Scenario, build_agent, make_scenarios, rollout, worked_plan
from .demo_config import DEFAULT_JUDGE_MODEL, DemoConfig
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
from .interrupt import Interrupt
from .plots import plot_demo
from .ui.app import start_viewer

if TYPE_CHECKING:
    from ..local import LocalBackend

__all__ = ["DEFAULT_JUDGE_MODEL", "Demo", "DemoConfig", "restore_rollout_rows", "resume_config", "run_demo"]

CONFIG_FILE = "demo_config.json"
"""The run's settings, written when it starts: what ``journeyman demo --resume`` runs again."""
SAMPLE_TRIES = 3
"""Times a step's (or an evaluation's) rollouts are sampled when vLLM dies under them."""
BEFORE_FILE = "demo_before.json"
"""The held-out evaluation before training, kept so a resumed run reports against it."""


def rollout_seed(run_seed: int, draw: str, question: int, sample: int) -> int:
    """vLLM's sampling seed for one rollout: sample ``sample`` of question ``question`` in ``draw``
    (a step, or the held-out set) of the run seeded ``run_seed``. Every held-out evaluation draws
    the same seeds, so before and after differ by the model, not by the draw."""
    return random.Random(f"{run_seed}/{draw}/{question}/{sample}").getrandbits(31)


def restore_rollout_rows(store: jm.ModelStore) -> list[int]:
    """The ``rollouts`` history rows of trained steps whose process died before it wrote them
    (killed between the step's checkpoint and the row: the trainer restores its own row), made
    again from the groups the step stored and marked ``recovered`` (their seconds are lost); the
    steps restored."""
    rows = store.read_history()
    trained = {int(r["step"]) - 1 for r in rows if r.get("split") == "train"}  # train rows count steps done
    missing = sorted(trained - {int(r["step"]) for r in rows if r.get("split") == "rollouts"})
    restored = []
    for step in missing:
        if groups := store.load_groups("train", step):
            stats = summarize(groups)
            store.append_history(
                {
                    "step": step,
                    "split": "rollouts",
                    **{f"rollouts/{k}": v for k, v in stats.items()},
                    "recovered": 1,
                }
            )
            restored.append(step)
    return restored


def resume_config(run_dir: Path) -> DemoConfig:
    """The settings of the run in ``run_dir`` (``ROOT/PROJECT/NAME``, the folder the demo printed)."""
    path = Path(run_dir) / CONFIG_FILE
    if not path.is_file():
        raise ConfigError(
            f"{run_dir} holds no {CONFIG_FILE}: give the folder `journeyman demo` printed after '->' "
            "(ROOT/demo/NAME), of a run this version started"
        )
    saved = json.loads(path.read_text())
    store = jm.ModelStore.from_path(run_dir)
    saved.update(root=store.root, project=store.project, name=store.model)
    return DemoConfig(**saved)


class Demo:
    """The demo's state: backend, model, agents. ``await Demo(config).run()``.

    ``resume``: go on with the run of ``config.name``: training continues at the step after its
    latest checkpoint (the same questions in the same order, the same held-out set, its adapter
    and optimizer state), its time limit counts the minutes already trained, and the report sets
    the evaluation from before the first part against the one after this part.
    """

    def __init__(self, config: DemoConfig, *, resume: bool = False) -> None:
        if resume and config.name is None:
            raise ConfigError("a resumed demo needs the run's name (journeyman demo --resume RUN_DIR)")
        self.config = config
        self.resume = resume
        self.calibrated = True
        """False until the judge was calibrated on the first step's groups (when there is a judge)."""
        self.name = config.name or datetime.now().strftime("calc-%Y%m%d-%H%M%S")
        self.train_set = make_scenarios(config.train_scenarios, seed=config.seed)
        self.val_set = make_scenarios(config.val_scenarios, seed=config.seed + 10_000)
        self.http: httpx.AsyncClient | None = None
        self.records: Any = None
        self.console: Any = None
        self.interrupt = Interrupt()
        self.backend: LocalBackend | None = None
        share = config.worked_share
        if share is None:  # SmolLM2 calls no tool without the worked examples
            share = 1.0 if config.base_model == "smollm2-135m" else 0.5
        self.worked_share = share

    def _agent(self, model: jm.TrainableModel, worked_examples: bool, temperature: float, seed: int) -> Any:
        """The calculator agent on the served model, sampling with vLLM's per-request ``seed``."""
        assert self.http is not None
        llm = ChatOpenAI(
            model=model.inference_name,
            base_url=model.inference_base_url,
            api_key=model.inference_api_key or "-",
            temperature=temperature,
            seed=seed,
            max_tokens=self.config.max_tokens,
            disable_streaming=True,  # one response per call: nothing to stream in a batch run
            max_retries=1,
            timeout=600,
            http_async_client=self.http,
        )
        return build_agent(llm, worked_examples=worked_examples)

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
            return jm.Judge(
                c.judge_model, base_url=c.judge_base_url, api_key=key, cache_dir=backend.root / "judge_cache"
            )
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
        model: jm.TrainableModel,
        scenarios: Sequence[Scenario],
        worked: Sequence[bool],
        n: int,
        description: str,
        *,
        temperature: float,
        draw: str,
        after_each: Any = None,
    ) -> list[jm.TrajectoryGroup]:
        """A group of ``n`` rollouts for each scenario, with the worked examples where ``worked``
        says; sampled again (up to ``SAMPLE_TRIES`` times) when they failed because vLLM died
        meanwhile. Each rollout samples with a seed of its own from ``draw`` (the step, or the
        held-out set), so a step sampled again, resumed or rerun with the run's seed draws the same."""
        backend, attempt, c = self.backend, 1, self.config
        sampling = c.seed if c.sampling_seed is None else c.sampling_seed
        assert backend is not None, "sampling needs the servers running (Demo.run)"
        while True:
            restarts = backend.restarts
            try:
                return await jm.gather_trajectory_groups(
                    (
                        jm.TrajectoryGroup(
                            rollout(
                                self._agent(model, shots, temperature, rollout_seed(sampling, draw, i, k)),
                                s,
                                shaping=c.shaping,
                                records=self.records,
                            )
                            for k in range(n)
                        )
                        for i, (s, shots) in enumerate(zip(scenarios, worked, strict=True))
                    ),
                    max_exceptions=0.1,
                    after_each=after_each,
                    description=description,
                    progress=self.config.progress,
                )  # exported to Langfuse (with split and step) by model.log and model.train
            except RolloutError as error:
                if attempt == SAMPLE_TRIES or not (backend.policy_down() or backend.restarts > restarts):
                    raise
                self.console.print(f"[yellow]{error}[/yellow]\nvLLM died: sampling again once it is back")
                await backend.wait_serving()
                attempt += 1

    async def _judge_again(
        self, groups: list[jm.TrajectoryGroup], after_each: Any, restarts: int
    ) -> list[jm.TrajectoryGroup]:
        """The groups whose judging failed because the judge's server died meanwhile, judged again
        once it is back (each keeps its first failure on record); the others as they are."""
        backend = self.backend
        assert backend is not None
        failed = [i for i, group in enumerate(groups) if group.metrics.get("judge/failed")]
        if not failed or not (backend.judge_down() or backend.judge_restarts > restarts):
            return groups
        self.console.print(
            f"[yellow]the judge's vLLM server died: judging {len(failed)} group(s) again once it is back[/yellow]"
        )
        await backend.wait_serving(judges=True)
        again = list(groups)
        for i in failed:
            again[i] = await after_each(groups[i])
            again[i].metrics["judge/judged_again"] = 1
        return again

    async def evaluate(self, model: jm.TrainableModel, label: str) -> Evaluation:
        """Held-out success at the training temperature and greedily, with worked examples in the
        prompt, and (``zero_shot_eval``) without them."""
        c = self.config
        step = await model.get_step()
        result = Evaluation(step)
        prompts = [True, False] if c.zero_shot_eval or 0 < self.worked_share < 1 else [self.worked_share == 1]
        for shots in prompts:
            tag = "" if shots else " (no examples)"
            worked = [shots] * len(self.val_set)
            sampled = await self._groups(
                model, self.val_set, worked, c.val_samples, f"eval {label}{tag} (T={c.temperature})",
                temperature=c.temperature, draw="val",
            )  # fmt: skip
            greedy = await self._groups(
                model, self.val_set, worked, 1, f"eval {label}{tag} (greedy)", temperature=0.0, draw="val"
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
        # A resumed run that trained a step had the judge calibrated on its first step, and went on.
        self.calibrated = self.resume and await model.get_step() > 0
        return judge, after_each

    def _policy_vllm(self) -> VLLMConfig | None:
        """The policy server's config where the demo sets more than the backend's defaults: its
        share of the GPU (``gpu_memory_utilization``; otherwise planned on CUDA)."""
        share = self.config.gpu_memory_utilization
        return None if share is None else VLLMConfig(model="", gpu_memory_utilization=share)

    async def _start_servers(self, model: jm.TrainableModel, backend: LocalBackend) -> None:
        """The policy's server and trainer, and a local judge's server of its own beside them. On
        CPU both vLLM servers start at once (each start is mostly one core's work); on a GPU one
        after the other, the judge's last, since vLLM sizes its cache from the memory it sees free
        while it starts, and another process allocating meanwhile would be counted as its own."""
        c = self.config
        own = c.judge == "ruler" and c.judge_base_url is None and not self.judge_is_policy_base
        if own and cuda_available():
            await model.register(backend)
            await backend.start_judge(self.judge_model)
            return
        judge = asyncio.create_task(backend.start_judge(self.judge_model)) if own else None
        try:
            await model.register(backend)
        except BaseException:
            if judge is not None:  # its server is stopped as its start is cancelled
                judge.cancel()
                await asyncio.gather(judge, return_exceptions=True)
            raise
        if judge is not None:
            await judge  # _judge finds its server started

    async def run(self) -> dict[str, Any]:
        from rich.console import Console

        from ..local import LocalBackend

        c = self.config
        self.console = Console()
        started = time.monotonic()
        model, train_config = self._model()
        verb = "resuming" if self.resume else "teaching"
        self.console.print(
            f"[bold]journeyman demo[/bold]: {verb} {c.base_model} on a LangGraph calculator task "
            f"({prompt_line(self.worked_share)}) -> {model.store.path}"
        )
        if not self.resume:
            saved = {k: str(v) if isinstance(v, Path) else v for k, v in asdict(c).items()}
            atomic_write(model.store.path / CONFIG_FILE, json.dumps({**saved, "name": self.name}, indent=2))
        if c.langfuse:  # fail now, not with a warning per export after vLLM started
            from journeyman.integrations.langfuse import LangfuseExporter

            LangfuseExporter(project=c.project, model=self.name).check()
        merge = self._merge()
        self.console.print(f"starting vLLM with {c.base_model} (under a minute on 2 cores) ...")
        with start_viewer(model.store.root) if c.viewer else contextlib.nullcontext() as viewer:
            if viewer is not None:
                self.console.print(f"viewer: {viewer.base_url}/runs/{c.project}/{self.name}")
            async with (
                self.interrupt,  # first in, last out: Ctrl-C is kept until the servers are down
                LocalBackend(
                    root=c.root,
                    merge_adapters=merge,
                    dtype=c.serving_dtype,
                    vllm=self._policy_vllm(),
                    sleep_mode=c.sleep_mode,
                    train_device=c.train_device,
                ) as backend,
                httpx.AsyncClient(
                    timeout=600, limits=httpx.Limits(max_connections=512, max_keepalive_connections=64)
                ) as self.http,
            ):
                self.backend = backend
                await self._start_servers(model, backend)
                self.console.print(f"trainer: {backend.describe_trainer(model)}")
                self.records = backend.records
                judge, after_each = await self._judging(model, backend)
                self.console.print(f"vLLM ready after {time.monotonic() - started:.0f} s")
                before = self._saved_before(model)
                if before is None:
                    before = await self.evaluate(model, "before")
                    atomic_write(model.store.path / BEFORE_FILE, json.dumps(asdict(before)))
                self.console.print(f"before: {evaluation_line(before)}")
                trained = self._trained_minutes(model)
                if self.resume:
                    if restored := restore_rollout_rows(
                        model.store
                    ):  # rows without seconds: minutes as they were
                        steps = ", ".join(str(step + 1) for step in restored)
                        self.console.print(f"[yellow]step {steps}: rollout row lost with its process, made again "
                                           "from its stored groups[/yellow]")  # fmt: skip
                    step = await model.get_step()
                    self.console.print(f"resuming at step {step + 1} after {trained:.1f} min of training")
                train_minutes = await self._train(model, train_config, judge, after_each, trained)
                self.interrupt.check()
                after = await self.evaluate(model, "after")
        return self._report(model, before, after, train_minutes, started)

    def _saved_before(self, model: jm.TrainableModel) -> Evaluation | None:
        """The first part's evaluation before training, when resuming a run that got that far."""
        path = model.store.path / BEFORE_FILE
        if not self.resume or not path.is_file():
            return None
        return Evaluation(**json.loads(path.read_text()))

    def _trained_minutes(self, model: jm.TrainableModel) -> float:
        """Minutes the run trained before this part (its completed steps; 0 for a new run)."""
        if not self.resume:
            return 0.0
        rows = [r for r in model.store.read_history() if r.get("split") == "rollouts"]
        return max((float(r.get("elapsed_s", 0.0)) for r in rows), default=0.0) / 60

    async def _train(
        self,
        model: jm.TrainableModel,
        train_config: jm.TrainConfig,
        judge: jm.Judge | None,
        after_each: Any,
        trained: float = 0.0,
    ) -> float:
        """Train until ``steps`` or ``max_train_minutes``, counting the ``trained`` minutes of an
        earlier part; the minutes of training in all."""
        c = self.config
        started = time.monotonic() - trained * 60
        # In the generated order (add, multiply, add, ...): every step sees both operations. Shuffled
        # steps of four questions were sometimes all products, and the next step called multiply for sums.
        for batch in jm.iterate_dataset(
            self.train_set,
            per_step=c.scenarios_per_step,
            epochs=100,
            initial_step=await model.get_step(),
            seed=None,
        ):
            self.interrupt.check()  # a Ctrl-C whose cancellation a library swallowed stops here
            spent = (time.monotonic() - started) / 60
            if batch.step >= c.steps or (c.max_train_minutes is not None and spent >= c.max_train_minutes):
                break
            await self._step(model, train_config, batch, judge, after_each, started)
        return (time.monotonic() - started) / 60

    async def _step(
        self,
        model: jm.TrainableModel,
        train_config: jm.TrainConfig,
        batch: jm.DatasetBatch[Scenario],
        judge: jm.Judge | None,
        after_each: Any,
        train_started: float,
    ) -> None:
        """One training step: rollouts (judged), the update, a history row and a progress line."""
        c = self.config
        t0 = time.monotonic()
        judge_restarts = self.backend.judge_restarts if self.backend is not None else 0
        groups = await self._groups(
            model, batch.items, worked_plan(len(batch.items), self.worked_share), c.group_size,
            f"step {batch.step + 1}/{c.steps} rollouts", temperature=c.temperature, draw=f"step {batch.step}",
            after_each=after_each if self.calibrated else None,
        )  # fmt: skip
        if not self.calibrated:  # the first step's groups still hold the programmatic rewards
            assert judge is not None and after_each is not None
            await self._calibrate(model, judge, groups)
            groups = [await after_each(group) for group in groups]
            self.calibrated = True
        if judge is not None:
            groups = await self._judge_again(groups, after_each, judge_restarts)
        rollout_s = time.monotonic() - t0
        self.interrupt.check()
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
            "name": self.name, "worked_share": self.worked_share, "before": asdict(before), "after": asdict(after),
            "train_minutes": train_minutes, "total_minutes": (time.monotonic() - started) / 60,
            "png": str(png), "summary": summary,
        }  # fmt: skip
        (model.store.path / "demo_report.json").write_text(json.dumps(report, indent=2))
        return report


def run_demo(config: DemoConfig, *, resume: bool = False) -> dict[str, Any]:
    """Run the demo to the end; returns its report (also written to ``demo_report.json``). On
    Ctrl-C, says how to go on with the run (``journeyman demo --resume RUN_DIR``) and exits 130."""
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request drowns the progress bars
    demo = Demo(config, resume=resume)
    try:
        return asyncio.run(demo.run())
    except (KeyboardInterrupt, asyncio.CancelledError):  # Ctrl-C (see .interrupt)
        from rich.console import Console

        run_dir = jm.ModelStore(config.project, demo.name, root=config.root).path
        Console(stderr=True).print(
            f"\ninterrupted; the completed steps are kept. Go on with: journeyman demo --resume {run_dir}"
        )
        raise SystemExit(130) from None
