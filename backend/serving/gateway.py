"""The capture gateway: an OpenAI-compatible endpoint in front of vLLM that records every token.

Agents point their OpenAI base URL at the gateway. For each chat or text completion it

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
import errno
import json
import logging
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from journeyman.errors import BackendError, StorageError
from journeyman.messages import AssistantMessage, StreamedReply
from journeyman.records import (
    ROLLOUT_HEADER,
    SAMPLING_KEYS,
    TOOL_CALL_FORMS,
    ChoiceRecord,
    CompletionRecord,
    ToolCallForm,
    register_in_process,
    unregister_in_process,
)

from .router import ModelUnavailableError, Router

__all__ = ["ROLLOUT_HEADER", "Gateway", "GatewayThread", "RecordLog"]

logger = logging.getLogger(__name__)

_DEFAULT_TIMEOUT = httpx.Timeout(600.0, connect=5.0)
"""Generation can be slow on CPU; connecting should not be."""
_ROLLOUT_ID = re.compile(r"[A-Za-z0-9._:-]{1,200}")
_FORM_ID = re.compile(r"call_(tagged|bare|fenced)_[0-9a-f]+")
"""Tool call ids from journeyman's vLLM tool parser (``vllm_plugin/journeyman_tool_parser.py``,
``tool_call_id``), which name the form the model wrote the call in."""
_FORMS: dict[str, ToolCallForm] = {form: form for form in TOOL_CALL_FORMS}


class RecordLog:
    """Completion records: appended to a JSONL file, the most recent kept in memory.

    Memory holds at most ``max_in_memory`` records; older ones are read back from the file on
    demand. Thread-safe.
    """

    def __init__(self, path: Path, *, max_in_memory: int = 10_000, fsync: bool = False) -> None:
        self.path = Path(path)
        self.max_in_memory = max_in_memory
        self.fsync = fsync
        """``True`` also survives power loss (costs a disk flush per completion)."""
        self._recent: OrderedDict[str, CompletionRecord] = OrderedDict()
        self._by_rollout: dict[str, list[str]] = {}
        self._evicted = 0
        self._lock = threading.Lock()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
        except OSError as error:
            raise StorageError(f"cannot open the completion records {self.path}: {error}") from error

    def append(self, record: CompletionRecord) -> None:
        """Write the record as one line; :class:`StorageError` (and no partial line) if it cannot."""
        line = (record.model_dump_json() + "\n").encode()
        with self._lock:
            if self._fd is None:
                raise StorageError(f"the completion records {self.path} are closed")
            size = os.fstat(self._fd).st_size
            try:
                if os.write(self._fd, line) != len(line):
                    raise OSError(errno.ENOSPC, "short write")
                if self.fsync:
                    os.fsync(self._fd)
            except OSError as error:
                with contextlib.suppress(OSError):
                    os.ftruncate(self._fd, size)  # no torn line for the next record to follow
                raise StorageError(
                    f"could not write a completion record to {self.path}: {error.strerror or error}. "
                    "Free disk space or fix the folder's permissions; this completion was not returned."
                ) from error
            self._recent[record.completion_id] = record
            if record.rollout_id is not None:
                self._by_rollout.setdefault(record.rollout_id, []).append(record.completion_id)
            while len(self._recent) > self.max_in_memory:
                _, old = self._recent.popitem(last=False)
                self._evicted += 1
                if old.rollout_id is not None and (ids := self._by_rollout.get(old.rollout_id)):
                    ids.remove(old.completion_id)
                    if not ids:
                        del self._by_rollout[old.rollout_id]

    def get(self, completion_id: str) -> CompletionRecord | None:
        with self._lock:
            if (record := self._recent.get(completion_id)) is not None or not self._evicted:
                return record
        found = self._scan(lambda r: r.get("completion_id") == completion_id)
        return found[-1] if found else None

    def for_rollout(self, rollout_id: str) -> list[CompletionRecord]:
        """The records of one rollout, in the order they were completed."""
        with self._lock:
            if not self._evicted:
                return [self._recent[i] for i in self._by_rollout.get(rollout_id, [])]
        return self._scan(lambda r: r.get("rollout_id") == rollout_id)

    def __len__(self) -> int:
        with self._lock:
            return len(self._recent) + self._evicted

    def _scan(self, keep: Callable[[dict[str, Any]], bool]) -> list[CompletionRecord]:
        records = []
        with open(self.path, encoding="utf-8") as handle:
            for line in handle:
                with contextlib.suppress(ValueError):
                    raw = json.loads(line)
                    if keep(raw):
                        records.append(CompletionRecord.model_validate(raw))
        return records

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


def _error(status: int, message: str, kind: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


def _assistant_message(raw: dict[str, Any]) -> AssistantMessage:
    calls = raw.get("tool_calls") or None
    if calls:
        calls = [
            {
                "id": c.get("id") or "",
                "type": "function",
                "function": {
                    "name": c["function"]["name"],
                    "arguments": c["function"].get("arguments") or "",
                },
            }
            for c in calls
        ]
    return AssistantMessage(
        content=raw.get("content"),
        tool_calls=calls,
        refusal=raw.get("refusal"),
        reasoning_content=raw.get("reasoning_content") or raw.get("reasoning"),
    )


def _tool_call_forms(calls: list[dict[str, Any]] | None) -> list[ToolCallForm | None] | None:
    """The form of each call, from its id; None when no id comes from journeyman's parser."""
    forms = [
        _FORMS[match.group(1)] if (match := _FORM_ID.fullmatch(str(c.get("id") or ""))) else None
        for c in calls or []
    ]
    return forms if any(form is not None for form in forms) else None


