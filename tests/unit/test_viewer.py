"""The viewer's pages over a store written here: what each page holds, escaping, names, sign-in,
and the token view's trained marks against the trainer's own batch. Real-browser tests (a real
training run's store, clicks, live updates, the XSS payloads in Chromium) are in
tests/integration/test_viewer_browser.py."""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

import journeyman as jm
from journeyman.backend.app.server import create_app
from journeyman.backend.app.ui import attempts
from journeyman.backend.app.ui.app import COOKIE, Viewer, session_value
from journeyman.backend.local import LocalBackend
from journeyman.backend.training.batch import build_batch
from journeyman.messages import ModelTurn
from journeyman.store import ModelStore
from journeyman.trajectory import Failure

PAYLOADS = ["<script>window.pwned = 1</script>", '<img src=x onerror="window.pwned = 2">']
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]


def turn(prompt: list[int], completion: list[int], message: dict[str, object], version: str) -> ModelTurn:
    return ModelTurn.model_validate(
        {
            "message": message,
            "model": version,
            "prompt_token_ids": prompt,
            "completion_token_ids": completion,
            "logprobs": [-0.1 * (i + 1) for i in range(len(completion))],
            "finish_reason": "stop",
        }
    )


def attempt(reward: float, answer: str, *, n: int = 0) -> jm.Trajectory:
    """Two model turns, the second's prompt extending the first's: one training sequence."""
    call = {"id": f"c{n}", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
    first = turn([1, 2, 3], [10 + n, 11], {"role": "assistant", "content": None, "tool_calls": [call]}, "m@1")
    second = turn([1, 2, 3, 10 + n, 11, 4, 5], [20, 21, 22], {"role": "assistant", "content": answer}, "m@1")
    return jm.Trajectory(
        conversation=[
            {"role": "system", "content": "You add."},
            {"role": "user", "content": f"What is 2+3? {PAYLOADS[0]}"},
            first,
            {"role": "tool", "tool_call_id": f"c{n}", "content": PAYLOADS[1]},
            second,
        ],
        tools=TOOLS,
        reward=reward,
        metrics={"success": reward == 1.0},
        metadata={"judge_explanation": f"judged {PAYLOADS[0]}"},
    )


@pytest.fixture
def store(tmp_path: Path) -> ModelStore:
    store = ModelStore("proj", "m", root=tmp_path)
    spread = jm.TrajectoryGroup([attempt(1.0, "5", n=0), attempt(0.0, f"6 {PAYLOADS[1]}", n=1)])
    spread.failures.append(Failure(type="TimeoutError", message="tool took too long", stage="tool"))
    flat = jm.TrajectoryGroup([attempt(0.5, "5", n=2), attempt(0.5, "5", n=3)])
    store.save_groups([spread, flat], "train", 0)
    store.save_groups([jm.TrajectoryGroup([attempt(1.0, "5", n=4)])], "val", 0)
    store.append_history({"step": 0, "split": "val", "val/reward": 0.25})
    store.append_history(
        {"step": 1, "split": "train", "reward/mean": 0.5, "train/loss": 0.1, "data/trained_tokens": 7}
    )
    store.append_history({"step": 1, "split": "val", "val/reward": 0.75})
    with store.write_checkpoint(1) as folder:
        state = {
            "step": 1,
            "base_model": "/nowhere",
            "sequences": {"max_seq_len": 4096, "overlong": "truncate"},
        }
        (folder / "trainer_state.json").write_text(json.dumps({**state, "metrics": {"reward/mean": 0.5}}))
    return store


@pytest.fixture
async def http(store: ModelStore) -> AsyncIterator[httpx.AsyncClient]:
    app = Viewer(store.root).app
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://ui") as client:
        yield client


def links(html: str, pattern: str) -> list[str]:
    return re.findall(rf'href="({pattern})"', html)


async def test_pages_link_runs_to_run_to_step_to_attempt(http: httpx.AsyncClient, store: ModelStore) -> None:
    runs = await http.get("/")
    assert (
        runs.status_code == 200 and "proj/m" in runs.text and "m@1" in runs.text
    )  # served: latest checkpoint
    [run_link] = links(runs.text, "/runs/proj/m")
    run = await http.get(run_link)
    assert run.status_code == 200
    spec = json.loads(re.search(r'id="chart-spec">(.*?)</script>', run.text, re.S).group(1))  # type: ignore[union-attr]
    assert spec["data"]["train"]["series"]["reward/mean"] == [0.5]
    assert spec["data"]["val"]["series"]["val/reward"] == [0.25, 0.75]
    assert ["Reward", "train", ["reward/mean"]] in spec["charts"]
    assert ["Loss terms", "train", ["train/loss"]] in spec["charts"]
    assert ["val: reward and success", "val", ["val/reward"]] in spec["charts"]
    assert 'class="best"' in run.text  # the one checkpoint is the best by val/reward
    step_links = links(run.text, "/runs/proj/m/[a-z]+/0")
    assert sorted(step_links) == ["/runs/proj/m/train/0", "/runs/proj/m/val/0"]
    step = await http.get("/runs/proj/m/train/0")
    assert step.text.count('class="card') == 4 and "no reward spread: not trained on" in step.text
    assert step.text.count("success</span>") == 1 and "tool took too long" in step.text
    attempt_links = links(step.text, "/runs/proj/m/train/0/0/[0-9a-f]+")
    page = await http.get(attempt_links[0])
    assert page.status_code == 200 and "m@1" in page.text and "add" in page.text
    failures = await http.get("/runs/proj/m/failures")
    assert "TimeoutError" in failures.text and "tool took too long" in failures.text


async def test_only_successes_or_failures_are_shown_when_asked(http: httpx.AsyncClient) -> None:
    successes = await http.get("/runs/proj/m/train/0?show=success")
    assert successes.text.count('class="card') == 1
    assert "1 hidden by the filter" in successes.text and "2 hidden by the filter" in successes.text
    assert (await http.get("/runs/proj/m/train/0?show=nope")).status_code == 400


async def test_every_written_string_is_escaped(http: httpx.AsyncClient, store: ModelStore) -> None:
    pages = ["/runs/proj/m/train/0"]
    group = store.load_groups("train", 0)[0]
    pages += [f"/runs/proj/m/train/0/0/{t.id}" for t in group]
    first, second = group.trajectories
    pages.append(f"/runs/proj/m/train/0/0/diff?a={first.id}&b={second.id}")
    for path in pages:
        html = (await http.get(path)).text
        assert "<script>window" not in html and "<img src=x" not in html, path
        assert "&lt;script&gt;window.pwned" in html or "&lt;img src=x" in html, path


@pytest.mark.parametrize(
    "path",
    ["/runs/proj/..%2F..%2Fetc", "/runs/..%2Fproj/m", "/runs/proj/m/..%2Fx/0", "/runs/proj/m/train/0/9/x"],
)
async def test_names_are_validated_before_they_touch_the_filesystem(
    http: httpx.AsyncClient, path: str
) -> None:
    response = await http.get(path)
    assert response.status_code in (400, 404)
    assert "<h1>" in response.text  # an error page, not a traceback


async def test_the_token_view_marks_exactly_what_the_trainer_trains(
    http: httpx.AsyncClient, store: ModelStore
) -> None:
    groups = store.load_groups("train", 0)
    batch = build_batch(groups, None, jm.TrainConfig())
    trained_ids = set().union(*(attempts.trained_attempts(g) for g in groups))
    expected = Counter[str]()
    for sequence in batch.sequences:  # the trainer keeps only trajectories in groups with a spread
        trajectory = [t for g in groups for t in g.trajectories][sequence.trajectory]
        if trajectory.id in trained_ids:
            expected[trajectory.id] += sequence.trained_tokens
    shown = Counter[str]()
    for index, group in enumerate(groups):
        for trajectory in group:
            html = (await http.get(f"/runs/proj/m/train/0/{index}/{trajectory.id}")).text
            shown[trajectory.id] = html.count('class="tok trained"')
    assert shown == expected and sum(shown.values()) == 10  # two attempts x (2 + 3) sampled tokens
    assert sum(shown.values()) != sum(s.trained_tokens for s in batch.sequences)  # the flat group is left out


async def test_an_evaluation_attempt_has_no_trained_tokens(
    http: httpx.AsyncClient, store: ModelStore
) -> None:
    [group] = store.load_groups("val", 0)
    html = (await http.get(f"/runs/proj/m/val/0/0/{group.trajectories[0].id}")).text
    assert 'class="tok trained"' not in html and html.count('class="tok"') == 10
    assert "An evaluation: nothing here was trained on." in html


def test_a_cut_sequence_marks_only_the_tokens_within_max_seq_len() -> None:
    history = attempt(1.0, "5")
    [whole] = attempts.token_sequences(history, str, jm.TrainConfig())
    [cut] = attempts.token_sequences(history, str, jm.TrainConfig(max_seq_len=8))
    assert (whole.trained, cut.trained, cut.cut) == (5, 3, 2)
    assert [trained for _, trained, _ in cut.tokens][:8] == [trained for _, trained, _ in whole.tokens][:8]


async def test_the_run_data_polled_by_the_page_grows_with_the_history(
    http: httpx.AsyncClient, store: ModelStore
) -> None:
    before = (await http.get("/runs/proj/m/data.json")).json()
    store.append_history({"step": 2, "split": "train", "reward/mean": 0.9})
    store.save_groups([jm.TrajectoryGroup([attempt(1.0, "5")])], "train", 1)
    after = (await http.get("/runs/proj/m/data.json")).json()
    assert before["data"]["train"]["step"] == [1] and after["data"]["train"]["step"] == [1, 2]
    # a training step's reward is that of the groups it learned from: stored at the step before
    assert {"split": "train", "step": 1, "reward": 0.9} in after["steps"]
    assert {"split": "train", "step": 0, "reward": 0.5} in after["steps"]


async def test_with_a_token_pages_need_the_sign_in_cookie(store: ModelStore) -> None:
    app = Viewer(store.root, token="s3cret").app
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://ui") as client:
        assert (await client.get("/")).headers["location"] == "/signin"
        assert (await client.get("/runs/proj/m/data.json")).status_code == 401
        wrong = await client.post("/signin", data={"token": "nope"})
        assert wrong.status_code == 401 and COOKIE not in wrong.cookies
        right = await client.post("/signin", data={"token": "s3cret"})
        assert right.status_code == 303
        header = right.headers["set-cookie"]
        assert "HttpOnly" in header and "SameSite=strict" in header and "s3cret" not in header
        assert (await client.get("/")).status_code == 200  # the cookie jar now holds the session
        client.cookies.clear()
        assert (await client.get("/", headers={"Authorization": "Bearer s3cret"})).status_code == 200
        client.cookies.set(COOKIE, "s3cret")  # the token itself is not a session
        assert (await client.get("/")).status_code == 303


async def test_serve_mounts_the_viewer_at_ui_behind_its_token(tmp_path: Path, store: ModelStore) -> None:
    app = create_app(LocalBackend(root=store.root, gateway_thread=False), "s3cret")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://serve") as client:
        assert (await client.get("/ui/")).headers["location"] == "/ui/signin"
        assert (await client.get("/ui/runs/proj/m/data.json")).status_code == 401
        assert (await client.get("/api/models/p/m/step")).status_code == 401  # the API is still guarded
        signed = await client.post("/ui/signin", data={"token": "s3cret"})
        assert signed.headers["location"] == "/ui/" and "Path=/ui" in signed.headers["set-cookie"]
        client.cookies.set(COOKIE, session_value("s3cret"))
        page = await client.get("/ui/runs/proj/m")
        assert page.status_code == 200 and 'href="/ui/runs/proj/m/train/0"' in page.text
        assert (await client.get("/ui/static/uplot.iife.min.js")).status_code == 200


def test_the_ui_command_refuses_to_open_the_store_to_the_network_without_a_token(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from journeyman.backend.app.cli import app

    result = CliRunner().invoke(app, ["ui", "--root", str(tmp_path), "--host", "0.0.0.0"])
    assert result.exit_code != 0 and "without a token" in str(result.exception)


def test_the_viewer_does_not_load_the_trainer() -> None:
    """`journeyman ui` stays a small process (bench/results.md: the viewer's memory)."""
    import subprocess
    import sys

    script = (
        "import sys, journeyman.backend.app.ui.app, journeyman.backend.app.binding\n"
        "print(sorted(m for m in ('torch', 'transformers', 'vllm', 'peft') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_an_attempt_shows_the_policy_steps_that_sampled_it_and_only_its_own_tool_calls() -> None:
    """Under merged serving every turn is served under the base model's name ("served base" for
    every attempt, before): the record's policy version says which step answered. A worked example's
    tool call in the prompt is not the attempt's own."""
    worked = {"id": "w", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 1}'}}
    merged = turn(
        [1, 2], [10, 11], {"role": "assistant", "content": None, "tool_calls": [worked | {"id": "c"}]}, "base"
    )
    merged.policy_version = 3
    trajectory = jm.Trajectory(
        conversation=[
            {"role": "user", "content": "What is 1+1?"},
            {"role": "assistant", "content": None, "tool_calls": [worked]},  # a worked example
            {"role": "tool", "tool_call_id": "w", "content": "2"},
            {"role": "assistant", "content": "2"},
            {"role": "user", "content": "What is 2+3?"},
            merged,
        ],
        reward=1.0,
    )
    assert trajectory.policy_versions == [3]
    (row,) = attempts.group_rows([jm.TrajectoryGroup([trajectory, attempt(0.0, "6")])])
    card = next(c for c in row.attempts if c.id == trajectory.id)
    assert card.versions == ["step 3"] and len(card.calls) == 1
    views = attempts.conversation(trajectory.histories[0])
    assert [v.version for v in views if v.version] == ["step 3"]
    other = next(c for c in row.attempts if c.id != trajectory.id)
    assert other.versions == ["m@1"] and len(other.calls) == 1  # no version recorded: the served name
