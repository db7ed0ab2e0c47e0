"""A Langfuse-API-compatible server for tests, on loopback (a real Langfuse cannot run here).

It speaks the endpoints the Langfuse Python SDK 5 uses, with the server's own behaviour:

- ``POST /api/public/otel/v1/traces``: OTLP/HTTP protobuf (gzip or not) or OTLP JSON. Each span
  becomes an observation the way Langfuse's OTel ingestion maps it: type from
  ``langfuse.observation.type`` (SPAN otherwise), input/output as the raw attribute strings, model,
  model parameters (non-scalar values stringified), usage (``total`` added as the sum when
  missing), metadata from ``langfuse.observation.metadata[.*]`` plus resource and scope
  attributes (values kept as strings), session/user/tags/trace name from the trace attributes
  (including the LangChain ``metadata.langfuse_*`` route), timestamps cut to milliseconds, ids
  as hex, root = no parent or marked as app root / ``as_root`` by the SDK.
- ``POST /api/public/scores``: a JSON array (or one object) of scores; 202, or 207 with the
  rejected ones; each item parsed with the SDK's ``CreateScoreRequest``; upsert by id.
- ``GET /api/public/v2/observations``: field groups, ``expandMetadata`` (other metadata values cut
  to 200 characters), cursor pagination, the single query filters and the structured ``filter``
  (which, as in Langfuse, overrides them).
- ``GET /api/public/v3/scores``: field groups (details, subject, annotation), cursor, filters, the
  documented 400s (limit over 100, unknown group, traceId with sessionId, observationId alone).
- ``GET /api/public/health``, ``GET /api/public/projects`` (``auth_check``).

Every JSON answer is parsed with the SDK's own response model (as the client does) and checked
for field names the model does not know, before it is sent; a mismatch is recorded in
``errors`` and answered with a 500, so tests fail loudly when the fake drifts from the contract.
"""

from __future__ import annotations

import base64
import gzip
import json
import threading
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

from google.protobuf.json_format import Parse
from langfuse.api import GetScoresV3Response, HealthResponse, ObservationsV2Response, ObservationV2, Projects
from langfuse.api.core.pydantic_utilities import parse_obj_as
from langfuse.api.core.serialization import FieldMetadata
from langfuse.api.scores.types.create_score_batch_response import CreateScoreBatchResponse
from langfuse.api.scores.types.create_score_batch_results import CreateScoreBatchResults
from langfuse.api.scores.types.create_score_request import CreateScoreRequest
from langfuse.api.scores.types.score_v3 import ScoreV3_Numeric
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

PROJECT = {"id": "project-test", "name": "journeyman-test", "organization": {"id": "org", "name": "org"}}
OBSERVATION_TYPES = {
    "GENERATION",
    "SPAN",
    "EVENT",
    "AGENT",
    "TOOL",
    "CHAIN",
    "RETRIEVER",
    "EVALUATOR",
    "EMBEDDING",
    "GUARDRAIL",
}
FIELD_GROUPS = {
    "core": ["id", "traceId", "startTime", "endTime", "projectId", "parentObservationId", "type"],
    "basic": [
        "name",
        "level",
        "statusMessage",
        "version",
        "environment",
        "bookmarked",
        "public",
        "userId",
        "sessionId",
        "isRootObservation",
    ],
    "time": ["completionStartTime", "createdAt", "updatedAt"],
    "io": ["input", "output"],
    "metadata": ["metadata"],
    "model": ["model", "internalModelId", "modelParameters"],
    "usage": ["usageDetails", "costDetails", "totalCost", "usagePricingTierName"],
    "prompt": ["promptId", "promptName", "promptVersion"],
    "metrics": ["latency", "timeToFirstToken"],
    "trace_context": ["tags", "release", "traceName"],
}
SCORE_CORE = [
    "id",
    "projectId",
    "name",
    "value",
    "dataType",
    "source",
    "timestamp",
    "environment",
    "createdAt",
    "updatedAt",
]
SCORE_GROUPS = {"details": ["comment", "configId", "metadata"], "subject": ["subject"], "annotation": []}
METADATA_PREVIEW = 200


