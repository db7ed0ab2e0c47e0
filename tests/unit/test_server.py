"""journeyman serve: authentication, validation, limits, serving state (no model is started here)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.types import ASGIApp

import journeyman as jm
from journeyman.backend.app.server import check_bind, create_app
from journeyman.backend.app.ui.app import start_viewer
from journeyman.backend.local import LocalBackend
from journeyman.backend.serving.vllm import VLLMConfig
from journeyman.errors import BackendError
from journeyman.model import ServingState
from tests.scripted_upstream import Reply, ScriptedUpstream, serve
from tests.unit.test_engine_seam import Dying

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
    with pytest.raises(BackendError, match="could not reach journeyman serve"):
        await unreachable.get_step(model)
    await unreachable.close()


def _remote(app: ASGIApp, token: str = TOKEN) -> jm.RemoteBackend:
    """A RemoteBackend whose requests reach ``app`` in this process."""
    backend = jm.RemoteBackend("http://serve", token=token)
    backend._http = httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app),
        base_url="http://serve",
        headers={"Authorization": f"Bearer {token}"},
    )
    return backend


async def test_serving_route_needs_the_token_and_answers_the_backends_state(http: httpx.AsyncClient) -> None:
    assert (await http.get("/api/serving")).status_code == 401
    response = await http.get("/api/serving", headers=AUTH)
    assert response.status_code == 200
    assert response.json() == {
        "policy_restarts": 0,
        "judge_restarts": 0,
        "policy_down": False,
        "judge_down": False,
    }


async def test_remote_backend_reads_the_servers_serving_state(tmp_path: Path) -> None:
    local = LocalBackend(root=tmp_path, gateway_thread=False)
    local.restarts, local.judge_restarts = 2, 1
    local.restarting_judges.add("judge")  # a judge's server is being restarted
    async with _remote(create_app(local, TOKEN)) as remote:
        assert await remote.serving_state() == ServingState(
            policy_restarts=2, judge_restarts=1, policy_down=False, judge_down=True
        )


async def test_a_server_without_the_serving_route_reads_as_serving() -> None:
    async with _remote(Starlette()) as remote:  # every path 404, as from a server older than the route
        assert await remote.serving_state() == ServingState()
        await asyncio.wait_for(remote.wait_serving(timeout=0), 5)


async def test_remote_wait_serving_returns_once_the_server_is_back(tmp_path: Path) -> None:
    local = LocalBackend(root=tmp_path, gateway_thread=False)
    local.restarting_judges.add("judge")
    async with _remote(create_app(local, TOKEN)) as remote:
        await asyncio.wait_for(remote.wait_serving(timeout=5), 5)  # the policy's server is up
        waiting = asyncio.create_task(remote.wait_serving(timeout=30, judges=True))
        await asyncio.sleep(1.2)  # a few polls
        assert not waiting.done()
        local.restarting_judges.clear()
        await asyncio.wait_for(waiting, 5)


async def test_remote_wait_serving_gives_up_after_its_timeout(tmp_path: Path) -> None:
    local = LocalBackend(root=tmp_path, gateway_thread=False)
    local.restarting_judges.add("judge")
    async with _remote(create_app(local, TOKEN)) as remote:
        with pytest.raises(BackendError, match=r"judges' server .* not back within 0.6 s \(still down\)"):
            await asyncio.wait_for(remote.wait_serving(timeout=0.6, judges=True), 10)
    async with jm.RemoteBackend("http://127.0.0.1:9", token=TOKEN) as unreachable:  # down while restarting
        with pytest.raises(BackendError, match=r"not back within 0.6 s \(could not reach journeyman serve"):
            await asyncio.wait_for(unreachable.wait_serving(timeout=0.6), 10)
    async with _remote(create_app(local, TOKEN), token="wrong") as refused:  # no waiting out a wrong token
        with pytest.raises(jm.ConfigError, match="answered 401"):
            await asyncio.wait_for(refused.wait_serving(timeout=60), 5)


async def test_remote_viewer_url_is_the_runs_page_of_serves_viewer(tmp_path: Path) -> None:
    model = jm.TrainableModel(name="m", project="p", base_model="smollm2-135m", root=tmp_path)
    model.store.path.mkdir(parents=True)  # a run, as a registration makes it
    async with _remote(create_app(LocalBackend(root=tmp_path, gateway_thread=False), TOKEN)) as remote:
        url = remote.viewer_url(model)
        assert url == "http://serve/ui/runs/p/m"
        page = await remote._http.get(url)
        assert page.status_code == 200 and "text/html" in page.headers["content-type"]


@contextlib.asynccontextmanager
async def _backend_of_dying_engines(
    tmp_path: Path, **options: Any
) -> AsyncIterator[tuple[LocalBackend, list[Dying]]]:
    """A LocalBackend whose servers are :class:`Dying` endpoints on one scripted upstream that
    answers each start's and restart's health probe; the endpoints it made, in order."""
    upstream = ScriptedUpstream(replies=[Reply(body={}) for _ in range(4)])
    thread = serve(upstream.app())
    made: list[Dying] = []

    def make(config: VLLMConfig, *, log_path: Path) -> Dying:
        made.append(Dying(thread.base_url, config, log_path=log_path))
        return made[-1]

    try:
        async with LocalBackend(root=tmp_path, engine=make, watch_interval=0.05, **options) as backend:
            yield backend, made
    finally:
        thread.stop()


async def test_local_serving_state_counts_restarts_and_says_what_is_down(tmp_path: Path) -> None:
    judge_dir = tmp_path / "judge-model"
    judge_dir.mkdir()
    (judge_dir / "config.json").write_text("{}")
    async with _backend_of_dying_engines(tmp_path) as (backend, made):
        model = jm.TrainableModel(name="agent", project="seam", base_model="smollm2-135m", root=tmp_path)
        await model.register(backend)
        await backend.start_judge(str(judge_dir))
        policy, judge = made
        assert await backend.serving_state() == ServingState()
        policy.code = -9  # killed: down until the watchdog has it back
        assert await backend.serving_state() == ServingState(policy_down=True)
        await asyncio.wait_for(backend.wait_serving(), 10)
        assert await backend.serving_state() == ServingState(policy_restarts=1)
        judge.code = -9
        assert await backend.serving_state() == ServingState(policy_restarts=1, judge_down=True)
        await asyncio.wait_for(backend.wait_serving(judges=True), 10)
        assert await backend.serving_state() == ServingState(policy_restarts=1, judge_restarts=1)


async def test_local_backend_serves_its_viewer_from_the_first_registration_until_closed(
    tmp_path: Path,
) -> None:
    model = jm.TrainableModel(name="agent", project="seam", base_model="smollm2-135m", root=tmp_path)
    elsewhere = jm.TrainableModel(
        name="agent", project="seam", base_model="smollm2-135m", root=tmp_path / "other"
    )
    async with _backend_of_dying_engines(tmp_path, viewer=start_viewer) as (backend, _):
        assert backend.viewer_url(model) is None  # started by the first registration
        await model.register(backend)
        url = backend.viewer_url(model)
        assert url is not None and url.endswith("/runs/seam/agent")
        async with httpx.AsyncClient() as client:
            page = await client.get(url)
        assert page.status_code == 200 and "text/html" in page.headers["content-type"]
        assert backend.viewer_url(elsewhere) is None  # its run is not under the viewer's root
    assert backend.viewer_url(model) is None
    with pytest.raises(httpx.ConnectError):
        httpx.get(url)
    assert LocalBackend(root=tmp_path).viewer_url(model) is None  # no viewer unless asked for
