"""The capture gateway: an OpenAI-compatible endpoint in front of vLLM that records every token.

Agents point their OpenAI base URL at the gateway. For each chat or text completion, and each
Responses API call (``/v1/responses``, run as the chat completion it amounts to:
:mod:`journeyman.responses`), it

1. resolves the model name (``calc-agent`` means its current adapter version),
2. asks vLLM for logprobs and token ids whatever the client asked for,
3. appends a :class:`~journeyman.records.CompletionRecord` to a JSONL file before the client
   gets the response (a gateway crash loses nothing a client saw), and
4. returns the normal OpenAI response, without the logprobs and token ids the client did not ask for.

A rollout id ties completions to one agent run, without patching any library: send the header
``X-Journeyman-Rollout-Id``, or use the per-rollout base URL ``{gateway}/r/{rollout_id}/v1``.
Records are found by completion id and by rollout id, in process (:class:`RecordLog`, which
:class:`GatewayThread` registers under its URL for tracers in the same process) and over HTTP
(``GET /records/{completion_id}``, ``GET /records?completion_id=...&completion_id=...``,
``GET /records?rollout_id=...``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from journeyman.errors import InvalidDataError, StorageError
from journeyman.records import (
    ROLLOUT_HEADER,
    SAMPLING_KEYS,
    ChoiceRecord,
    CompletionRecord,
)
from journeyman.responses import chat_request, response_id, response_object

from .answers import StreamState, choice_records, strip, tag_deltas, tag_messages
from .gateway_thread import GatewayThread
from .record_log import RecordLog
from .response_events import ResponseEvents
from .router import ModelUnavailableError, Router

__all__ = ["ROLLOUT_HEADER", "Gateway", "GatewayThread", "RecordLog"]

logger = logging.getLogger(__name__)

_DEFAULT_TIMEOUT = httpx.Timeout(600.0, connect=5.0)
"""Generation can be slow on CPU; connecting should not be."""
_ROLLOUT_ID = re.compile(r"[A-Za-z0-9._:-]{1,200}")


def _error(status: int, message: str, kind: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


class Gateway:
    """The gateway's ASGI app (``gateway.app``) and its in-process record API (``gateway.records``)."""

    def __init__(
        self,
        router: Router,
        records: RecordLog,
        *,
        timeout: httpx.Timeout | float = _DEFAULT_TIMEOUT,
        max_connections: int = 512,
    ) -> None:
        self.router = router
        self.records = records
        self._timeout = timeout if isinstance(timeout, httpx.Timeout) else httpx.Timeout(timeout)
        self._limits = httpx.Limits(
            max_connections=max_connections, max_keepalive_connections=max_connections
        )
        self._client: httpx.AsyncClient | None = None
        routes = [
            Route("/health", self.health, methods=["GET"]),
            Route("/records", self.list_records, methods=["GET"]),
            Route("/records/{completion_id}", self.get_record, methods=["GET"]),
        ]
        for prefix in ("", "/r/{rollout_id}"):
            routes += [
                Route(prefix + "/v1/models", self.models, methods=["GET"]),
                Route(prefix + "/v1/chat/completions", self.chat_completions, methods=["POST"]),
                Route(prefix + "/v1/completions", self.completions, methods=["POST"]),
                Route(prefix + "/v1/responses", self.responses, methods=["POST"]),
            ]
        self.app = Starlette(routes=routes, lifespan=self._lifespan)

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        self._client = httpx.AsyncClient(timeout=self._timeout, limits=self._limits)
        try:
            yield
        finally:
            await self._client.aclose()

    async def aclose(self) -> None:
        """Close the upstream client (served without the ASGI lifespan, nothing else closes it)."""
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:  # used without the ASGI lifespan (e.g. an in-process transport)
            self._client = httpx.AsyncClient(timeout=self._timeout, limits=self._limits)
        return self._client

    # Plain routes ------------------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        up = self.router.server.is_running()
        return JSONResponse(
            {"status": "ok" if up else "degraded", "upstream": up}, status_code=200 if up else 503
        )

    async def models(self, request: Request) -> Response:
        created = int(time.time())
        names = self.router.served_names()
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {"id": n, "object": "model", "created": created, "owned_by": "journeyman"} for n in names
                ],
            }
        )

    async def get_record(self, request: Request) -> Response:
        record = self.records.get(request.path_params["completion_id"])
        if record is None:
            return _error(
                404, f"no record for completion id {request.path_params['completion_id']!r}", "not_found"
            )
        return Response(record.model_dump_json(), media_type="application/json")

    async def list_records(self, request: Request) -> Response:
        rollout_id = request.query_params.get("rollout_id")
        completion_ids = request.query_params.getlist("completion_id")
        if rollout_id:
            records = self.records.for_rollout(rollout_id)
        elif completion_ids:  # several at once: a tracer joins a whole run in one request
            records = [r for i in completion_ids if (r := self.records.get(i)) is not None]
        else:
            return _error(
                400,
                "give ?rollout_id=... or ?completion_id=...&completion_id=... "
                "(one record by completion id is at /records/{id})",
                "invalid_request",
            )
        body = '{"records": [' + ", ".join(r.model_dump_json() for r in records) + "]}"
        return Response(body, media_type="application/json")

    async def chat_completions(self, request: Request) -> Response:
        return await self._complete(request, "chat")

    async def completions(self, request: Request) -> Response:
        return await self._complete(request, "completion")

    async def responses(self, request: Request) -> Response:
        return await self._complete(request, "response")

    # Completions -------------------------------------------------------------------------------

    async def _complete(self, request: Request, kind: Kind) -> Response:
        started, clock = datetime.now(UTC), time.perf_counter()
        rollout_id = request.path_params.get("rollout_id") or request.headers.get(ROLLOUT_HEADER)
        body = await _request_body(request, rollout_id)
        if isinstance(body, Response):
            return body
        asked = body
        if kind == "response":  # run as the chat completion it amounts to; the record keeps that
            body = self._chat_for_response(body)
            if isinstance(body, Response):
                return body
        if not self.router.server.is_running():
            return _error(
                503,
                "the inference server is not running (it may be restarting); retry shortly",
                "upstream_unavailable",
            )
        try:
            served, version = await self.router.admit(
                body["model"], rollout_id
            )  # counted in flight from here
        except ModelUnavailableError as error:
            return _error(404, str(error), "model_not_found")
        call = _Pending(kind, body, rollout_id, served, version, started, clock, asked)
        try:
            upstream_request = self.client.build_request(
                "POST", self.router.server.url_for(rollout_id) + call.path, json=call.upstream_body()
            )
            response = await self.client.send(upstream_request, stream=True)
        except (httpx.HTTPError, OSError) as error:
            self.router.end(served)
            return self._upstream_error(error)
        if response.status_code == 200 and call.stream:
            return StreamingResponse(
                self._relay(response, call),
                media_type="text/event-stream",
                headers={"cache-control": "no-cache"},
            )
        try:
            content = await response.aread()
        except httpx.HTTPError as error:
            return self._upstream_error(error)
        finally:
            await response.aclose()
            self.router.end(served)
        if response.status_code != 200:
            media = response.headers.get("content-type", "application/json")
            return Response(content, status_code=response.status_code, media_type=media)
        return self._answer(json.loads(content), call)

    def _chat_for_response(self, body: dict[str, Any]) -> dict[str, Any] | Response:
        """The chat request a Responses request runs as, or the error that says why it cannot."""
        history = None
        if previous := body.get("previous_response_id"):
            record = self.records.get(str(previous))
            if record is None or not record.choices or record.messages is None:
                return _error(
                    404,
                    f"no response {previous!r} on this gateway: send the whole conversation as 'input' "
                    "instead of previous_response_id",
                    "not_found",
                )
            reply = record.choices[0].message
            history = [*record.messages, *([reply.model_dump(exclude_none=True)] if reply else [])]
        try:
            return chat_request(body, history)
        except InvalidDataError as error:
            return _error(400, str(error), "invalid_request")

    def _answer(self, data: dict[str, Any], call: _Pending) -> Response:
        """Record a whole response, then return the client's copy of it."""
        choices, prompt_token_ids = choice_records(data, call.upstream_kind)
        completion_id = data.get("id")
        if call.kind == "response" and completion_id:
            completion_id = response_id(completion_id)
        try:
            self._save(call, completion_id, choices, data.get("usage"), prompt_token_ids)
        except StorageError as error:
            logger.error("%s", error)
            return _error(507, str(error), "storage_error")
        if call.kind == "response":
            choice = (data.get("choices") or [{}])[0]
            return JSONResponse(
                response_object(
                    call.asked,
                    completion_id or response_id(f"missing-{time.time_ns()}"),
                    message=choice.get("message") or {},
                    finish_reason=choice.get("finish_reason"),
                    usage=data.get("usage"),
                    model=call.asked["model"],
                    logprobs=choice.get("logprobs"),
                )
            )
        strip(data, call.wants_logprobs, call.wants_ids)
        if call.kind == "chat" and completion_id:
            tag_messages(data, completion_id)
        return JSONResponse(data)

    async def _relay(self, response: httpx.Response, call: _Pending) -> AsyncIterator[bytes]:
        """Pass a stream on chunk by chunk, and record it whole before its end reaches the client."""
        state = StreamState()
        events = ResponseEvents(call.asked) if call.kind == "response" else None
        try:
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    completion_id = state.completion_id
                    if events is not None and completion_id is not None:
                        completion_id = response_id(completion_id)
                    try:
                        choices = state.choice_records(call.upstream_kind)
                        self._save(call, completion_id, choices, state.usage, state.prompt_token_ids)
                    except StorageError as error:  # the client sees an error, never a clean end
                        logger.error("%s", error)
                        yield _stream_error(events, str(error), "storage_error", 507)
                        return
                    if events is None:
                        yield b"data: [DONE]\n\n"
                        continue
                    first = choices[0] if choices else None
                    message = first.message if first is not None else None
                    closing = events.done(
                        message.model_dump(exclude_none=True) if message is not None else {},
                        first.finish_reason if first is not None else None,
                        state.usage,
                    )
                    for event in closing:
                        yield _event_bytes(event)
                    continue
                try:
                    chunk = json.loads(payload)
                except ValueError:
                    yield f"data: {payload}\n\n".encode()
                    continue
                state.add(chunk, call.upstream_kind)
                if events is not None:
                    for event in events.chunk(chunk):
                        yield _event_bytes(event)
                    continue
                strip(chunk, call.wants_logprobs, call.wants_ids)
                if call.kind == "chat" and state.completion_id is not None:
                    tag_deltas(chunk, state.completion_id)
                yield b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"
        except httpx.HTTPError as error:
            logger.warning("upstream stream broke: %r", error)
            yield _stream_error(events, f"the inference server stream broke: {error!r}", "upstream_error")
        finally:
            await response.aclose()
            self.router.end(call.served)

    def _save(
        self,
        call: _Pending,
        completion_id: str | None,
        choices: list[ChoiceRecord],
        usage: dict[str, Any] | None,
        prompt_token_ids: list[int] | None,
    ) -> None:
        body = call.body
        self.records.append(
            CompletionRecord(
                completion_id=completion_id or f"missing-{time.time_ns()}",
                rollout_id=call.rollout_id,
                kind=call.kind,
                requested_model=body["model"],
                served_model=call.served,
                policy_version=call.version,
                messages=body.get("messages") if call.upstream_kind == "chat" else None,
                prompt=body.get("prompt") if call.kind == "completion" else None,
                tools=body.get("tools"),
                sampling={k: body[k] for k in SAMPLING_KEYS if k in body},
                stream=call.stream,
                prompt_token_ids=prompt_token_ids,
                choices=choices,
                usage=usage,
                started_at=call.started,
                finished_at=datetime.now(UTC),
                upstream_seconds=time.perf_counter() - call.clock,
            )
        )

    def _upstream_error(self, error: Exception) -> JSONResponse:
        if isinstance(error, httpx.TimeoutException):
            return _error(504, f"the inference server timed out ({type(error).__name__})", "upstream_timeout")
        return _error(502, f"could not reach the inference server: {error!r}", "upstream_unavailable")


