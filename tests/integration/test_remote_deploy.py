"""Trainer and inference on separate servers: `journeyman serve --push-to` pushes each step.

Two real `journeyman serve` processes on loopback (each with its own vLLM): the trainer server
trains a step and pushes the adapter over the authenticated API to the inference server, which
then answers ``agent`` with exactly the trainer's adapter.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import journeyman as jm
from journeyman.backend.serving.vllm import free_port
from journeyman.config import TrainConfig
from tests.integration.test_distributed_trainer import groups
from tests.waits import serving

TOKEN = "trainer-token-1"
INFERENCE_TOKEN = "inference-token-2"


def _serve(tmp_path: Path, name: str, token: str, *extra: str) -> tuple[str, subprocess.Popen[bytes]]:
    port = free_port()
    command = [sys.executable, "-m", "journeyman.backend", "serve", "--port", str(port),
               "--root", str(tmp_path / name), *extra]  # fmt: skip
    log = open(tmp_path / f"{name}.log", "wb")  # noqa: SIM115
    env = {**os.environ, "JOURNEYMAN_TOKEN": token, "JOURNEYMAN_PUSH_TOKEN": INFERENCE_TOKEN}
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    if serving(url, 60):
        return url, process
    process.kill()
    pytest.fail((tmp_path / f"{name}.log").read_text()[-3000:])


def _stop(*processes: subprocess.Popen[bytes]) -> None:
    for process in processes:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[tuple[str, str]]:
    inference, first = _serve(tmp_path, "inference", INFERENCE_TOKEN)
    trainer, second = _serve(tmp_path, "trainer", TOKEN, "--push-to", inference)
    yield trainer, inference
    _stop(second, first)


def _answer(url: str, token: str, model: str) -> tuple[str, list[float]]:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "What is 2+3?"}],
        "max_tokens": 12,
        "temperature": 0,
        "logprobs": True,
    }
    response = httpx.post(
        f"{url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {token}"}, timeout=120
    )
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    return choice["message"]["content"], [t["logprob"] for t in choice["logprobs"]["content"]]


async def test_the_trainer_pushes_each_step_to_the_inference_server(
    servers: tuple[str, str], tmp_path: Path, tokenizer: Any
) -> None:
    trainer_url, inference_url = servers
    async with jm.RemoteBackend(trainer_url, token=TOKEN) as backend:
        model = jm.TrainableModel(
            name="agent", project="test", base_model="smollm2-135m", root=tmp_path / "c"
        )
        await model.register(backend)
        _, base_logprobs = _answer(trainer_url, TOKEN, "agent")
        result = await model.train(groups(tokenizer), TrainConfig(learning_rate=5e-3))
        assert result.step == 1

    # The inference server serves the pushed step, and only with its own token.
    headers = {"Authorization": f"Bearer {INFERENCE_TOKEN}"}
    listed = {m["id"] for m in httpx.get(f"{inference_url}/v1/models", headers=headers).json()["data"]}
    assert {"agent", "agent@1"} <= listed
    assert (
        httpx.get(f"{inference_url}/v1/models", headers={"Authorization": f"Bearer {TOKEN}"}).status_code
        == 401
    )

    # Byte for byte the trainer's checkpoint.
    trained = tmp_path / "trainer" / "test" / "agent" / "checkpoints" / "0001" / "adapter"
    pushed = tmp_path / "inference" / "deployments" / "agent" / "0001"
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        assert (pushed / name).read_bytes() == (trained / name).read_bytes()

    # Both servers answer `agent` with the same new weights (greedy, same logprobs).
    text, logprobs = _answer(trainer_url, TOKEN, "agent")
    remote_text, remote_logprobs = _answer(inference_url, INFERENCE_TOKEN, "agent")
    assert remote_text == text
    assert remote_logprobs == pytest.approx(logprobs, abs=1e-3)
    assert remote_logprobs != pytest.approx(base_logprobs, abs=1e-3)  # not the base model's answer
    assert _answer(inference_url, INFERENCE_TOKEN, "agent@1")[0] == text


async def test_a_trainer_only_server_starts_no_vllm_and_sends_rollouts_to_the_inference_server(
    tmp_path: Path, tokenizer: Any
) -> None:
    inference_url, first = _serve(tmp_path, "inference", INFERENCE_TOKEN)
    trainer_url, second = _serve(tmp_path, "trainer", TOKEN, "--push-to", inference_url, "--no-inference")
    try:
        async with jm.RemoteBackend(trainer_url, token=TOKEN) as backend:
            model = jm.TrainableModel(
                name="solo", project="test", base_model="smollm2-135m", root=tmp_path / "c"
            )
            await model.register(backend)  # pushes step 0 to the inference server
            assert model.inference_base_url == f"{inference_url}/v1"
            before, _ = _answer(inference_url, INFERENCE_TOKEN, "solo@0")
            result = await model.train(groups(tokenizer), TrainConfig(learning_rate=5e-3))
            assert result.step == 1
            await model.register(backend)  # registering again: step 1 is already there, which is fine
        headers = {"Authorization": f"Bearer {INFERENCE_TOKEN}"}
        listed = {m["id"] for m in httpx.get(f"{inference_url}/v1/models", headers=headers).json()["data"]}
        assert {"solo", "solo@0", "solo@1"} <= listed
        assert (
            _answer(inference_url, INFERENCE_TOKEN, "solo")[0]
            == _answer(inference_url, INFERENCE_TOKEN, "solo@1")[0]
        )
        assert not (tmp_path / "trainer" / "logs" / "vllm.log").exists()  # no vLLM on the trainer
        trained = tmp_path / "trainer" / "test" / "solo" / "checkpoints" / "0001" / "adapter"
        pushed = tmp_path / "inference" / "deployments" / "solo" / "0001"
        assert (pushed / "adapter_model.safetensors").read_bytes() == (
            trained / "adapter_model.safetensors"
        ).read_bytes()
        assert before  # step 0 answered before training
    finally:
        _stop(second, first)
