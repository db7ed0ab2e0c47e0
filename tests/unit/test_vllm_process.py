"""How a vLLM server is launched on CPU: one engine process, bound to its cores by affinity."""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from journeyman.backend.serving.vllm import PORT_RELAUNCHES, VLLMConfig, VLLMServer
from journeyman.backend.serving.vllm_config import core_list, free_port
from journeyman.errors import ConfigError, ServerStartError


def _server(tmp_path: Path, **settings: object) -> VLLMServer:
    return VLLMServer(VLLMConfig(model=tmp_path, port=1, **settings), log_path=tmp_path / "log")  # type: ignore[arg-type]


def test_a_cpu_server_runs_its_model_in_the_engine_process_on_its_cores(tmp_path: Path) -> None:
    server = _server(tmp_path, device="cpu", cpu_cores="0")
    command, env = server.command(), server.environment()
    assert command[command.index("--distributed-executor-backend") + 1] == "uni"
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert server.cores() == {0} and env["OMP_NUM_THREADS"] == "1"


def test_auto_cores_leave_the_server_unbound_on_every_core_but_the_reserved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "7")  # the caller's own setting is not the server's
    available = len(os.sched_getaffinity(0))
    server = _server(tmp_path, device="cpu")
    assert server.cores() is None
    assert server.environment()["OMP_NUM_THREADS"] == str(max(1, available - 1))
    server = _server(tmp_path, device="cpu", reserved_cpus=0)
    assert server.environment()["OMP_NUM_THREADS"] == str(available)


def test_cores_this_process_may_not_use_are_left_out(tmp_path: Path) -> None:
    allowed = os.sched_getaffinity(0)
    server = _server(tmp_path, device="cpu", cpu_cores=f"0-{max(allowed) + 4}")
    assert server.cores() == allowed
    assert _server(tmp_path, device="cpu", cpu_cores=f"{max(allowed) + 1}").cores() is None


@pytest.mark.parametrize(
    "settings",
    [
        {"device": "cuda"},
        {"device": "cpu", "tensor_parallel_size": 2},
        {"device": "cpu", "cpu_single_process": False},
    ],
)
def test_gpu_several_workers_or_a_choice_keep_vllm_s_own_executor(
    tmp_path: Path, settings: dict[str, object]
) -> None:
    server = _server(tmp_path, cpu_cores="0", **settings)
    assert "--distributed-executor-backend" not in server.command() and server.cores() is None
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in server.environment()


def test_core_lists_parse_as_vllm_writes_them() -> None:
    assert core_list("3") == [3]
    assert core_list("0-3") == [0, 1, 2, 3]
    assert core_list("0, 2-3") == [0, 2, 3]
    with pytest.raises(ConfigError, match="'0-3' or '0,2-3'"):
        core_list("first")


def test_a_float32_cpu_server_gets_batch_invariant_linear_layers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MKL_CBWR", raising=False)
    monkeypatch.delenv("JOURNEYMAN_CPU_EXACT", raising=False)
    monkeypatch.delenv("VLLM_CPU_ATTN_SPLIT_KV", raising=False)
    env = _server(tmp_path, device="cpu", dtype="float32").environment()
    assert env["JOURNEYMAN_CPU_EXACT"] == "1" and env["MKL_CBWR"] == "AUTO,STRICT"
    assert env["VLLM_CPU_ATTN_SPLIT_KV"] == "0"  # a decode's keys not split by the batch's length
    monkeypatch.setattr("journeyman.backend.serving.vllm.cpu_has_bf16", lambda: False)  # auto: float32
    for settings in (
        {"device": "cpu", "dtype": "bfloat16"},
        {"device": "cpu"},  # auto's float32 keeps vLLM's own (faster) layers
        {"device": "cuda", "dtype": "float32"},
    ):
        env = _server(tmp_path, **settings).environment()
        assert not {"JOURNEYMAN_CPU_EXACT", "MKL_CBWR", "VLLM_CPU_ATTN_SPLIT_KV"} & set(env)
    monkeypatch.setenv("JOURNEYMAN_CPU_EXACT", "0")  # the caller's choice stands
    assert _server(tmp_path, device="cpu", dtype="float32").environment()["JOURNEYMAN_CPU_EXACT"] == "0"


