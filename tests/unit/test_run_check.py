"""check_run: each promise about a run's files, kept and broken, on a store written by hand."""

from __future__ import annotations

import json
from pathlib import Path

import journeyman as jm
from journeyman.messages import AssistantMessage, ModelTurn
from journeyman.run_check import check_run
from journeyman.store import CHECKPOINT_STATE, ModelStore


def _group(*completion_ids: str) -> jm.TrajectoryGroup:
    trajectories = [
        jm.Trajectory(
            conversation=[
                {"role": "user", "content": "hi"},
                ModelTurn(
                    message=AssistantMessage(content="hello"),
                    completion_id=cid,
                    prompt_token_ids=[1, 2],
                    completion_token_ids=[3],
                    logprobs=[-0.1],
                ),
            ],
            reward=float(number),
        )
        for number, cid in enumerate(completion_ids)
    ]
    return jm.TrajectoryGroup(trajectories)


def _run(root: Path, steps: int = 2) -> ModelStore:
    """A run of ``steps`` completed steps, two turns a step, each recorded once by the gateway."""
    store = ModelStore("demo", "run", root=root)
    records = []
    for step in range(steps + 1):
        with store.write_checkpoint(step) as folder:
            (folder / CHECKPOINT_STATE).write_text(json.dumps({"metrics": {}}))
        if step < steps:
            ids = (f"c{step}a", f"c{step}b")
            store.save_groups([_group(*ids)], "train", step)
            store.append_history({"step": step + 1, "split": "train", "train/loss": 0.5})
            records += [{"completion_id": cid, "policy_version": step} for cid in ids]
    (root / "gateway").mkdir()
    (root / "gateway" / "completions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return store


def test_a_run_that_keeps_every_promise(tmp_path: Path) -> None:
    store = _run(tmp_path)
    (store.checkpoints_path / ".0003.abc.tmp").mkdir()  # a write that was killed: hidden, counted
    check = check_run(store.path)
    assert check.ok, check.problems
    assert (check.latest_step, check.trained_steps, check.trained_groups, check.records) == (2, 2, 2, 4)
    assert check.unfinished_step is None and check.hidden_leftovers == 1


def test_an_unfinished_step_is_reported_apart(tmp_path: Path) -> None:
    store = _run(tmp_path)
    store.save_groups([_group("c2a", "c2b")], "train", 2)  # stored, not trained: the run stopped here
    check = check_run(store.path)
    assert check.ok and check.unfinished_step == 2


def test_each_broken_promise_is_named(tmp_path: Path) -> None:
    store = _run(tmp_path)
    store.save_groups([_group("c0a")], "train", 1)  # a turn of step 0 trained again in step 1
    store.append_history({"step": 2, "split": "train"})  # step 2's row twice
    (store.path / "trajectories" / "train" / "0007.jsonl.tmp").write_text("{")  # visible half-write
    with (tmp_path / "gateway" / "completions.jsonl").open("a") as records:
        records.write(json.dumps({"completion_id": "c1a"}) + "\n")  # recorded twice
    store.save_groups([_group("c1z")], "train", 1)  # trained, never recorded
    problems = "\n".join(check_run(store.path).problems)
    assert "trained on more than once: ['c0a']" in problems
    assert "not once each for 1..2" in problems
    assert "a temporary file is visible" in problems
    assert "recorded more than once: ['c1a']" in problems
    assert "no gateway record: ['c1z']" in problems


def test_journeyman_check_exits_1_on_a_broken_promise(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from journeyman.backend.app.cli import app

    store = _run(tmp_path)
    held = CliRunner().invoke(app, ["check", str(store.path)])
    assert held.exit_code == 0 and "every promise holds" in held.output
    store.append_history({"step": 1, "split": "train"})
    broken = CliRunner().invoke(app, ["check", str(store.path)])
    assert broken.exit_code == 1 and "1 problem(s)" in broken.output


def test_missing_checkpoints_and_trajectories_are_named(tmp_path: Path) -> None:
    store = _run(tmp_path, steps=3)
    (store.checkpoint_path(1) / CHECKPOINT_STATE).unlink()
    store.trajectories_path("train", 2).unlink()
    problems = "\n".join(check_run(store.path).problems)
    assert "checkpoint 1 is incomplete" in problems
    assert "files for steps [2] missing" in problems


def test_turns_answered_by_an_older_version_are_counted_and_fail_an_on_policy_check(tmp_path: Path) -> None:
    store = _run(tmp_path)
    path = tmp_path / "gateway" / "completions.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()]
    records[2]["policy_version"] = 0  # step 1's first turn, sampled before step 1 was served
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert check_run(store.path).ok and check_run(store.path).stale_turns == 1
    strict = check_run(store.path, on_policy=True)
    assert strict.problems == [
        "1 trained turns were answered by an older version than their step's, up to 1 versions behind "
        "(at most 0 allowed)"
    ]
    assert (
        check_run(store.path, max_off_policy=1).ok
        and check_run(store.path, max_off_policy=1).most_off_policy == 1
    )


def test_a_run_that_overlaps_by_k_steps_may_train_turns_up_to_k_versions_old(tmp_path: Path) -> None:
    store = _run(tmp_path, steps=4)
    path = tmp_path / "gateway" / "completions.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()]
    for record in records:  # each step trained on what the version two steps before it sampled
        record["policy_version"] = max(0, record["policy_version"] - 2)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert check_run(store.path, max_off_policy=2).ok
    behind = check_run(store.path, max_off_policy=1)
    assert behind.most_off_policy == 2 and behind.stale_turns == 6
    assert behind.problems == [
        "6 trained turns were answered by an older version than their step's, up to 2 versions behind "
        "(at most 1 allowed)"
    ]
    from typer.testing import CliRunner

    from journeyman.backend.app.cli import app

    allowed = CliRunner().invoke(app, ["check", str(store.path), "--max-off-policy", "2"])
    assert allowed.exit_code == 0 and "(at most 2 behind)" in allowed.output
    assert CliRunner().invoke(app, ["check", str(store.path), "--max-off-policy", "1"]).exit_code == 1
    assert CliRunner().invoke(app, ["check", str(store.path), "--on-policy"]).exit_code == 1


def test_the_served_step_needs_its_checkpoint(tmp_path: Path) -> None:
    store = _run(tmp_path)
    store.append_promotion({"action": "rollback", "step": 5, "by": "me"})
    assert check_run(store.path).problems == ["the plain name serves step 5, which has no checkpoint"]
