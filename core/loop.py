"""The training loop: rollouts, rewards, judging, training, evaluation, budget and recovery in one call.

::

    loop = jm.TrainingLoop(
        model,                                  # registered with a LocalBackend or a RemoteBackend
        rollout,                                # async (model, scenario) -> Trajectory
        train_scenarios,
        group_size=8,
        scenarios_per_step=4,
        evals=[jm.EvalSet("val", val_scenarios, samples=4)],
        steps=20,
        max_minutes=30,
    )
    result = await loop.run()                   # the same call again on the same root resumes

Each step draws ``scenarios_per_step`` scenarios in an order fixed by ``seed`` (a resumed run draws
what the uninterrupted one would have), samples a group of ``group_size`` rollouts for each (each
with a sampling seed of its own, read from :func:`rollout_info`), sets rewards (the rollout's own,
``reward``, a ``judge``, or a weighted sum of both), trains on the groups, and appends a
``rollouts`` row to the history. The held-out ``evals`` run before training, every ``eval_every``
steps and after the last step; their rows and trajectories are stored, so a resumed run does not
evaluate again what it already did.

What can go wrong on the way is the loop's business, not the user's:

- the policy's server dies during a step's rollouts (the backend restarts it): once it is back,
  the step is sampled again, up to ``sample_tries`` times;
- a judge's server dies while it judges: the groups whose judging failed are judged again once it
  is back (each keeps its first failure on record);
- the process is killed: the same call resumes at the step after the latest checkpoint, with the
  minutes already trained counted against ``max_minutes``, and the ``rollouts`` rows of steps that
  were trained but not written made again from the groups the step stored;
- Ctrl-C: the loop stops between two units of work, keeps the completed steps, says how to resume
  and raises ``KeyboardInterrupt``.

With ``max_steps_off_policy=k`` the rollouts of the next ``k`` steps run while a step trains, on the
adapter last deployed: each turn keeps the policy step that sampled it (``ModelTurn.policy_version``)
and is trained with the importance ratio against its sampling logprobs. ``k=0`` alternates.

Hooks are how users' metrics, trackers and early stopping plug in: ``on_step_end(report)`` and
``on_eval(report)`` (sync or async) are called after each step and each evaluation; either may return
True to stop after it (the last evaluation still runs).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import inspect
import json
import logging
import math
import os
import random
import statistics
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, Literal, TypeVar

from journeyman.config import SFTConfig, TrainConfig
from journeyman.data import DatasetBatch, iterate_dataset
from journeyman.errors import ConfigError, JudgeError, RolloutError
from journeyman.interrupt import Interrupt
from journeyman.model import ServingState, TrainableModel, TrainResult, summarize
from journeyman.store import ModelStore, atomic_write
from journeyman.trackers import Tracker, TrackerSync, default_report_to, make_trackers
from journeyman.trajectory import JsonScalar, Trajectory, TrajectoryGroup

if TYPE_CHECKING:
    from journeyman.judge import Judge
    from journeyman.ruler import Method, RewardFrom

__all__ = [
    "EvalReport",
    "EvalSet",
    "JudgeReward",
    "LoopResult",
    "RolloutInfo",
    "StepReport",
    "TrainingLoop",
    "WarmStart",
    "restore_rollout_rows",
    "rollout_info",
    "rollout_seed",
]

logger = logging.getLogger(__name__)

S = TypeVar("S")

STATE_FILE = "loop.json"
"""Written in the run's folder when a loop first starts it: a later run on the same root resumes."""
MAX_STEPS_ENV = "JOURNEYMAN_MAX_STEPS"
"""Set to N, a run trains at most N steps past where it starts, whatever its budget: a smoke run of
any training script (``JOURNEYMAN_MAX_STEPS=1 python train.py``). The docs' snippets run this way."""

Summary = Callable[[Sequence[TrajectoryGroup]], dict[str, float]]
Hook = Callable[[Any], Any]


@dataclass(frozen=True)
class RolloutInfo:
    """What the loop's current rollout is for (:func:`rollout_info` inside a rollout)."""

    split: str
    """``train``, or the evaluation's split (``val``...)."""
    step: int
    """The training step the rollout is sampled for (an evaluation's: the step evaluated)."""
    index: int
    """The scenario's place in the step (or evaluation set)."""
    sample: int
    """The rollout's place in its group."""
    seed: int
    """A sampling seed of its own (:func:`rollout_seed`): pass it to the model (OpenAI's ``seed``), and a
    step sampled again, resumed or rerun with the loop's seed samples the same."""


_current: contextvars.ContextVar[RolloutInfo | None] = contextvars.ContextVar(
    "journeyman_rollout", default=None
)


def rollout_info() -> RolloutInfo | None:
    """Inside a rollout the loop runs: what it is for (split, step, scenario, sample, seed); else None."""
    return _current.get()


def rollout_seed(run_seed: int, draw: str, question: int, sample: int) -> int:
    """The sampling seed of sample ``sample`` of question ``question`` in ``draw`` (``step N``, or
    ``val`` for every evaluation) of the run seeded ``run_seed``. Every evaluation draws the same
    seeds, so two evaluations differ by the model, not by the draw."""
    return random.Random(f"{run_seed}/{draw}/{question}/{sample}").getrandbits(31)


