"""jm.TrainingLoop's bookkeeping on a backend that only counts steps: data order and resume,
evaluations kept for resume, budget, hooks, sampling and judging again, overlap, Ctrl-C.

The same loop against real vLLM servers is in tests/integration/test_loop.py and the chaos test."""

from __future__ import annotations

import asyncio
import os
import signal
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

import journeyman as jm
from journeyman.loop import JudgeReward, StepReport, restore_rollout_rows, rollout_seed
from journeyman.messages import AssistantMessage, ModelTurn
from tests.loop_backend import CountingBackend

SCENARIOS = [f"q{i}" for i in range(12)]


class Recorder:
    """A rollout that scores ``q<even>`` 1 and records what it was asked to do, and the step
    served when it started (the model turn's policy version)."""

    def __init__(self, backend: CountingBackend, delay: float = 0.0) -> None:
        self.backend = backend
        self.delay = delay
        self.calls: list[tuple[str, int, str, int, int]] = []
        self.fail: set[tuple[str, int]] = set()
        """(split, step) whose rollouts raise once, after the policy's server 'died'."""

    async def __call__(self, model: jm.TrainableModel, scenario: str) -> jm.Trajectory:
        info = jm.rollout_info()
        assert info is not None
        served = self.backend.step
        self.calls.append((info.split, info.step, scenario, info.sample, info.seed))
        await asyncio.sleep(self.delay)
        if (info.split, info.step) in self.fail:
            self.backend.state = replace(
                self.backend.state, policy_down=True, policy_restarts=self.backend.state.policy_restarts + 1
            )
            raise ConnectionError("the server died")
        turn = ModelTurn(message=AssistantMessage(content=scenario), policy_version=served)
        reward = float(int(scenario[1:]) % 2 == 0) if info.sample % 2 == 0 else 0.5
        return jm.Trajectory(conversation=[turn], reward=reward, metadata={"scenario": scenario})


async def make(
    tmp_path: Path, backend: CountingBackend | None = None
) -> tuple[jm.TrainableModel, CountingBackend]:
    backend = backend or CountingBackend()
    model = jm.TrainableModel(name="loop", project="test", base_model="smollm2-135m", root=tmp_path)
    await model.register(backend)
    return model, backend


def loop(model: jm.TrainableModel, rollout: Any, **options: Any) -> jm.TrainingLoop[str]:
    defaults: dict[str, Any] = dict(group_size=2, scenarios_per_step=2, steps=4, progress=False)
    return jm.TrainingLoop(model, rollout, SCENARIOS, **{**defaults, **options})


def train_calls(rollout: Recorder) -> list[tuple[int, str]]:
    return sorted({(step, scenario) for split, step, scenario, _, _ in rollout.calls if split == "train"})


async def test_a_resumed_run_draws_what_the_whole_run_draws_and_keeps_its_evaluations(tmp_path: Path) -> None:
    whole_model, whole_backend = await make(tmp_path / "whole")
    whole = Recorder(whole_backend)
    evals = [jm.EvalSet("val", ["q0", "q1"], samples=2)]
    result = await loop(whole_model, whole, steps=5, evals=evals).run()
    assert result.step == 5 and result.stopped_by == "steps" and sorted(result.evaluations) == [0, 5]

    model, backend = await make(tmp_path / "parts")
    first = Recorder(backend)
    part = await loop(model, first, steps=3, evals=evals).run()
    assert (part.step, part.started_step, part.steps_this_part) == (3, 0, 3)
    model, backend = await make(tmp_path / "parts", CountingBackend())  # a new process: registered again
    second = Recorder(backend)
    rest = await loop(model, second, steps=5, evals=evals).run()
    assert (rest.step, rest.started_step, rest.steps_this_part) == (5, 0, 2)
    assert train_calls(first) + train_calls(second) == train_calls(whole)
    assert {c[1] for c in second.calls if c[0] == "val"} == {5}  # "before" came from the first part's rows
    assert (
        sorted(rest.evaluations) == [0, 3, 5]
        and rest.before["val"]["val/reward"] == result.before["val"]["val/reward"]
    )
    # The same seeds: every rollout of the resumed steps drew the seed the whole run drew.
    assert {c for c in second.calls if c[0] == "train"} <= set(whole.calls)


def test_seeds_differ_by_draw_question_and_sample_and_repeat() -> None:
    seeds = {
        rollout_seed(0, draw, q, k)
        for draw in ("step 0", "step 1", "val")
        for q in range(3)
        for k in range(3)
    }
    assert len(seeds) == 27 and rollout_seed(0, "val", 1, 2) == rollout_seed(0, "val", 1, 2)


