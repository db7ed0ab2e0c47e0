"""The viewer in a real browser: Debian's Chromium driven by Playwright, over the store of a real
short training run (the demo on the embedded model, real vLLM, two steps), watched live while it
trains. Screenshots of each page go to ``$JOURNEYMAN_ARTIFACTS/viewer`` (default
``build/artifacts/viewer``)."""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from playwright import sync_api as playwright_api

import journeyman as jm
from journeyman.backend.app.demo import DemoConfig, run_demo
from journeyman.backend.app.server import create_app
from journeyman.backend.app.ui.app import COOKIE, start_viewer
from journeyman.backend.local import LocalBackend
from journeyman.backend.serving.gateway_thread import GatewayThread
from journeyman.store import ModelStore
from tests.firefox_bidi import Firefox, firefox_executable

CHROMIUM = Path(os.environ.get("JOURNEYMAN_CHROMIUM", "/usr/bin/chromium"))
pytestmark = pytest.mark.skipif(
    not CHROMIUM.exists(),
    reason=f"no Chromium at {CHROMIUM}: `make setup` installs Debian's chromium as root",
)

ARTIFACTS = Path(os.environ.get("JOURNEYMAN_ARTIFACTS", "build/artifacts")) / "viewer"
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"]  # fmt: skip
PAYLOADS = ["<script>window.pwned = 1</script>", '<img src=x onerror="window.pwned = 2">']


@dataclass
class Run:
    root: Path
    url: str
    browser: Any
    store: ModelStore
    live_rows: tuple[int, int] = (0, 0)
    """Step rows the run page showed when opened during training, and later without a reload."""
    live_points: tuple[int, int] = (0, 0)
    """Training points its charts drew then and later."""
    live_charts: tuple[int, int] = (0, 0)
    """Charts it drew then (evaluations only: nothing had trained) and later."""
    live_rewards: dict[str, str] = field(default_factory=dict)
    """The reward each training step's row showed at the end, by step."""
    errors: list[str] = field(default_factory=list)

    def page(self) -> Any:
        page = self.browser.new_page(viewport={"width": 1400, "height": 900})
        page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: self.errors.append(str(e)))
        page.on("dialog", lambda d: (self.errors.append(f"dialog: {d.message}"), d.dismiss()))
        return page


def shot(page: Any, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


def rows(page: Any) -> int:
    return int(page.locator("#steps tbody tr").count())


def charts(page: Any) -> int:
    return int(page.locator("figure.chart canvas").count())


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    """The demo trains two steps in a thread while the run page is open in Chromium."""
    root = tmp_path_factory.mktemp("viewer")
    config = DemoConfig(
        steps=2, scenarios_per_step=2, group_size=4, train_scenarios=2, val_scenarios=2, val_samples=1,
        max_tokens=40, name="ui", root=root, zero_shot_eval=False, viewer=False, progress=False,
    )  # fmt: skip
    failure: list[BaseException] = []

    def train() -> None:
        try:
            run_demo(config)
        except BaseException as error:  # reported by the fixture below
            failure.append(error)

    demo = threading.Thread(target=train, name="demo")
    with (
        start_viewer(root, poll_seconds=0.5) as viewer,
        playwright_api.sync_playwright() as playwright,
    ):
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=FLAGS)
        store = ModelStore("demo", "ui", root=root)
        state = Run(root, viewer.base_url, browser, store)
        demo.start()
        deadline = time.monotonic() + 900
        while not store.steps("val") and demo.is_alive() and time.monotonic() < deadline:
            time.sleep(0.5)  # the first evaluation is stored before the first step trains
        page = state.page()
        page.goto(f"{viewer.base_url}/runs/demo/ui")
        opened = (rows(page), int(page.evaluate("document.body.dataset.points")), charts(page))
        demo.join(timeout=max(1.0, deadline - time.monotonic()))
        assert not demo.is_alive(), "the demo did not finish in 15 minutes"
        if failure:
            raise failure[0]
        final = len([1 for split in store.splits() for _ in store.steps(split)])
        page.wait_for_function(
            f"document.querySelectorAll('#steps tbody tr').length === {final}", timeout=20_000
        )
        page.wait_for_function("Number(document.body.dataset.points) === 2", timeout=20_000)
        state.live_rows = (opened[0], rows(page))
        state.live_points = (opened[1], int(page.evaluate("document.body.dataset.points")))
        state.live_charts = (opened[2], charts(page))
        page.wait_for_function(  # a training step's reward is logged after its groups are stored
            "Array.from(document.querySelectorAll('#steps tr[data-key^=\"train/\"] td:last-child'))"
            ".every(cell => cell.textContent !== '—')",
            timeout=20_000,
        )
        for row in page.locator('#steps tr[data-key^="train/"]').all():
            state.live_rewards[row.get_attribute("data-key")] = row.locator("td").last.inner_text()
        shot(page, "run")
        page.close()
        yield state
        browser.close()


