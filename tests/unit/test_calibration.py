"""Judge calibration against scripted judges whose biases are known: the report finds each."""

from __future__ import annotations

import hashlib
import json
import random
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import journeyman as jm
from journeyman.calibration import (
    Calibration,
    GroupCalibration,
    calibrate_judge,
    group_advantages,
    kendall_tau,
    presentation_orders,
)
from journeyman.errors import InvalidDataError
from journeyman.judge import Judge
from journeyman.store import ModelStore
from tests.scripted_judge import Reply, ScriptedJudge, running, trajectory_texts

SYSTEM = {"role": "system", "content": "You are a calculator agent."}
QUESTION = {"role": "user", "content": "What is 2+3?"}


def group(qualities: list[float], seed: int = 0) -> jm.TrajectoryGroup:
    """A group whose i-th trajectory says its quality, which is also its known reward."""
    return jm.TrajectoryGroup(
        [
            jm.Trajectory(
                conversation=[
                    SYSTEM,
                    QUESTION,
                    {"role": "assistant", "content": f"attempt {seed}.{i}: quality={q}"},
                ],
                reward=q,
            )
            for i, q in enumerate(qualities)
        ],
        id=f"group-{seed}",  # a fixed id: it seeds the group's shuffled presentations, so each run is the same
    )


def answer(request: dict[str, Any], score: Callable[[int, str, str], float]) -> Reply:
    """A reply scoring each shown trajectory with ``score(position, id, text)``."""
    shown = trajectory_texts(request)
    body = {
        id_: {"explanation": "-", "score": score(k, id_, text)} for k, (id_, text) in enumerate(shown.items())
    }
    return Reply(json.dumps(body))


def quality(text: str) -> float:
    found = re.search(r"quality=([0-9.]+)", text)
    assert found, text
    return float(found.group(1))


def perfect(request: dict[str, Any]) -> Reply:
    return answer(request, lambda _, __, text: quality(text))


def inverted(request: dict[str, Any]) -> Reply:
    return answer(request, lambda _, __, text: 1 - quality(text))


def first(request: dict[str, Any]) -> Reply:
    return answer(request, lambda position, _, __: 1.0 if position == 0 else 0.0)


def coin(request: dict[str, Any]) -> Reply:
    """Scores drawn from the text and the order shown, so the same request gets the same answer."""
    prompt = request["messages"][-1]["content"]
    return answer(
        request,
        lambda position, _, text: random.Random(
            hashlib.sha256(f"{prompt}{position}{text}".encode()).digest()
        ).random(),
    )


def constant(request: dict[str, Any]) -> Reply:
    return answer(request, lambda *_: 0.5)


QUALITIES = [0.0, 0.1, 0.25, 0.4, 0.5, 0.7, 0.85, 1.0]
GROUPS = [group(random.Random(seed).sample(QUALITIES, 8), seed) for seed in range(6)]  # 6 x 28 pairs


async def test_a_perfect_judge_ranks_every_pair_and_agrees_with_itself(
    script: ScriptedJudge, judge: Judge
) -> None:
    script.respond = perfect
    report = await calibrate_judge(GROUPS, judge, method="scores", orders=3)
    assert (report.pairs, report.correct, report.wrong, report.ties) == (168, 168, 0, 0)
    assert report.pairwise_accuracy == 1.0 and report.kendall_tau == pytest.approx(1.0)
    assert report.position_consistency == 1.0 and report.first_position_bias == pytest.approx(0.0)
    assert report.better_than_chance() and report.p_value < 1e-40
    assert len(script.received) == 18 and report.failed == 0
    # Each presentation puts another trajectory first.
    firsts = {next(iter(trajectory_texts(request).values())) for request in script.received}
    assert len(firsts) == 18
    assert [g.calls for g in report.groups] == [3] * 6
    assert (
        report.groups[0].prompt_tokens == 3 and report.groups[0].completion_tokens == 3
    )  # the script's usage