Kind = Literal["chat", "completion", "response"]


def _event_bytes(event: dict[str, Any]) -> bytes:
    """One server-sent event of a streamed Responses call."""
    return (
        f"event: {event['type']}\ndata: ".encode()
        + json.dumps(event, separators=(",", ":")).encode()
        + b"\n\n"
    )


def _stream_error(events: ResponseEvents | None, message: str, kind: str, code: int | None = None) -> bytes:
    """The event that ends a stream that failed: the client sees an error, never a clean end."""
    if events is not None:
        return _event_bytes(
            {"type": "error", "sequence_number": -1, "code": kind, "message": message, "param": None}
        )
    error: dict[str, Any] = {"message": message, "type": kind}
    if code is not None:
        error["code"] = code
    return b"data: " + json.dumps({"error": error}).encode() + b"\n\n"


@dataclass(frozen=True)
class _Pending:
    """A completion on its way: the client's request, and what the gateway decided for it."""

    kind: Kind
    body: dict[str, Any]
    rollout_id: str | None
    served: str
    version: int | None
    started: datetime
    clock: float
    """``time.perf_counter()`` when the request arrived (the record's ``upstream_seconds``)."""
    asked: dict[str, Any]
    """The request as the client sent it (for a Responses call, ``body`` is the chat request it runs as)."""

    @property
    def upstream_kind(self) -> Literal["chat", "completion"]:
        return "completion" if self.kind == "completion" else "chat"

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.upstream_kind == "chat" else "/v1/completions"

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))

    @property
    def wants_logprobs(self) -> bool:
        logprobs = self.body.get("logprobs")
        return bool(logprobs) or (self.kind == "completion" and logprobs == 0)

    @property
    def wants_ids(self) -> bool:
        return bool(self.body.get("return_token_ids"))

    def upstream_body(self) -> dict[str, Any]:
        """The request for vLLM: the served name, and token ids and logprobs whatever was asked."""
        upstream = {**self.body, "model": self.served, "return_token_ids": True}
        if self.upstream_kind == "chat":
            upstream["logprobs"] = True
        elif self.body.get("logprobs") is None:
            upstream["logprobs"] = 0
        return upstream


async def _request_body(request: Request, rollout_id: str | None) -> dict[str, Any] | Response:
    """The request's JSON body, or the 400 that says what is wrong with it."""
    if rollout_id is not None and not _ROLLOUT_ID.fullmatch(rollout_id):
        return _error(400, "a rollout id is 1-200 letters, digits or . _ : - characters", "invalid_request")
    try:
        body = json.loads(await request.body())
    except ValueError as error:
        return _error(400, f"the request body is not JSON: {error}", "invalid_request")
    if not isinstance(body, dict) or not isinstance(body.get("model"), str):
        return _error(400, "the request body must be a JSON object with a 'model' string", "invalid_request")
    for key in ("messages", "tools"):  # the record keeps them: refuse what it could not hold
        value = body.get(key)
        if value is not None and not (isinstance(value, list) and all(isinstance(v, dict) for v in value)):
            return _error(400, f"'{key}' must be a list of JSON objects", "invalid_request")
    return body
