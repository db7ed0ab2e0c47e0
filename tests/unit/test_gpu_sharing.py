"""One GPU shared by the policy's vLLM server, a judge's and the trainer: the servers' command
lines, sleep mode over HTTP (a loopback server that records requests), and LocalBackend's plan,
replica check and sleep around a training step. Nothing here needs a GPU."""

from __future__ import annotations

import asyncio
import http.server
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from typer.testing import CliRunner

from journeyman import TrainConfig
from journeyman.backend import local
from journeyman.backend.app.cli import app
from journeyman.backend.local import LocalBackend
from journeyman.backend.serving.gpu_memory import CARDS
from journeyman.backend.serving.replicas import Replicas
from journeyman.backend.serving.vllm import VLLMConfig, VLLMServer
from journeyman.errors import BackendError, ConfigError

from .test_gpu_memory import CONFIGS


def _server(tmp_path: Path, **settings: Any) -> VLLMServer:
    return VLLMServer(VLLMConfig(model=tmp_path, port=1, **settings), log_path=tmp_path / "log")


def _flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def test_a_cuda_server_takes_its_configured_share_and_sleeps_only_when_asked(tmp_path: Path) -> None:
    command = _server(tmp_path, device="cuda").command()
    assert _flag(command, "--gpu-memory-utilization") == "0.5"  # on its own, unplanned
    assert "--enable-sleep-mode" not in command
    server = _server(tmp_path, device="cuda", gpu_memory_utilization=0.27, sleep_mode=True)
    command = server.command()
    assert _flag(command, "--gpu-memory-utilization") == "0.27"
    assert "--enable-sleep-mode" in command
    assert server.environment()["VLLM_SERVER_DEV_MODE"] == "1"  # vLLM serves /sleep and /wake_up only then


def test_a_cpu_server_is_unchanged_by_gpu_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_SERVER_DEV_MODE", raising=False)
    plain = _server(tmp_path, device="cpu")
    server = _server(tmp_path, device="cpu", gpu_memory_utilization=0.3, sleep_mode=True)
    assert server.command() == plain.command()
    assert "--gpu-memory-utilization" not in server.command()
    assert "VLLM_SERVER_DEV_MODE" not in server.environment()


def test_sleep_mode_binds_to_loopback(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="sleep_mode=True turns on vLLM's development endpoints"):
        VLLMServer(VLLMConfig(model=tmp_path, host="0.0.0.0", sleep_mode=True), log_path=tmp_path / "log")


