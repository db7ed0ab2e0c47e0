"""``journeyman demo``: teach the embedded SmolLM2-135M a LangGraph calculator task on CPU.

A LangGraph ReAct agent answers arithmetic questions and word problems with three tools (add,
multiply and a distraction), served by vLLM through the capture gateway and captured by the
one-line :class:`~journeyman.integrations.langgraph.TrajectoryTracer`. The demo evaluates on a
held-out set, runs GRPO steps (groups of rollouts per question, reward 1 for the right final
number), redeploys the adapter after each step, evaluates again and prints the two side by side.

What the base models do: SmolLM2 with no worked examples in the prompt never calls a tool, so the
prompt carries four; at temperature 0.7 some of its samples then call the right tool and state its
result, which gives GRPO groups with both successes and failures. Qwen2.5-Coder-0.5B calls the
right tool zero-shot but then calls again on the tool's result instead of answering: zero-shot
groups alone have no success to learn from. So for such models half of each step's groups carry
the worked examples by default (``worked_share``), where it does answer, and what it learns there
can carry over to the zero-shot prompt, though not in every run (see docs/results/).
Mixing both prompts inside a group teaches the wrong thing instead: the zero-shot rollouts, failing
beside the successes with examples, are pushed away from calling a tool at all.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from dataclasses import asdict
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import journeyman as jm
from journeyman.errors import ConfigError, MissingDependencyError
from journeyman.judge import Judge
from journeyman.loop import restore_rollout_rows as loop_rows
from journeyman.loop import rollout_seed
from journeyman.sft import with_context
from journeyman.store import ModelStore, atomic_write

try:
    import httpx
    from langchain_openai import ChatOpenAI
except ImportError as error:  # pragma: no cover - the extra is missing
    raise MissingDependencyError(error.name or "langgraph", "langgraph", "the demo") from error

from journeyman.interrupt import Interrupt

from ..serving.vllm_config import VLLMConfig, cuda_available
from .calculator import DEMO_RUBRICS, SYSTEM, Scenario, build_agent, make_scenarios, rollout, worked_plan
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
from .plots import plot_demo
from .ui.app import start_viewer

if TYPE_CHECKING:
    from ..local import LocalBackend

__all__ = [
    "DEFAULT_JUDGE_MODEL",
    "Demo",
    "DemoConfig",
    "restore_rollout_rows",
    "resume_config",
    "rollout_seed",
    "run_demo",
]

CONFIG_FILE = "demo_config.json"
"""The run's settings, written when it starts: what ``journeyman demo --resume`` runs again."""
BEFORE_FILE = "demo_before.json"
"""The held-out evaluation before training, kept so a resumed run reports against it."""


def restore_rollout_rows(store: ModelStore) -> list[int]:
    """:func:`journeyman.loop.restore_rollout_rows` with the demo's summary of each step."""
    return loop_rows(store, summarize)