def _calls_as_text(choice: dict[str, Any]) -> list[dict[str, Any]]:
    """Turn tool calls whose arguments are JSON but not an object into text; return them.

    A small model sometimes writes ``"arguments": [3, 4]``. vLLM's tool parsers pass that on,
    and OpenAI clients that parse arguments raise on it (langchain-openai's ``AIMessage``
    refuses a list), which would end the agent's run as an error. Returned as text instead, the
    agent sees an answer without the call, the run ends normally and gets its reward: a wrong
    call is trained against rather than lost. The tokens the model sampled are unchanged.
    """
    message = choice.get("message") or {}
    invalid: list[tuple[str, str, Any]] = []  # (id, name, arguments parsed)
    kept: list[dict[str, Any]] = []
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        name, arguments = function.get("name"), function.get("arguments")
        try:
            parsed = json.loads(arguments) if isinstance(arguments, str) and arguments.strip() else {}
        except ValueError:  # not JSON at all: clients already handle that (as an invalid call)
            parsed = {}
        if isinstance(parsed, dict) or not name:
            kept.append(call)
        else:
            invalid.append((call.get("id") or "", name, parsed))
    if not invalid:
        return []
    written = [json.dumps({"name": name, "arguments": parsed}) for _, name, parsed in invalid]
    message["content"] = "\n".join([message["content"], *written] if message.get("content") else written)
    message["tool_calls"] = kept
    if not kept and choice.get("finish_reason") == "tool_calls":
        choice["finish_reason"] = "stop"
    logger.info("returned %d tool call(s) with non-object arguments as text", len(invalid))
    return [
        {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(parsed)}}
        for call_id, name, parsed in invalid
    ]


def _chat_logprobs(logprobs: dict[str, Any] | None) -> list[float | None] | None:
    if not logprobs or logprobs.get("content") is None:
        return None
    return [entry.get("logprob") for entry in logprobs["content"]]


def _text_logprobs(logprobs: dict[str, Any] | None) -> list[float | None] | None:
    return None if not logprobs else list(logprobs.get("token_logprobs") or [])