class _Recorder(http.server.BaseHTTPRequestHandler):
    """Answers every POST with the status its server holds, and records the path."""

    server: _RecordingServer

    def do_POST(self) -> None:
        self.server.requests.append(self.path)
        body = json.dumps({"status": "ok"} if self.server.status == 200 else {"detail": "Not Found"}).encode()
        self.send_response(self.server.status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


class _RecordingServer(http.server.ThreadingHTTPServer):
    requests: list[str]
    status: int


@pytest.fixture
def vllm_double() -> Iterator[_RecordingServer]:
    double = _RecordingServer(("127.0.0.1", 0), _Recorder)
    double.requests, double.status = [], 200
    thread = threading.Thread(target=double.serve_forever, daemon=True)
    thread.start()
    try:
        yield double
    finally:
        double.shutdown()
        double.server_close()


def _sleeper(tmp_path: Path, double: _RecordingServer) -> VLLMServer:
    config = VLLMConfig(model=tmp_path, port=double.server_address[1], device="cuda", sleep_mode=True)
    return VLLMServer(config, log_path=tmp_path / "log")


def test_sleep_and_wake_up_call_vllm_s_endpoints(tmp_path: Path, vllm_double: _RecordingServer) -> None:
    server = _sleeper(tmp_path, vllm_double)
    asyncio.run(server.sleep())
    asyncio.run(server.wake_up())
    asyncio.run(server.sleep(level=2))
    assert vllm_double.requests == ["/sleep?level=1&mode=wait", "/wake_up", "/sleep?level=2&mode=wait"]


def test_a_refused_sleep_says_what_vllm_answered(tmp_path: Path, vllm_double: _RecordingServer) -> None:
    vllm_double.status = 404  # a server started without VLLM_SERVER_DEV_MODE has no /sleep
    with pytest.raises(
        BackendError, match=r"could not put vLLM to sleep.*404.*Not Found.*VLLM_SERVER_DEV_MODE=1"
    ):
        asyncio.run(_sleeper(tmp_path, vllm_double).sleep())
    with pytest.raises(ConfigError, match="sleep_mode=True"):
        asyncio.run(_server(tmp_path, device="cuda").sleep())
    assert vllm_double.requests == ["/sleep?level=1&mode=wait"]


def _gpus(monkeypatch: pytest.MonkeyPatch, *mib: int) -> None:
    monkeypatch.setattr(local, "visible_gpu_memory", lambda: [m * 1024**2 for m in mib])
    monkeypatch.setattr(local, "cuda_available", lambda: bool(mib))


def test_more_replicas_than_visible_gpus_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _gpus(monkeypatch, 81559)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    config = VLLMConfig(model=tmp_path)
    with pytest.raises(
        ConfigError, match=r"need 2 GPUs, and 1 is visible \(CUDA_VISIBLE_DEVICES=0\).*to 1 or fewer"
    ):
        LocalBackend(root=tmp_path, replicas=2)._servers(config)
    with pytest.raises(ConfigError, match=r"need 2 GPUs.*data_parallel_size to 1 or fewer"):
        LocalBackend(root=tmp_path)._servers(VLLMConfig(model=tmp_path, tensor_parallel_size=2))
    _gpus(monkeypatch, 81559, 81559)
    assert isinstance(LocalBackend(root=tmp_path, replicas=2)._servers(config), Replicas)
    _gpus(monkeypatch)  # CPU: cores are shared out, no GPU is counted
    assert isinstance(LocalBackend(root=tmp_path, replicas=3)._servers(config), Replicas)


def _model(root: Path, name: str) -> Path:
    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(CONFIGS[name]))
    return folder


def test_the_backend_plans_each_server_s_share_with_the_others_and_the_trainer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _gpus(monkeypatch, CARDS[3].mib)
    backend = LocalBackend(root=tmp_path)
    policy = backend._planned(VLLMConfig(model=_model(tmp_path, "Qwen2.5-7B")), "policy")
    assert policy.gpu_memory_utilization == 0.25
    judge = VLLMConfig(model=_model(tmp_path, "Qwen2.5-1.5B"), max_model_len=8192)
    assert backend._planned(judge, "judge Qwen2.5-1.5B").gpu_memory_utilization == 0.09
    plan = backend.gpu_memory
    assert plan is not None and plan.trainer is not None and len(plan.servers) == 2
    explicit = backend._planned(VLLMConfig(model=policy.model, gpu_memory_utilization=0.3), "policy")
    assert explicit.gpu_memory_utilization == 0.3  # an explicit share wins
    cpu = VLLMConfig(model=policy.model, device="cpu")
    assert backend._planned(cpu, "policy") is cpu


def test_a_7b_policy_on_a_24_gb_gpu_is_refused_before_its_server_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _gpus(monkeypatch, CARDS[0].mib)
    backend = LocalBackend(root=tmp_path, sleep_mode=True)
    with pytest.raises(ConfigError, match=r"22\.5 GiB GPU.*on a 40 GB card"):
        asyncio.run(backend._serve(_model(tmp_path, "Qwen2.5-7B")))
    assert backend.server is None and backend._memory_parts == {}