def resume_config(run_dir: Path) -> DemoConfig:
    """The settings of the run in ``run_dir`` (``ROOT/PROJECT/NAME``, the folder the demo printed)."""
    path = Path(run_dir) / CONFIG_FILE
    if not path.is_file():
        raise ConfigError(
            f"{run_dir} holds no {CONFIG_FILE}: give the folder `journeyman demo` printed after '->' "
            "(ROOT/demo/NAME), of a run this version started"
        )
    saved = json.loads(path.read_text())
    store = ModelStore.from_path(run_dir)
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
        self.run_dir = ModelStore(config.project, self.name, root=config.root).path
        self.hinted = False
        """The training loop said how to resume after a Ctrl-C."""
        share = config.worked_share
        if share is None and config.warm_start != "none":  # the warm start taught the zero-shot prompt
            share = 0.0
        elif share is None:  # SmolLM2 calls no tool without the worked examples
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
        return build_agent(llm, worked_examples=worked_examples, tool_seconds=self.config.tool_seconds)

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

    async def _judge(self, model: jm.TrainableModel, backend: LocalBackend) -> Judge:
        c = self.config
        if c.judge_base_url is not None:
            key = os.environ.get("JOURNEYMAN_JUDGE_API_KEY") or os.environ.get("OPENAI_API_KEY")
            return Judge(
                c.judge_model, base_url=c.judge_base_url, api_key=key, cache_dir=backend.root / "judge_cache"
            )
        if self.judge_is_policy_base:  # the base weights on the demo's own server, through the gateway
            return await backend.judge(model)
        with self.console.status(f"starting the judge's vLLM server with {self.judge_model} ..."):
            return await backend.judge(model, self.judge_model, timeout=900, temperature=0.0)

    @property
    def rubric(self) -> str:
        return DEMO_RUBRICS[self.config.judge_method]

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

    async def _judging(self, model: jm.TrainableModel, backend: LocalBackend) -> jm.JudgeReward | None:
        """The judge's reward for each group (None without a judge), calibrated on the first step."""
        c = self.config
        if c.judge != "ruler":
            return None
        judge = await self._judge(model, backend)
        self.console.print(f"judge: RULER ({c.judge_method}) with {judge.model} at {judge.base_url}")
        return jm.JudgeReward(
            judge, rubric=self.rubric, method=c.judge_method, reference=c.judge_reference,
            reward_from=c.judge_reward, reward_weight=c.reward_weight, calibrate=True,
            calibrate_anyway=c.judge_anyway,
        )  # fmt: skip

    def _cores(self) -> tuple[str | None, int | None]:
        """The policy server's cores and the trainer's threads: as given; on a CPU whose rollouts
        overlap training (``max_steps_off_policy``), the upper half of the cores for vLLM and a
        thread per core of the lower half for the trainer, so the two do not fight for each core."""
        c = self.config
        cpu = not cuda_available() or c.train_device == "cpu"
        n = os.cpu_count() or 1
        if c.max_steps_off_policy == 0 or c.vllm_cores or c.trainer_threads or not cpu or n < 2:
            return c.vllm_cores, c.trainer_threads
        half = n // 2
        return (str(half) if n - half == 1 else f"{half}-{n - 1}"), half

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

    async def _rollout(self, model: jm.TrainableModel, scenario: Scenario) -> jm.Trajectory:
        """One rollout of the calculator agent, with the prompt and temperature its split asks for."""
        info = jm.rollout_info()
        assert info is not None, "the demo's rollouts run in its training loop"
        c = self.config
        if info.split == "train":
            shots = worked_plan(c.scenarios_per_step, self.worked_share)[info.index]
        else:
            shots = not info.split.startswith("val_zero_shot")
        greedy = info.split in ("val_greedy", "val_zero_shot")
        agent = self._agent(model, shots, 0.0 if greedy else c.temperature, info.seed)
        return await rollout(agent, scenario, shaping=c.shaping, records=self.records)

    def _evals(self) -> list[jm.EvalSet[Scenario]]:
        """Held-out success at the training temperature and greedily, with worked examples in the
        prompt, and (``zero_shot_eval``) without them."""
        c = self.config
        prompts = [True, False] if c.zero_shot_eval or 0 < self.worked_share < 1 else [self.worked_share == 1]
        splits = {True: ("val", "val_greedy"), False: ("val_zero_shot_sampled", "val_zero_shot")}
        return [
            jm.EvalSet(split, self.val_set, samples=samples)
            for shots in prompts
            for split, samples in zip(splits[shots], (c.val_samples, 1), strict=True)
        ]

    def _loop(
        self, model: jm.TrainableModel, train_config: jm.TrainConfig, judge: jm.JudgeReward | None
    ) -> Any:
        c = self.config
        run_dir = model.store.path
        return jm.TrainingLoop(
            model, self._rollout, self.train_set, group_size=c.group_size,
            scenarios_per_step=c.scenarios_per_step, steps=c.steps, max_minutes=c.max_train_minutes,
            config=train_config, judge=judge, evals=self._evals(),
            # In the generated order (add, multiply, add, ...): every step sees both operations. Shuffled
            # steps of four questions were sometimes all products, and the next step called multiply for sums.
            shuffle=False, seed=c.seed if c.sampling_seed is None else c.sampling_seed,
            on_step_end=self._step_line, on_eval=self._evaluated, summary=summarize, langfuse=c.langfuse,
            report_to=c.report_to,
            progress=c.progress, console=self.console, step_lines=False, interrupt=self.interrupt,
            max_steps_off_policy=c.max_steps_off_policy,
            resume_hint=f"Go on with: journeyman demo --resume {run_dir}", warm_start=self._warm_start(),
        )  # fmt: skip

    def _warm_start(self) -> jm.WarmStart | None:
        """``warm_start="sft"``: the training questions' successes with the worked examples, taught
        under the zero-shot prompt (the held-out questions never enter them)."""
        c = self.config
        if c.warm_start == "none":
            return None
        config = jm.SFTConfig(
            learning_rate=c.warm_start_learning_rate, epochs=c.warm_start_epochs, batch_size=8,
            eval_fraction=0.1, seed=c.seed,
        )  # fmt: skip
        return jm.WarmStart(self._collect_successes, config)

    async def _collect_successes(self, model: jm.TrainableModel) -> list[jm.Trajectory]:
        c = self.config
        attempts = [(s, k) for s in self.train_set for k in range(c.warm_start_samples)]

        async def attempt(index: int, scenario: Scenario) -> jm.Trajectory:
            agent = self._agent(model, True, c.temperature, c.seed * 100_003 + index)
            return await rollout(agent, scenario, shaping=c.shaping, records=self.records)

        done = await asyncio.gather(*(attempt(i, s) for i, (s, _) in enumerate(attempts)))
        kept = [t for t in done if t.metrics.get("success") and t.metrics.get("right_tool_call")]
        self.console.print(
            f"warm start: {len(kept)} of {len(done)} attempts with the worked examples succeeded with the "
            "right tool call; teaching them under the zero-shot prompt"
        )
        return [with_context(t, [{"role": "system", "content": SYSTEM}]) for t in kept]

    async def evaluate(self, model: jm.TrainableModel, label: str) -> Evaluation:
        """The held-out evaluation of the model served now, outside a run (``bench/heldout.py``)."""
        rows = await self._loop(model, jm.TrainConfig(), None).evaluate(label)
        evaluation = Evaluation(await model.get_step())
        for split, values in rows.items():
            setattr(evaluation, EVALUATION_FIELDS[split], values)
        return evaluation

    def _evaluated(self, report: Any) -> None:
        """Print an evaluation; keep the first one (``demo_before.json``: the steps begin)."""
        evaluation = self._evaluation(report.step, report.rows)
        self.console.print(f"{report.label}: {evaluation_line(evaluation)}")
        if report.label == "before":
            atomic_write(self.run_dir / BEFORE_FILE, json.dumps(asdict(evaluation)))

    @staticmethod
    def _evaluation(step: int, rows: dict[str, dict[str, Any]]) -> Evaluation:
        """The demo's evaluation from the loop's history rows (each split's keys without its prefix)."""
        evaluation = Evaluation(step)
        for split, row in rows.items():
            prefix = f"{split}/"
            values = {k[len(prefix) :]: v for k, v in row.items() if k.startswith(prefix)}
            setattr(evaluation, EVALUATION_FIELDS[split], values)
        return evaluation

    def _step_line(self, report: Any) -> None:
        stats = {k.removeprefix("rollouts/"): v for k, v in report.row.items() if k.startswith("rollouts/")}
        zero_shot = f"zero-shot {stats['success_zero_shot']:.2f}  " if "success_zero_shot" in stats else ""
        self.console.print(
            f"step {report.step:>3}  success {stats.get('success', 0):.2f}  "
            f"word {share(stats.get('success_word'))}  valid calls {stats.get('valid_tool_call', 0):.2f}  "
            f"{zero_shot}rollouts {report.rollout_seconds:.0f} s  train {report.train_seconds:.0f} s  "
            f"elapsed {report.elapsed_minutes:.1f} min"
        )

    async def run(self) -> dict[str, Any]:
        from rich.console import Console

        from ..local import LocalBackend

        c = self.config
        self.console = Console()
        started = time.monotonic()
        model, train_config = self._model()
        self.run_dir = model.store.path
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
        cores, threads = self._cores()
        if cores is not None and c.vllm_cores is None:
            self.console.print(f"steps overlap: vLLM on core(s) {cores}, the trainer on {threads} thread(s)")
        self.console.print(f"starting vLLM with {c.base_model} (under a minute on 2 cores) ...")
        async with (
            self.interrupt,  # first in, last out: Ctrl-C is kept until the servers are down
            LocalBackend(
                root=c.root,
                merge_adapters=merge,
                dtype=c.serving_dtype,
                vllm=self._policy_vllm(),
                sleep_mode=c.sleep_mode,
                train_device=c.train_device,
                vllm_cores=cores,
                trainer_threads=threads,
                viewer=start_viewer if c.viewer else None,
            ) as backend,
            httpx.AsyncClient(
                timeout=600, limits=httpx.Limits(max_connections=512, max_keepalive_connections=64)
            ) as self.http,
        ):
            self.backend = backend
            await self._start_servers(model, backend)
            self.console.print(f"trainer: {backend.describe_trainer(model)}")
            self.records = backend.records
            judge = await self._judging(model, backend)
            self.console.print(f"vLLM ready after {time.monotonic() - started:.0f} s")
            try:
                result = await self._loop(model, train_config, judge).run()
            except KeyboardInterrupt:
                self.hinted = True  # the loop said how to go on
                raise
        before = self._evaluation(result.started_step, result.before)
        after = self._evaluation(result.step, result.after)
        return self._report(model, before, after, result.minutes, started)

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
        try:  # the picture needs matplotlib (the bench extra): without it the run still reports
            png: Path | None = plot_demo(
                model.store.read_history(),
                model.store.path / "demo_curve.png",
                title=f"{c.project}/{self.name}",
            )
        except MissingDependencyError as error:
            png = None
            self.console.print(f"[yellow]no reward curve: {error}[/yellow]")
        self.console.print(evaluation_table(before, after, c.temperature))
        summary = summary_line(before, after, c.temperature, c.zero_shot_eval) + (
            f"after {after.step - before.step} steps in {train_minutes:.1f} min of training "
            f"({(time.monotonic() - started) / 60:.1f} min in all)"
        )
        self.console.print(f"[bold green]{summary}[/bold green]")
        self.console.print(
            (f"reward curve: {png}\n" if png else "")
            + f"trajectories: {model.store.path} (journeyman trajectories show {c.project} {self.name})"
        )
        report = {
            "config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(c).items()},
            "name": self.name, "worked_share": self.worked_share, "before": asdict(before), "after": asdict(after),
            "train_minutes": train_minutes, "total_minutes": (time.monotonic() - started) / 60,
            "png": str(png) if png else None, "summary": summary,
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
    except (KeyboardInterrupt, asyncio.CancelledError):  # Ctrl-C (journeyman.interrupt)
        if not demo.hinted:  # stopped before its training loop ran
            from rich.console import Console

            run_dir = ModelStore(config.project, demo.name, root=config.root).path
            Console(stderr=True).print(
                f"\ninterrupted; the completed steps are kept. Go on with: journeyman demo --resume {run_dir}"
            )
        raise SystemExit(130) from None