def test_a_page_open_during_training_shows_the_next_steps_without_a_reload(run: Run) -> None:
    before, after = run.live_rows
    assert before < after and run.live_points[0] < run.live_points[1] == 2
    assert run.live_charts[0] < run.live_charts[1]  # the training charts appeared
    history = [r for r in run.store.read_history() if r.get("split") == "train"]
    # the groups of stored step s trained step s + 1
    assert run.live_rewards == {f"train/{r['step'] - 1}": f"{r['reward/mean']:.3f}" for r in history}
    assert not run.errors


def test_runs_to_run_to_step_to_attempt_by_clicking(run: Run) -> None:
    page = run.page()
    page.goto(f"{run.url}/")
    shot(page, "runs")
    page.get_by_role("link", name="demo/ui").click()
    page.wait_for_url(re.compile(r"/runs/demo/ui$"))
    figures = page.locator("figure.chart")
    assert figures.count() >= 5 and page.locator("figure.chart canvas").count() == figures.count()
    page.locator('#steps tr[data-key="train/0"] a').click()
    page.wait_for_url(re.compile(r"/runs/demo/ui/train/0$"))
    shot(page, "step")
    cards = page.locator("article.card")
    assert cards.count() == 8  # two groups of four
    rewards = [float(t) for t in page.locator("article.card .reward b").all_inner_texts()]
    first_group = rewards[:4]
    assert first_group == sorted(first_group, reverse=True)  # sorted by reward
    cards.first.locator("h3 a").click()
    page.wait_for_url(re.compile(r"/train/0/0/[0-9a-f]+$"))
    assert page.locator("li.msg.assistant .tag.version").count() >= 1  # each model turn's name@step
    shot(page, "attempt")
    page.goto(f"{run.url}/runs/demo/ui/failures")
    shot(page, "failures")
    page.close()
    assert not run.errors


def test_the_pages_work_from_the_keyboard(run: Run) -> None:
    page = run.page()
    page.goto(f"{run.url}/")
    for _ in range(10):  # Tab through the breadcrumbs to the run's link, then Enter
        page.keyboard.press("Tab")
        if page.evaluate("document.activeElement.textContent") == "demo/ui":
            break
    page.keyboard.press("Enter")
    page.wait_for_url(re.compile(r"/runs/demo/ui$"))
    page.goto(f"{run.url}/runs/demo/ui/train/0")
    page.locator("select[name=a]").first.focus()  # the diff form of the first group
    page.keyboard.press("Tab")
    page.keyboard.press("Tab")
    page.keyboard.press("Enter")
    page.wait_for_url(re.compile(r"/train/0/0/diff\?a=.+&b=.+"))
    assert page.locator("pre.diff span").count() > 0
    page.close()
    assert not run.errors


def test_the_charts_hold_the_runs_values(run: Run) -> None:
    page = run.page()
    page.goto(f"{run.url}/runs/demo/ui")
    history = [r for r in run.store.read_history() if r.get("split") == "train"]
    drawn = page.evaluate("JSON.parse(document.getElementById('chart-spec').textContent).data.train")
    assert drawn["step"] == [r["step"] for r in history]
    assert drawn["series"]["reward/mean"] == [r["reward/mean"] for r in history]
    assert drawn["series"]["train/loss"] == [r.get("train/loss") for r in history]
    page.get_by_label("minutes").check()  # the x axis by minutes redraws every chart
    assert page.locator("figure.chart .u-axis").first.is_visible()
    page.close()
    assert not run.errors