@dataclass(frozen=True)
class EvalSet(Generic[S]):
    """A held-out evaluation: ``samples`` rollouts of each scenario, logged under ``split``."""

    split: str
    """Its name in the history (``val/reward``...) and the trajectories' folder."""
    scenarios: Sequence[S]
    """What each rollout of it is asked, as for training."""
    samples: int = 1
    """Rollouts of each scenario (more than one: a sampled success rate)."""

    def __post_init__(self) -> None:
        if self.samples < 1 or not self.scenarios:
            raise ConfigError(f"evaluation {self.split!r} needs scenarios and samples >= 1")
        if self.split in ("train", "rollouts"):
            raise ConfigError(f"an evaluation cannot be called {self.split!r}: the loop's own rows use it")


@dataclass(frozen=True)
class JudgeReward:
    """An LLM judge's reward for each group (:func:`~journeyman.judge.judge_group`):
    ``judge_weight x score + reward_weight x`` the programmatic reward the rollout set."""

    judge: Judge
    """The judge that scores (:class:`~journeyman.judge.Judge`; a LocalBackend's ``start_judge``)."""
    rubric: str | None = None
    """What a good attempt does; default: the method's own rubric."""
    method: Method = "auto"
    """``auto`` (verdicts where the judge returns logprobs, else scores), ``scores``, ``verdict`` or
    ``pairwise`` (:data:`~journeyman.judge.Method`)."""
    reference: bool = False
    """The judge first writes how the task should be done, and checks each attempt against it."""
    reward_from: RewardFrom = "best"
    """1 for the group's best and 0 for the rest, the rank in the group, or the judge's score
    (:data:`~journeyman.judge.RewardFrom`)."""
    criteria: Sequence[str] | None = None
    """Yes/no questions asked of each attempt instead of whether it achieved the goal (verdicts)."""
    fallback: float | None = None
    """The score of every attempt of a group the judge failed to judge; None leaves them untrained."""
    judge_weight: float = 1.0
    """Weight of the judge's part of the reward."""
    reward_weight: float = 0.0
    """Weight of the reward the rollout or ``reward=`` set."""
    calibrate: bool = False
    """Before it scores the first step, rank that step's groups with the judge against their
    programmatic rewards (written to ``judge_calibration.json``) and stop when it ranks no better
    than chance."""
    calibrate_anyway: bool = False
    """Calibrate, report, and train with the judge even when it ranks at chance."""

    async def score(self, group: TrajectoryGroup) -> TrajectoryGroup:
        from journeyman.ruler import judge_group

        return await judge_group(
            group, judge=self.judge, rubric=self.rubric, judge_weight=self.judge_weight,
            reward_weight=self.reward_weight, method=self.method, reference=self.reference,
            reward_from=self.reward_from, criteria=self.criteria, fallback=self.fallback,
        )  # fmt: skip


@dataclass
class WarmStart:
    """A supervised run before a :class:`TrainingLoop`'s first RL step, saved as the model's next
    step (``model.train_sft``): the conversations to imitate, or an async function of the model
    that collects them (a teacher's rollouts, the successes of a prompt with worked examples).
    Collecting is timed apart; the supervised run counts in the loop's minutes and steps."""

    data: Sequence[Trajectory] | Callable[[TrainableModel], Awaitable[Sequence[Trajectory]]]
    config: SFTConfig = field(default_factory=SFTConfig)
    evaluation: Sequence[Trajectory] | None = None
    """Conversations for the validation loss (default: ``config.eval_fraction`` of the data)."""


@dataclass
class StepReport:
    """What ``on_step_end`` receives after a trained step."""

    step: int
    """The model's step after training (1 after the first)."""
    groups: list[TrajectoryGroup]
    row: dict[str, Any]
    """The step's ``rollouts`` history row (``rollouts/...`` keys, seconds, ``elapsed_s``)."""
    train: TrainResult
    rollout_seconds: float
    train_seconds: float
    elapsed_minutes: float
    """Minutes of training so far, earlier parts of a resumed run included."""


@dataclass
class EvalReport:
    """What ``on_eval`` receives after an evaluation: each split's history row, by split."""

    step: int
    label: Literal["before", "during", "after"]
    rows: dict[str, dict[str, Any]]
    best_step: int | None = None
    """The checkpointed step best by ``best_metric`` so far."""


@dataclass
class LoopResult:
    """What :meth:`TrainingLoop.run` returns."""

    step: int
    """The model's step at the end."""
    started_step: int
    """The step the run started at (before any part of it trained)."""
    steps_this_part: int
    minutes: float
    """Minutes of training, earlier parts of a resumed run included."""
    evaluations: dict[int, dict[str, dict[str, Any]]] = field(default_factory=dict)
    """Every evaluation of the run: rows by split, by the step evaluated."""
    best_step: int | None = None
    stopped_by: str = "steps"
    """``steps``, ``minutes``, ``epochs`` or ``hook``."""

    @property
    def before(self) -> dict[str, dict[str, Any]]:
        return self.evaluations.get(self.started_step, {})

    @property
    def after(self) -> dict[str, dict[str, Any]]:
        return self.evaluations.get(self.step, {})


