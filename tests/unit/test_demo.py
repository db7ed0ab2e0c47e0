"""The demo's task without a model: questions, reward, metrics, settings, plot."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import journeyman as jm
from journeyman.backend.app.calculator import Scenario, make_scenarios, rollout, score, worked_plan
from journeyman.backend.app.demo import DemoConfig, restore_rollout_rows, rollout_seed, run_demo
from journeyman.backend.app.demo_report import summarize
from journeyman.backend.app.plots import plot_demo
from journeyman.backend.serving.vllm import free_port
from journeyman.errors import ConfigError
from journeyman.judge import Judge
from journeyman.store import ModelStore

QUESTION = Scenario("What is 347 plus 655?", "add", 347, 655, "arithmetic")


def _trajectory(*turns: dict[str, Any], question: str = QUESTION.question) -> jm.Trajectory:
    worked = [
        {"role": "system", "content": "You are a calculator assistant."},
        {"role": "user", "content": "What is 12 times 7?"},
        {"role": "assistant", "content": "The answer is 84."},
        {"role": "user", "content": question},
    ]
    conversation = [
        *worked,
        *({"type": "model_turn", "message": t} if t["role"] == "assistant" else t for t in turns),
    ]
    return jm.Trajectory(conversation=conversation)


def _call(name: str, arguments: str) -> dict[str, Any]:
    call = {"id": "c1", "type": "function", "function": {"name": name, "arguments": arguments}}
    return {"role": "assistant", "content": None, "tool_calls": [call]}


def test_scenarios_are_seeded_split_and_out_of_the_models_head() -> None:
    train, again, val = make_scenarios(50, seed=0), make_scenarios(50, seed=0), make_scenarios(50, seed=1)
    assert train == again and train != val
    assert {s.op for s in train} == {"add", "multiply"} and {s.kind for s in train} == {"word", "arithmetic"}
    for s in train:
        assert str(s.a) in s.question and str(s.b) in s.question
        assert s.answer == (s.a + s.b if s.op == "add" else s.a * s.b) and s.answer > 100


def test_each_rollout_has_a_seed_of_its_own_that_a_rerun_draws_again() -> None:
    draws = [
        (run, draw, q, k)
        for run in (0, 1)
        for draw in ("step 0", "step 1", "val")
        for q in range(4)
        for k in range(8)
    ]
    seeds = [rollout_seed(*d) for d in draws]
    assert len(set(seeds)) == len(seeds) and all(0 <= s < 2**31 for s in seeds)
    assert seeds == [rollout_seed(*d) for d in draws]
    # Another process with other string hashes (a resumed run) draws the same seeds.
    code = "from journeyman.backend.app.demo import rollout_seed; print(rollout_seed(0, 'step 0', 3, 5))"
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert int(other.stdout) == rollout_seed(0, "step 0", 3, 5)


def test_right_call_then_right_answer_succeeds() -> None:
    t = score(
        _trajectory(
            _call("add", '{"a": 347, "b": 655}'),
            {"role": "tool", "tool_call_id": "c1", "content": "1002"},
            {"role": "assistant", "content": "The answer is 1,002."},
        ),
        QUESTION,
    )
    assert t.reward == 1.0
    assert t.metrics == {"success": 1, "tool_call": 1, "valid_tool_call": 1, "right_tool_call": 1, "turns": 2}
    assert t.metadata["kind"] == "arithmetic"


def test_wrong_function_fails_but_is_a_valid_call_and_earns_only_shaping_when_right() -> None:
    wrong = _trajectory(
        _call("multiply", '{"a": 347, "b": 655}'),
        {"role": "tool", "tool_call_id": "c1", "content": "227285"},
        {"role": "assistant", "content": "The answer is 227285."},
    )
    scored = score(wrong, QUESTION, shaping=0.2)
    assert (
        scored.reward == 0.0
        and scored.metrics["valid_tool_call"] == 1
        and scored.metrics["right_tool_call"] == 0
    )
    right_but_misread = _trajectory(
        _call("add", '{"b": 655, "a": 347}'),
        {"role": "tool", "tool_call_id": "c1", "content": "1002"},
        {"role": "assistant", "content": "The answer is 1020."},
    )
    assert score(right_but_misread, QUESTION, shaping=0.2).reward == 0.2


def test_imitating_the_tool_response_or_a_tool_error_is_no_valid_call() -> None:
    imitated = score(
        _trajectory({"role": "assistant", "content": "<tool_response>\n1002\n</tool_response>"}), QUESTION
    )
    assert imitated.metrics["tool_call"] == 0 and imitated.metrics["valid_tool_call"] == 0
    errored = score(
        _trajectory(
            _call("add", '{"x": 1}'),
            {"role": "tool", "tool_call_id": "c1", "content": "Error: 2 validation errors for add"},
            {"role": "assistant", "content": "I could not add them."},
        ),
        QUESTION,
    )
    assert (
        errored.reward == 0.0
        and errored.metrics["tool_call"] == 1
        and errored.metrics["valid_tool_call"] == 0
    )


def test_the_answer_must_be_the_last_message_and_not_a_worked_example() -> None:
    unanswered = score(_trajectory(_call("add", '{"a": 347, "b": 655}')), QUESTION)
    assert unanswered.reward == 0.0 and unanswered.metrics["success"] == 0
    # "84" from the worked example before the question is no answer to another question.
    assert (
        score(_trajectory(), Scenario("What is 12 times 7?", "multiply", 12, 7, "arithmetic")).reward == 0.0
    )


def test_summarize_splits_word_problems() -> None:
    word = Scenario("A box holds 12 pens. How many pens are in 7 boxes?", "multiply", 12, 7, "word")
    good = score(_trajectory({"role": "assistant", "content": "84"}, question=word.question), word)
    bad = score(_trajectory({"role": "assistant", "content": "1000"}), QUESTION)
    group = jm.TrajectoryGroup([good, bad])
    group.record_failure(TimeoutError("slow"), stage="rollout")
    row = summarize([group])
    assert row["success"] == 0.5 and row["success_word"] == 1.0 and row["success_arithmetic"] == 0.0
    assert row["failures"] == 1 and row["n"] == 2
    assert "success_zero_shot" not in row  # every run had the worked examples


def test_a_zero_shot_run_is_told_apart_and_summarized_on_its_own() -> None:
    zero_shot = jm.Trajectory(
        conversation=[
            {"role": "system", "content": "You are a calculator assistant."},
            {"role": "user", "content": QUESTION.question},
            {"type": "model_turn", "message": {"role": "assistant", "content": "1002"}},
        ]
    )
    right = score(zero_shot, QUESTION)
    worked = score(_trajectory({"role": "assistant", "content": "no idea"}), QUESTION)
    assert right.metadata["worked_examples"] is False and worked.metadata["worked_examples"] is True
    row = summarize([jm.TrajectoryGroup([right]), jm.TrajectoryGroup([worked])])
    assert row["success"] == 0.5 and row["success_zero_shot"] == 1.0


@pytest.mark.parametrize(
    ("n", "share", "plan"),
    [
        (4, 0.5, [True, True, False, False]),  # both a sum and a product in each prompt
        (4, 1.0, [True] * 4),
        (4, 0.0, [False] * 4),
        (2, 0.1, [True, False]),  # a share strictly between 0 and 1 gives each prompt a group
        (2, 0.9, [True, False]),
        (3, 0.5, [True, True, False]),
    ],
)
def test_worked_plan_splits_a_step_between_the_prompts(n: int, share: float, plan: list[bool]) -> None:
    assert worked_plan(n, share) == plan


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("group_size", 1, "group_size"),
        ("max_train_minutes", 0, "max_train_minutes"),
        ("loss", "ppo", "unknown loss"),
        ("judge", "gpt", "unknown judge"),
        ("judge_model", "gpt-5", "need judge='ruler'"),
        ("judge_method", "pairs", "unknown judge_method"),
        ("judge_reward", "ranks", "unknown judge_reward"),
        ("reward_weight", -1.0, "reward_weight must be >= 0"),
        ("worked_share", 1.5, "worked_share must be between 0 and 1"),
        ("serving_dtype", "fp8", "unknown serving_dtype 'fp8': auto, bfloat16, float16, float32"),
        ("tool_seconds", -1.0, "tool_seconds must be >= 0"),
        ("max_steps_off_policy", -1, "max_steps_off_policy must be >= 0"),
    ],
)
def test_bad_settings_say_what_to_do(field: str, value: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        DemoConfig(**{field: value})


def test_a_remote_judge_needs_its_model_name() -> None:
    with pytest.raises(ConfigError, match="judge_base_url needs judge_model"):
        DemoConfig(judge="ruler", judge_base_url="https://api.example.com/v1")


def test_langfuse_that_cannot_be_reached_stops_the_demo_before_vllm_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:

    monkeypatch.setenv("LANGFUSE_PUBLIC_KEY", "pk-unreachable")
    monkeypatch.setenv("LANGFUSE_SECRET_KEY", "sk-unreachable")
    monkeypatch.setenv("LANGFUSE_BASE_URL", f"http://127.0.0.1:{free_port()}")  # nothing listens
    backends: list[object] = []  # vLLM would start with the first LocalBackend
    monkeypatch.setattr(
        "journeyman.backend.local.LocalBackend", lambda *args, **kwargs: backends.append(args)
    )
    with pytest.raises(ConfigError, match=r"cannot reach Langfuse: .*LANGFUSE_BASE_URL"):
        run_demo(DemoConfig(langfuse=True, root=tmp_path, name="unreachable", progress=False))
    assert backends == []
    assert not (tmp_path / "demo" / "unreachable" / "checkpoints").exists()


def test_plot_demo_writes_a_png(tmp_path: Path) -> None:
    rows = [
        {"step": 0, "split": "val", "val/success": 0.35, "val_greedy/success": 0.4, "val/success_word": 0.2},
        {"step": 0, "split": "rollouts", "rollouts/success": 0.3},
        {"step": 1, "split": "rollouts", "rollouts/success": 0.5},
    ]
    out = plot_demo(json.loads(json.dumps(rows)), tmp_path / "curve.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _judged_groups() -> list[jm.TrajectoryGroup]:
    """Two questions, four attempts each: two right, two wrong (scored by the demo's own check)."""
    groups = []
    for scenario in make_scenarios(2, seed=0):
        attempts = []
        for answer in (scenario.answer, scenario.answer, scenario.answer + 1, scenario.answer + 7):
            messages = [{"role": "system", "content": "calc"}, {"role": "user", "content": scenario.question},
                        {"role": "assistant", "content": f"The answer is {answer}."}]  # fmt: skip
            attempts.append(score(jm.Trajectory(conversation=messages), scenario))
        groups.append(jm.TrajectoryGroup(attempts))
    return groups


@pytest.mark.parametrize("anyway", [False, True])
async def test_the_loop_refuses_a_judge_that_ranks_at_chance_on_the_demos_groups(
    tmp_path: Path, anyway: bool
) -> None:
    from rich.console import Console

    from journeyman.backend.app.demo import Demo
    from tests.scripted_judge import Reply, ScriptedJudge, running, trajectory_texts

    def inverted(request: dict[str, Any]) -> Reply:  # prefers every wrong answer to every right one
        shown = trajectory_texts(request)
        scores = {id_: {"explanation": "-", "score": 0.0 if "answer is" in text and _right(text) else 1.0}
                  for id_, text in shown.items()}  # fmt: skip
        return Reply(json.dumps(scores))

    groups = _judged_groups()
    rights = {str(s.answer) for s in make_scenarios(2, seed=0)}

    def _right(text: str) -> bool:
        return any(f"is {answer}." in text for answer in rights)

    demo = Demo(
        DemoConfig(judge="ruler", judge_method="scores", judge_anyway=anyway, root=tmp_path, name="gate")
    )
    console = Console(record=True, width=200)
    model = jm.TrainableModel(name="gate", project="demo", base_model="smollm2-135m", root=tmp_path)
    script = ScriptedJudge(respond=inverted)
    with running(script) as url:
        judge = Judge("judge", base_url=url, max_retries=0, cache=False)
        reward = jm.JudgeReward(
            judge, rubric=demo.rubric, method="scores", calibrate=True, calibrate_anyway=anyway
        )
        loop = jm.TrainingLoop(model, rollout, make_scenarios(4, seed=0), judge=reward, console=console)
        if anyway:
            await loop._calibrate(groups)
        else:
            with pytest.raises(
                jm.JourneymanError, match="ranks the first step's attempts no better than chance"
            ):
                await loop._calibrate(groups)
    report = json.loads((model.store.path / "judge_calibration.json").read_text())
    assert report["summary"]["pairs"] == 8 and report["summary"]["pairwise_accuracy"] == 0.0
    assert "NOT better than chance" in console.export_text()
    assert (
        "Only a <tool> block is a tool result" in script.received[0]["messages"][0]["content"]
    )  # the task rubric


async def test_a_calibration_on_too_few_pairs_says_the_first_step_needs_more(tmp_path: Path) -> None:
    from tests.scripted_judge import Reply, ScriptedJudge, running, trajectory_texts

    rights = {str(s.answer) for s in make_scenarios(2, seed=0)}

    def right_first(request: dict[str, Any]) -> Reply:  # orders every pair it sees right
        scores = {id_: {"explanation": "-", "score": float(any(f"is {a}." in text for a in rights))}
                  for id_, text in trajectory_texts(request).items()}  # fmt: skip
        return Reply(json.dumps(scores))

    (one, *_) = _judged_groups()
    model = jm.TrainableModel(name="few", project="demo", base_model="smollm2-135m", root=tmp_path)
    with running(ScriptedJudge(respond=right_first)) as url:
        judge = Judge("judge", base_url=url, max_retries=0, cache=False)
        reward = jm.JudgeReward(judge, method="scores", calibrate=True)
        loop = jm.TrainingLoop(model, rollout, make_scenarios(4, seed=0), judge=reward, progress=False)
        with pytest.raises(
            jm.JourneymanError, match=r"p = 0\.\d+; 4 decided pairs are too few .* \(it needs 5\)"
        ):
            await loop._calibrate([one])
    report = json.loads((model.store.path / "judge_calibration.json").read_text())
    assert report["summary"]["pairwise_accuracy"] == 1.0


def test_the_default_judge_is_the_calibrated_one_on_a_server_of_its_own() -> None:
    from journeyman.backend.app.demo import DEFAULT_JUDGE_MODEL, Demo

    default = Demo(DemoConfig(judge="ruler"))
    assert (
        default.judge_model == DEFAULT_JUDGE_MODEL == "qwen2.5-coder-1.5b"
        and not default.judge_is_policy_base
    )
    assert (
        default.config.judge_method == "verdict" and "states the number that call returned" in default.rubric
    )
    assert default.config.judge_reward == "best" and not default.config.judge_reference
    own = Demo(DemoConfig(judge="ruler", judge_model="smollm2-135m", judge_method="scores"))
    assert own.judge_is_policy_base and "Every success must score clearly higher" in own.rubric
    assert Demo(DemoConfig(judge="ruler", base_model=DEFAULT_JUDGE_MODEL)).judge_is_policy_base
    hosted = Demo(DemoConfig(judge="ruler", judge_model="smollm2-135m", judge_base_url="https://x/v1"))
    assert not hosted.judge_is_policy_base  # a hosted judge, whatever its name
    # The trainer recomputes activations whenever a judge's server shares the memory (it ran out without).
    assert (
        default.gradient_checkpointing
        and not own.gradient_checkpointing
        and not hosted.gradient_checkpointing
    )
    assert (
        not Demo(DemoConfig()).gradient_checkpointing
        and Demo(DemoConfig(base_model="qwen2.5-coder-0.5b")).gradient_checkpointing
    )
    assert not Demo(DemoConfig(judge="ruler", gradient_checkpointing=False)).gradient_checkpointing


def test_a_resumed_run_restores_the_rollout_rows_its_killed_process_never_wrote(tmp_path: Path) -> None:
    """Killed between a step's checkpoint and the demo's row (the trainer restores its own row), the
    step's rollout success is made again from its stored groups, once."""
    store = ModelStore("demo", "run", root=tmp_path)
    for step, groups in enumerate([_judged_groups(), _judged_groups()[:1]]):
        store.save_groups(groups, "train", step)
        store.append_history({"step": step + 1, "split": "train", "loss": 0.1})
    store.append_history({"step": 0, "split": "rollouts", "rollouts/success": 0.5, "elapsed_s": 30.0})
    assert restore_rollout_rows(store) == [1]
    assert restore_rollout_rows(store) == []  # a second resume finds the row there
    rows = [r for r in store.read_history() if r.get("split") == "rollouts"]
    restored = rows[-1]
    assert restored["step"] == 1 and restored["recovered"] == 1 and "elapsed_s" not in restored
    assert restored["rollouts/success"] == 0.5 and restored["rollouts/n"] == 4
    assert plot_demo(rows, tmp_path / "curve.png").exists()


@pytest.mark.parametrize("on_gpu", [False, True])
def test_a_judge_server_starts_beside_the_policy_on_cpu_and_after_it_on_a_gpu(
    on_gpu: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM sizes its cache from the GPU memory it sees free while it starts: on a GPU the judge's
    server starts once the policy's server and the trainer hold theirs; on CPU both start at once."""
    import asyncio
    from types import SimpleNamespace

    from journeyman.backend.app import demo

    monkeypatch.setattr(demo, "cuda_available", lambda: on_gpu)
    events: list[str] = []

    class Model:
        async def register(self, backend: Any) -> None:
            events.append("policy starts")
            await asyncio.sleep(0.05)
            events.append("policy ready")

    class Backend:
        async def start_judge(self, name: str) -> None:
            events.append(f"judge {name} starts")

    config = SimpleNamespace(judge="ruler", judge_base_url=None)
    runner = SimpleNamespace(config=config, judge_is_policy_base=False, judge_model="qwen2.5-coder-1.5b")
    asyncio.run(demo.Demo._start_servers(runner, Model(), Backend()))  # type: ignore[arg-type]
    judge = events.index("judge qwen2.5-coder-1.5b starts")
    assert (judge > events.index("policy ready")) is on_gpu


async def test_a_tool_wait_delays_each_call_and_keeps_its_answer() -> None:
    import time

    from journeyman.backend.app.calculator import _ToolWait

    async def handler(request: str) -> str:
        return f"answered {request}"

    wait = _ToolWait(0.2)
    start = time.monotonic()
    assert await wait.awrap_tool_call("add(2, 3)", handler) == "answered add(2, 3)"
    assert time.monotonic() - start >= 0.2
    assert wait.wrap_tool_call("x", lambda request: request * 2) == "xx"


@pytest.mark.parametrize(
    ("cpus", "options", "split"),
    [
        (2, {"max_steps_off_policy": 1}, ("1", 1)),
        (8, {"max_steps_off_policy": 1}, ("4-7", 4)),
        (2, {}, (None, None)),  # steps in turn: each takes every core while it runs
        (2, {"max_steps_off_policy": 1, "vllm_cores": "0"}, ("0", None)),  # as given
        (1, {"max_steps_off_policy": 1}, (None, None)),
    ],
)
def test_overlapping_steps_split_the_cpu_between_vllm_and_the_trainer(
    cpus: int, options: dict[str, Any], split: tuple[str | None, int | None], monkeypatch: pytest.MonkeyPatch
) -> None:
    from journeyman.backend.app import demo

    monkeypatch.setattr(demo.os, "cpu_count", lambda: cpus)
    monkeypatch.setattr(demo, "cuda_available", lambda: False)
    assert demo.Demo(DemoConfig(**options))._cores() == split