class BadRequest(Exception):
    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Request:
    method: str
    path: str
    headers: dict[str, str]
    query: dict[str, list[str]]


@dataclass
class LangfuseServer:
    """Start with ``with LangfuseServer() as server:``; point the SDK at ``server.base_url``."""

    public_key: str = "pk-lf-test"
    secret_key: str = "sk-lf-test"
    observations: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    traces: dict[str, dict[str, Any]] = field(default_factory=dict)
    scores: dict[str, dict[str, Any]] = field(default_factory=dict)
    requests: list[Request] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    """Contract violations found in our own answers (each also answered with a 500)."""
    reject_scores: set[str] = field(default_factory=set)
    """Score names to reject (answered 207), to test partial failures."""

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._http: ThreadingHTTPServer | None = None

    # Life cycle -----------------------------------------------------------------------------

    def start(self) -> LangfuseServer:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                server._handle(self, "GET")

            def do_POST(self) -> None:
                server._handle(self, "POST")

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._http.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None

    def __enter__(self) -> LangfuseServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def base_url(self) -> str:
        assert self._http is not None, "start the server first"
        return f"http://127.0.0.1:{self._http.server_address[1]}"

    def trace_observations(self, trace_id: str) -> list[dict[str, Any]]:
        with self._lock:
            return [o for (tid, _), o in self.observations.items() if tid == trace_id]

    # Dispatch -------------------------------------------------------------------------------

    def _handle(self, handler: BaseHTTPRequestHandler, method: str) -> None:
        url = urlparse(handler.path)
        query = parse_qs(url.query, keep_blank_values=True)
        headers = {k.lower(): v for k, v in handler.headers.items()}
        self.requests.append(Request(method, url.path, headers, query))
        body = handler.rfile.read(int(headers.get("content-length") or 0))
        try:
            if (method, url.path) == ("GET", "/api/public/health"):
                status, payload = (
                    200,
                    self._checked(HealthResponse, {"status": "OK", "version": "4.59.0-test"}),
                )
            else:
                self._authenticate(headers)
                status, payload = self._route(method, url.path, headers, query, body)
        except BadRequest as error:
            status, payload = error.status, {"message": str(error)}
        except Exception as error:  # a bug in the fake: make the test fail loudly
            self.errors.append(f"{method} {url.path}: {type(error).__name__}: {error}")
            status, payload = 500, {"message": f"{type(error).__name__}: {error}"}
        data = json.dumps(payload).encode()
        handler.send_response(status)
        handler.send_header("content-type", "application/json")
        handler.send_header("content-length", str(len(data)))
        handler.end_headers()
        handler.wfile.write(data)

    def _authenticate(self, headers: dict[str, str]) -> None:
        expected = base64.b64encode(f"{self.public_key}:{self.secret_key}".encode()).decode()
        if headers.get("authorization") != f"Basic {expected}":
            raise BadRequest("Invalid credentials. Confirm that you've configured the correct host.", 401)

    def _route(
        self, method: str, path: str, headers: dict[str, str], query: dict[str, list[str]], body: bytes
    ) -> tuple[int, Any]:
        if (method, path) == ("POST", "/api/public/otel/v1/traces"):
            self._ingest(headers, body)
            return 200, {}
        if (method, path) == ("POST", "/api/public/scores"):
            return self._create_scores(json.loads(body))
        if (method, path) == ("GET", "/api/public/v2/observations"):
            return 200, self._checked(ObservationsV2Response, self._get_observations(query))
        if (method, path) == ("GET", "/api/public/v3/scores"):
            return 200, self._checked(GetScoresV3Response, self._get_scores(query))
        if (method, path) == ("GET", "/api/public/projects"):
            return 200, self._checked(Projects, {"data": [{**PROJECT, "metadata": {}}]})
        raise BadRequest(f"{method} {path} is not served by this test server", 404)

    def _checked(self, model: Any, payload: dict[str, Any]) -> dict[str, Any]:
        """Parse the answer as the SDK does, and refuse field names its models do not know."""
        parse_obj_as(model, payload)
        if model is ObservationsV2Response:
            _known(ObservationV2, payload["data"])
        if model is GetScoresV3Response:
            _known(ScoreV3_Numeric, payload["data"])
        return payload

    # Ingestion ------------------------------------------------------------------------------

    def _ingest(self, headers: dict[str, str], body: bytes) -> None:
        if headers.get("content-encoding") == "gzip":
            body = gzip.decompress(body)
        request = ExportTraceServiceRequest()
        content_type = headers.get("content-type", "")
        if content_type.startswith("application/x-protobuf"):
            request.ParseFromString(body)
        elif content_type.startswith("application/json"):
            Parse(json.dumps(_hex_ids_to_base64(json.loads(body))), request)
        else:
            raise BadRequest(f"unsupported content type {content_type!r}", 415)
        now = _iso(datetime.now(UTC))
        for resource_spans in request.resource_spans:
            resource = _attributes(resource_spans.resource.attributes)
            for scope_spans in resource_spans.scope_spans:
                scope = {
                    "name": scope_spans.scope.name,
                    "version": scope_spans.scope.version,
                    "attributes": _attributes(scope_spans.scope.attributes),
                }
                for span in scope_spans.spans:
                    self._observe(span, resource, scope, now)

    def _observe(self, span: Any, resource: dict[str, Any], scope: dict[str, Any], now: str) -> None:
        a = _attributes(span.attributes)
        trace_id, span_id = span.trace_id.hex(), span.span_id.hex()
        parent = span.parent_span_id.hex() or None
        is_root = parent is None or str(a.get("langfuse.internal.as_root")).lower() == "true"
        is_root = is_root or str(a.get("langfuse.internal.is_app_root")).lower() == "true"
        start, end = _from_nanos(span.start_time_unix_nano), _from_nanos(span.end_time_unix_nano)
        usage = _json_attribute(a.get("langfuse.observation.usage_details")) or _gen_ai_usage(a)
        usage = {k: int(v) for k, v in (usage or {}).items() if isinstance(v, int | float)}
        if usage and "total" not in usage:
            usage["total"] = sum(usage.values())
        parameters = _json_attribute(a.get("langfuse.observation.model.parameters"))
        observation = {
            "id": span_id,
            "traceId": trace_id,
            "projectId": PROJECT["id"],
            "parentObservationId": parent,
            "type": _observation_type(a),
            "name": a.get("gen_ai.tool.name") or span.name,
            "level": a.get("langfuse.observation.level") or ("ERROR" if span.status.code == 2 else "DEFAULT"),
            "statusMessage": a.get("langfuse.observation.status_message") or span.status.message or None,
            "version": a.get("langfuse.version") or resource.get("service.version"),
            "environment": a.get("langfuse.environment")
            or resource.get("deployment.environment.name")
            or resource.get("deployment.environment")
            or "default",
            "bookmarked": False,
            "public": False,
            "userId": _first(a, "langfuse.user.id", "user.id", *_metadata_keys("langfuse_user_id")),
            "sessionId": _first(
                a, "langfuse.session.id", "session.id", *_metadata_keys("langfuse_session_id")
            ),
            "isRootObservation": is_root,
            "startTime": start,
            "endTime": end,
            "completionStartTime": _timestamp(a.get("langfuse.observation.completion_start_time")),
            "createdAt": now,
            "updatedAt": now,
            "input": _raw(a.get("langfuse.observation.input")),
            "output": _raw(a.get("langfuse.observation.output")),
            "metadata": {
                **_metadata(a, "langfuse.observation.metadata"),
                "resourceAttributes": json.dumps(resource),
                "scope": json.dumps(scope),
            },
            "model": _first(
                a, "langfuse.observation.model.name", "gen_ai.response.model", "gen_ai.request.model"
            ),
            "internalModelId": None,
            "modelParameters": {
                k: v if isinstance(v, str | int | float) and not isinstance(v, bool) else json.dumps(v)
                for k, v in (parameters or {}).items()
            },
            "usageDetails": usage,
            "costDetails": _json_attribute(a.get("langfuse.observation.cost_details")) or {},
            "totalCost": None,
            "usagePricingTierName": None,
            "promptId": None,
            "promptName": a.get("langfuse.observation.prompt.name"),
            "promptVersion": a.get("langfuse.observation.prompt.version"),
            "latency": (_parse(end) - _parse(start)).total_seconds(),
            "timeToFirstToken": None,
        }
        tags = a.get("langfuse.trace.tags") or a.get("langfuse.observation.metadata.langfuse_tags")
        with self._lock:
            self.observations[(trace_id, span_id)] = observation
            trace = self.traces.setdefault(trace_id, {"tags": [], "name": None, "release": None})
            trace["tags"] = sorted({*trace["tags"], *_tags(tags)})
            name = a.get("langfuse.trace.name") or (span.name if is_root else None)
            if name and (is_root or trace["name"] is None):
                trace["name"] = name
            trace["release"] = a.get("langfuse.release") or trace["release"]

    # Scores ---------------------------------------------------------------------------------

    def _create_scores(self, body: Any) -> tuple[int, Any]:
        items = body if isinstance(body, list) else [body]
        errors = []
        now = _iso(datetime.now(UTC))
        for item in items:
            try:
                request = parse_obj_as(CreateScoreRequest, item)
            except Exception as error:
                errors.append({"message": f"invalid score: {error}"})
                continue
            if request.name in self.reject_scores:
                errors.append({"message": f"score {request.name!r} rejected by the test"})
                continue
            if not (request.trace_id or request.session_id or request.dataset_run_id):
                errors.append({"message": "a score needs a traceId, sessionId or datasetRunId"})
                continue
            data_type = item.get("dataType") or (
                "CATEGORICAL" if isinstance(request.value, str) else "NUMERIC"
            )
            value: Any = request.value
            if data_type == "BOOLEAN":
                value = bool(value)
            elif data_type == "NUMERIC":
                value = float(value)
            score_id = request.id or str(uuid.uuid4())
            with self._lock:
                self.scores[score_id] = {
                    "id": score_id,
                    "projectId": PROJECT["id"],
                    "name": request.name,
                    "value": value,
                    "dataType": data_type,
                    "source": "API",
                    "timestamp": item.get("timestamp") or now,
                    "environment": request.environment or "default",
                    "createdAt": self.scores.get(score_id, {}).get("createdAt", now),
                    "updatedAt": now,
                    "comment": request.comment,
                    "configId": request.config_id,
                    "metadata": request.metadata if isinstance(request.metadata, dict) else None,
                    "traceId": request.trace_id,
                    "observationId": request.observation_id,
                    "sessionId": request.session_id,
                }
        if errors:
            return 207, _parsed(
                CreateScoreBatchResults,
                {"accepted": len(items) - len(errors), "rejected": len(errors), "errors": errors},
            )
        return 202, _parsed(CreateScoreBatchResponse, {"message": "Accepted"})

    def _get_scores(self, query: dict[str, list[str]]) -> dict[str, Any]:
        q = {k: v[-1] for k, v in query.items()}
        limit = int(q.get("limit", 50))
        if limit > 100:
            raise BadRequest("limit must be at most 100")
        groups = [g for g in q.get("fields", "").split(",") if g]
        unknown = [g for g in groups if g not in SCORE_GROUPS]
        if unknown:
            raise BadRequest(f"unknown field group(s): {', '.join(unknown)}")
        if "traceId" in q and "sessionId" in q:
            raise BadRequest("traceId and sessionId are mutually exclusive")
        if "observationId" in q and "traceId" not in q:
            raise BadRequest("observationId requires traceId")
        lists = {
            k: set(q[k].split(",")) for k in ("id", "name", "traceId", "sessionId", "observationId") if k in q
        }
        data_types = {t.upper() for t in q["dataType"].split(",")} if "dataType" in q else None
        with self._lock:
            scores = list(self.scores.values())
        selected = [
            s
            for s in scores
            if all(s[key] in values for key, values in lists.items())
            and (data_types is None or s["dataType"] in data_types)
            and ("fromTimestamp" not in q or _parse(s["timestamp"]) >= _parse(q["fromTimestamp"]))
            and ("toTimestamp" not in q or _parse(s["timestamp"]) < _parse(q["toTimestamp"]))
        ]
        selected.sort(key=lambda s: (s["timestamp"], s["id"]), reverse=True)
        offset = _offset(q.get("cursor"), urlsafe=True)
        page = selected[offset : offset + limit]
        fields = SCORE_CORE + [f for g in groups for f in SCORE_GROUPS[g]]
        data = [{f: _score_field(s, f) for f in fields} for s in page]
        meta: dict[str, Any] = {"limit": limit}
        if offset + limit < len(selected):
            meta["cursor"] = base64.urlsafe_b64encode(
                json.dumps({"offset": offset + limit}).encode()
            ).decode()
        return {"data": data, "meta": meta}

    # Observations ---------------------------------------------------------------------------

    def _get_observations(self, query: dict[str, list[str]]) -> dict[str, Any]:
        q = {k: v[-1] for k, v in query.items()}
        limit = int(q.get("limit", 50))
        if not 0 <= limit <= 1000:
            raise BadRequest("limit must be between 0 and 1000")
        if q.get("parseIoAsJson") == "true":
            raise BadRequest("parseIoAsJson=true is no longer supported on the v2 observations endpoint")
        groups = ["core"] + [g for g in (q.get("fields") or "basic").split(",") if g in FIELD_GROUPS]
        expand = {k for k in q.get("expandMetadata", "").split(",") if k}
        with self._lock:
            rows = [{**o, **self._trace_context(o["traceId"])} for o in self.observations.values()]
        conditions = (
            _filters(q, query.get("environment", []))
            if "filter" not in q
            else [_condition(f) for f in _parse_filter(q["filter"])]
        )
        rows = [r for r in rows if all(condition(r) for condition in conditions)]
        rows.sort(key=lambda r: (r["startTime"], r["traceId"], r["id"]), reverse=True)
        offset = _offset(q.get("cursor"), urlsafe=False)
        page = rows[offset : offset + limit]
        fields = [f for g in dict.fromkeys(groups) for f in FIELD_GROUPS[g]]
        data = [{f: _observation_field(r, f, expand) for f in fields} for r in page]
        meta = {}
        if offset + limit < len(rows):
            meta["cursor"] = base64.b64encode(json.dumps({"offset": offset + limit}).encode()).decode()
        return {"data": data, "meta": meta}

    def _trace_context(self, trace_id: str) -> dict[str, Any]:
        trace = self.traces.get(trace_id, {})
        return {
            "tags": trace.get("tags", []),
            "traceName": trace.get("name"),
            "release": trace.get("release"),
        }