async def test_an_inverted_judge_is_perfectly_consistent_and_perfectly_wrong(
    script: ScriptedJudge, judge: Judge
) -> None:
    script.respond = inverted
    report = await calibrate_judge(GROUPS, judge, method="scores", orders=2)
    assert report.pairwise_accuracy == 0.0 and report.kendall_tau == pytest.approx(-1.0)
    assert report.position_consistency == 1.0
    assert not report.better_than_chance() and report.p_value == 1.0
    assert "NOT better than chance" in report.table()


async def test_a_judge_that_prefers_the_first_trajectory_shows_its_position_bias(
    script: ScriptedJudge, judge: Judge
) -> None:
    script.respond = first
    report = await calibrate_judge(GROUPS, judge, method="scores", orders=3)
    # Each presentation's first gets 1 and the rest 0: three trajectories average 1/3, five 0.
    assert report.first_position_bias == pytest.approx(2 / 3)
    # Only the pairs of never-first trajectories (10 of 28: always tied) are ordered alike each time.
    assert report.position_consistency == pytest.approx(10 / 28)
    # Tied: the three shown first (3 pairs, 1/3 each) and the five never first (10 pairs, 0 each).
    assert report.ties == 6 * 13 and not report.better_than_chance()


async def test_a_coin_ranks_at_chance(script: ScriptedJudge, judge: Judge) -> None:
    script.respond = coin
    report = await calibrate_judge(GROUPS, judge, method="scores", orders=3)
    assert report.pairwise_accuracy is not None and 0.35 < report.pairwise_accuracy < 0.65
    assert report.kendall_tau is not None and abs(report.kendall_tau) < 0.3
    assert report.position_consistency is not None and report.position_consistency < 0.5
    assert not report.better_than_chance()


async def test_a_judge_that_ties_everything_is_at_chance(script: ScriptedJudge, judge: Judge) -> None:
    script.respond = constant
    report = await calibrate_judge(GROUPS[:2], judge, method="scores", orders=1)
    assert report.ties == report.pairs == 56 and report.pairwise_accuracy == 0.5
    assert report.kendall_tau is None  # the judged scores are constant
    assert report.position_consistency is None  # one presentation: nothing to agree with
    assert report.p_value == 1.0 and not report.better_than_chance()


async def test_judge_failures_are_recorded_and_the_rest_still_count(
    script: ScriptedJudge, judge: Judge
) -> None:
    seen = 0

    def flaky(request: dict[str, Any]) -> Reply:
        nonlocal seen
        seen += 1
        return Reply(status=500) if seen % 3 == 0 else perfect(request)

    script.respond = flaky
    report = await calibrate_judge(GROUPS[:2], judge, method="scores", orders=3)
    assert report.failed == 2 and all(len(g.errors) == 1 for g in report.groups)
    assert "HTTP 500" in report.groups[0].errors[0]
    assert [g.presentations for g in report.groups] == [2, 2]
    assert report.pairwise_accuracy == 1.0  # from the presentations that were scored


async def test_groups_without_two_known_rewards_are_skipped_and_said_why(
    script: ScriptedJudge, judge: Judge
) -> None:
    script.respond = perfect
    unknown = group([0.0, 1.0, 0.5])
    for trajectory in unknown.trajectories[1:]:
        trajectory.reward = None
    report = await calibrate_judge([unknown, GROUPS[0]], judge, method="scores", orders=1)
    assert len(report.groups) == 1 and report.skipped == [
        f"{unknown.id}: 1 trajectory(ies) with a known reward, 2 needed"
    ]
    # A known reward kept by an earlier judging counts, the judge's reward does not.
    judged = GROUPS[0].model_copy(deep=True)
    for trajectory in judged.trajectories:
        trajectory.metrics["programmatic_reward"], trajectory.reward = trajectory.reward, 0.5
    assert (await calibrate_judge([judged], judge, method="scores", orders=1)).pairwise_accuracy == 1.0
    # Labels a person gave, as the truth instead.
    labels = {t.id: 1.0 - float(t.reward or 0) for t in GROUPS[0].trajectories}
    assert (
        await calibrate_judge([GROUPS[0]], judge, method="scores", orders=1, truth=lambda t: labels[t.id])
    ).pairwise_accuracy == 0.0


