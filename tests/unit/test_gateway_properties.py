"""Properties of the gateway's request parsing: any request gets a JSON answer, never a crash, and
what reaches the upstream and the record is exactly what the client sent (plus what the gateway adds)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from journeyman.backend.serving.gateway import ROLLOUT_HEADER, Gateway, GatewayThread, RecordLog
from journeyman.backend.serving.router import Router
from journeyman.records import SAMPLING_KEYS
from tests.scripted_upstream import ScriptedServer, serve

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=10,
)
KEYS = ["messages", "prompt", "tools", "logprobs", "return_token_ids", "n", *SAMPLING_KEYS]
ROLLOUT_ID = re.compile(r"[A-Za-z0-9._:-]{1,200}")


def _problem(body: Any) -> str | None:
    """Why the gateway must refuse this body itself (None: it goes upstream)."""
    if not isinstance(body, dict) or not isinstance(body.get("model"), str):
        return "a JSON object with a 'model' string"
    for key in ("messages", "tools"):
        value = body.get(key)
        if value is not None and not (isinstance(value, list) and all(isinstance(v, dict) for v in value)):
            return f"'{key}' must be a list of JSON objects"
    return None


class Echo:
    """An upstream that answers every request with one choice, and keeps what it received."""

    def __init__(self) -> None:
        self.received: list[dict[str, Any]] = []

    def app(self) -> Starlette:
        async def complete(request: Request) -> JSONResponse:
            body = json.loads(await request.body())
            self.received.append(body)
            choice = {"index": 0, "finish_reason": "stop", "token_ids": [7, 8],
                      "logprobs": {"content": [{"logprob": -0.5}, {"logprob": -0.25}]}}  # fmt: skip
            if request.url.path.endswith("/chat/completions"):
                choice["message"] = {"role": "assistant", "content": "ok"}
            else:
                choice |= {
                    "text": "ok",
                    "logprobs": {"token_logprobs": [-0.5, -0.25]},
                    "prompt_token_ids": [1],
                }
            n = len(self.received)
            return JSONResponse({"id": f"c{n}", "object": "x", "choices": [choice], "prompt_token_ids": [1]})

        return Starlette(
            routes=[Route(p, complete, methods=["POST"]) for p in ("/v1/chat/completions", "/v1/completions")]
        )


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Echo, GatewayThread]]:
    folder = tmp_path_factory.mktemp("gateway-properties")
    echo = Echo()
    upstream = serve(echo.app())
    records = RecordLog(Path(folder) / "records.jsonl")
    gateway = GatewayThread(
        Gateway(Router(ScriptedServer(upstream.base_url, log_dir=folder)), records)
    ).start()
    yield echo, gateway
    gateway.stop()
    upstream.stop()
    records.close()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=st.binary(max_size=80) | json_values.map(lambda v: json.dumps(v).encode()), chat=st.booleans())
def test_any_body_gets_a_json_answer_and_only_objects_with_a_model_go_upstream(
    stack: tuple[Echo, GatewayThread], body: bytes, chat: bool
) -> None:
    echo, gateway = stack
    sent = len(echo.received)
    path = "/v1/chat/completions" if chat else "/v1/completions"
    response = httpx.post(gateway.base_url + path, content=body, timeout=10)
    answer = response.json()  # always JSON
    try:
        problem = _problem(json.loads(body))
    except ValueError:
        problem = "not JSON"
    if problem is None:
        assert response.status_code == 200 and len(echo.received) == sent + 1
    else:
        assert response.status_code == 400 and answer["error"]["type"] == "invalid_request"
        assert len(echo.received) == sent


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    fields=st.dictionaries(st.sampled_from(KEYS), json_values, max_size=6),
    model=st.text(min_size=1, max_size=20),
    rollout=st.none() | st.text(st.characters(min_codepoint=33, max_codepoint=126), max_size=30),
)
def test_what_goes_upstream_and_into_the_record_is_what_the_client_sent(
    stack: tuple[Echo, GatewayThread], fields: dict[str, Any], model: str, rollout: str | None
) -> None:
    echo, gateway = stack
    body = {**fields, "model": model}
    headers = {ROLLOUT_HEADER: rollout} if rollout is not None else {}
    response = httpx.post(gateway.base_url + "/v1/chat/completions", json=body, headers=headers, timeout=10)
    if rollout is not None and not ROLLOUT_ID.fullmatch(rollout):
        assert response.status_code == 400 and "rollout id" in response.json()["error"]["message"]
        return
    if (problem := _problem(body)) is not None:
        assert response.status_code == 400 and problem in response.json()["error"]["message"]
        return
    assert response.status_code == 200, response.text
    upstream = echo.received[-1]
    added = {"model", "return_token_ids", "logprobs"}
    assert {k: v for k, v in upstream.items() if k not in added} == {
        k: v for k, v in body.items() if k not in added
    }
    assert (
        upstream["return_token_ids"] is True and upstream["logprobs"] is True and upstream["model"] == model
    )

    answer = response.json()
    record = gateway.gateway.records.get(answer["id"])
    assert record is not None and record.rollout_id == rollout and record.requested_model == model
    assert record.sampling == {k: body[k] for k in SAMPLING_KEYS if k in body}
    assert record.choices[0].completion_token_ids == [7, 8] and record.choices[0].logprobs == [-0.5, -0.25]
    if not body.get("return_token_ids"):
        assert "prompt_token_ids" not in answer and "token_ids" not in answer["choices"][0]
    if not body.get("logprobs"):
        assert answer["choices"][0]["logprobs"] is None
