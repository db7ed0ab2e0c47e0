"""`journeyman demo` end to end with tiny settings: real vLLM, LangGraph, trainer and redeploy."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
from typer.testing import CliRunner

from journeyman.backend.app.cli import app
from journeyman.integrations.langfuse import import_trajectories
from journeyman.store import ModelStore
from tests.langfuse_server import LangfuseServer, client_for

TINY = ["--steps", "1", "--scenarios-per-step", "2", "--group-size", "2", "--train-scenarios", "2",
        "--val-scenarios", "2", "--val-samples", "1", "--max-tokens", "40", "--name", "smoke"]  # fmt: skip


def test_demo_evaluates_trains_redeploys_and_reports(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["demo", *TINY, "--root", str(tmp_path)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "held-out success" in result.output and "held-out evaluation" in result.output
    assert "viewer: http://127.0.0.1:" in result.output and "/runs/demo/smoke" in result.output
    store = ModelStore("demo", "smoke", root=tmp_path)
    report = json.loads((store.path / "demo_report.json").read_text())
    assert report["before"]["step"] == 0 and report["after"]["step"] == 1
    assert report["config"]["base_model"] == "smollm2-135m" and report["worked_share"] == 1.0
    for part in ("sampled", "greedy", "zero_shot", "zero_shot_sampled"):
        assert report["after"][part]["n"] == 2 and 0 <= report["after"][part]["success"] <= 1
    assert store.checkpoint_steps()[-1] == 1
    assert Path(report["png"]).read_bytes()[:4] == b"\x89PNG"
    # Trajectories on disk: the training groups and each evaluation, captured token-exact.
    train = store.load_groups("train", 0)
    assert len(train) == 2 and all(len(g) + len(g.failures) == 2 for g in train)
    for split in ("val", "val_greedy", "val_zero_shot", "val_zero_shot_sampled"):
        assert store.steps(split) == [0, 1]
    turns = [turn for g in train for t in g for turn in t.model_turns]
    assert turns and all(turn.is_token_exact for turn in turns)
    served = {r.get("rollouts/n") for r in store.read_history() if r.get("split") == "rollouts"}
    assert served == {4.0}


@pytest.mark.slow
def test_demo_on_qwen_trains_on_both_prompts(tmp_path: Path) -> None:
    """``--model qwen2.5-coder-0.5b``: half of each step's groups see the worked examples, the
    others the zero-shot prompt (system prompt and tools only); both prompts are evaluated."""
    # Served as LoRA: a merging server compiles its graphs first (minutes on 2 cores), LoRA runs eager.
    args = ["demo", *TINY, "--model", "qwen2.5-coder-0.5b", "--no-merge-adapters", "--no-zero-shot-eval"]
    args += ["--root", str(tmp_path)]
    result = CliRunner().invoke(app, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    store = ModelStore("demo", "smoke", root=tmp_path)
    report = json.loads((store.path / "demo_report.json").read_text())
    assert report["config"]["base_model"] == "qwen2.5-coder-0.5b" and report["after"]["step"] == 1
    assert report["worked_share"] == 0.5
    with_examples, zero_shot = store.load_groups("train", 0)  # two questions a step: one group each
    assert {t.metadata["worked_examples"] for t in with_examples} == {True}
    assert {t.metadata["worked_examples"] for t in zero_shot} == {False}
    for t in with_examples:
        assert len(t.messages) > 17 and t.messages[1].content == "What is 12 times 7?"
    for t in zero_shot:  # the system prompt, then the question: no worked example
        assert [m.role for m in t.messages[:2]] == ["system", "user"] and len(t.messages) > 2
        assert t.messages[1].content != "What is 12 times 7?"
    turns = [turn for g in (with_examples, zero_shot) for t in g for turn in t.model_turns]
    assert turns and all(turn.is_token_exact for turn in turns)
    # A mixed run evaluates both prompts, even with --no-zero-shot-eval.
    for part in ("sampled", "greedy", "zero_shot", "zero_shot_sampled"):
        assert report["after"][part]["n"] == 2
    assert store.steps("val_zero_shot") == [0, 1] and store.steps("val") == [0, 1]


@pytest.mark.slow
def test_demo_with_the_ruler_judge_exports_every_trajectory_to_langfuse(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--judge ruler --langfuse``: the local base model judges each training group (so the
    adapters are served with LoRA, keeping the base model), its scores are the rewards trained
    on, and every trajectory reaches Langfuse (here the API-compatible test server) with them."""
    with LangfuseServer(public_key=f"pk-{uuid.uuid4().hex}") as server:
        for key, value in {"LANGFUSE_PUBLIC_KEY": server.public_key, "LANGFUSE_SECRET_KEY": server.secret_key,
                           "LANGFUSE_BASE_URL": server.base_url}.items():  # fmt: skip
            monkeypatch.setenv(key, value)
        args = [
            "demo",
            *TINY,
            "--judge",
            "ruler",
            "--judge-model",  # the policy's own base model, on its own server: no second server
            "smollm2-135m",
            "--judge-method",
            "scores",
            "--judge-anyway",  # two groups of two: too few pairs for the 135M judge to beat chance
            "--langfuse",
            "--no-zero-shot-eval",
            "--root",
            str(tmp_path),
        ]
        result = CliRunner().invoke(app, args, catch_exceptions=False)
        assert result.exit_code == 0, result.output
        assert (
            "serving adapters with LoRA" in result.output
            and "judge: RULER (scores) with base" in result.output
        )
        store = ModelStore("demo", "smoke", root=tmp_path)
        train = store.load_groups("train", 0)
        # Calibrated on the first step's groups, against the rewards the check gave them.
        calibration = json.loads((store.path / "judge_calibration.json").read_text())
        assert "judge calibration" in result.output and calibration["judge"] == "base"
        assert [g["group_id"] for g in calibration["groups"]] == [g.id for g in train]
        for kept, group in zip(calibration["groups"], train, strict=True):
            assert kept["rewards"] == [t.metrics["programmatic_reward"] for t in group]
        judged = [t for g in train for t in g]
        assert len(judged) + sum(len(g.failures) for g in train) == 4
        for group in train:  # each group's best attempts by the judge's score get 1, the others 0
            scores = [t.metrics["ruler_score"] for t in group]
            assert [t.reward for t in group] == [float(score == max(scores)) for score in scores]
        for trajectory in judged:  # the judge's score and the right answer are kept beside the reward
            assert 0 <= trajectory.metrics["ruler_score"] <= 1 and "programmatic_reward" in trajectory.metrics
            assert trajectory.reward == trajectory.metrics["ruler_best"]
        assert [g.metrics.get("judge/failed") for g in train] == [0, 0]  # each group judged, validly

        client = client_for(server)
        try:
            exported = import_trajectories(client, tags=["split:train"])
            assert sorted(t.reward for t in exported) == sorted(t.reward for t in judged)
            for step in (0, 1):  # the held-out evaluations before and after the step
                evaluated = import_trajectories(client, tags=["split:val", f"step:{step}"])
                kept = [t for g in store.load_groups("val", step) for t in g]
                assert sorted(t.id for t in evaluated) == sorted(t.id for t in kept) and kept
        finally:
            client.shutdown()
        assert server.errors == []