async def test_the_report_saves_as_json_with_each_group(
    script: ScriptedJudge, judge: Judge, tmp_path: Path
) -> None:
    script.respond = perfect
    report = await calibrate_judge(GROUPS[:2], judge, method="scores", orders=2)
    data = json.loads(report.save(tmp_path / "out" / "calibration.json").read_text())
    assert data["judge"] == "judge" and data["orders"] == 2
    assert data["summary"]["pairwise_accuracy"] == 1.0 and data["summary"]["pairs"] == 56
    assert [g["group_id"] for g in data["groups"]] == [g.id for g in GROUPS[:2]]
    assert data["groups"][0]["rewards"] == [t.reward for t in GROUPS[0].trajectories]
    assert data["groups"][0]["scores"] == data["groups"][0]["rewards"]  # a perfect judge's mean scores
    lines = report.table().splitlines()
    assert lines[0].split()[:3] == ["group", "n", "pairs"] and lines[-3].split()[0] == "all"
    assert lines[-1].startswith("advantages vs the known reward's: cosine 1.00")


async def test_cached_presentations_are_counted(script: ScriptedJudge, tmp_path: Path) -> None:
    script.respond = perfect
    with running(script) as url:
        judge = Judge("judge", base_url=url, max_retries=0, cache_dir=tmp_path / "cache")
        await calibrate_judge(GROUPS[:1], judge, method="scores", orders=3)
        again = await calibrate_judge(GROUPS[:1], judge, method="scores", orders=3)
    assert again.groups[0].cached == 3 and again.groups[0].calls == 0 and len(script.received) == 3


async def test_bad_arguments_get_a_clear_error(judge: Judge) -> None:
    with pytest.raises(jm.ConfigError, match="orders must be >= 1"):
        await calibrate_judge(GROUPS, judge, method="scores", orders=0)
    with pytest.raises(InvalidDataError, match="takes TrajectoryGroups, got a list"):
        await calibrate_judge([GROUPS[0].trajectories], judge)  # type: ignore[list-item]


def test_presentations_put_each_trajectory_first_until_all_have_been() -> None:
    rng = random.Random(1)
    plans = presentation_orders(4, 6, rng)
    assert plans[0] == [0, 1, 2, 3] and all(sorted(p) == [0, 1, 2, 3] for p in plans)
    assert {p[0] for p in plans[:4]} == {0, 1, 2, 3}


