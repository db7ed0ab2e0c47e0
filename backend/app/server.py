"""``journeyman serve``: a LocalBackend over HTTP, for agents and training scripts elsewhere.

Endpoints (JSON; all but ``/health`` need ``Authorization: Bearer <token>`` when a token is set)::

    GET    /health
    POST   /api/models                                   register {name, project, base_model, lora}
    GET    /api/models/{project}/{name}/step
    POST   /api/models/{project}/{name}/train            {groups, config, promote} -> NDJSON progress events
    POST   /api/models/{project}/{name}/history          {row, groups}: a client loop's rollouts or evaluation row
    POST   /api/models/{project}/{name}/sft              {trajectories, evaluation, config, promote} -> NDJSON
                                                         progress events (a 'batch' event per batch)
    GET    /api/models/{project}/{name}/promoted         the step the plain name serves
    POST   /api/models/{project}/{name}/promoted         {step, action, by, gate, share}: promote, roll back,
                                                         hold, canary
    GET    /api/models/{project}/{name}/checkpoints      the steps with a complete checkpoint
    DELETE /api/models/{project}/{name}/checkpoints      ?best_metric=val/reward
    PUT    /api/deployments/{name}/{step}                ?base_model=...; a tar of an adapter (serving/adapters.py)
    GET    /api/serving                                  {policy_restarts, judge_restarts, policy_down,
                                                         judge_down}: the vLLM servers' restarts and state
    /v1/..., /r/{rollout_id}/v1/..., /records/...        the capture gateway
    /ui/...                                              the viewer (journeyman.backend.app.ui): a browser
                                                         signs in once through its token form; a run's
                                                         page is /ui/runs/{project}/{name}

Binding beyond loopback without a token is refused. Tokens are compared in constant time and
never forwarded to vLLM or logged. Names are validated (no path traversal) and request bodies
are capped in size. Errors are ``{"error": {"message", "type"}}`` with a message that says what
to do.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import shutil
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Mount, Route, Router
from starlette.types import ASGIApp, Receive, Scope, Send

from journeyman.config import LoRAConfig, SFTConfig, TrainConfig
from journeyman.errors import AdapterError, ConfigError, InvalidDataError, JourneymanError
from journeyman.model import TrainableModel, TrainResult
from journeyman.sft import check_conversations
from journeyman.store import PROMOTION_ACTIONS, atomic_dir, validate_name
from journeyman.trackers import TrackerSync, make_trackers
from journeyman.trajectory import Trajectory, TrajectoryGroup, format_validation_error

from ..local import LocalBackend
from ..serving.adapters import unpack_adapter
from .binding import check_bind
from .ui.app import Viewer

__all__ = ["MAX_BODY_BYTES", "check_bind", "create_app"]

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 * 2**20
"""Largest request body accepted (a train upload of many long trajectories fits)."""


class _NotRegistered(ConfigError):
    """A model path names no registered model."""


def _viewer_path(path: str) -> bool:
    return path == "/ui" or path.startswith("/ui/")


def _error(status: int, message: str, kind: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind}}, status_code=status)


class _Guard:
    """Bearer-token check and body-size limit in front of every route but /health."""

    def __init__(self, app: ASGIApp, token: str | None, max_body: int) -> None:
        self.app, self.token, self.max_body = app, token, max_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] == "/health":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        if self.token is not None and not _viewer_path(scope["path"]):  # the viewer signs in itself
            given = headers.get(b"authorization", b"")
            if not hmac.compare_digest(given, f"Bearer {self.token}".encode()):
                response = _error(
                    401, "missing or wrong token: send 'Authorization: Bearer <token>'", "unauthorized"
                )
                await response(scope, receive, send)
                return
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            await self._too_large(scope, receive, send)
            return
        # Read the body here, counting as it arrives (a chunked upload has no length header), and
        # hand the app a replay of it: an oversize body is refused before any handler runs.
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                await self.app(scope, receive, send)  # disconnected: let the app see it
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body:
                await self._too_large(scope, receive, send)
                return
            more = message.get("more_body", False)
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Any:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        message = f"request body over {self.max_body} bytes: send fewer or smaller groups per call"
        await _error(413, message, "too_large")(scope, receive, send)


def _json_body(
    handler: Callable[[Request, dict[str, Any]], Awaitable[Response]],
) -> Callable[[Request], Awaitable[Response]]:
    async def wrapped(request: Request) -> Response:
        try:
            body = json.loads(await request.body())
        except ValueError as error:
            return _error(400, f"the request body is not JSON: {error}", "invalid_request")
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object", "invalid_request")
        try:
            return await handler(request, body)
        except ValidationError as error:
            return _error(422, format_validation_error(error, "request"), "invalid_request")
        except (ConfigError, InvalidDataError) as error:
            return _error(400, str(error), "invalid_request")

    return wrapped


def deployment_route(backend: LocalBackend) -> Route:
    """``PUT /api/deployments/{name}/{step}`` for ``journeyman serve`` (behind its token check)."""

    async def receive(request: Request) -> Response:
        try:
            name = validate_name(request.path_params["name"], "model name")
            step = _step(request.path_params["step"])
            base_model = request.query_params.get("base_model")
            if not base_model:
                raise InvalidDataError("add ?base_model=<the adapter's base model> to the URL")
            folder = backend.root / "deployments" / name / f"{step:04d}"
            if folder.exists():
                raise AdapterError(f"{name}@{step} was deployed here already; push each step once")
            data = await request.body()
            with atomic_dir(folder) as staging:
                unpack_adapter(data, staging)
        except (ConfigError, InvalidDataError) as error:
            return _error(400, str(error), "invalid_request")
        except AdapterError as error:
            return _error(409, str(error), "conflict")
        try:
            served = await backend.deploy_adapter(name, base_model, folder, step)
        except AdapterError as error:
            shutil.rmtree(folder, ignore_errors=True)  # a later push of this step may succeed
            return _error(502, str(error), "adapter_error")
        return JSONResponse({"served_name": served, "step": step})

    return Route("/api/deployments/{name}/{step}", receive, methods=["PUT"])


def _step(text: str) -> int:
    if not text.isdigit():
        raise InvalidDataError(f"the step must be a whole number, got {text!r}")
    return int(text)


SERVER_SPLITS = ("train", "sft", "sft_batch")
"""History splits the server's own trainer writes: a client does not send them."""