def test_a_server_that_dies_while_starting_says_so_until_it_is_stopped(tmp_path: Path) -> None:
    """What a watchdog reads: a restart killed before it answered is still a dead server (it
    once read as 'not started', and the watchdog left it dead)."""
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\necho starting\nkill -9 $$\n")
    python.chmod(0o755)
    server = VLLMServer(
        VLLMConfig(model=tmp_path, port=1, device="cpu"), log_path=tmp_path / "log", python=python
    )
    server.launch()
    with pytest.raises(ServerStartError, match="exited with code -9 while starting"):
        server.wait_healthy(timeout=30)
    assert server.exit_code() == -9 and not server.is_running()
    server.stop()
    assert server.exit_code() is None


FAKE_VLLM = """
import http.server, socket, sys

args = sys.argv[1:]
host, port = args[args.index("--host") + 1], int(args[args.index("--port") + 1])
sock = socket.socket()
sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
sock.bind((host, port))  # as vLLM binds it, after its imports


class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()


server = http.server.HTTPServer((host, port), Health, bind_and_activate=False)
server.socket.close()
server.socket = sock
server.server_activate()
server.serve_forever()
"""


def _fake_vllm(tmp_path: Path) -> Path:
    """A python that runs, instead of ``-m vllm...``, a server that binds ``--port`` as vLLM does
    and answers /health."""
    script = tmp_path / "fake_vllm.py"
    script.write_text(FAKE_VLLM)
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nshift 2\nexec {sys.executable} {script} "$@"\n')
    python.chmod(0o755)
    return python


@pytest.fixture
def taken() -> Iterator[int]:
    """A port another socket holds (as a client connection's own port would)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield int(sock.getsockname()[1])


def test_a_server_whose_picked_port_was_taken_meanwhile_starts_on_another(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, taken: int
) -> None:
    """free_port's port is free when picked and bound by vLLM 10-20 s later: here it was taken."""
    picks = iter([taken])
    monkeypatch.setattr(
        "journeyman.backend.serving.vllm.free_port", lambda host: next(picks, None) or free_port(host)
    )
    config = VLLMConfig(model=tmp_path, device="cpu")
    server = VLLMServer(config, log_path=tmp_path / "log", python=_fake_vllm(tmp_path))
    try:
        server.start(timeout=30)
        assert server.port not in (None, taken) and server.is_running()
        assert httpx.get(f"{server.base_url}/health").status_code == 200
    finally:
        server.stop()
    log = (tmp_path / "log").read_text()
    assert log.count("Address already in use") == 1 and log.count(f"--port {taken} ") == 1


@pytest.mark.parametrize("given", [True, False], ids=["port-given", "taken-each-time"])
def test_a_taken_port_the_caller_gave_or_that_stays_taken_fails_the_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, taken: int, given: bool
) -> None:
    """Only a port the server picked itself is given up, and only a bounded number of times."""
    monkeypatch.setattr("journeyman.backend.serving.vllm.free_port", lambda host: taken)
    config = VLLMConfig(model=tmp_path, device="cpu", port=taken if given else None)
    server = VLLMServer(config, log_path=tmp_path / "log", python=_fake_vllm(tmp_path))
    server.launch()
    with pytest.raises(
        ServerStartError, match=r"(?s)exited with code 1 while starting.*Address already in use"
    ):
        server.wait_healthy(timeout=60)
    server.stop()
    launches = (tmp_path / "log").read_text().count("=== journeyman: ")
    assert launches == (1 if given else 1 + PORT_RELAUNCHES)


@pytest.mark.parametrize("offline", [None, "0", "1"])
def test_the_server_is_as_offline_as_its_caller(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, offline: str | None
) -> None:
    """A hub name resolves in vLLM where the caller may reach the hub (it was forced offline)."""
    if offline is None:
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    else:
        monkeypatch.setenv("HF_HUB_OFFLINE", offline)
    for device in ("cpu", "cuda"):
        assert _server(tmp_path, device=device).environment().get("HF_HUB_OFFLINE") == offline


def test_torchrun_s_variables_stay_out_of_the_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A server started by a trainer rank joins no process group of the trainer's."""
    torchrun = {
        "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0",
        "GROUP_WORLD_SIZE": "1", "ROLE_RANK": "1", "ROLE_NAME": "default", "ROLE_WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_ERROR_FILE": "/tmp/error.json", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    }  # fmt: skip  # what torch's LocalElasticAgent sets for a worker
    for name, value in torchrun.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")  # the caller's own settings pass
    for device in ("cpu", "cuda"):
        env = _server(tmp_path, device=device).environment()
        assert not set(torchrun) & set(env) and env["CUDA_VISIBLE_DEVICES"] == "1"
    env = _server(tmp_path, device="cpu", env={"MASTER_PORT": "29600"}).environment()
    assert env["MASTER_PORT"] == "29600"  # VLLMConfig.env still sets what it names