async def test_evaluations_before_during_after_and_the_best_step(tmp_path: Path) -> None:
    model, backend = await make(tmp_path)
    seen: list[tuple[int, str]] = []
    rollout = Recorder(backend)
    result = await loop(
        model, rollout, steps=4, eval_every=2, evals=[jm.EvalSet("val", ["q0", "q1"])],
        on_eval=lambda report: seen.append((report.step, report.label)),
    ).run()  # fmt: skip
    assert seen == [(0, "before"), (2, "during"), (4, "after")]
    assert result.best_step in (2, 4) and model.store.steps("val") == [0, 2, 4]


@pytest.mark.parametrize(("higher_is_better", "kept"), [(True, [2, 3]), (False, [1, 3])])
async def test_pruning_keeps_the_latest_and_the_best_in_the_metrics_direction(
    tmp_path: Path, higher_is_better: bool, kept: list[int]
) -> None:
    model, _ = await make(tmp_path)
    rewards = {1: 0.2, 2: 0.9, 3: 0.5}  # val/reward by the step evaluated (before training: 0.7)

    async def rollout(model: jm.TrainableModel, scenario: str) -> jm.Trajectory:
        info = jm.rollout_info()
        assert info is not None
        return jm.Trajectory(
            conversation=[AssistantMessage(content=scenario)], reward=rewards.get(info.step, 0.7)
        )

    result = await loop(
        model, rollout, steps=3, eval_every=1, evals=[jm.EvalSet("val", ["q0"])], prune_checkpoints=True,
        higher_is_better=higher_is_better,
    ).run()  # fmt: skip
    assert result.best_step == (2 if higher_is_better else 1)
    assert model.store.checkpoint_steps() == kept


async def test_a_run_resumes_only_with_its_own_seed(tmp_path: Path) -> None:
    model, backend = await make(tmp_path)
    await loop(model, Recorder(backend), steps=1, seed=3).run()
    with pytest.raises(
        jm.ConfigError, match=r"a run with seed=3, and this loop has seed=4: resume it with seed=3"
    ):
        await loop(model, Recorder(backend), steps=2, seed=4).run()
    assert (await loop(model, Recorder(backend), steps=2, seed=3).run()).step == 2


async def test_a_hook_stops_the_run_and_the_last_evaluation_still_runs(tmp_path: Path) -> None:
    model, backend = await make(tmp_path)
    steps: list[int] = []

    async def on_step_end(report: StepReport) -> bool:
        steps.append(report.step)
        return report.row["rollouts/reward"] >= 0.0 and report.step == 2

    result = await loop(
        model, Recorder(backend), steps=10, on_step_end=on_step_end, evals=[jm.EvalSet("val", ["q0"])]
    ).run()
    assert steps == [1, 2] and result.stopped_by == "hook" and sorted(result.evaluations) == [0, 2]


async def test_the_time_budget_counts_the_minutes_of_earlier_parts(tmp_path: Path) -> None:
    model, backend = await make(tmp_path)
    await loop(model, Recorder(backend), steps=1).run()
    rows = model.store.read_history()
    assert [r["split"] for r in rows] == ["train", "rollouts"]
    model.store.append_history({**rows[1], "step": 0, "elapsed_s": 600.0})  # as if it had trained 10 minutes
    result = await loop(model, Recorder(backend), steps=5, max_minutes=10).run()
    assert result.stopped_by == "minutes" and result.step == 1


async def test_a_step_whose_rollouts_failed_as_the_server_died_is_sampled_again(tmp_path: Path) -> None:
    model, backend = await make(tmp_path)
    rollout = Recorder(backend)
    rollout.fail = {("train", 1)}
    original = rollout.__call__

    async def once(model: jm.TrainableModel, scenario: str) -> jm.Trajectory:
        info = jm.rollout_info()
        try:
            return await original(model, scenario)
        finally:
            if info is not None and info.step == 1:  # only the first sampling of step 2 meets the dead server
                rollout.fail.discard(("train", 1))

    result = await loop(model, once, steps=3).run()
    assert result.step == 3 and backend.waited == [False]
    step_two = backend.trained[1]
    assert all(not g.failures and len(g) == 2 for g in step_two)
    draws = [c for c in rollout.calls if c[:2] == ("train", 1)]
    assert (
        len(draws) == 8 and draws[:4] != [] and sorted(draws[:4]) == sorted(draws[4:])
    )  # the same seeds again


async def test_failures_without_a_server_death_are_kept_as_data(tmp_path: Path) -> None:
    model, backend = await make(tmp_path)

    async def flaky(model: jm.TrainableModel, scenario: str) -> jm.Trajectory:
        info = jm.rollout_info()
        assert info is not None
        if info.sample == 1 and info.index == 0:
            raise ValueError("the tool broke")
        return jm.Trajectory(reward=1.0)

    result = await loop(model, flaky, steps=1, max_exceptions=1.0).run()
    assert result.step == 1 and backend.waited == []
    assert [f.stage for g in backend.trained[0] for f in g.failures] == ["rollout"]


