"""`journeyman serve` under torchrun: rank 0 serves HTTP and leads, rank 1 follows each step."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import journeyman as jm
from journeyman.backend.serving.vllm import free_port
from journeyman.config import TrainConfig
from journeyman.store import ModelStore
from tests.integration.test_distributed_trainer import groups, lora_weights
from tests.waits import serving

TOKEN = "dp-token"
CONFIG = TrainConfig(learning_rate=5e-3)


async def test_serve_under_torchrun_trains_each_step_on_both_ranks(tmp_path: Path, tokenizer: Any) -> None:
    from safetensors.torch import load_file

    from journeyman.backend.training.trainer import Trainer

    port = free_port()
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "-m", "journeyman.backend", "serve", "--port", str(port), "--root", str(tmp_path / "served"),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "JOURNEYMAN_TOKEN": TOKEN}
    log = tmp_path / "torchrun.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    try:
        if not serving(url, 120, interval=0.5):
            pytest.fail(log.read_text()[-3000:])

        async with jm.RemoteBackend(url, token=TOKEN, timeout=600) as backend:
            model = jm.TrainableModel(
                name="dp", project="test", base_model="smollm2-135m", root=tmp_path / "c"
            )
            await model.register(backend)
            # rank 0 all-reduces with rank 1 inside the step: it completes only if rank 1 follows
            result = await model.train(groups(tokenizer), CONFIG)
            assert result.step == 1
            assert "train/loss" in result.metrics
    finally:
        os.killpg(process.pid, signal.SIGINT)  # torchrun passes it on; rank 0 tells rank 1 to stop
        try:
            code = process.wait(90)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            pytest.fail("torchrun did not stop within 90 s of SIGINT:\n" + log.read_text()[-3000:])
    # torchrun itself exits 1 after a signal (SignalException); the ranks must stop cleanly.
    text = log.read_text()
    assert code in (0, 1), text[-3000:]
    ours = [line for line in text.splitlines() if 'File "' in line and "/backend/" in line]
    assert not ours, text[-3000:]  # no traceback through journeyman on either rank

    served = load_file(
        str(
            tmp_path
            / "served"
            / "test"
            / "dp"
            / "checkpoints"
            / "0001"
            / "adapter"
            / "adapter_model.safetensors"
        )
    )
    single = Trainer("smollm2-135m", ModelStore("test", "dp", root=tmp_path / "single"), threads=1)
    single.load()
    single.train_step(groups(tokenizer), CONFIG)
    reference = {n.replace(".default", ""): w for n, w in lora_weights(single).items()}
    # AdamW's first step moves each weight by about lr x sign(g): both agree except where a bf16
    # gradient is so small that summing it in another order flips its sign (the fp32 equality is
    # test_distributed_trainer.py's).
    disagree = {
        name: ((weight - reference[name].to(weight.dtype)).abs() > CONFIG.learning_rate / 2).float().mean()
        for name, weight in served.items()
    }
    overall = sum(float(d) * served[n].numel() for n, d in disagree.items()) / sum(
        w.numel() for w in served.values()
    )
    assert overall < 0.01 and max(disagree.values()) < 0.05, (
        overall,
        max(disagree.items(), key=lambda x: x[1]),
    )
    assert all(
        bool(w.abs().max() > 0) for n, w in served.items() if "lora_B" in n
    )  # every lora_B moved off 0