class _Api:
    """The model routes of the server: register, step, train, checkpoints."""

    def __init__(self, backend: LocalBackend, report_to: Sequence[str] = ()) -> None:
        self.backend = backend
        self.models: dict[tuple[str, str], TrainableModel] = {}
        self.report_to = list(report_to)
        self.trackers: dict[tuple[str, str], TrackerSync] = {}
        """Each model's trackers, following its store here, where it trains."""

    def routes(self) -> list[Route]:
        return [
            Route("/health", self.health, methods=["GET"]),
            Route("/api/models", _json_body(self.register), methods=["POST"]),
            Route("/api/models/{project}/{name}/step", self.step, methods=["GET"]),
            Route("/api/models/{project}/{name}/train", _json_body(self.train), methods=["POST"]),
            Route("/api/models/{project}/{name}/sft", _json_body(self.sft), methods=["POST"]),
            Route("/api/models/{project}/{name}/history", _json_body(self.history), methods=["POST"]),
            Route("/api/models/{project}/{name}/checkpoints", self.checkpoints, methods=["GET", "DELETE"]),
            Route("/api/models/{project}/{name}/promoted", self.promoted, methods=["GET"]),
            Route("/api/models/{project}/{name}/promoted", _json_body(self.promote), methods=["POST"]),
            deployment_route(self.backend),  # adapters pushed by a trainer on another machine
            Route("/api/serving", self.serving, methods=["GET"]),
        ]

    def model_of(self, request: Request) -> TrainableModel:
        project = validate_name(request.path_params["project"], "project name")
        name = validate_name(request.path_params["name"], "model name")
        if (project, name) not in self.models:
            raise _NotRegistered(f"model {project}/{name} is not registered: POST /api/models first")
        return self.models[(project, name)]

    def lookup(self, request: Request) -> TrainableModel | Response:
        """The model named in the path, or the error response: 400 for a bad name, 404 if unknown."""
        try:
            return self.model_of(request)
        except ConfigError as error:
            return _error(404 if isinstance(error, _NotRegistered) else 400, str(error), "not_found")

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def serving(self, request: Request) -> Response:
        """The servers' restarts and whether they are down (a client's loop samples or judges again)."""
        return JSONResponse(dataclasses.asdict(await self.backend.serving_state()))

    async def register(self, request: Request, body: dict[str, Any]) -> Response:
        for key in ("name", "project", "base_model"):
            if not isinstance(body.get(key), str):
                raise InvalidDataError(f"'{key}' must be a string")
        model = TrainableModel(
            name=body["name"],
            project=body["project"],
            base_model=body["base_model"],
            lora=body.get("lora") or LoRAConfig(),
            root=self.backend.root,
        )
        registration = await self.backend.register(model)
        self.models[(model.project, model.name)] = model
        here = f"{str(request.base_url).rstrip('/')}/v1"
        base = here if self.backend.inference else registration.base_url
        return JSONResponse({"base_url": base, "step": registration.step})  # rollouts go there

    async def step(self, request: Request) -> Response:
        model = self.lookup(request)
        if isinstance(model, Response):
            return model
        return JSONResponse({"step": await self.backend.get_step(model)})

    async def train(self, request: Request, body: dict[str, Any]) -> Response:
        model = self.model_of(request)
        groups = [TrajectoryGroup.model_validate(group) for group in body.get("groups") or []]
        if not groups:
            raise InvalidDataError("'groups' must be a non-empty list of trajectory groups")
        config = TrainConfig.model_validate(body.get("config") or {})
        promote = _promote_flag(body)
        started = {"event": "started", "groups": len(groups)}
        training = self.backend.train(model, groups, config, promote=promote)
        events = _train_events(model, started, training, self.track)
        return StreamingResponse(events, media_type="application/x-ndjson")

    async def sft(self, request: Request, body: dict[str, Any]) -> Response:
        """A supervised run; its batches are streamed as 'batch' events."""
        model = self.model_of(request)
        trajectories = _trajectories(body.get("trajectories"), "trajectories")
        evaluation = body.get("evaluation")
        held = None if evaluation is None else _trajectories(evaluation, "evaluation")
        check_conversations(trajectories)
        if held is not None:
            check_conversations(held, "the evaluation conversations")
        config = SFTConfig.model_validate(body.get("config") or {})
        promote = _promote_flag(body)
        batches: asyncio.Queue[bytes] = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def progress(row: dict[str, Any], total: int) -> None:  # on the trainer's thread
            event = json.dumps({"event": "batch", "total": total, **row}).encode() + b"\n"
            loop.call_soon_threadsafe(batches.put_nowait, event)

        started = {"event": "started", "conversations": len(trajectories)}
        training = self.backend.train_sft(
            model, trajectories, config, evaluation=held, promote=promote, progress=progress
        )
        return StreamingResponse(
            _train_events(model, started, training, self.track, batches), media_type="application/x-ndjson"
        )

    async def history(self, request: Request, body: dict[str, Any]) -> Response:
        """A row a client's loop wrote (its rollouts, an evaluation and its groups), kept in this
        store beside the steps trained here, for the trackers that follow it."""
        model = self.model_of(request)
        row, groups = body.get("row"), body.get("groups")
        if (
            not isinstance(row, dict)
            or not isinstance(row.get("step"), int)
            or not isinstance(row.get("split"), str)
        ):
            raise InvalidDataError(
                "expected {'row': {'step': <int>, 'split': <str>, ...}, 'groups': [...] or null}"
            )
        if row["split"] in SERVER_SPLITS:
            raise InvalidDataError(
                f"{row['split']!r} rows are written here, where training happens, not sent"
            )
        validate_name(row["split"], "split")
        if groups is not None:
            if not isinstance(groups, list):
                raise InvalidDataError("'groups' must be a list of trajectory groups or null")
            stored = [TrajectoryGroup.model_validate(group) for group in groups]
            await asyncio.to_thread(model.store.save_groups, stored, row["split"], row["step"])
        await asyncio.to_thread(model.store.append_history, row)
        await self.track(model)
        return JSONResponse({"ok": True})

    async def track(self, model: TrainableModel) -> None:
        """Send the model's trackers what its store recorded since (failures are theirs to count)."""
        if not self.report_to:
            return
        key = (model.project, model.name)
        if key not in self.trackers:
            config = {"project": model.project, "model": model.name, "base_model": model.base_model}
            self.trackers[key] = TrackerSync(
                model.store,
                make_trackers(self.report_to),
                config=config,
                metrics_url=self.backend.metrics_url(),
            )
        await asyncio.to_thread(self.trackers[key].sync)

    async def close_trackers(self) -> None:
        for sync in self.trackers.values():
            await asyncio.to_thread(sync.close)
        self.trackers.clear()

    async def promoted(self, request: Request) -> Response:
        model = self.lookup(request)
        if isinstance(model, Response):
            return model
        return JSONResponse({"step": await self.backend.promoted_step(model)})

    async def promote(self, request: Request, body: dict[str, Any]) -> Response:
        model = self.model_of(request)
        step, action, by, gate = body.get("step"), body.get("action"), body.get("by"), body.get("gate")
        if not isinstance(step, int) or isinstance(step, bool) or action not in PROMOTION_ACTIONS:
            raise InvalidDataError(
                f"expected {{'step': <int>, 'action': one of {', '.join(PROMOTION_ACTIONS)}, 'by': ..., 'gate': ...}}"
            )
        if not isinstance(by, str) or not (gate is None or isinstance(gate, dict)):
            raise InvalidDataError("'by' must be a string and 'gate' an object or null")
        share = body.get("share")
        if not (share is None or (isinstance(share, int | float) and not isinstance(share, bool))):
            raise InvalidDataError("'share' must be a number between 0 and 1, or null")
        moved = await self.backend.promote(model, step, action=action, by=by, gate=gate, share=share)
        await self.track(model)  # the alias moves with it
        return JSONResponse({"step": moved})

    async def checkpoints(self, request: Request) -> Response:
        model = self.lookup(request)
        if isinstance(model, Response):
            return model
        if request.method == "GET":
            return JSONResponse({"steps": model.store.checkpoint_steps()})
        metric = request.query_params.get("best_metric") or None
        lower = request.query_params.get("lower_is_better", "false").lower() in ("1", "true", "yes")
        deleted = await self.backend.delete_checkpoints(model, metric, higher_is_better=not lower)
        return JSONResponse({"deleted": deleted})


