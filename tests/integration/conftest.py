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

import httpx
import pytest

from journeyman.backend.serving.engine import Engine, InferenceServer
from journeyman.backend.serving.gateway import Gateway, GatewayThread, RecordLog
from journeyman.backend.serving.router import Router
from journeyman.backend.serving.vllm import VLLMConfig, VLLMServer

SERVED_BASE = "smollm2"
MAX_LORA_RANK = 8
QWEN = "qwen2.5-coder-0.5b"
FAMILIES = ("smollm2-135m", QWEN)
each_family = pytest.mark.parametrize("family", FAMILIES)
"""Run a test on both model families (Llama-architecture SmolLM2 and Qwen2)."""


_RUNNING: dict[str, VLLMServer] = {}
"""The session servers started so far, by fixture name."""
_FAMILY_OF = {"vllm_server": "smollm2-135m", "qwen_server": QWEN}
_last_users: dict[str, str] | None = None


def _server(
    model_dir: Path, name: str, tmp: pytest.TempPathFactory, *, fixture: str | None = None, **settings: Any
) -> Iterator[VLLMServer]:
    """A vLLM server for the generator's life; ``fixture``: the session fixture that holds it, so that
    it can be stopped after the last test that needs it."""
    log = tmp.mktemp(f"vllm-{name}") / "vllm.log"
    config = VLLMConfig(
        model=model_dir, served_name=name, max_lora_rank=MAX_LORA_RANK, max_loras=2, **settings
    )
    server = VLLMServer(config, log_path=log)
    server.start(timeout=900)
    if fixture is not None:
        _RUNNING[fixture] = server
    yield server
    _RUNNING.pop(fixture or "", None)
    server.stop()


def _uses(item: pytest.Item, fixture: str) -> bool:
    """Whether the test needs the session server of ``fixture`` (directly, or as ``served``)."""
    names = getattr(item, "fixturenames", ())
    callspec = getattr(item, "callspec", None)
    return fixture in names or (
        "served" in names and callspec is not None and callspec.params.get("family") == _FAMILY_OF[fixture]
    )


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Stop a session server after the last test that needs it, not at the session's end: the
    slow tier, run last in the same session, needs the memory (3-5 GB a server)."""
    global _last_users
    if _last_users is None:
        _last_users = {}
        for test in item.session.items:
            _last_users.update({fixture: test.nodeid for fixture in _FAMILY_OF if _uses(test, fixture)})
    for fixture, last in _last_users.items():
        if last == item.nodeid and fixture in _RUNNING:
            _RUNNING.pop(fixture).stop()


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
    yield from _server(model_dir, SERVED_BASE, tmp_path_factory, fixture="vllm_server", kv_cache_gib=1)


@pytest.fixture(scope="session")
def router(vllm_server: VLLMServer) -> Router:
    return Router(vllm_server, keep_versions=2)


@pytest.fixture(scope="session")
def gateway(router: Router, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayThread]:
    yield from _gateway(router, SERVED_BASE, tmp_path_factory)


@pytest.fixture(scope="session")
def tokenizer(model_dir: Path) -> Any:
    return _tokenizer(model_dir)


class SharedServer:
    """The session's vLLM server, lent to a LocalBackend as the policy's server it would otherwise
    start (about 20 s): ``LocalBackend(engine=shared_engine)``. It serves the backend's adapters
    beside the other tests' (each model's adapters have names of their own), and the backend's
    close leaves it running. Only for tests that never kill, restart or merge into their server:
    those start their own, as does every judge the backend starts (:meth:`LocalBackend.start_judge`)."""

    def __init__(self, server: VLLMServer, config: VLLMConfig) -> None:
        if str(config.model) != str(server.config.model) or config.merge_adapters:
            raise AssertionError(f"the session server serves {server.config.model} with LoRA, not {config}")
        self.server = server

    @property
    def config(self) -> VLLMConfig:
        return self.server.config

    @property
    def base_url(self) -> str:
        return self.server.base_url

    @property
    def pids(self) -> tuple[int | None, ...]:
        return self.server.pids

    @property
    def log_path(self) -> Path:
        return self.server.log_path

    def url_for(self, rollout_id: str | None) -> str:
        return self.server.url_for(rollout_id)

    def launch(self) -> None:
        assert self.server.is_running(), "the session server died: see its log"

    def wait_healthy(self, timeout: float | None = None) -> None:
        self.server.wait_healthy(timeout)

    def is_running(self) -> bool:
        return self.server.is_running()

    def exit_code(self) -> int | None:
        return self.server.exit_code()

    def stop(self, timeout: float = 30.0) -> None:
        """Left running for the tests after."""

    async def load_adapter(self, name: str, path: Path, client: httpx.AsyncClient | None = None) -> None:
        await self.server.load_adapter(name, path, client)

    async def unload_adapter(self, name: str, client: httpx.AsyncClient | None = None) -> None:
        await self.server.unload_adapter(name, client)

    async def reload_weights(self, folder: Path, client: httpx.AsyncClient | None = None) -> None:
        raise AssertionError("a shared server serves adapters: a merging test starts its own")


@pytest.fixture(scope="session")
def shared_engine(vllm_server: VLLMServer) -> Engine:
    """``LocalBackend(engine=shared_engine)``: its policy's server is the session's (:class:`SharedServer`);
    a judge's server is a vLLM server of its own."""

    def engine(config: VLLMConfig, *, log_path: Path) -> InferenceServer:
        if config.served_name == VLLMConfig.served_name:  # the policy's ("base"); a judge's has its name
            return SharedServer(vllm_server, config)
        return VLLMServer(config, log_path=log_path)

    return engine


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
    yield from _server(qwen_dir, "qwen", tmp_path_factory, fixture="qwen_server", kv_cache_gib=1)


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
