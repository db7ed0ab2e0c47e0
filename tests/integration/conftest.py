"""Real servers for the integration tier: one vLLM server and one gateway per model per test run.

The embedded SmolLM2-135M serves every test (``vllm_server``, ``gateway``, ``tokenizer``); tests of
model-specific paths also run on Qwen2.5-Coder-0.5B: mark them ``@each_family`` and take ``served``,
which starts that model's server once, on first use, and keeps it for the run.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from journeyman.backend.serving.gateway import Gateway, GatewayThread, RecordLog
from journeyman.backend.serving.router import Router
from journeyman.backend.serving.vllm import VLLMConfig, VLLMServer

SERVED_BASE = "smollm2"
MAX_LORA_RANK = 8
QWEN = "qwen2.5-coder-0.5b"
FAMILIES = ("smollm2-135m", QWEN)
each_family = pytest.mark.parametrize("family", FAMILIES)
"""Run a test on both model families (Llama-architecture SmolLM2 and Qwen2)."""


def _server(model_dir: Path, name: str, tmp: pytest.TempPathFactory, **settings: Any) -> Iterator[VLLMServer]:
    log = tmp.mktemp(f"vllm-{name}") / "vllm.log"
    config = VLLMConfig(
        model=model_dir, served_name=name, max_lora_rank=MAX_LORA_RANK, max_loras=2, **settings
    )
    server = VLLMServer(config, log_path=log)
    server.start(timeout=900)
    yield server
    server.stop()


def _gateway(router: Router, name: str, tmp: pytest.TempPathFactory) -> Iterator[GatewayThread]:
    records = RecordLog(tmp.mktemp(f"gateway-{name}") / "records.jsonl")
    with GatewayThread(Gateway(router, records)) as thread:
        yield thread
    records.close()


def _tokenizer(model_dir: Path) -> Any:
    import transformers

    return transformers.AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="session")
def vllm_server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    """The real vLLM server with the embedded model (20-25 s to start on 2 cores). A 1 GiB KV cache
    (about 23k tokens in fp32) holds what the tests run at once and leaves memory to the servers
    that tests start beside this one and Qwen's."""
    yield from _server(model_dir, SERVED_BASE, tmp_path_factory, kv_cache_gib=1)


@pytest.fixture(scope="session")
def router(vllm_server: VLLMServer) -> Router:
    return Router(vllm_server, keep_versions=2)


@pytest.fixture(scope="session")
def gateway(router: Router, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayThread]:
    yield from _gateway(router, SERVED_BASE, tmp_path_factory)


@pytest.fixture(scope="session")
def tokenizer(model_dir: Path) -> Any:
    return _tokenizer(model_dir)


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


# The second family: Qwen2.5-Coder-0.5B (q/k/v biases, its own tool template, untied output) -----


@pytest.fixture(scope="session")
def qwen_dir() -> Path:
    from journeyman.backend.models import prepare_model

    return prepare_model(QWEN)


@pytest.fixture(scope="session")
def qwen_server(qwen_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    """The real vLLM server with Qwen2.5-Coder-0.5B (about 100 s to start on 2 cores)."""
    yield from _server(qwen_dir, "qwen", tmp_path_factory, kv_cache_gib=1)


@pytest.fixture(scope="session")
def qwen_router(qwen_server: VLLMServer) -> Router:
    return Router(qwen_server, keep_versions=2)


@pytest.fixture(scope="session")
def qwen_gateway(qwen_router: Router, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayThread]:
    yield from _gateway(qwen_router, "qwen", tmp_path_factory)


@pytest.fixture(scope="session")
def qwen_tokenizer(qwen_dir: Path) -> Any:
    return _tokenizer(qwen_dir)


@dataclass(frozen=True)
class Served:
    """One model family's shared servers, for tests marked ``@each_family``."""

    family: str
    model_dir: Path
    server: VLLMServer
    router: Router
    gateway: GatewayThread
    tokenizer: Any

    @property
    def name(self) -> str:
        """The name the base model is served under."""
        return self.server.config.served_name


_FIXTURES = {
    "smollm2-135m": ("model_dir", "vllm_server", "router", "gateway", "tokenizer"),
    QWEN: ("qwen_dir", "qwen_server", "qwen_router", "qwen_gateway", "qwen_tokenizer"),
}


@pytest.fixture
def served(request: pytest.FixtureRequest, family: str) -> Served:
    """The family's servers, started on first use and shared by the whole run."""
    return Served(family, *(request.getfixturevalue(name) for name in _FIXTURES[family]))


@pytest.fixture
def family_tokenizer(request: pytest.FixtureRequest, family: str) -> Any:
    """The family's tokenizer alone (no server started)."""
    return request.getfixturevalue(_FIXTURES[family][4])