def test_kendall_tau_b_matches_its_definition() -> None:
    assert kendall_tau([1, 2, 3], [1, 3, 2]) == pytest.approx(1 / 3)
    assert kendall_tau([1, 1, 2], [1, 2, 3]) == pytest.approx(2 / 6**0.5)  # scipy.stats.kendalltau: 0.8165
    assert kendall_tau([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    assert kendall_tau([1, 1, 1], [1, 2, 3]) is None


def test_the_cli_calibrates_stored_groups_and_can_fail_at_chance(
    script: ScriptedJudge, tmp_path: Path
) -> None:
    from typer.testing import CliRunner

    from journeyman.backend.app.cli import app

    store = ModelStore("demo", "agent", root=tmp_path)
    store.save_groups(GROUPS[:2], "train", 1)
    store.save_groups(GROUPS[2:3], "train", 2)
    runner = CliRunner()
    with running(script) as url:
        args = ["judge", "calibrate", "demo", "agent", "--judge-model", "judge", "--judge-base-url", url,
                "--method", "scores", "--orders", "2", "--root", str(tmp_path)]  # fmt: skip
        script.respond = perfect
        result = runner.invoke(app, args)
        assert result.exit_code == 0, result.output
        assert "better than chance" in result.output and "NOT" not in result.output
        data = json.loads((store.path / "calibration" / "judge.json").read_text())
        assert data["summary"]["pairs"] == 3 * 28 and data["summary"]["pairwise_accuracy"] == 1.0
        assert len(script.received) == 6

        result = runner.invoke(
            app, [*args, "--step", "2", "--fail-at-chance", "--out", str(tmp_path / "r.json")]
        )
        assert (
            result.exit_code == 0 and json.loads((tmp_path / "r.json").read_text())["summary"]["pairs"] == 28
        )

        labels = tmp_path / "labels.jsonl"  # a person's labels, the reverse of the stored rewards
        labels.write_text(
            "".join(json.dumps({"trajectory_id": t.id, "reward": -(t.reward or 0)}) + "\n" for t in GROUPS[2])
        )
        result = runner.invoke(app, [*args, "--step", "2", "--labels", str(labels), "--fail-at-chance"])
        assert result.exit_code == 2 and "NOT better than chance" in result.output

        labels.write_text('{"trajectory_id": "x"}\n')
        result = runner.invoke(app, [*args, "--labels", str(labels)])
        assert isinstance(result.exception, jm.JourneymanError) and "labels.jsonl, line 1" in str(
            result.exception
        )


async def test_a_verdict_judge_is_calibrated_from_one_presentation(
    script: ScriptedJudge, judge: Judge
) -> None:
    import math

    def reads(request: dict[str, Any]) -> Reply:
        (text,) = trajectory_texts_alone(request)
        q = min(max(quality(text), 0.01), 0.99)
        return Reply(top_logprobs={"yes": math.log(q), "no": math.log(1 - q)})

    script.respond = reads
    report = await calibrate_judge(GROUPS[:2], judge, method="verdict")
    assert report.orders == 1 and report.method == "verdict" and len(script.received) == 16
    assert report.pairwise_accuracy == 1.0 and report.kendall_tau == pytest.approx(1.0)
    assert "(verdict)" in report.table()


def trajectory_texts_alone(request: dict[str, Any]) -> list[str]:
    return re.findall(r"<trajectory>\n(.*?)\n</trajectory>", request["messages"][-1]["content"], re.DOTALL)


def test_advantages_are_grpo_s() -> None:
    assert group_advantages([1.0, 0.0]) == pytest.approx([1.0, -1.0], rel=1e-5)
    assert group_advantages([1.0, 0.0], "none") == pytest.approx([0.5, -0.5])
    assert group_advantages([0.3, 0.3, 0.3]) == [0.0, 0.0, 0.0]
    assert group_advantages([0.7]) == [0.0]


@pytest.mark.parametrize("scale", ["group", "none"])
def test_group_advantages_match_the_trainers(scale: str) -> None:
    """Core's torch-free twin of backend/training/loss.py ``advantages``, group by group."""
    import torch

    from journeyman.backend.training.loss import advantages

    groups = [[0.2, 0.9, 0.4, 0.9], [1.0, 1.0, 1.0], [0.0, 1.0], [0.5]]
    rewards = torch.tensor([r for g in groups for r in g], dtype=torch.float64)
    index = torch.tensor([k for k, g in enumerate(groups) for _ in g])
    trainer, _ = advantages(rewards, index, scale)  # type: ignore[arg-type]
    ours = [a for g in groups for a in group_advantages(g, scale)]  # type: ignore[arg-type]
    assert ours == pytest.approx(trainer.tolist(), abs=1e-9)


async def test_advantage_alignment_finds_noise_that_group_scaling_blows_up(
    script: ScriptedJudge, judge: Judge
) -> None:
    """A judge that ranks mixed groups right but scores attempts of equal known reward a little
    apart: scaled by each group's std, that little spread becomes advantages as large as the real
    ones; unscaled, it stays small."""
    mixed = [group([0.0, 1.0, 0.0, 1.0], seed) for seed in range(2)]
    solved = [group([1.0, 1.0, 1.0, 1.0], seed) for seed in range(2, 4)]

    def nearly_right(request: dict[str, Any]) -> Reply:  # 0.05 or 0.95, give or take 0.02
        return answer(
            request,
            lambda _, __, text: 0.05 + 0.9 * quality(text) + 0.01 * (int(text.split(".")[1][0]) - 1.5),
        )

    script.respond = nearly_right
    report = await calibrate_judge([*mixed, *solved], judge, method="scores", orders=1)
    assert report.pairwise_accuracy == 1.0  # the ranking is perfect; what training sees is not
    assert report.noise_share("group") == pytest.approx(0.5, abs=0.01)  # half of it is noise
    assert report.advantage_alignment("group") == pytest.approx(0.707, abs=0.01)
    assert report.noise_share("none") < 0.002 and report.advantage_alignment("none") > 0.999
    summary = report.to_dict()["summary"]
    assert summary["advantage_alignment_group"] == report.advantage_alignment("group")
    assert "cosine 0.71 (scaled by group std; noise share 0.50)" in report.table()

    script.respond = perfect
    exact = await calibrate_judge([*mixed, *solved], judge, method="scores", orders=1)
    assert exact.advantage_alignment("group") == pytest.approx(1.0) and exact.noise_share("group") == 0.0


def test_advantage_alignment_with_rewards_made_of_ranks_or_the_best() -> None:
    """A judge that orders a group right but scores a near-miss beside the success: its scores'
    advantages leave the near-miss near the mean; ranks spread it; the best alone matches the truth."""
    scores, rewards = [0.96, 0.95, 0.14, 0.95], [1.0, 0.0, 0.0, 0.0]
    report = Calibration(
        judge="j", orders=1, groups=[GroupCalibration("g", 4, scores=scores, rewards=rewards)]
    )
    by = {made_of: report.advantage_alignment("group", made_of) for made_of in ("score", "rank", "best")}
    assert by["score"] < by["rank"] < by["best"] == pytest.approx(1.0)
    summary = report.to_dict()["summary"]
    assert summary["advantage_alignment_group_best"] == by["best"]
    assert summary["advantage_alignment_group_rank"] == by["rank"]
    assert f"rewards made of ranks {by['rank']:.2f}, of the best 1 and the rest 0 1.00" in report.table()


def test_the_cli_can_calibrate_a_judge_that_writes_a_reference_first(
    script: ScriptedJudge, tmp_path: Path
) -> None:
    import math

    from typer.testing import CliRunner

    from journeyman.backend.app.cli import app

    def reads(request: dict[str, Any]) -> Reply:
        if not request.get("logprobs"):  # the reference, asked once for the group
            return Reply("Add 2 and 3 with the tool, then say 5.")
        assert "Add 2 and 3 with the tool" in request["messages"][-1]["content"]
        q = min(max(quality(trajectory_texts_alone(request)[0]), 0.01), 0.99)
        return Reply(top_logprobs={"yes": math.log(q), "no": math.log(1 - q)})

    script.respond = reads
    ModelStore("demo", "agent", root=tmp_path).save_groups(GROUPS[:1], "train", 1)
    with running(script) as url:
        result = CliRunner().invoke(
            app,
            ["judge", "calibrate", "demo", "agent", "--judge-model", "judge", "--judge-base-url", url,
             "--method", "verdict", "--reference", "--out", str(tmp_path / "r.json"), "--root", str(tmp_path)],
        )  # fmt: skip
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["reference"] is True and report["summary"]["pairwise_accuracy"] == 1.0
    assert sum(not r.get("logprobs") for r in script.received) == 1