class _StreamState:
    """Accumulates a streamed completion into what a non-streamed one would have returned."""

    def __init__(self) -> None:
        self.completion_id: str | None = None
        self.prompt_token_ids: list[int] | None = None
        self.usage: dict[str, Any] | None = None
        self.choices: dict[int, dict[str, Any]] = {}

    def add(self, chunk: dict[str, Any], kind: str) -> None:
        self.completion_id = self.completion_id or chunk.get("id")
        if chunk.get("prompt_token_ids") is not None:
            self.prompt_token_ids = chunk["prompt_token_ids"]
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            state = self.choices.setdefault(
                choice.get("index", 0),
                {"reply": StreamedReply(), "ids": [], "logprobs": [], "finish": None, "has_lp": False},
            )
            if kind == "completion" and choice.get("prompt_token_ids") is not None:
                self.prompt_token_ids = choice["prompt_token_ids"]
            delta = (choice.get("delta") or {}) if kind == "chat" else {"content": choice.get("text")}
            state["reply"].add(delta)
            state["ids"].extend(choice.get("token_ids") or [])
            found = (
                _chat_logprobs(choice.get("logprobs"))
                if kind == "chat"
                else _text_logprobs(choice.get("logprobs"))
            )
            if found is not None:
                state["has_lp"] = True
                state["logprobs"].extend(found)
            state["finish"] = choice.get("finish_reason") or state["finish"]

    def choice_records(self, kind: str) -> list[ChoiceRecord]:
        records = []
        for index, state in sorted(self.choices.items()):
            text = state["reply"].text
            message, forms = None, None
            if kind == "chat":
                calls = state["reply"].tool_calls
                message = AssistantMessage(
                    content=text if text or not calls else None, tool_calls=calls or None
                )
                forms = _tool_call_forms(calls)
            records.append(
                ChoiceRecord(
                    index=index,
                    message=message,
                    text=text if kind == "completion" else None,
                    completion_token_ids=state["ids"] or None,
                    logprobs=state["logprobs"] if state["has_lp"] and state["ids"] else None,
                    finish_reason=state["finish"],
                    tool_call_forms=forms,
                )
            )
        return records


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

    # Completions -------------------------------------------------------------------------------

    async def _complete(self, request: Request, kind: str) -> Response:
        started, clock = datetime.now(UTC), time.perf_counter()
        rollout_id = request.path_params.get("rollout_id") or request.headers.get(ROLLOUT_HEADER)
        if rollout_id is not None and not _ROLLOUT_ID.fullmatch(rollout_id):
            return _error(
                400, "a rollout id is 1-200 letters, digits or . _ : - characters", "invalid_request"
            )
        try:
            body = json.loads(await request.body())
        except ValueError as error:
            return _error(400, f"the request body is not JSON: {error}", "invalid_request")
        if not isinstance(body, dict) or not isinstance(body.get("model"), str):
            return _error(
                400, "the request body must be a JSON object with a 'model' string", "invalid_request"
            )
        for key in ("messages", "tools"):  # the record keeps them: refuse what it could not hold
            value = body.get(key)
            if value is not None and not (
                isinstance(value, list) and all(isinstance(v, dict) for v in value)
            ):
                return _error(400, f"'{key}' must be a list of JSON objects", "invalid_request")
        if not self.router.server.is_running():
            return _error(
                503,
                "the inference server is not running (it may be restarting); retry shortly",
                "upstream_unavailable",
            )

        requested = body["model"]
        try:
            served, version = await self.router.admit(requested)  # counted in flight from here
        except ModelUnavailableError as error:
            return _error(404, str(error), "model_not_found")
        wants_logprobs = bool(body.get("logprobs")) or (kind == "completion" and body.get("logprobs") == 0)
        wants_ids = bool(body.get("return_token_ids"))
        upstream = {**body, "model": served, "return_token_ids": True}
        if kind == "chat":
            upstream["logprobs"] = True
        elif body.get("logprobs") is None:
            upstream["logprobs"] = 0
        path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
        record = {
            "rollout_id": rollout_id,
            "kind": kind,
            "requested_model": requested,
            "served_model": served,
            "policy_version": version,
            "messages": body.get("messages") if kind == "chat" else None,
            "prompt": body.get("prompt") if kind == "completion" else None,
            "tools": body.get("tools"),
            "sampling": {k: body[k] for k in SAMPLING_KEYS if k in body},
            "stream": bool(body.get("stream")),
            "started_at": started,
        }

        try:
            upstream_request = self.client.build_request(
                "POST", self.router.server.url_for(rollout_id) + path, json=upstream
            )
            response = await self.client.send(upstream_request, stream=True)
        except (httpx.HTTPError, OSError) as error:
            self.router.end(served)
            return self._upstream_error(error)
        if response.status_code != 200 or not record["stream"]:
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
            data = json.loads(content)
            record["prompt_token_ids"] = data.get("prompt_token_ids")
            choices = []
            for choice in data.get("choices") or []:
                if kind == "completion" and choice.get("prompt_token_ids") is not None:
                    record["prompt_token_ids"] = choice["prompt_token_ids"]
                if kind == "chat":  # forms first: _calls_as_text moves calls out of the message
                    forms = _tool_call_forms((choice.get("message") or {}).get("tool_calls"))
                    invalid = _calls_as_text(choice)
                else:
                    forms, invalid = None, []
                choices.append(
                    ChoiceRecord(
                        index=choice.get("index", 0),
                        message=_assistant_message(choice["message"]) if kind == "chat" else None,
                        text=choice.get("text") if kind == "completion" else None,
                        completion_token_ids=choice.get("token_ids"),
                        logprobs=(_chat_logprobs if kind == "chat" else _text_logprobs)(
                            choice.get("logprobs")
                        ),
                        finish_reason=choice.get("finish_reason"),
                        invalid_tool_calls=invalid or None,
                        tool_call_forms=forms,
                    )
                )
            try:
                self._save(record, data.get("id"), choices, data.get("usage"), clock)
            except StorageError as error:
                logger.error("%s", error)
                return _error(507, str(error), "storage_error")
            _strip(data, wants_logprobs, wants_ids)
            return JSONResponse(data)
        return StreamingResponse(
            self._relay(response, record, kind, served, wants_logprobs, wants_ids, clock),
            media_type="text/event-stream",
            headers={"cache-control": "no-cache"},
        )

    async def _relay(
        self,
        response: httpx.Response,
        record: dict[str, Any],
        kind: str,
        served: str,
        wants_logprobs: bool,
        wants_ids: bool,
        clock: float,
    ) -> AsyncIterator[bytes]:
        state = _StreamState()
        try:
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    try:
                        self._save(
                            record,
                            state.completion_id,
                            state.choice_records(kind),
                            state.usage,
                            clock,
                            state.prompt_token_ids,
                        )
                    except StorageError as error:  # the client sees an error, never a clean end
                        logger.error("%s", error)
                        failed = {"error": {"message": str(error), "type": "storage_error", "code": 507}}
                        yield b"data: " + json.dumps(failed).encode() + b"\n\n"
                        return
                    yield b"data: [DONE]\n\n"
                    continue
                try:
                    chunk = json.loads(payload)
                except ValueError:
                    yield f"data: {payload}\n\n".encode()
                    continue
                state.add(chunk, kind)
                _strip(chunk, wants_logprobs, wants_ids)
                if kind == "chat" and state.completion_id is not None:
                    _tag_deltas(chunk, state.completion_id)
                yield b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"
        except httpx.HTTPError as error:
            logger.warning("upstream stream broke: %r", error)
            message = {
                "error": {
                    "message": f"the inference server stream broke: {error!r}",
                    "type": "upstream_error",
                }
            }
            yield b"data: " + json.dumps(message).encode() + b"\n\n"
        finally:
            await response.aclose()
            self.router.end(served)

    def _save(
        self,
        record: dict[str, Any],
        completion_id: str | None,
        choices: list[ChoiceRecord],
        usage: dict[str, Any] | None,
        clock: float,
        prompt_token_ids: list[int] | None = None,
    ) -> None:
        record = {
            **record,
            "completion_id": completion_id or f"missing-{time.time_ns()}",
            "choices": choices,
            "usage": usage,
        }
        if prompt_token_ids is not None:
            record["prompt_token_ids"] = prompt_token_ids
        record["finished_at"] = datetime.now(UTC)
        record["upstream_seconds"] = time.perf_counter() - clock
        self.records.append(CompletionRecord(**record))

    def _upstream_error(self, error: Exception) -> JSONResponse:
        if isinstance(error, httpx.TimeoutException):
            return _error(504, f"the inference server timed out ({type(error).__name__})", "upstream_timeout")
        return _error(502, f"could not reach the inference server: {error!r}", "upstream_unavailable")