def test_the_token_view_marks_exactly_the_tokens_the_step_trained(run: Run) -> None:
    page = run.page()
    trained = 0
    for index, group in enumerate(run.store.load_groups("train", 0)):
        for trajectory in group:
            page.goto(f"{run.url}/runs/demo/ui/train/0/{index}/{trajectory.id}")
            trained += page.locator(".tokens .tok.trained").count()
    [step_one] = [r for r in run.store.read_history() if r.get("split") == "train" and r["step"] == 1]
    assert trained == step_one["data/trained_tokens"]
    page.close()


def save_payloads(store: ModelStore, split: str) -> list[str]:
    """A group whose messages and judge's explanation hold the payloads; the paths of its step,
    an attempt and a diff, under the run."""
    trajectory = jm.Trajectory(
        conversation=[
            {"role": "user", "content": PAYLOADS[0]},
            {"role": "assistant", "content": PAYLOADS[1]},
        ],
        reward=1.0,
        metadata={"judge_explanation": PAYLOADS[0]},
    )
    group = jm.TrajectoryGroup([trajectory, trajectory.model_copy(update={"id": "other", "reward": 0.0})])
    store.save_groups([group], split, 0)
    return [f"{split}/0", f"{split}/0/0/{trajectory.id}", f"{split}/0/0/diff?a={trajectory.id}&b=other"]


def test_written_payloads_render_as_text_and_never_run(run: Run) -> None:
    page = run.page()
    for path in save_payloads(run.store, "xss"):
        page.goto(f"{run.url}/runs/demo/ui/{path}")
        assert page.evaluate("window.pwned") is None, path
        assert PAYLOADS[1] in page.locator("main").inner_text(), path
    shot(page, "escaped")
    page.close()
    assert not run.errors


def test_ui_under_serve_refuses_a_missing_or_wrong_token(run: Run) -> None:
    class Served:
        app = create_app(LocalBackend(root=run.root, gateway_thread=False), "s3cret-token")

    with GatewayThread(Served(), name="server") as server:
        page = run.page()
        page.goto(f"{server.base_url}/ui/runs/demo/ui")
        assert page.url.endswith("/ui/signin")
        page.fill("#token", "wrong")
        page.get_by_role("button", name="sign in").click()
        assert page.get_by_role("alert").inner_text() == "That is not the server's token."
        page.fill("#token", "s3cret-token")
        page.get_by_role("button", name="sign in").click()
        page.wait_for_url(re.compile(r"/ui/$"))
        assert "demo/ui" in page.locator("#runs").inner_text() and "s3cret" not in page.url
        [cookie] = [c for c in page.context.cookies() if c["name"] == COOKIE]
        assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and "s3cret" not in cookie["value"]
        page.close()
    run.errors.clear()  # the refused requests are logged by Chromium as console errors (401)


@pytest.mark.skipif(firefox_executable() is None, reason="no Firefox: `apt-get install firefox-esr`")
def test_every_page_works_in_firefox_too(run: Run) -> None:
    """Debian's Firefox ESR over WebDriver BiDi: each page loads with no error logged, the run
    page draws its charts and polls, the payloads stay text."""
    first = run.store.load_groups("train", 0)[0].trajectories[0].id
    pages = ["", "runs/demo/ui", "runs/demo/ui/train/0", f"runs/demo/ui/train/0/0/{first}",
             "runs/demo/ui/failures", *(f"runs/demo/ui/{p}" for p in save_payloads(run.store, "xss_firefox"))]  # fmt: skip
    executable = firefox_executable()
    assert executable is not None
    with Firefox(executable) as firefox:
        for path in pages:
            firefox.goto(f"{run.url}/{path}")
            assert firefox.evaluate("document.querySelector('main') !== null"), path
            assert firefox.evaluate("window.pwned") is None, path
            if path == "runs/demo/ui":
                figures = firefox.evaluate("document.querySelectorAll('figure.chart').length")
                assert (
                    figures >= 5
                    and firefox.evaluate("document.querySelectorAll('figure.chart canvas').length") == figures
                )
                firefox.wait_for("document.getElementById('live').textContent.startsWith('live: updated')")
                firefox.screenshot(ARTIFACTS / "firefox-run.png")
            if path.startswith("runs/demo/ui/xss_firefox"):
                assert PAYLOADS[1] in firefox.evaluate("document.querySelector('main').innerText"), path
        assert firefox.errors == []