# Mapping helpers ----------------------------------------------------------------------------


def _hex_ids_to_base64(body: dict[str, Any]) -> dict[str, Any]:
    """OTLP JSON writes trace and span ids as hex, where protobuf's JSON mapping expects base64."""
    for resource_spans in body.get("resourceSpans", []):
        for scope_spans in resource_spans.get("scopeSpans", []):
            for span in scope_spans.get("spans", []):
                for key in ("traceId", "spanId", "parentSpanId"):
                    if span.get(key):
                        span[key] = base64.b64encode(bytes.fromhex(span[key])).decode()
    return body


def _attributes(attributes: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in attributes}


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in value.kvlist_value.values}
    if kind == "bytes_value":
        return value.bytes_value.hex()
    return getattr(value, kind) if kind else None


_OPENINFERENCE = {"LLM": "GENERATION"}
_GEN_AI_OPERATIONS = {
    "chat": "GENERATION",
    "completion": "GENERATION",
    "text_completion": "GENERATION",
    "generate_content": "GENERATION",
    "generate": "GENERATION",
    "embeddings": "EMBEDDING",
    "invoke_agent": "AGENT",
    "create_agent": "AGENT",
    "execute_tool": "TOOL",
}


def _observation_type(a: dict[str, Any]) -> str:
    """Langfuse's order: its own type, OpenInference span kind, GenAI operation, tool, model, SPAN."""
    candidates = [
        str(a.get("langfuse.observation.type") or "").upper(),
        _OPENINFERENCE.get(str(a.get("openinference.span.kind")), str(a.get("openinference.span.kind"))),
        _GEN_AI_OPERATIONS.get(str(a.get("gen_ai.operation.name")), ""),
        "TOOL" if a.get("gen_ai.tool.name") or a.get("gen_ai.tool.call.id") else "",
        "GENERATION"
        if any(
            a.get(k)
            for k in ("langfuse.observation.model.name", "gen_ai.request.model", "gen_ai.response.model")
        )
        else "",
    ]
    return next((c for c in candidates if c in OBSERVATION_TYPES), "SPAN")


