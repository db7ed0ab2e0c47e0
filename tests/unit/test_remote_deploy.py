"""Adapter uploads to journeyman serve: what is refused, and how (no model is started here)."""

from __future__ import annotations

import io
import tarfile
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from journeyman.backend.app.server import create_app
from journeyman.backend.local import LocalBackend
from journeyman.backend.serving.adapters import AdapterPush, pack_adapter, unpack_adapter
from journeyman.backend.serving.replicas import Replicas
from journeyman.backend.serving.vllm import VLLMConfig, VLLMServer
from journeyman.errors import AdapterError, ConfigError, InvalidDataError

TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _adapter(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text('{"r": 4}')
    (folder / "adapter_model.safetensors").write_bytes(b"\x00" * 64)
    return folder


def _tar(files: dict[str, bytes], kind: bytes = tarfile.REGTYPE) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size, info.type = len(data), kind
            if kind == tarfile.SYMTYPE:
                info.size, info.linkname = 0, "/etc/passwd"
            tar.addfile(info, io.BytesIO(data) if kind == tarfile.REGTYPE else None)
    return buffer.getvalue()


def test_pack_and_unpack_keep_the_adapter_files_exactly(tmp_path: Path) -> None:
    source = _adapter(tmp_path / "a")
    (source / "optimizer.safetensors").write_bytes(b"not sent")
    out = tmp_path / "b"
    out.mkdir()
    unpack_adapter(pack_adapter(source), out)
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert (out / "adapter_model.safetensors").read_bytes() == (
        source / "adapter_model.safetensors"
    ).read_bytes()


def test_pack_refuses_a_folder_that_is_no_adapter(tmp_path: Path) -> None:
    with pytest.raises(AdapterError, match=r"adapter_model\.safetensors missing"):
        pack_adapter(tmp_path)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (_tar({"../evil.json": b"x"}), "'../evil.json'"),
        (_tar({"adapter_model.bin": b"pickle"}), "'adapter_model.bin'"),
        (_tar({"adapter_config.json": b"{}"}), "lacks adapter_model.safetensors"),
        (_tar({"adapter_config.json": b""}, tarfile.SYMTYPE), "'adapter_config.json'"),
        (b"not a tar at all" * 40, "not a tar archive"),
    ],
)
def test_unpack_refuses_anything_but_adapter_files(tmp_path: Path, data: bytes, message: str) -> None:
    with pytest.raises(InvalidDataError, match=message):
        unpack_adapter(data, tmp_path)
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
async def http(tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(LocalBackend(root=tmp_path, gateway_thread=False), TOKEN)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://serve") as client:
        yield client


async def test_upload_needs_the_token(http: httpx.AsyncClient, tmp_path: Path) -> None:
    body = pack_adapter(_adapter(tmp_path / "a"))
    response = await http.put("/api/deployments/agent/1?base_model=smollm2-135m", content=body)
    assert response.status_code == 401
    assert not (tmp_path / "deployments").exists()


@pytest.mark.parametrize(
    ("path", "status", "message"),
    [
        ("/api/deployments/agent/1", 400, "?base_model="),
        ("/api/deployments/agent/one?base_model=smollm2-135m", 400, "whole number"),
        # the client decodes %2F: the path leaves the deployments' routes
        ("/api/deployments/..%2Fx/1?base_model=smollm2-135m", 404, "no such endpoint"),
    ],
)
async def test_bad_uploads_get_an_error_and_store_nothing(
    http: httpx.AsyncClient, tmp_path: Path, path: str, status: int, message: str
) -> None:
    body = pack_adapter(_adapter(tmp_path / "a"))
    response = await http.put(path, content=body, headers=AUTH)
    assert response.status_code == status, response.text
    assert message in response.json()["error"]["message"]
    assert not (tmp_path / "deployments").exists()


async def test_a_bad_tar_stores_nothing(http: httpx.AsyncClient, tmp_path: Path) -> None:
    response = await http.put(
        "/api/deployments/agent/1?base_model=smollm2-135m", content=_tar({"x.py": b"1"}), headers=AUTH
    )
    assert response.status_code == 400
    assert "only the files" in response.json()["error"]["message"]
    assert list((tmp_path / "deployments" / "agent").iterdir()) == []


async def test_push_names_the_gateway_that_refused(tmp_path: Path) -> None:
    app = create_app(LocalBackend(root=tmp_path / "serve", gateway_thread=False), TOKEN)
    push = AdapterPush(["http://serve"], "wrong-token")
    transport = httpx.ASGITransport(app=app)
    original = httpx.AsyncClient.__init__

    def with_transport(self: httpx.AsyncClient, **kwargs: object) -> None:
        original(self, transport=transport, **kwargs)  # type: ignore[arg-type]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(httpx.AsyncClient, "__init__", with_transport)
        with pytest.raises(AdapterError, match=r"http://serve refused agent@1 \(401\).*token"):
            await push.push("agent", "smollm2-135m", _adapter(tmp_path / "a"), 1)


def test_push_needs_a_url() -> None:
    with pytest.raises(ConfigError, match="at least one gateway URL"):
        AdapterPush([])


def _replicas(n: int) -> Replicas:
    return Replicas(
        [VLLMServer(VLLMConfig(model="m", port=9000 + i), log_path=Path("x.log")) for i in range(n)]
    )


def test_replicas_send_every_turn_of_a_rollout_to_one_replica_and_spread_rollouts() -> None:
    replicas = _replicas(2)
    chosen = {rollout: replicas.url_for(rollout) for rollout in (f"r{i}" for i in range(40))}
    assert all(replicas.url_for(rollout) == url for rollout, url in chosen.items())  # sticky
    assert set(chosen.values()) == {"http://127.0.0.1:9000", "http://127.0.0.1:9001"}
    assert {replicas.url_for(None) for _ in range(4)} == set(chosen.values())  # no id: take turns


def test_replicas_skip_a_replica_that_is_down(monkeypatch: pytest.MonkeyPatch) -> None:
    replicas = _replicas(3)
    down = replicas.servers[1]
    for server in replicas.servers:
        monkeypatch.setattr(server, "is_running", lambda s=server: s is not down)
    assert replicas.is_running()
    urls = {replicas.url_for(f"r{i}") for i in range(40)}
    assert urls == {"http://127.0.0.1:9000", "http://127.0.0.1:9002"}


def test_replicas_must_share_a_served_name() -> None:
    a = VLLMServer(VLLMConfig(model="m", served_name="a"), log_path=Path("x.log"))
    b = VLLMServer(VLLMConfig(model="m", served_name="b"), log_path=Path("x.log"))
    with pytest.raises(ConfigError, match="one name"):
        Replicas([a, b])


@pytest.mark.parametrize(
    ("cores", "n", "shares"),
    [("0-1", 2, ["0", "1"]), ("0-3", 2, ["0,1", "2,3"]), ("0,2,4", 3, ["0", "2", "4"]), ("0", 2, ["0", "0"])],
)
def test_replicas_split_the_cores(cores: str, n: int, shares: list[str]) -> None:
    from journeyman.backend.local import _share

    assert [_share(cores, i, n) for i in range(n)] == shares


def test_local_backend_refuses_settings_that_cannot_work(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="push_to"):
        LocalBackend(root=tmp_path, inference=False)
    with pytest.raises(ConfigError, match="at least 1"):
        LocalBackend(root=tmp_path, replicas=0)