class FlakyJudge(JudgeReward):
    """Fails each group's judging while the test's judge server is 'dead', then scores 1."""

    def __init__(self, backend: CountingBackend) -> None:
        super().__init__(judge=None)  # type: ignore[arg-type]
        object.__setattr__(self, "backend", backend)
        object.__setattr__(self, "calls", [])

    async def score(self, group: jm.TrajectoryGroup) -> jm.TrajectoryGroup:
        backend: CountingBackend = self.backend  # type: ignore[attr-defined]
        self.calls.append(backend.state.judge_down)  # type: ignore[attr-defined]
        if backend.state.judge_down:
            group.metrics["judge/failed"] = 1
            return group
        judged = group.model_copy(deep=True)
        for t in judged:
            t.reward = 1.0
        return judged


async def test_groups_whose_judge_died_are_judged_again_once_it_is_back(tmp_path: Path) -> None:
    model, backend = await make(tmp_path)
    backend.state = replace(backend.state, judge_down=True, judge_restarts=0)
    judge = FlakyJudge(backend)
    await loop(model, Recorder(backend), steps=1, judge=judge).run()
    assert backend.waited == [True] and judge.calls == [True, True, False, False]  # type: ignore[attr-defined]
    assert all(g.metrics["judge/judged_again"] == 1 and g.rewards == [1.0, 1.0] for g in backend.trained[0])


async def test_with_one_step_off_policy_the_next_rollouts_overlap_training(tmp_path: Path) -> None:
    model, backend = await make(tmp_path, CountingBackend(train_seconds=0.2))
    rollout = Recorder(backend, delay=0.05)
    result = await loop(model, rollout, steps=4, max_steps_off_policy=1).run()
    assert result.step == 4
    rows = [r for r in model.store.read_history() if r["split"] == "rollouts"]
    lags = [r["rollouts/off_policy_max"] for r in rows]
    assert max(lags) == 1 and all(lag <= 1 for lag in lags)  # sampled one version behind, never two
    versions = [{t.policy_versions[0] for g in groups for t in g} for groups in backend.trained]
    assert all(step - min(v) <= 1 for step, v in enumerate(versions))


async def test_on_policy_rollouts_wait_for_the_step_before(tmp_path: Path) -> None:
    model, backend = await make(tmp_path, CountingBackend(train_seconds=0.05))
    await loop(model, Recorder(backend), steps=3).run()
    rows = [r for r in model.store.read_history() if r["split"] == "rollouts"]
    assert [r["rollouts/off_policy_max"] for r in rows] == [0, 0, 0]


async def test_a_failed_training_step_is_sampled_again_when_the_run_resumes(tmp_path: Path) -> None:
    model, backend = await make(tmp_path)
    backend.fail_next_train = RuntimeError("CUDA out of memory")
    with pytest.raises(RuntimeError, match="out of memory"):
        await loop(model, Recorder(backend), steps=2).run()
    rollout = Recorder(backend)
    result = await loop(model, rollout, steps=2).run()
    assert result.step == 2 and {c[1] for c in rollout.calls} == {0, 1}


async def test_rollout_rows_of_a_killed_process_are_restored_on_resume(tmp_path: Path) -> None:
    model, backend = await make(tmp_path)
    await loop(model, Recorder(backend), steps=2).run()
    history = model.store.history_path
    lines = history.read_text().splitlines()
    history.write_text("\n".join(lines[:-1]) + "\n")  # killed between the checkpoint and the row
    assert restore_rollout_rows(model.store) == [1]
    assert restore_rollout_rows(model.store) == []
    rows = [r for r in model.store.read_history() if r["split"] == "rollouts"]
    assert [r["step"] for r in rows] == [0, 1] and rows[1]["recovered"] == 1


def test_ctrl_c_stops_between_steps_says_how_to_resume_and_the_same_call_resumes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async def main(press_at: int | None) -> jm.loop.LoopResult:
        model, backend = await make(tmp_path)

        def pressed(report: StepReport) -> None:
            if report.step == press_at:
                os.kill(os.getpid(), signal.SIGINT)

        return await loop(model, Recorder(backend, delay=0.01), steps=4, on_step_end=pressed).run()

    with pytest.raises(KeyboardInterrupt):
        asyncio.run(main(press_at=2))
    assert "interrupted; the 2 completed step(s) are kept" in caplog.text
    result = asyncio.run(main(press_at=None))
    assert (result.step, result.steps_this_part) == (4, 2)