def _raw(value: Any) -> str | None:
    """Input and output are stored, and returned, as the raw strings the SDK sent."""
    return None if value is None else value if isinstance(value, str) else json.dumps(value)


def _json_attribute(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return None
    return value


def _timestamp(value: Any) -> str | None:
    """A completion start time, sent as an ISO string or (older SDKs) a JSON-encoded one."""
    parsed = _json_attribute(value)
    text = parsed if isinstance(parsed, str) else value if isinstance(value, str) else None
    return _iso(_parse(text)) if text else None


def _gen_ai_usage(a: dict[str, Any]) -> dict[str, Any]:
    names = {"prompt_tokens": "input", "completion_tokens": "output", "input_tokens": "input"}
    names |= {"output_tokens": "output", "total_tokens": "total"}
    usage = {}
    for key, value in a.items():
        if key.startswith("gen_ai.usage.") and key != "gen_ai.usage.cost":
            name = key.removeprefix("gen_ai.usage.")
            usage[names.get(name, name)] = value
    return usage


def _metadata(a: dict[str, Any], prefix: str) -> dict[str, str]:
    """Metadata as Langfuse stores it: one string per key (objects and numbers as JSON)."""
    top = _json_attribute(a.get(prefix))
    merged = dict(top) if isinstance(top, dict) else {}
    merged |= {k.removeprefix(prefix + "."): v for k, v in a.items() if k.startswith(prefix + ".")}
    return {k: v if isinstance(v, str) else json.dumps(v) for k, v in merged.items()}


def _metadata_keys(name: str) -> list[str]:
    return [f"langfuse.observation.metadata.{name}", f"langfuse.trace.metadata.{name}"]


def _first(a: dict[str, Any], *keys: str) -> str | None:
    for key in keys:
        if a.get(key):
            value = a[key]
            return value if isinstance(value, str) else json.dumps(value)
    return None


def _tags(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, list | tuple):
        return [str(v) for v in value]
    if isinstance(value, str) and value.strip().startswith("["):
        parsed = _json_attribute(value)
        if isinstance(parsed, list):
            return [str(v) for v in parsed]
    if isinstance(value, str):
        return [t.strip() for t in value.split(",")] if "," in value else [value]
    return []


def _from_nanos(nanos: int) -> str:
    """An OTLP timestamp as Langfuse keeps it: milliseconds, ISO 8601 with Z."""
    return _iso(datetime.fromtimestamp(nanos // 1_000_000 / 1000, UTC))


def _iso(moment: datetime) -> str:
    return moment.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _parse(text: str) -> datetime:
    moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


def _offset(cursor: str | None, urlsafe: bool) -> int:
    if not cursor:
        return 0
    try:
        decoded = (base64.urlsafe_b64decode if urlsafe else base64.b64decode)(cursor)
        return int(json.loads(decoded)["offset"])
    except Exception:
        raise BadRequest("Invalid cursor format") from None


def _observation_field(row: dict[str, Any], name: str, expand: set[str]) -> Any:
    if name == "metadata":
        return {
            k: v if k in expand or len(v) <= METADATA_PREVIEW else v[:METADATA_PREVIEW]
            for k, v in row["metadata"].items()
        }
    return row.get(name)


def _score_field(score: dict[str, Any], name: str) -> Any:
    if name != "subject":
        return score[name]
    if score["observationId"]:
        return {"kind": "observation", "id": score["observationId"], "traceId": score["traceId"]}
    if score["traceId"]:
        return {"kind": "trace", "id": score["traceId"]}
    return {"kind": "session", "id": score["sessionId"]}


Condition = Any


def _filters(q: dict[str, str], environments: list[str]) -> list[Condition]:
    """The single query-parameter filters (ignored by Langfuse when ``filter`` is given)."""
    conditions: list[Condition] = []
    for param in (
        "name",
        "userId",
        "sessionId",
        "type",
        "traceId",
        "level",
        "version",
        "parentObservationId",
    ):
        if param in q:
            conditions.append(lambda r, p=param, v=q[param]: r.get(p) == v)
    if "isRootObservation" in q:
        wanted = q["isRootObservation"].lower() == "true"
        conditions.append(lambda r: r["isRootObservation"] == wanted)
    if environments:  # repeated (environment=a&environment=b) or comma-separated
        wanted = {e for value in environments for e in value.split(",")}
        conditions.append(lambda r: r["environment"] in wanted)
    if "fromStartTime" in q:
        conditions.append(lambda r: _parse(r["startTime"]) >= _parse(q["fromStartTime"]))
    if "toStartTime" in q:
        conditions.append(lambda r: _parse(r["startTime"]) < _parse(q["toStartTime"]))
    return conditions


_COLUMNS = {"traceTags": "tags"}


def _parse_filter(text: str) -> list[dict[str, Any]]:
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError:
        raise BadRequest("Invalid JSON in filter parameter") from None
    if not isinstance(parsed, list) or not all(isinstance(f, dict) for f in parsed):
        raise BadRequest("filter must be a JSON array of filter objects")
    return parsed


def _condition(f: dict[str, Any]) -> Condition:
    kind, column, operator, value = f.get("type"), f.get("column"), f.get("operator"), f.get("value")
    column = _COLUMNS.get(str(column), column)
    known = {name for names in FIELD_GROUPS.values() for name in names}
    if column not in known:
        raise BadRequest(f"filter column {column!r} is not supported by this test server")
    if kind == "string":
        tests = {
            "=": lambda x: x == value,
            "contains": lambda x: value in (x or ""),
            "does not contain": lambda x: value not in (x or ""),
            "starts with": lambda x: (x or "").startswith(value),
            "ends with": lambda x: (x or "").endswith(value),
        }
    elif kind in ("stringOptions", "categoryOptions"):
        tests = {"any of": lambda x: x in value, "none of": lambda x: x not in value}
    elif kind == "arrayOptions":
        tests = {
            "any of": lambda x: bool(set(x or []) & set(value)),
            "all of": lambda x: set(value) <= set(x or []),
            "none of": lambda x: not set(x or []) & set(value),
        }
    elif kind == "datetime":
        bound = _parse(str(value))
        tests = {
            ">": lambda x: _parse(x) > bound,
            "<": lambda x: _parse(x) < bound,
            ">=": lambda x: _parse(x) >= bound,
            "<=": lambda x: _parse(x) <= bound,
        }
    elif kind == "boolean":
        tests = {"=": lambda x: x is value, "<>": lambda x: x is not value}
    elif kind == "null":
        tests = {"is null": lambda x: x is None, "is not null": lambda x: x is not None}
    else:
        raise BadRequest(f"filter type {kind!r} is not supported by this test server")
    if operator not in tests:
        raise BadRequest(f"operator {operator!r} is not valid for filter type {kind!r}")
    test = tests[operator]
    return lambda row: test(row.get(str(column)))


def _wire_names(model: Any) -> set[str]:
    names = set()
    for name, info in model.model_fields.items():
        alias = next((m.alias for m in info.metadata if isinstance(m, FieldMetadata) and m.alias), None)
        names.add(alias or name)
    return names


def _known(model: Any, items: list[dict[str, Any]]) -> None:
    known = _wire_names(model) | {"dataType"}
    for item in items:
        unknown = set(item) - known
        if unknown:
            raise AssertionError(f"fields the SDK's {model.__name__} does not know: {sorted(unknown)}")


def _parsed(model: Any, payload: dict[str, Any]) -> dict[str, Any]:
    parse_obj_as(model, payload)
    return payload


def client_for(server: LangfuseServer, **kwargs: Any) -> Any:
    """A real Langfuse client talking to ``server`` (its own tracer provider: no global state)."""
    from langfuse import Langfuse
    from opentelemetry.sdk.trace import TracerProvider

    return Langfuse(
        public_key=server.public_key,
        secret_key=server.secret_key,
        base_url=server.base_url,
        tracer_provider=TracerProvider(),
        **kwargs,
    )
