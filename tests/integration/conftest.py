"""Real servers for the integration tier: one vLLM server and one gateway per test run."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from journeyman.backend.gateway import Gateway, GatewayThread, RecordLog
from journeyman.backend.router import Router
from journeyman.backend.vllm import VLLMConfig, VLLMServer

SERVED_BASE = "smollm2"
MAX_LORA_RANK = 8


@pytest.fixture(scope="session")
def vllm_server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    """The real vLLM server with the embedded model (40-70 s to start on 2 cores)."""
    log = tmp_path_factory.mktemp("vllm") / "vllm.log"
    config = VLLMConfig(model=model_dir, served_name=SERVED_BASE, max_lora_rank=MAX_LORA_RANK, max_loras=2)
    server = VLLMServer(config, log_path=log)
    server.start(timeout=600)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def router(vllm_server: VLLMServer) -> Router:
    return Router(vllm_server, keep_versions=2)


@pytest.fixture(scope="session")
def gateway(router: Router, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayThread]:
    records = RecordLog(tmp_path_factory.mktemp("gateway") / "records.jsonl")
    with GatewayThread(Gateway(router, records)) as thread:
        yield thread
    records.close()


@pytest.fixture(scope="session")
def tokenizer(model_dir: Path) -> Any:
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(model_dir)


def make_adapter(model_dir: Path, out: Path, *, rank: int = 4, seed: int = 0, scale: float = 16.0) -> Path:
    """A peft LoRA adapter with random (non-zero) weights, so it changes what the model says."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(
        r=rank, lora_alpha=scale * rank, target_modules=["q_proj", "v_proj"], init_lora_weights=False
    )
    get_peft_model(model, config).save_pretrained(out)
    return out