async def test_journeyman_max_steps_caps_each_part_of_a_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, backend = await make(tmp_path)
    monkeypatch.setenv("JOURNEYMAN_MAX_STEPS", "2")
    first = await loop(model, Recorder(backend), steps=5).run()
    assert first.stopped_by == "steps" and first.step == 2
    second = await loop(model, Recorder(backend), steps=3).run()  # steps=3 ends first
    assert second.step == 3
    monkeypatch.setenv("JOURNEYMAN_MAX_STEPS", "two")
    with pytest.raises(jm.ConfigError, match="JOURNEYMAN_MAX_STEPS='two': give a whole number"):
        await loop(model, Recorder(backend), steps=5).run()
    assert await model.get_step() == 3  # nothing trained on bad input


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"scenarios_per_step": 20}, "cannot fill one step"),
        ({"group_size": 0}, "group_size"),
        ({"max_steps_off_policy": -1}, "max_steps_off_policy"),
        ({"evals": [jm.EvalSet("val", ["q0"]), jm.EvalSet("val", ["q1"])]}, "share a split"),
    ],
)
async def test_bad_settings_say_what_to_do(tmp_path: Path, options: dict[str, Any], message: str) -> None:
    model, backend = await make(tmp_path)
    with pytest.raises(jm.ConfigError, match=message):
        loop(model, Recorder(backend), **options)


async def test_a_reward_function_sync_or_async_scores_and_its_failures_are_recorded_as_reward(
    tmp_path: Path,
) -> None:
    model, backend = await make(tmp_path)

    async def reward(trajectory: jm.Trajectory, scenario: str) -> float:
        if scenario == "q1" and trajectory.metadata["scenario"] == "q1":
            raise KeyError("no answer key for q1")
        return 2.0

    await loop(model, Recorder(backend), steps=1, reward=reward, shuffle=False).run()
    groups = backend.trained[0]  # q0, q1 in order
    assert [g.metadata["scenario_index"] for g in groups] == [0, 1]
    assert groups[0].rewards == [2.0, 2.0] and not groups[0].failures
    assert [f.stage for f in groups[1].failures] == ["reward", "reward"]
    assert all(t.reward is None for t in groups[1])


async def test_evaluate_outside_a_run_summarizes_each_set_and_stores_nothing(tmp_path: Path) -> None:
    model, backend = await make(tmp_path)
    rollout = Recorder(backend)
    evals = [jm.EvalSet("val", ["q0", "q1"], samples=2), jm.EvalSet("val_odd", ["q1"])]
    rows = await loop(model, rollout, evals=evals).evaluate()
    assert rows["val"]["reward"] == 0.5 and rows["val_odd"]["reward"] == 0.0  # q0 even: 1, q1 odd: 0
    assert rows["val"]["trajectories"] == 4 and model.store.read_history() == []
    assert {c[0] for c in rollout.calls} == {"val", "val_odd"}


async def test_a_warm_start_on_a_backend_that_keeps_its_rows_elsewhere_is_done_once(tmp_path: Path) -> None:
    """As over journeyman serve: the supervised step's rows are in the server's store, not this one;
    the loop's own state says the warm start was done, so a resumed run neither repeats it nor
    skips a batch of the data for it."""

    class Elsewhere(CountingBackend):
        sft_calls = 0

        async def train_sft(self, model: jm.TrainableModel, trajectories: Any, config: Any, **_: Any) -> Any:
            self.sft_calls += 1
            self.step += 1
            with model.store.write_checkpoint(self.step) as folder:
                (folder / "adapter.txt").write_text(str(self.step))
            return jm.model.TrainResult(step=self.step, metrics={"sft/loss": 1.0})

    backend = Elsewhere()
    model = jm.TrainableModel(name="far", project="test", base_model="smollm2-135m", root=tmp_path)
    await model.register(backend)
    scenarios = ["a", "b", "c", "d"]
    taught = [jm.Trajectory(conversation=[{"role": "user", "content": "q"},
                                          {"type": "model_turn", "message": {"role": "assistant", "content": "a"}}])]  # fmt: skip

    async def rollout(model: jm.TrainableModel, scenario: str) -> jm.Trajectory:
        return jm.Trajectory(
            conversation=[{"role": "assistant", "content": scenario}], reward=float(scenario == "a")
        )

    for steps in (2, 3):
        await jm.TrainingLoop(model, rollout, scenarios, group_size=1, scenarios_per_step=1, steps=steps,
                              shuffle=False, progress=False, warm_start=jm.WarmStart(taught)).run()  # fmt: skip
    assert backend.sft_calls == 1 and backend.step == 3
    trained = [g.trajectories[0].conversation[0].content for groups in backend.trained for g in groups]  # type: ignore[union-attr]
    assert trained == ["a", "b"]  # the data's first two batches, at model steps 2 and 3
