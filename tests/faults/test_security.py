"""Security: no pickle anywhere, names and paths confined, the backend token kept in the server."""

from __future__ import annotations

import ast
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

import journeyman as jm
from journeyman.backend.app.server import MAX_BODY_BYTES, check_bind, create_app
from journeyman.backend.local import LocalBackend
from journeyman.backend.serving.gateway import Gateway, RecordLog
from journeyman.backend.serving.router import Router
from journeyman.store import ModelStore
from tests.logs import reaching_caplog
from tests.scripted_upstream import Reply, ScriptedUpstream

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "tok-9f8e7d6c5b4a"
UNSAFE_MODULES = {"pickle", "cPickle", "dill", "joblib", "shelve", "marshal", "cloudpickle"}


def _sources() -> list[Path]:
    return sorted(p for folder in ("core", "integrations", "backend") for p in (ROOT / folder).rglob("*.py"))


def _unsafe_calls(tree: ast.AST) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] in UNSAFE_MODULES]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in UNSAFE_MODULES:
            found.append(node.module or "")
        elif isinstance(node, ast.Call):
            name = ast.unparse(node.func)
            keywords = {k.arg: k.value for k in node.keywords}
            safe = (
                isinstance(keywords.get("weights_only"), ast.Constant)
                and keywords["weights_only"].value is True
            )
            if name.endswith(("torch.load", "torch.serialization.load")) and not safe:
                found.append(f"{name} without weights_only=True (line {node.lineno})")
            if name.endswith(("numpy.load", "np.load")) and "allow_pickle" in keywords:
                found.append(f"{name} with allow_pickle (line {node.lineno})")
            if name.endswith("torch.save"):
                found.append(f"torch.save pickles (line {node.lineno}); use safetensors")
    return found


def test_no_pickle_in_the_library() -> None:
    sources = _sources()
    assert len(sources) > 20  # the walk found the package
    problems = {
        str(p.relative_to(ROOT)): found for p in sources if (found := _unsafe_calls(ast.parse(p.read_text())))
    }
    assert problems == {}


def test_the_pickle_check_catches_what_it_looks_for() -> None:
    code = "import pickle\nfrom joblib import load\nimport torch\ntorch.load('x')\ntorch.save(m, 'y')\n"
    assert len(_unsafe_calls(ast.parse(code))) == 4
    assert _unsafe_calls(ast.parse("import torch\ntorch.load('x', weights_only=True)\n")) == []


@pytest.mark.parametrize(
    "name", ["../x", "a/b", "..", ".hidden", "", "a b", "x" * 200, "/etc", "a\x00b", "c:\\x", "ü"]
)
def test_unsafe_names_never_become_paths(name: str, tmp_path: Path) -> None:
    with pytest.raises(jm.ConfigError, match="no '/'"):
        ModelStore("p", name, root=tmp_path)
    with pytest.raises(jm.ConfigError):
        ModelStore(name, "m", root=tmp_path)
    store = ModelStore("p", "m", root=tmp_path)
    with pytest.raises(jm.ConfigError):
        store.trajectories_path(name, 0)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("step", [-1, "../1", 1.5, True])
def test_checkpoint_paths_are_steps_inside_the_project(step: object, tmp_path: Path) -> None:
    store = ModelStore("p", "m", root=tmp_path)
    with pytest.raises(jm.JourneymanError):
        store.checkpoint_path(step)  # type: ignore[arg-type]
    assert store.checkpoint_path(3).resolve().is_relative_to(store.path.resolve())


async def test_router_refuses_unsafe_model_names(scripted: tuple[ScriptedUpstream, Router]) -> None:
    _, router = scripted
    for name in ("../m", "m/x", "m@1", ""):
        with pytest.raises(jm.ConfigError):
            await router.deploy(name, None, 0)
    assert router.deployments == {}


@pytest.fixture
async def served(
    scripted: tuple[ScriptedUpstream, Router], tmp_path: Path
) -> AsyncIterator[tuple[httpx.AsyncClient, ScriptedUpstream]]:
    """`journeyman serve`'s app with a token, its gateway in front of a scripted upstream."""
    upstream, router = scripted
    backend = LocalBackend(root=tmp_path, gateway_thread=False)
    backend.router = router
    backend.records = RecordLog(tmp_path / "records.jsonl")
    backend.gateway_app = gateway = Gateway(router, backend.records)
    app = create_app(backend, TOKEN, max_body=MAX_BODY_BYTES)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://serve") as http:
        yield http, upstream
    await gateway.aclose()
    backend.records.close()


async def test_the_token_is_never_forwarded_upstream_or_logged(
    served: tuple[httpx.AsyncClient, ScriptedUpstream], caplog: pytest.LogCaptureFixture
) -> None:
    http, upstream = served
    # A call with a list for arguments: the gateway logs (INFO) that it returned it as text.
    call = {"id": "t1", "type": "function", "function": {"name": "add", "arguments": "[3, 4]"}}
    reply = {"id": "c1", "object": "chat.completion", "model": "smollm2",
             "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi", "tool_calls": [call]},
                          "finish_reason": "tool_calls", "token_ids": [5]}], "prompt_token_ids": [1, 2]}  # fmt: skip
    upstream.replies += [Reply(body=reply), Reply(status=500, body={"error": {"message": "boom"}})]
    caplog.set_level(logging.DEBUG)
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}]}
    auth = {"Authorization": f"Bearer {TOKEN}", "X-Api-Key": TOKEN}
    with reaching_caplog("journeyman"):
        assert (await http.post("/v1/chat/completions", json=body, headers=auth)).status_code == 200
        assert (await http.post("/v1/chat/completions", json=body, headers=auth)).status_code == 500
        wrong = await http.post(
            "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {TOKEN}x"}
        )
    assert wrong.status_code == 401 and TOKEN not in wrong.text
    assert len(upstream.headers) == 2
    for headers in upstream.headers:
        assert TOKEN not in repr(headers) and "authorization" not in headers
    assert TOKEN not in repr(upstream.received)
    # The gateway's own line is there: journeyman's logging did reach the capture checked below.
    line = "returned 1 tool call(s) with non-object arguments as text"
    assert ("journeyman.backend.serving.gateway", logging.INFO, line) in caplog.record_tuples
    assert TOKEN not in caplog.text


async def test_uploads_over_the_limit_are_refused_before_parsing(
    served: tuple[httpx.AsyncClient, ScriptedUpstream],
) -> None:
    http, upstream = served
    big = b'{"model": "smollm2", "messages": [], "pad": "' + b"x" * MAX_BODY_BYTES + b'"}'
    response = await http.post(
        "/v1/chat/completions", content=big, headers={"Authorization": f"Bearer {TOKEN}"}
    )
    assert response.status_code == 413 and upstream.received == []


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "example.org"])
def test_serving_beyond_loopback_without_a_token_is_refused(host: str) -> None:
    with pytest.raises(jm.ConfigError, match="token"):
        check_bind(host, None)
    with pytest.raises(jm.ConfigError, match="token"):
        check_bind(host, "")
    check_bind(host, TOKEN)


def test_the_serve_command_refuses_to_start_open_to_the_network(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "JOURNEYMAN_TOKEN"}
    done = subprocess.run(
        [sys.executable, "-m", "journeyman.backend", "serve", "--host", "0.0.0.0", "--root", str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 1
    assert "error: refusing to listen on 0.0.0.0 without a token" in done.stderr
    assert "Traceback" not in done.stderr and list(tmp_path.iterdir()) == []