class TrainingLoop(Generic[S]):
    """Train ``model`` on ``rollout`` over ``scenarios``: the loop every journeyman run goes through.

    ``rollout(model, scenario)`` returns a :class:`Trajectory`, scored or not; a rollout that raises
    is recorded on its group (``max_exceptions`` is :func:`gather_trajectory_groups`'). ``reward``
    (``reward(trajectory, scenario) -> float``) sets each trajectory's reward after its rollout;
    ``judge`` (a :class:`Judge` or a :class:`JudgeReward`) then scores each group. ``summary``
    turns groups into the numbers of the ``rollouts`` rows and the evaluations' rows (default:
    reward, its std, failures and every trajectory metric, averaged).

    Budget: ``steps`` (the model's step to reach), ``epochs`` over ``scenarios`` and ``max_minutes``
    of training, whichever ends first (one epoch when none is given).

    ``warm_start`` (a :class:`WarmStart`): a supervised run after the first evaluation and before
    the first RL step, once per run (a resumed run does not repeat it); it is the model's next
    step, and the data order goes on as if it were not there.
    """

    def __init__(
        self,
        model: TrainableModel,
        rollout: Callable[[TrainableModel, S], Awaitable[Trajectory]],
        scenarios: Sequence[S],
        *,
        group_size: int = 8,
        scenarios_per_step: int = 4,
        steps: int | None = None,
        epochs: int | None = None,
        max_minutes: float | None = None,
        config: TrainConfig | None = None,
        promote: bool = True,
        reward: Callable[[Trajectory, S], float] | None = None,
        judge: Judge | JudgeReward | None = None,
        evals: Sequence[EvalSet[S]] = (),
        eval_every: int | None = None,
        best_metric: str | None = None,
        higher_is_better: bool = True,
        prune_checkpoints: bool = False,
        max_steps_off_policy: int = 0,
        seed: int = 0,
        shuffle: bool = True,
        max_exceptions: int | float = 0.1,
        sample_tries: int = 3,
        on_step_end: Hook | None = None,
        on_eval: Hook | None = None,
        summary: Summary | None = None,
        labels: Callable[[S], dict[str, JsonScalar]] | None = None,
        langfuse: Any = False,
        report_to: Sequence[str | Tracker] | None = None,
        progress: bool = True,
        console: Any = None,
        step_lines: bool = True,
        resume_hint: str | None = None,
        interrupt: Interrupt | None = None,
        warm_start: WarmStart | None = None,
    ) -> None:
        checks = [
            (group_size >= 1, f"group_size must be at least 1, got {group_size}"),
            (scenarios_per_step >= 1, f"scenarios_per_step must be at least 1, got {scenarios_per_step}"),
            (len(scenarios) >= scenarios_per_step,
             f"{len(scenarios)} scenarios cannot fill one step of {scenarios_per_step}: give more or lower scenarios_per_step"),
            (steps is None or steps >= 0, f"steps must be >= 0, got {steps}"),
            (epochs is None or epochs >= 1, f"epochs must be >= 1, got {epochs}"),
            (max_minutes is None or max_minutes > 0, f"max_minutes must be > 0, got {max_minutes}"),
            (eval_every is None or eval_every >= 1, f"eval_every must be >= 1 steps, got {eval_every}"),
            (max_steps_off_policy >= 0, f"max_steps_off_policy must be >= 0, got {max_steps_off_policy}"),
            (sample_tries >= 1, f"sample_tries must be >= 1, got {sample_tries}"),
            (len({e.split for e in evals}) == len(evals), "two evaluations share a split name: give each its own"),
        ]  # fmt: skip
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)
        self.model = model
        self.rollout = rollout
        self.scenarios = list(scenarios)
        self.group_size = group_size
        self.scenarios_per_step = scenarios_per_step
        self.steps = steps
        self.epochs = epochs if epochs is not None or steps is not None or max_minutes is not None else 1
        self.max_minutes = max_minutes
        self.config = config or TrainConfig()
        self.promote = promote
        """False: each trained step is served as ``name@step`` only, the plain name stays where it is
        (``model.train(promote=False)``): promote it from a hook, e.g. with :func:`~journeyman.promote_if_better`."""
        self.reward = reward
        self.judge = JudgeReward(judge) if judge is not None and not isinstance(judge, JudgeReward) else judge
        self.evals = list(evals)
        self.eval_every = eval_every
        self.best_metric = best_metric or (f"{self.evals[0].split}/reward" if self.evals else None)
        self.higher_is_better = higher_is_better
        self.prune_checkpoints = prune_checkpoints
        self.max_steps_off_policy = max_steps_off_policy
        self.seed = seed
        self.shuffle = shuffle
        self.max_exceptions = max_exceptions
        self.sample_tries = sample_tries
        self.on_step_end = on_step_end
        self.on_eval = on_eval
        self.summary: Summary = summary or summarize
        self.labels = labels
        """Labels for each group's ``metadata`` from its scenario (beside ``split``, ``step`` and
        ``scenario_index``, which every group gets)."""
        self.langfuse = langfuse
        self.report_to = report_to
        """Experiment trackers that follow the run (``wandb``, ``tensorboard``, ``mlflow``: see
        :mod:`journeyman.trackers`); None: W&B when ``WANDB_API_KEY`` is set; ``[]``: none."""
        self.trackers: TrackerSync | None = None
        """The trackers' sync while the loop runs (its ``failures``, ``seconds``)."""
        self.mirror_failures = 0
        """Rows the backend that trains elsewhere could not take (``RemoteBackend.record``)."""
        self.progress = progress
        self.console = console
        self.step_lines = step_lines
        self.resume_hint = resume_hint
        self.interrupt = interrupt
        self.warm_start = warm_start
        self.stopped = False
        """Set by :meth:`stop` (or a hook that returned True): the loop ends after the current step."""
        self._calibrated = True
        self._train_started = 0.0
        self._interrupt: Interrupt | None = None
        self._last_step: int | None = None  # steps, or fewer under JOURNEYMAN_MAX_STEPS (set by _run)

    # -- what users call ---------------------------------------------------------------------------

    def stop(self) -> None:
        """End the run after the step in progress (its last evaluation still runs)."""
        self.stopped = True

    async def run(self) -> LoopResult:
        """Train to the budget, evaluating before, during and after; resume where the run on this
        model's root left off. Ctrl-C stops it, says how to resume and raises ``KeyboardInterrupt``."""
        interrupt = self.interrupt or Interrupt()  # the caller's, already entered, or one of this run's
        async with contextlib.nullcontext() if self.interrupt is not None else interrupt:
            self._interrupt = interrupt
            try:
                return await self._run()
            except asyncio.CancelledError:
                if not interrupt.presses:
                    raise
                step = await self.model.get_step()
                self._say(
                    f"interrupted; the {step} completed step(s) are kept in {self.store.path}. "
                    + (self.resume_hint or "Resume: run the same loop again on the same root."),
                    logging.WARNING,
                )
                raise KeyboardInterrupt from None

    @property
    def store(self) -> ModelStore:
        return self.model.store

    # -- the run -----------------------------------------------------------------------------------

    async def _run(self) -> LoopResult:
        self.trackers = self._tracker_sync()
        try:
            return await self._run_tracked()
        finally:
            if self.trackers is not None:
                await asyncio.to_thread(self.trackers.close)

    def _tracker_sync(self) -> TrackerSync | None:
        """The trackers ``report_to`` names, following this run's store; None for none."""
        from journeyman.remote import RemoteBackend

        names = default_report_to() if self.report_to is None else list(self.report_to)
        if not names:
            return None
        if isinstance(self.model.backend, RemoteBackend):
            if self.report_to is None:
                return None  # W&B's key is in this environment, but this machine does not train
            raise ConfigError(
                f"report_to={names!r}: trackers write where training happens, and this model trains on "
                f"{self.model.backend.url}: give `journeyman serve` the trackers there, not the loop here"
            )
        metrics = getattr(self.model.backend, "metrics_url", None)  # the serving engine's, where known
        return TrackerSync(
            self.store, make_trackers(names), config=self._tracked_config(),
            metrics_url=metrics() if callable(metrics) else None,
        )  # fmt: skip

    def _tracked_config(self) -> dict[str, Any]:
        return {
            "project": self.model.project, "model": self.model.name, "base_model": self.model.base_model,
            "group_size": self.group_size, "scenarios_per_step": self.scenarios_per_step,
            "steps": self.steps, "epochs": self.epochs, "max_minutes": self.max_minutes, "seed": self.seed,
            "max_steps_off_policy": self.max_steps_off_policy, "train": self.config.model_dump(mode="json"),
            "judge": None if self.judge is None else {"method": self.judge.method, "reward_from": self.judge.reward_from},
        }  # fmt: skip

    async def _track(self) -> None:
        if self.trackers is not None:
            await asyncio.to_thread(self.trackers.sync)

    async def _mirror(self, row: dict[str, Any], groups: Sequence[TrajectoryGroup] | None = None) -> None:
        """A row this loop wrote (and an evaluation's groups) also in the store of the backend that
        trains elsewhere (``journeyman serve``), whose trackers follow that store. Recorded where
        the backend cannot take it (a failure is counted in :attr:`mirror_failures`, never raised)."""
        record = getattr(self.model.backend, "record", None)
        if record is None:
            return
        try:
            await record(self.model, row, groups)
        except Exception as error:
            self.mirror_failures += 1
            logger.warning(
                "the %s row of step %s is not in %s's run (%s: %s); it is in %s",
                row.get("split"), row.get("step"), getattr(self.model.backend, "url", "the backend"),
                type(error).__name__, error, self.store.history_path,
            )  # fmt: skip

    async def _run_tracked(self) -> LoopResult:
        step = await self.model.get_step()
        self._last_step = _last_step(self.steps, step, os.environ.get(MAX_STEPS_ENV))
        started_step, resumed = self._start_state(step)
        if (url := self._viewer_url()) is not None:
            self._say(f"viewer: {url}")
        trained = self._trained_minutes() if resumed else 0.0
        if resumed:
            if restored := restore_rollout_rows(self.store, self.summary):
                steps = ", ".join(str(step + 1) for step in restored)
                self._say(
                    f"step {steps}: rollout row lost with its process, made again from its stored groups"
                )
            self._say(
                f"resuming at step {await self.model.get_step() + 1} after {trained:.1f} min of training"
            )
        self._calibrated = not (
            self.judge is not None and self.judge.calibrate and await self.model.get_step() == 0
        )
        await self._evaluate(started_step, "before")
        if self.warm_start is not None and not self._supervised_steps():
            trained += await self._warm_start(self.warm_start)
        first = await self.model.get_step()
        stopped_by = await self._train(trained)
        self._check_interrupt()
        step = await self.model.get_step()
        minutes = (time.monotonic() - self._train_started) / 60
        if self.evals:
            await self._evaluate(step, "after")
        if self.prune_checkpoints:
            deleted = await self.model.delete_checkpoints(
                self.best_metric, higher_is_better=self.higher_is_better
            )
            if deleted:
                self._say(
                    f"deleted the checkpoints of steps {', '.join(map(str, deleted))} (kept the latest and best)"
                )
        return LoopResult(
            step=step, started_step=started_step, steps_this_part=step - first, minutes=minutes,
            evaluations=self._evaluations(), best_step=self._best_step(), stopped_by=stopped_by,
        )  # fmt: skip

    def _start_state(self, step: int) -> tuple[int, bool]:
        """The run's first step and whether this call resumes it (its state file exists)."""
        path = self.store.path / STATE_FILE
        if path.is_file():
            state = json.loads(path.read_text())
            if state.get("seed", self.seed) != self.seed:
                raise ConfigError(
                    f"{self.store.path} is a run with seed={state['seed']}, and this loop has seed={self.seed}: "
                    f"resume it with seed={state['seed']} (the same data order), or give a new name or root"
                )
            return int(state["started_step"]), True
        atomic_write(path, json.dumps({"started_step": step, "seed": self.seed}, indent=2))
        return step, False

    def _viewer_url(self) -> str | None:
        viewer = getattr(self.model.backend, "viewer_url", None)
        return viewer(self.model) if viewer is not None else None

    def _trained_minutes(self) -> float:
        """Minutes the run trained before this part (from its completed steps' rows; a supervised
        step's own seconds where no RL step followed it yet)."""
        rows = self.store.read_history()
        elapsed = max(
            (float(r.get("elapsed_s", 0.0)) for r in rows if r.get("split") == "rollouts"), default=0.0
        )
        supervised = sum(float(r.get("time/sft", 0.0)) for r in rows if r.get("split") == "sft")
        return max(elapsed, supervised) / 60

    def _supervised_steps(self) -> int:
        """The model's steps that were supervised runs: the data order skips none of its batches for
        them. Counted from this store's ``sft`` rows, and at least the warm start this loop's state
        records: a model that trains elsewhere (``journeyman serve``) keeps its rows there."""
        rows = sum(1 for r in self.store.read_history() if r.get("split") == "sft")
        path = self.store.path / STATE_FILE
        warm = path.is_file() and "warm_start" in json.loads(path.read_text())
        return max(rows, int(warm))

    async def _warm_start(self, warm: WarmStart) -> float:
        """Collect the warm start's conversations and train on them; its minutes of training."""
        t0 = time.monotonic()
        if callable(warm.data):
            with self._status("warm start: collecting the conversations to imitate ..."):
                data = list(await warm.data(self.model))
        else:
            data = list(warm.data)
        collect_s = time.monotonic() - t0
        self._say(
            f"warm start: {len(data)} conversations"
            + (f", collected in {collect_s:.0f} s" if callable(warm.data) else "")
        )
        t0 = time.monotonic()
        with self._status(f"warm start: supervised training on {len(data)} conversations ..."):
            result = await self.model.train_sft(
                data, warm.config, evaluation=warm.evaluation, promote=self.promote
            )
        minutes = (time.monotonic() - t0) / 60
        metrics = result.metrics
        validation = (
            f", validation loss {metrics['sft/val_loss_before']:.3f} -> {metrics['sft/val_loss']:.3f}"
            if "sft/val_loss" in metrics
            else ""
        )
        self._say(
            f"step {result.step:>3}  supervised: loss {metrics['sft/loss']:.3f}{validation}, {minutes * 60:.0f} s"
        )
        state = json.loads((self.store.path / STATE_FILE).read_text())
        state["warm_start"] = {"step": result.step, "conversations": len(data), "collect_s": collect_s}
        atomic_write(self.store.path / STATE_FILE, json.dumps(state, indent=2))
        await self._track()
        if self.evals:
            await self._evaluate(result.step, "during")
        return minutes

    def _batches(self, initial_step: int) -> Iterator[DatasetBatch[S]]:
        """The data from the model's step ``initial_step`` on, each batch labelled with the model step
        it trains (supervised steps take no batch of the data)."""
        offset = self._supervised_steps()
        for batch in iterate_dataset(
            self.scenarios, per_step=self.scenarios_per_step, epochs=self.epochs or 10**9,
            initial_step=max(0, initial_step - offset), seed=self.seed if self.shuffle else None,
        ):  # fmt: skip
            yield DatasetBatch(batch.items, batch.step + offset, batch.epoch, batch.epoch_step)

    def _out_of_budget(self, step: int) -> str | None:
        """Why no step ``step`` (0-based) is trained, or None while the budget allows it."""
        if self._last_step is not None and step >= self._last_step:
            return "steps"
        if self.max_minutes is not None and (time.monotonic() - self._train_started) / 60 >= self.max_minutes:
            return "minutes"
        if self.stopped:
            return "hook"
        return None

    async def _train(self, trained_minutes: float) -> str:
        """Train until the budget ends; why it ended. With ``max_steps_off_policy=k``, the rollouts
        of up to ``k`` later steps run while a step trains."""
        self._train_started = time.monotonic() - trained_minutes * 60
        batches = self._batches(await self.model.get_step())
        upcoming = next(batches, None)
        pending: dict[int, asyncio.Task[tuple[list[TrajectoryGroup], float]]] = {}
        k = self.max_steps_off_policy
        try:
            while True:
                self._check_interrupt()
                done = await self.model.get_step()
                # Start the rollouts of each step the budget allows, never more than k versions ahead.
                while (
                    upcoming is not None
                    and len(pending) <= k
                    and upcoming.step <= done + k
                    and not self._out_of_budget(upcoming.step)
                ):
                    pending[upcoming.step] = asyncio.create_task(
                        self._rollouts(upcoming), name=f"journeyman rollouts of step {upcoming.step + 1}"
                    )
                    upcoming = next(batches, None)
                if not pending:
                    return self._out_of_budget(done) or "epochs"
                step = min(pending)
                groups, rollout_s = await pending.pop(step)
                self._check_interrupt()
                if self.stopped:  # a hook stopped the run: later steps' rollouts are dropped
                    return "hook"
                await self._step(step, groups, rollout_s)  # sampled within the budget: trained
                due = self.eval_every is not None and (step + 1) % self.eval_every == 0
                if due and self.evals and not self._out_of_budget(step + 1):  # else "after" follows at once
                    await self._evaluate(step + 1, "during")
        finally:
            for task in pending.values():
                task.cancel()
            await asyncio.gather(*pending.values(), return_exceptions=True)

    async def _step(self, step: int, groups: list[TrajectoryGroup], rollout_s: float) -> None:
        """Train on a step's groups, append its ``rollouts`` row, report it."""
        t0 = time.monotonic()
        with self._status(f"step {step + 1}: training on {len(groups)} groups ..."):
            result = await self.model.train(groups, self.config, langfuse=self.langfuse, promote=self.promote)
        train_s = time.monotonic() - t0
        stats = self.summary(groups)
        lags = [step - min(t.policy_versions or [0]) for g in groups for t in g]  # versions behind
        elapsed = time.monotonic() - self._train_started
        judged = (
            {
                f"rollouts/judge_{key}": sum(float(g.metrics.get(f"judge/{key}", 0.0)) for g in groups)
                for key in ("seconds", "failed", "judged_again")
            }
            if self.judge is not None
            else {}
        )
        row = {
            "step": step,
            "split": "rollouts",
            **{f"rollouts/{k}": v for k, v in stats.items()},
            "rollouts/seconds": rollout_s,
            **judged,
            **({"rollouts/off_policy_max": float(max(lags)), "rollouts/off_policy_mean": statistics.fmean(lags)} if lags else {}),
            "elapsed_s": elapsed,
        }  # fmt: skip
        self.store.append_history(row)
        await self._mirror(row)
        report = StepReport(
            step=result.step, groups=groups, row=row, train=result, rollout_seconds=rollout_s,
            train_seconds=train_s, elapsed_minutes=elapsed / 60,
        )  # fmt: skip
        if self.step_lines:
            reward = stats.get("reward")
            self._say(
                f"step {result.step:>3}  reward {'-' if reward is None else f'{reward:.2f}'}  "
                f"failures {int(stats.get('failures', 0))}  rollouts {rollout_s:.0f} s  train {train_s:.0f} s  "
                f"elapsed {report.elapsed_minutes:.1f} min"
            )
        await self._track()
        if await _call(self.on_step_end, report) is True:
            self.stop()

    # -- rollouts ----------------------------------------------------------------------------------

    async def _rollouts(self, batch: DatasetBatch[S]) -> tuple[list[TrajectoryGroup], float]:
        """A step's groups, rewarded and judged (judged again where the judge's server died), and
        the seconds they took."""
        t0 = time.monotonic()
        judge_restarts = (await self._serving()).judge_restarts
        scorer = self.judge.score if self.judge is not None and self._calibrated else None
        groups = await self._gather(
            batch.items, "train", batch.step, f"step {batch.step}", self.group_size,
            f"step {batch.step + 1}{f'/{self.steps}' if self.steps else ''} rollouts", scorer,
        )  # fmt: skip
        if self.judge is not None:
            if not self._calibrated:
                await self._calibrate(groups)
                groups = [await self._score(group) for group in groups]
            groups = await self._judge_again(groups, judge_restarts)
        return groups, time.monotonic() - t0

    async def _one(self, scenario: S, info: RolloutInfo) -> Trajectory:
        _current.set(info)  # this coroutine runs in a task of its own: the value stays with it
        return await self.rollout(self.model, scenario)

    async def _rewarded(self, group: TrajectoryGroup, scenario: S) -> TrajectoryGroup:
        """``reward`` (sync or async) on each trajectory; one that raises is recorded on the group
        (stage ``reward``) and leaves that trajectory unscored."""
        if self.reward is None:
            return group
        for trajectory in group:
            try:
                value = self.reward(trajectory, scenario)
                trajectory.reward = float(await value if inspect.isawaitable(value) else value)
            except Exception as error:
                group.record_failure(error, stage="reward")
                trajectory.reward = None
        return group

    async def _gather(
        self,
        scenarios: Sequence[S],
        split: str,
        step: int,
        draw: str,
        n: int,
        description: str,
        after_each: Callable[[TrajectoryGroup], Awaitable[TrajectoryGroup]] | None = None,
    ) -> list[TrajectoryGroup]:
        """A group of ``n`` rollouts for each scenario; sampled again (up to ``sample_tries`` times)
        when rollouts failed and the policy's server died meanwhile."""
        from journeyman.gather import gather_trajectory_groups

        async def finish(group: TrajectoryGroup) -> TrajectoryGroup:
            index = group.metadata["scenario_index"]
            assert isinstance(index, int)
            group = await self._rewarded(group, scenarios[index])
            return await after_each(group) if after_each is not None else group

        for attempt in range(1, self.sample_tries + 1):
            before = await self._serving()
            try:
                groups = await gather_trajectory_groups(
                    self._groups(scenarios, split, step, draw, n),
                    max_exceptions=self.max_exceptions,
                    after_each=finish,
                    description=description,
                    progress=self._live,
                )
                error: RolloutError | None = None
            except RolloutError as failed:
                groups, error = [], failed
            failures = error is not None or any(f.stage == "rollout" for g in groups for f in g.failures)
            now = await self._serving()
            died = now.policy_down or now.policy_restarts > before.policy_restarts
            if not (failures and died) or attempt == self.sample_tries:
                if error is not None:
                    raise error
                return groups
            self._say(f"{description}: the policy's server died under them; sampling again once it is back")
            await self._wait_serving(judges=False)
        raise AssertionError("unreachable")

    def _groups(
        self, scenarios: Sequence[S], split: str, step: int, draw: str, n: int
    ) -> list[TrajectoryGroup]:
        """A group of ``n`` pending rollouts per scenario, each with its seed, labelled."""
        groups = []
        for i, scenario in enumerate(scenarios):
            labels = {"split": split, "step": step, "scenario_index": i}
            rollouts = (
                self._one(scenario, RolloutInfo(split, step, i, k, rollout_seed(self.seed, draw, i, k)))
                for k in range(n)
            )
            own = self.labels(scenario) if self.labels is not None else {}
            groups.append(TrajectoryGroup(rollouts, metadata={**labels, **own}))
        return groups

    async def _score(self, group: TrajectoryGroup) -> TrajectoryGroup:
        assert self.judge is not None
        try:
            return await self.judge.score(group)
        except Exception as error:  # recorded as gather_trajectory_groups does
            group.record_failure(error, stage="reward")
            return group

    async def _judge_again(self, groups: list[TrajectoryGroup], restarts: int) -> list[TrajectoryGroup]:
        """The groups whose judging failed because a judge's server died meanwhile, judged again
        once it is back; the others as they are."""
        failed = [i for i, group in enumerate(groups) if group.metrics.get("judge/failed")]
        if not failed:
            return groups
        state = await self._serving()
        if not (state.judge_down or state.judge_restarts > restarts):
            return groups
        self._say(f"the judge's server died: judging {len(failed)} group(s) again once it is back")
        await self._wait_serving(judges=True)
        again = list(groups)
        for i in failed:
            again[i] = await self._score(groups[i])
            again[i].metrics["judge/judged_again"] = 1
        return again

    async def _calibrate(self, groups: list[TrajectoryGroup]) -> None:
        """Rank the first step's groups with the judge against their programmatic rewards; stop
        when it ranks no better than chance (unless ``calibrate_anyway``)."""
        from journeyman.calibration import calibrate_judge

        judge = self.judge
        assert judge is not None
        with self._status(
            f"calibrating the judge {judge.judge.name} on the first step's {len(groups)} groups ..."
        ):
            report = await calibrate_judge(
                groups, judge.judge, method=judge.method, rubric=judge.rubric, criteria=judge.criteria,
                reference=judge.reference,
            )  # fmt: skip
        path = report.save(self.store.path / "judge_calibration.json")
        self._say(f"judge calibration (truth: the programmatic reward; {path}):\n{report.table()}")
        self._calibrated = True
        if report.pairs == 0:
            self._say("no group of the first step has both successes and failures: nothing to calibrate on")
        elif not report.better_than_chance() and not judge.calibrate_anyway:
            decided, fewest = report.correct + report.wrong, report.fewest_pairs()
            few = (
                f"; {decided} decided pairs are too few for the test to pass even when all are right "
                f"(it needs {fewest}): give the first step more scenarios or a bigger group"
                if decided < fewest
                else ""
            )
            raise JudgeError(
                f"the judge {judge.judge.name} ranks the first step's attempts no better than chance "
                f"(pairwise accuracy {report.pairwise_accuracy:.0%} on {report.pairs} pairs, sign test "
                f"p = {report.p_value:.2g}{few}), so training on its scores would not teach: use a bigger judge, "
                "another method (verdict), or JudgeReward(calibrate_anyway=True) to train with it regardless"
            )

    # -- evaluation --------------------------------------------------------------------------------

    def _eval_rows(self) -> dict[int, dict[str, dict[str, Any]]]:
        splits = {e.split for e in self.evals}
        rows: dict[int, dict[str, dict[str, Any]]] = {}
        for row in self.store.read_history():
            if row.get("split") in splits:
                rows.setdefault(int(row["step"]), {})[row["split"]] = row
        return rows

    def _evaluations(self) -> dict[int, dict[str, dict[str, Any]]]:
        return self._eval_rows()

    def _best_step(self) -> int | None:
        if self.best_metric is None:
            return None
        return self.store.best_step(self.best_metric, higher_is_better=self.higher_is_better)

    async def _evaluation(
        self, evaluation: EvalSet[S], step: int, label: str
    ) -> tuple[list[TrajectoryGroup], dict[str, float]]:
        """One evaluation set's groups on the served model, and their summary."""
        groups = await self._gather(
            evaluation.scenarios, evaluation.split, step, "val", evaluation.samples,
            f"eval {label} ({evaluation.split})",
        )  # fmt: skip
        return groups, self.summary(groups)

    async def evaluate(self, label: str = "now") -> dict[str, dict[str, float]]:
        """Every evaluation set on the model served now, outside a run (nothing is stored): each
        split's summary, by split."""
        step = await self.model.get_step()
        return {e.split: (await self._evaluation(e, step, label))[1] for e in self.evals}

    async def _evaluate(self, step: int, label: Literal["before", "during", "after"]) -> None:
        """Each evaluation set at ``step`` that the run has not evaluated yet (a resumed run keeps
        what its earlier part evaluated); then ``on_eval``."""
        done = self._eval_rows().get(step, {})
        todo = [e for e in self.evals if e.split not in done]
        if not todo:
            return
        for evaluation in todo:
            self._check_interrupt()
            groups, stats = await self._evaluation(evaluation, step, label)
            done[evaluation.split] = await self.model.log(
                groups,
                split=evaluation.split,
                step=step,
                metrics={f"{evaluation.split}/{k}": v for k, v in stats.items()},
                langfuse=self.langfuse,
            )
            await self._mirror(done[evaluation.split], groups)
        best = self._best_step()
        report = EvalReport(step=step, label=label, rows=done, best_step=best)
        if self.best_metric is not None and (value := _metric(done, self.best_metric)) is not None:
            self._say(f"eval {label} at step {step}: {self.best_metric} {value:.3f} (best: step {best})")
        await self._track()
        if await _call(self.on_eval, report) is True:
            self.stop()

    # -- the servers -------------------------------------------------------------------------------

    async def _serving(self) -> ServingState:
        state = getattr(self.model.backend, "serving_state", None)
        return await state() if state is not None else ServingState()

    async def _wait_serving(self, *, judges: bool) -> None:
        wait = getattr(self.model.backend, "wait_serving", None)
        if wait is not None:
            await wait(judges=judges)

    # -- output ------------------------------------------------------------------------------------

    def _check_interrupt(self) -> None:
        if self._interrupt is not None:
            self._interrupt.check()

    def _say(self, line: str, level: int = logging.INFO) -> None:
        if self.console is None and self.progress:
            from rich.console import Console

            self.console = Console()
        if self.console is not None:
            self.console.print(line, markup=False, highlight=False)
        else:
            logger.log(level, line)

    @property
    def _live(self) -> bool:
        """Progress bars and spinners: one live display at a time, so not while steps overlap."""
        return self.progress and self.max_steps_off_policy == 0

    def _status(self, line: str) -> Any:
        if self.console is not None and self._live:
            return self.console.status(line)
        return contextlib.nullcontext()


def _last_step(steps: int | None, first: int, cap: str | None) -> int | None:
    """The step a run that starts after step ``first`` stops at: ``steps``, or fewer under the
    :data:`MAX_STEPS_ENV` cap (None: no limit by steps)."""
    if cap is None or not cap.strip():
        return steps
    try:
        most = int(cap)
    except ValueError:
        most = -1
    if most < 0:
        raise ConfigError(f"{MAX_STEPS_ENV}={cap!r}: give a whole number of steps (0 or more), or unset it")
    return first + most if steps is None else min(steps, first + most)


def _metric(rows: dict[str, dict[str, Any]], metric: str) -> float | None:
    for row in rows.values():
        value = row.get(metric)
        if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
            return float(value)
    return None


async def _call(hook: Hook | None, report: Any) -> Any:
    """A user's hook, sync or async."""
    if hook is None:
        return None
    result = hook(report)
    return await result if inspect.isawaitable(result) else result


def restore_rollout_rows(store: ModelStore, summary: Summary = summarize) -> list[int]:
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
            store.append_history(
                {
                    "step": step,
                    "split": "rollouts",
                    **{f"rollouts/{k}": v for k, v in summary(groups).items()},
                    "recovered": 1,
                }
            )
            restored.append(step)
    return restored
