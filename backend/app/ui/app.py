"""The viewer's web app: read-only pages over a run store, server-rendered with Jinja2.

Pages (each linkable; ``{run}`` is ``{project}/{model}``)::

    /                                        runs
    /runs/{run}                              curves, evaluations, checkpoints, steps (updates live)
    /runs/{run}/data.json                    what the run page polls
    /runs/{run}/failures                     failures by stage
    /runs/{run}/{split}/{step}               the step's groups, attempts side by side (?show=success)
    /runs/{run}/{split}/{step}/{group}/{id}  one attempt: conversation, extra histories, tokens
    /runs/{run}/{split}/{step}/{group}/diff  two attempts of a group compared (?a=ID&b=ID)

Every string a model, a tool or a user wrote is escaped by the templates (autoescape on, data for
scripts through ``tojson``). Names from the URL are validated by the store before they touch the
filesystem. With a ``token`` (under ``journeyman serve``) every page but the sign-in form needs a
session cookie that the form sets (HttpOnly, SameSite=Strict; its value is an HMAC of the token,
never the token) or the API's bearer header; the token travels only in the form's POST body.
"""

from __future__ import annotations

import hashlib
import hmac
import math
from collections import OrderedDict
from pathlib import Path
from typing import Any

from jinja2 import Environment, PackageLoader, select_autoescape
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Receive, Scope, Send

from journeyman.errors import JourneymanError
from journeyman.store import ModelStore
from journeyman.trajectory import Trajectory, TrajectoryGroup

from ...serving.gateway_thread import GatewayThread
from . import attempts, runs

__all__ = ["COOKIE", "Viewer", "start_viewer"]

COOKIE = "journeyman_ui"
_STATIC = Path(__file__).parent / "static"
_SHOW = {"all", "success", "failure"}
_PARSED_STEPS = 4


