"""journeyman serve: authentication, validation, limits (no model is started here)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

import journeyman as jm
from journeyman.backend.app.server import check_bind, create_app
from journeyman.backend.local import LocalBackend

TOKEN = "s3cret-token"


@pytest.fixture
async def http(tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(LocalBackend(root=tmp_path, gateway_thread=False), TOKEN, max_body=10_000)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://serve") as client:
        yield client


AUTH = {"Authorization": f"Bearer {TOKEN}"}


async def test_health_needs_no_token_everything_else_does(http: httpx.AsyncClient) -> None:
    assert (await http.get("/health")).json() == {"status": "ok"}
    for method, path in [("POST", "/api/models"), ("GET", "/api/models/p/m/step"), ("POST", "/v1/chat/completions"),
                         ("GET", "/records/x"), ("DELETE", "/api/models/p/m/checkpoints"),
                         ("GET", "/api/models/p/m/checkpoints")]:  # fmt: skip
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
            response = await http.request(method, path, headers=headers)
            assert response.status_code == 401, (method, path, headers)
            assert "Authorization: Bearer <token>" in response.json()["error"]["message"]


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        (b"{nope", 400, "not JSON"),
        (b"[]", 400, "must be a JSON object"),
        (b'{"project": "p", "base_model": "smollm2-135m"}', 400, "'name' must be a string"),
        (b'{"name": "../../etc", "project": "p", "base_model": "smollm2-135m"}', 400, "invalid name"),
        (
            b'{"name": "m", "project": "p", "base_model": "smollm2-135m", "lora": {"rank": -1}}',
            422,
            "lora.rank",
        ),
    ],
)
async def test_bad_registrations_get_4xx_with_a_message(
    http: httpx.AsyncClient, body: bytes, status: int, message: str
) -> None:
    response = await http.post("/api/models", content=body, headers=AUTH)
    assert response.status_code == status
    assert message in response.json()["error"]["message"]


async def test_unknown_and_unsafe_model_paths(http: httpx.AsyncClient) -> None:
    missing = await http.get("/api/models/p/m/step", headers=AUTH)
    assert missing.status_code == 404 and "POST /api/models first" in missing.json()["error"]["message"]
    unsafe = await http.get("/api/models/..%2F..%2Fetc/m/step", headers=AUTH)  # never reaches a route
    assert unsafe.status_code == 404 and "no such endpoint" in unsafe.json()["error"]["message"]
    dots = await http.get("/api/models/../m/step", headers=AUTH)
    assert dots.status_code in (400, 404) and "error" in dots.json()
    bad_name = await http.get("/api/models/-p/m/step", headers=AUTH)
    assert bad_name.status_code == 400 and "invalid project name" in bad_name.json()["error"]["message"]
    train = await http.post("/api/models/p/m/train", json={"groups": []}, headers=AUTH)
    assert train.status_code == 400 and "not registered" in train.json()["error"]["message"]


async def test_oversize_uploads_are_refused(http: httpx.AsyncClient) -> None:
    big = b'{"groups": [' + b" " * 20_000 + b"]}"
    response = await http.post("/api/models/p/m/train", content=big, headers=AUTH)
    assert response.status_code == 413 and "over 10000 bytes" in response.json()["error"]["message"]

    async def chunks() -> AsyncIterator[bytes]:  # no content-length: counted as it arrives
        for _ in range(30):
            yield b" " * 1000

    streamed = await http.post("/api/models/p/m/train", content=chunks(), headers=AUTH)
    assert streamed.status_code == 413


async def test_gateway_routes_wait_for_a_registered_model(http: httpx.AsyncClient) -> None:
    response = await http.post("/v1/chat/completions", json={"model": "m", "messages": []}, headers=AUTH)
    assert response.status_code == 503 and "POST /api/models first" in response.json()["error"]["message"]


@pytest.mark.parametrize("host", ["0.0.0.0", "192.0.2.10", "example.org", "::"])
def test_binding_beyond_loopback_needs_a_token(host: str) -> None:
    with pytest.raises(jm.ConfigError, match="refusing to listen"):
        check_bind(host, None)
    check_bind(host, "token")


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1"])
def test_loopback_may_run_without_a_token(host: str) -> None:
    check_bind(host, None)


async def test_remote_backend_reports_server_errors_clearly(tmp_path: Path) -> None:
    app = create_app(LocalBackend(root=tmp_path, gateway_thread=False), TOKEN)
    backend = jm.RemoteBackend("http://serve", token="wrong")
    backend._http = httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app),
        base_url="http://serve",
        headers={"Authorization": "Bearer wrong"},
    )
    model = jm.TrainableModel(name="m", project="p", base_model="smollm2-135m", root=tmp_path)
    with pytest.raises(jm.ConfigError, match="answered 401: missing or wrong token"):
        await model.register(backend)
    await backend.close()
    unreachable = jm.RemoteBackend("http://127.0.0.1:9", token=TOKEN)
    with pytest.raises(jm.BackendError, match="could not reach journeyman serve"):
        await unreachable.get_step(model)
    await unreachable.close()