def _strip(data: dict[str, Any], logprobs: bool, token_ids: bool) -> None:
    """Remove what the gateway asked vLLM for but the client did not."""
    if not token_ids:
        data.pop("prompt_token_ids", None)
    for choice in data.get("choices") or []:
        if not logprobs and "logprobs" in choice:
            choice["logprobs"] = None
        if not token_ids:
            choice.pop("token_ids", None)
            choice.pop("prompt_token_ids", None)


def _tag_deltas(chunk: dict[str, Any], completion_id: str) -> None:
    """Give each streamed delta the completion id, as ``delta["id"]``.

    OpenAI-compatible clients ignore the extra key, while langchain-openai, which keeps no
    chunk's top-level ``id``, makes it the streamed message's ``id``: so a tracer can join a
    token-streamed LangChain call to its record.
    """
    for choice in chunk.get("choices") or []:
        if isinstance(choice.get("delta"), dict):
            choice["delta"].setdefault("id", completion_id)


class GatewayThread:
    """Runs a gateway with uvicorn on a thread of its own (its own event loop).

    While it runs, tracers in this process that point at its URL read its records directly
    (``journeyman.records.in_process_records``) instead of over HTTP.
    """

    def __init__(
        self,
        gateway: Gateway,
        host: str = "127.0.0.1",
        port: int | None = None,
        *,
        shutdown_timeout: int = 10,
    ) -> None:
        import uvicorn

        from .vllm import free_port

        self.gateway = gateway
        self.host = host
        self.port = port or free_port(host)
        config = uvicorn.Config(
            gateway.app,
            host=host,
            port=self.port,
            log_level="warning",
            lifespan="on",
            timeout_graceful_shutdown=shutdown_timeout,  # requests still running then are cut off
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="journeyman-gateway", daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> GatewayThread:
        if self._thread.is_alive():
            return self
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise BackendError(f"the gateway did not start on {self.base_url} (port in use?)")
            time.sleep(0.02)
        if isinstance(self.gateway, Gateway):
            register_in_process(self.base_url, self.gateway.records)
        return self

    def stop(self) -> None:
        if isinstance(self.gateway, Gateway):
            unregister_in_process(self.base_url, self.gateway.records)
        self._server.should_exit = True
        self._thread.join()

    def __enter__(self) -> GatewayThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