class Viewer:
    """The viewer over the store at ``root``; ``.app`` is its ASGI app (serve it with uvicorn,
    :class:`~journeyman.backend.serving.gateway_thread.GatewayThread`, or mount it)."""

    def __init__(self, root: str | Path, *, token: str | None = None, poll_seconds: float = 3.0) -> None:
        self.root = Path(root)
        self.token = token
        self.poll_seconds = poll_seconds
        self.templates = Environment(
            loader=PackageLoader("journeyman.backend.app.ui", "templates"),
            autoescape=select_autoescape(default=True, default_for_string=True),
        )
        self.templates.filters["exp"] = math.exp
        self._tokenizers: dict[str, attempts.Decode | None] = {}
        self._parsed: OrderedDict[tuple[str, int, int], list[TrajectoryGroup]] = OrderedDict()
        routes = [
            Route("/", self.runs_page),
            Route("/signin", self.signin, methods=["GET", "POST"]),
            Route("/runs/{project}/{model}", self.run_page),
            Route("/runs/{project}/{model}/data.json", self.run_data),
            Route("/runs/{project}/{model}/failures", self.failures_page),
            Route("/runs/{project}/{model}/{split}/{step:int}", self.step_page),
            Route("/runs/{project}/{model}/{split}/{step:int}/{group:int}/diff", self.diff_page),
            Route("/runs/{project}/{model}/{split}/{step:int}/{group:int}/{attempt}", self.attempt_page),
            Mount("/static", StaticFiles(directory=_STATIC), name="static"),
        ]
        self.app: ASGIApp = _SignedIn(
            Starlette(routes=routes, exception_handlers={HTTPException: self._error}), token
        )

    # Pages -----------------------------------------------------------------------------------

    async def runs_page(self, request: Request) -> Response:
        summaries = [runs.summarise(store) for store in runs.find_runs(self.root)]
        return self._render(request, "runs.html", runs=summaries, root=str(self.root))

    async def run_page(self, request: Request) -> Response:
        store = self._store(request)
        metric = request.query_params.get("metric", "val/reward")
        lower = request.query_params.get("lower") == "1"
        rows = store.read_history()
        keys = sorted({k for row in rows for k in row})
        data = runs.chart_data(rows)
        return self._render(
            request,
            "run.html",
            run=runs.summarise(store, rows),
            charts=runs.charts(data),
            data=data,
            evals={split: d for split, d in data.items() if split != "train"},
            checkpoints=runs.checkpoints(store, metric, higher_is_better=not lower),
            metric=metric,
            lower=lower,
            metrics=[k for k in keys if k not in ("time", "step", "split")],
            steps=_steps(store, rows),
            poll=self.poll_seconds,
        )

    async def run_data(self, request: Request) -> Response:
        store = self._store(request)
        rows = store.read_history()
        data = runs.chart_data(rows)
        return JSONResponse({"data": data, "charts": runs.charts(data), "steps": _steps(store, rows)})

    async def failures_page(self, request: Request) -> Response:
        store = self._store(request)
        found = runs.failures(store)
        stages = sorted({f.stage for f in found})
        return self._render(
            request, "failures.html", run=runs.summarise(store), failures=found, stages=stages
        )

    async def step_page(self, request: Request) -> Response:
        store, split, step = self._step(request)
        show = request.query_params.get("show", "all")
        if show not in _SHOW:
            raise HTTPException(400, f"show must be one of {sorted(_SHOW)}, got {show!r}")
        groups = attempts.group_rows(self._groups(store, split, step), show)  # type: ignore[arg-type]
        return self._render(
            request, "step.html", run=runs.summarise(store), split=split, step=step, groups=groups, show=show
        )

    async def attempt_page(self, request: Request) -> Response:
        store, split, step = self._step(request)
        group = self._group(store, split, step, request.path_params["group"])
        trajectory = _attempt(group, request.path_params["attempt"])
        run = runs.summarise(store)
        decode = self._decoder(run.base_model)
        trained = split == "train" and trajectory.id in attempts.trained_attempts(group)
        config = runs.train_config(store, step)
        histories = []
        for history in trajectory.histories:
            try:
                tokens = attempts.token_sequences(history, decode or str, config, trained=trained)
                note = None
            except JourneymanError as error:
                tokens, note = [], str(error)
            histories.append((history.name, attempts.conversation(history), tokens, note))
        return self._group_page(
            request, "attempt.html", run, group=group, trajectory=trajectory, histories=histories,
            decoded=decode is not None, trained=trained,
        )  # fmt: skip

    async def diff_page(self, request: Request) -> Response:
        store, split, step = self._step(request)
        group = self._group(store, split, step, request.path_params["group"])
        a = _attempt(group, request.query_params.get("a", ""))
        b = _attempt(group, request.query_params.get("b", ""))
        return self._group_page(
            request, "diff.html", runs.summarise(store), a=a, b=b, lines=attempts.diff(a, b)
        )

    async def signin(self, request: Request) -> Response:
        base = request.scope.get("root_path", "")
        if self.token is None:
            return RedirectResponse(f"{base}/", status_code=303)
        wrong = False
        if request.method == "POST":
            form = await request.form()
            given = str(form.get("token", ""))
            if hmac.compare_digest(given.encode(), self.token.encode()):
                response = RedirectResponse(f"{base}/", status_code=303)
                response.set_cookie(
                    COOKIE, session_value(self.token), httponly=True, samesite="strict", path=base or "/"
                )
                return response
            wrong = True
        return self._render(request, "signin.html", wrong=wrong, status=401 if wrong else 200)

    # Helpers ---------------------------------------------------------------------------------

    def _render(self, request: Request, name: str, status: int = 200, **context: Any) -> HTMLResponse:
        base = request.scope.get("root_path", "")
        html = self.templates.get_template(name).render(base=base, request=request, **context)
        return HTMLResponse(html, status_code=status)

    def _group_page(self, request: Request, name: str, run: runs.RunSummary, **context: Any) -> HTMLResponse:
        """A page about one group of a step: the run, the split, the step and the group's index from
        the URL, and ``context``."""
        params = request.path_params
        return self._render(
            request,
            name,
            run=run,
            split=params["split"],
            step=params["step"],
            group_index=params["group"],
            **context,
        )

    async def _error(self, request: Request, error: Exception) -> Response:
        assert isinstance(error, HTTPException)
        return self._render(request, "error.html", status=error.status_code, message=error.detail)

    def _store(self, request: Request) -> ModelStore:
        try:
            store = ModelStore(request.path_params["project"], request.path_params["model"], root=self.root)
        except JourneymanError as error:
            raise HTTPException(400, str(error)) from None
        if not store.path.is_dir():
            raise HTTPException(404, f"no run {store.project}/{store.model} under {self.root}")
        return store

    def _step(self, request: Request) -> tuple[ModelStore, str, int]:
        store = self._store(request)
        split, step = request.path_params["split"], request.path_params["step"]
        try:
            path = store.trajectories_path(split, step)
        except JourneymanError as error:
            raise HTTPException(400, str(error)) from None
        if not path.is_file():
            raise HTTPException(404, f"no stored groups for {split} step {step}")
        return store, split, step

    def _groups(self, store: ModelStore, split: str, step: int) -> list[TrajectoryGroup]:
        """A step's groups, parsed once while the file stays as it is (a few recent steps are kept:
        the step page and the attempts opened from it read the same file)."""
        path = store.trajectories_path(split, step)
        stat = path.stat()
        key = (str(path), stat.st_mtime_ns, stat.st_size)
        if key not in self._parsed:
            try:
                self._parsed[key] = store.load_groups(split, step)
            except JourneymanError as error:
                raise HTTPException(500, str(error)) from None
            while len(self._parsed) > _PARSED_STEPS:
                self._parsed.popitem(last=False)
        self._parsed.move_to_end(key)
        return self._parsed[key]

    def _group(self, store: ModelStore, split: str, step: int, index: int) -> TrajectoryGroup:
        groups = self._groups(store, split, step)
        if not 0 <= index < len(groups):
            raise HTTPException(404, f"{split} step {step} has {len(groups)} groups, not a group {index}")
        return groups[index]

    def _decoder(self, base_model: str | None) -> attempts.Decode | None:
        key = str(base_model)
        if key not in self._tokenizers:
            self._tokenizers[key] = attempts.tokenizer_for(base_model)
        return self._tokenizers[key]