async def _not_found(request: Request, error: Exception) -> Response:
    return _error(404, f"no such endpoint: {request.method} {request.url.path}", "not_found")


async def _not_allowed(request: Request, error: Exception) -> Response:
    return _error(405, f"{request.method} is not allowed on {request.url.path}", "method_not_allowed")


def create_app(
    backend: LocalBackend,
    token: str | None = None,
    *,
    max_body: int = MAX_BODY_BYTES,
    report_to: Sequence[str] = (),
) -> ASGIApp:
    """The server's ASGI app around ``backend`` (whose gateway answers under /v1). ``report_to``:
    experiment trackers each model's run is written to after each step it trains here."""
    routes = _Api(backend, report_to)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await routes.close_trackers()
            await backend.close()  # stops vLLM with the server

    api = Starlette(
        routes=routes.routes(),
        lifespan=lifespan,
        exception_handlers={404: _not_found, 405: _not_allowed},
    )

    viewer = Router([Mount("/ui", Viewer(backend.root, token=token).app)])

    async def dispatch(scope: Scope, receive: Receive, send: Send) -> None:
        """/v1, /r/... and /records go to the capture gateway, /ui to the viewer, the rest to the API."""
        if scope["type"] == "http" and _viewer_path(scope["path"]):
            await viewer(scope, receive, send)
            return
        if scope["type"] == "http" and scope["path"].startswith(("/v1/", "/r/", "/records")):
            if backend.gateway_app is None:
                await _error(503, "no model is registered yet: POST /api/models first", "not_ready")(
                    scope, receive, send
                )
            else:
                await backend.gateway_app.app(scope, receive, send)
            return
        await api(scope, receive, send)

    return _Guard(dispatch, token, max_body)