def test_a_step_in_sleep_mode_sleeps_the_policy_server_and_wakes_it_with_timings(
    tmp_path: Path, vllm_double: _RecordingServer
) -> None:
    backend = LocalBackend(root=tmp_path, sleep_mode=True)
    backend.server = _sleeper(tmp_path, vllm_double)
    seen: list[list[str]] = []

    class Trainer:
        async def train(self, groups: Any, config: TrainConfig) -> Any:
            seen.append(list(vllm_double.requests))  # what the server was told before the step
            return SimpleNamespace(step=1, metrics={"train/loss": 0.5})

    backend._trainers["m"] = Trainer()  # type: ignore[assignment]
    result = asyncio.run(backend.train(SimpleNamespace(name="m"), [], TrainConfig()))  # type: ignore[arg-type]
    assert seen == [["/sleep?level=1&mode=wait"]]
    assert vllm_double.requests == ["/sleep?level=1&mode=wait", "/wake_up"]
    assert result.metrics["train/loss"] == 0.5
    assert result.metrics["time/sleep"] >= 0 and result.metrics["time/wake"] >= 0
    backend.server = _server(tmp_path, device="cuda")  # without sleep mode: no calls, no timings
    vllm_double.requests.clear()
    result = asyncio.run(backend.train(SimpleNamespace(name="m"), [], TrainConfig()))  # type: ignore[arg-type]
    assert vllm_double.requests == [] and "time/sleep" not in result.metrics


def test_serve_and_demo_pass_the_gpu_options_on(monkeypatch: pytest.MonkeyPatch) -> None:
    import uvicorn

    from journeyman.backend.app import demo, server

    made: list[dict[str, Any]] = []
    monkeypatch.setattr(local, "LocalBackend", lambda **options: made.append(options))
    apps: list[dict[str, Any]] = []
    monkeypatch.setattr(server, "create_app", lambda *args, **options: apps.append(options))
    monkeypatch.setattr(uvicorn, "run", lambda *args, **kwargs: None)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    runner = CliRunner()
    result = runner.invoke(app, ["serve", "--gpu-memory-utilization", "0.4", "--sleep-mode"])
    assert result.exit_code == 0, result.output
    assert made[0]["sleep_mode"] and made[0]["vllm"].gpu_memory_utilization == 0.4
    assert apps[0]["report_to"] == []  # no tracker unless asked for (or W&B's key is set)
    assert runner.invoke(app, ["serve", "--report-to", "tensorboard"]).exit_code == 0
    assert apps[1]["report_to"] == ["tensorboard"]
    made.pop()
    runner.invoke(app, ["serve"])
    assert not made[1]["sleep_mode"] and "vllm" not in made[1]
    assert runner.invoke(app, ["serve", "--gpu-memory-utilization", "1.5"]).exit_code == 2

    configs: list[Any] = []
    monkeypatch.setattr(demo, "run_demo", lambda config, **_: configs.append(config))
    result = runner.invoke(app, ["demo", "--gpu-memory-utilization", "0.3", "--sleep-mode", "--name", "g"])
    assert result.exit_code == 0, result.output
    assert configs[0].gpu_memory_utilization == 0.3 and configs[0].sleep_mode
    policy = demo.Demo(configs[0])._policy_vllm()
    assert policy is not None and policy.gpu_memory_utilization == 0.3


def test_with_two_gpus_or_more_the_trainer_takes_one_and_the_servers_the_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _gpus(monkeypatch, 81559, 81559, 81559)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6")
    backend = LocalBackend(root=tmp_path)
    assert backend._trainer_device() == "cuda:2" and not backend._trains_on_gpu()
    server = backend._servers(VLLMConfig(model=tmp_path))
    assert isinstance(server, VLLMServer) and server.config.env["CUDA_VISIBLE_DEVICES"] == "4,5"
    replicas = LocalBackend(root=tmp_path, replicas=2)._servers(VLLMConfig(model=tmp_path))
    assert isinstance(replicas, Replicas)
    assert [s.config.env["CUDA_VISIBLE_DEVICES"] for s in replicas.servers] == ["4", "5"]
    # servers that need every GPU, or a train device named by the user: they share
    assert LocalBackend(root=tmp_path, replicas=3)._trainer_device() == "auto"
    assert LocalBackend(root=tmp_path, train_device="cuda:0")._server_gpus() is None
    _gpus(monkeypatch, 81559)
    assert LocalBackend(root=tmp_path)._trainer_device() == "auto"