def start_viewer(
    root: str | Path, host: str = "127.0.0.1", port: int | None = None, *, poll_seconds: float = 3.0
) -> GatewayThread:
    """The viewer over ``root`` on a thread of its own (a free port unless ``port`` says), started;
    ``.base_url`` is its address, ``.stop()`` (or leaving a ``with`` block) stops it."""
    return GatewayThread(Viewer(root, poll_seconds=poll_seconds), host, port, name="viewer").start()


def session_value(token: str) -> str:
    """The sign-in cookie's value: an HMAC of the token (the cookie never holds the token)."""
    return hmac.new(token.encode(), b"journeyman-ui-session", hashlib.sha256).hexdigest()


class _SignedIn:
    """With a token, every path but the sign-in form and its stylesheet needs the session cookie
    or the bearer header; a page asked for without either redirects to the form."""

    def __init__(self, app: ASGIApp, token: str | None) -> None:
        self.app, self.token = app, token
        self.session = session_value(token) if token is not None else ""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.token is None or scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        base = scope.get("root_path", "")
        path = scope["path"][len(base) :] if scope["path"].startswith(base) else scope["path"]
        cookie = request.cookies.get(COOKIE, "")
        bearer = request.headers.get("authorization", "")
        if (
            path in ("/signin", "/static/viewer.css")
            or hmac.compare_digest(cookie.encode(), self.session.encode())
            or hmac.compare_digest(bearer.encode(), f"Bearer {self.token}".encode())
        ):
            await self.app(scope, receive, send)
            return
        if scope["method"] == "GET" and not path.endswith(".json"):
            response: Response = RedirectResponse(f"{base}/signin", status_code=303)
        else:
            response = JSONResponse({"error": {"message": "sign in first", "type": "unauthorized"}}, 401)
        await response(scope, receive, send)


def _attempt(group: TrajectoryGroup, attempt: str) -> Trajectory:
    found = next((t for t in group.trajectories if t.id == attempt), None)
    if found is None:
        raise HTTPException(404, f"group {group.id} has no attempt {attempt!r}")
    return found


def _steps(store: ModelStore, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each stored step of each split, newest first, with its mean reward from the history: an
    evaluation's ``<split>/reward`` at that step; for training groups, the ``reward/mean`` of the
    step that learned from them (the next one). ``None`` when absent."""
    reward: dict[tuple[str, int], Any] = {}
    for row in rows:
        split, step = str(row.get("split", "train")), row.get("step", 0)
        if split == "train":
            reward[(split, step - 1)] = row.get("reward/mean")
        else:
            reward[(split, step)] = row.get(f"{split}/reward")
    result = [
        {"split": split, "step": step, "reward": reward.get((split, step))}
        for split in store.splits()
        for step in store.steps(split)
    ]
    result.sort(key=lambda s: (s["step"], s["split"]), reverse=True)
    return result