def _promote_flag(body: dict[str, Any]) -> bool:
    promote = body.get("promote", True)
    if not isinstance(promote, bool):
        raise InvalidDataError("'promote' must be true or false")
    return promote


def _trajectories(value: Any, field: str) -> list[Trajectory]:
    if not isinstance(value, list) or not value:
        raise InvalidDataError(f"'{field}' must be a non-empty list of trajectories")
    return [Trajectory.model_validate(item) for item in value]


async def _train_events(
    model: TrainableModel,
    started: dict[str, Any],
    training: Awaitable[TrainResult],
    track: Callable[[TrainableModel], Awaitable[None]],
    events: asyncio.Queue[bytes] | None = None,
) -> AsyncIterator[bytes]:
    """NDJSON: a 'started' event, then what ``events`` receives meanwhile, or a 'progress'
    heartbeat every few seconds, then 'done' (once the trackers have the step) or 'error'."""
    yield json.dumps(started).encode() + b"\n"
    task = asyncio.ensure_future(training)
    events = events if events is not None else asyncio.Queue()
    while not task.done():
        getting = asyncio.ensure_future(events.get())
        finished, _ = await asyncio.wait({task, getting}, timeout=5.0, return_when=asyncio.FIRST_COMPLETED)
        if getting in finished:
            yield getting.result()
            continue
        getting.cancel()
        if not task.done():
            yield b'{"event": "progress"}\n'
    while not events.empty():
        yield events.get_nowait()
    try:
        result = task.result()
    except JourneymanError as error:
        yield (
            json.dumps({"event": "error", "message": str(error), "type": type(error).__name__}).encode()
            + b"\n"
        )
        return
    except Exception as error:
        logger.exception("training failed")
        yield (
            json.dumps(
                {"event": "error", "message": f"{type(error).__name__}: {error}", "type": "internal"}
            ).encode()
            + b"\n"
        )
        return
    await track(model)
    yield json.dumps({"event": "done", "step": result.step, "metrics": result.metrics}).encode() + b"\n"
