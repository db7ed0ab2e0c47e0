"""The GPU memory plan: real model shapes on 24, 40 and 80 GB cards, with and without a judge."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from journeyman.backend.serving.gpu_memory import (
    CARDS,
    GpuMemoryPlan,
    ModelShape,
    fit_table,
    model_shape,
    plan_gpu_memory,
    visible_gpu_memory,
)
from journeyman.errors import ConfigError
from tests.docs_snippets import docs_hooks

ROOT = Path(__file__).resolve().parents[2]

CONFIGS = {  # the keys the plan reads, as the models' config.json on the hub has them
    "Qwen2.5-0.5B": {
        "architectures": ["Qwen2ForCausalLM"], "hidden_size": 896, "intermediate_size": 4864,
        "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
        "vocab_size": 151936, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    },
    "Qwen2.5-1.5B": {
        "architectures": ["Qwen2ForCausalLM"], "hidden_size": 1536, "intermediate_size": 8960,
        "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2,
        "vocab_size": 151936, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    },
    "Qwen2.5-7B": {
        "architectures": ["Qwen2ForCausalLM"], "hidden_size": 3584, "intermediate_size": 18944,
        "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
        "vocab_size": 152064, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    },
    "Qwen3-8B": {
        "architectures": ["Qwen3ForCausalLM"], "hidden_size": 4096, "intermediate_size": 12288,
        "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "vocab_size": 151936, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    },
    "Llama-3.1-8B": {
        "architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "vocab_size": 128256, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    },
}  # fmt: skip
PARAMETERS = {  # the published counts
    "Qwen2.5-0.5B": 0.49e9,
    "Qwen2.5-1.5B": 1.54e9,
    "Qwen2.5-7B": 7.6e9,
    "Qwen3-8B": 8.2e9,
    "Llama-3.1-8B": 8.03e9,
}
GB24, GB40, GB80 = CARDS[0].total, CARDS[1].total, CARDS[3].total


@pytest.fixture(scope="module")
def shapes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, ModelShape]:
    """Each model read from a folder holding its config.json."""
    found = {}
    for name, config in CONFIGS.items():
        folder = tmp_path_factory.mktemp("models") / name
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(config))
        shape = model_shape(folder)
        assert shape is not None
        found[name] = shape
    return found


@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_parameter_estimate_is_within_a_few_percent_of_the_published_count(
    shapes: dict[str, ModelShape], name: str
) -> None:
    assert shapes[name].parameters == pytest.approx(PARAMETERS[name], rel=0.02)


def test_kv_cache_per_token_follows_layers_kv_heads_and_head_dim(shapes: dict[str, ModelShape]) -> None:
    assert shapes["Qwen2.5-7B"].kv_bytes_per_token() == 2 * 28 * 4 * 128 * 2  # 56 KiB
    assert shapes["Qwen3-8B"].kv_bytes_per_token() == 2 * 36 * 8 * 128 * 2  # head_dim given, not 4096/32
    assert shapes["Qwen2.5-0.5B"].head_dim == 64


def test_a_folder_without_config_json_has_no_shape_and_a_bad_one_says_what_is_missing(tmp_path: Path) -> None:
    assert model_shape(tmp_path) is None
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(ConfigError, match=r"num_attention_heads.*gpu_memory_utilization"):
        model_shape(tmp_path)
    snapshot = tmp_path / "models--Qwen--Qwen3-8B" / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(CONFIGS["Qwen3-8B"]))
    assert getattr(model_shape(snapshot), "name", None) == "Qwen3-8B"  # a hub snapshot: the model's name
    nested = {"text_config": CONFIGS["Qwen3-8B"], "vision_config": {"hidden_size": 1}}
    (tmp_path / "config.json").write_text(json.dumps(nested))
    assert model_shape(tmp_path) == ModelShape.from_config(CONFIGS["Qwen3-8B"], name=tmp_path.name)


def _fitting(plan: GpuMemoryPlan) -> GpuMemoryPlan | None:
    """The plan, or the cheapest of its variants that fits (as fit_table picks)."""
    for variant in (
        plan,
        plan.with_gradient_checkpointing(),
        plan.with_sleep("policy"),
        plan.with_gradient_checkpointing().with_sleep("policy"),
    ):
        if variant.fits:
            return variant
    return None


@pytest.mark.parametrize("judge", [None, "Qwen2.5-1.5B"])
@pytest.mark.parametrize("total", [GB24, GB40, GB80], ids=["24GB", "40GB", "80GB"])
@pytest.mark.parametrize("policy", ["Qwen2.5-0.5B", "Qwen2.5-1.5B", "Qwen2.5-7B", "Qwen3-8B", "Llama-3.1-8B"])
def test_a_plan_that_fits_leaves_room_for_every_part(
    shapes: dict[str, ModelShape], policy: str, total: int, judge: str | None
) -> None:
    plan = plan_gpu_memory(total, shapes[policy], shapes[judge] if judge else None)
    fitting = _fitting(plan)
    small = policy in ("Qwen2.5-0.5B", "Qwen2.5-1.5B")
    if small or total == GB80:
        assert fitting is not None, plan
    if total == GB80:
        assert fitting is plan  # as planned: no gradient checkpointing, no sleep
    if fitting is None:
        with pytest.raises(ConfigError):
            plan.with_gradient_checkpointing().with_sleep("policy").check()
        return
    assert fitting.check() is fitting
    trainer = fitting.trainer
    assert trainer is not None
    shares = [fitting.utilization(s.name) for s in fitting.servers]
    assert sum(shares) + trainer.resident / total < 1
    if not fitting.sleep_mode:
        assert sum(shares) + trainer.peak / total < 1
    for server in fitting.servers:
        assert server.share(total) >= server.weights + server.kv_cache + server.overhead(total)
        assert 0 < fitting.utilization(server.name) < 1
    assert f"{total / 1024**3:.1f} GiB GPU" in str(fitting)


@pytest.mark.parametrize("policy", ["Qwen2.5-7B", "Qwen3-8B", "Llama-3.1-8B"])
def test_a_7_or_8b_policy_on_a_24_gb_card_is_refused_with_the_card_that_fits(
    shapes: dict[str, ModelShape], policy: str
) -> None:
    plan = plan_gpu_memory(GB24, shapes[policy], shapes["Qwen2.5-1.5B"])
    for variant in (plan.with_gradient_checkpointing().with_sleep("policy"), plan):
        with pytest.raises(ConfigError) as refused:
            variant.check()
        message = str(refused.value)
        assert "22.5 GiB GPU" in message and "the trainer" in message and "QLoRA" in message
        assert any(f"{card} GB card" in message for card in (40, 48, 80))
    assert "an 80 GB card (H100, A100 80GB) as planned" in str(refused.value)


def test_the_refusal_names_what_fits_on_this_card(shapes: dict[str, ModelShape]) -> None:
    plan = plan_gpu_memory(GB40, shapes["Qwen2.5-7B"], shapes["Qwen2.5-1.5B"])
    with pytest.raises(ConfigError) as refused:
        plan.check()
    message = str(refused.value)
    assert "fits on this GPU with gradient_checkpointing=True in TrainConfig and sleep_mode=True" in message
    assert "needs 18.0 GiB (weights 14.2" in message  # each part's need, in GiB
    assert plan.with_gradient_checkpointing().with_sleep("policy").fits


def test_sleep_mode_lets_the_trainer_use_the_sleeping_server_s_weights_and_kv_cache(
    shapes: dict[str, ModelShape],
) -> None:
    plan = plan_gpu_memory(GB40, shapes["Qwen2.5-7B"], shapes["Qwen2.5-1.5B"], gradient_checkpointing=True)
    asleep = plan.with_sleep("policy")
    assert not plan.fits and asleep.fits
    policy = asleep.server("policy")
    assert policy.asleep(GB40) == policy.overhead(GB40) < policy.share(GB40)
    assert asleep.utilization("policy") == plan.utilization("policy")  # the same share while serving
    assert asleep.server(asleep.servers[1].name).asleep(GB40) == asleep.servers[1].share(GB40)  # judges stay
    # While serving, the trainer's weights stay beside the servers: sleep mode cannot fit a 7B on 24 GB.
    assert not plan.on(GB24).with_sleep("policy").fits


def test_an_explicit_utilization_wins_and_one_too_small_for_the_weights_is_refused(
    shapes: dict[str, ModelShape],
) -> None:
    plan = plan_gpu_memory(GB80, shapes["Qwen2.5-7B"], shapes["Qwen2.5-1.5B"], policy_utilization=0.3)
    assert plan.utilization("policy") == 0.3 and plan.fits
    assert "set by gpu_memory_utilization" in str(plan)
    starved = plan_gpu_memory(GB80, shapes["Qwen2.5-7B"], policy_utilization=0.1)
    with pytest.raises(ConfigError, match=r"gpu_memory_utilization=0.1 gives the policy vLLM server 8.0 GiB"):
        starved.check()


def test_a_judge_alone_needs_no_trainer(shapes: dict[str, ModelShape]) -> None:
    plan = plan_gpu_memory(GB24, None, shapes["Qwen2.5-1.5B"])
    assert plan.trainer is None and plan.fits and plan.need == plan.serving


def test_visible_gpus_follow_cuda_visible_devices(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    smi = tmp_path / "nvidia-smi"
    smi.write_text(
        "#!/bin/sh\n"
        'echo "0, GPU-aaaa-1111, 81559"\n'
        'echo "1, GPU-bbbb-2222, 40960"\n'
        'echo "2, GPU-cccc-3333, 23034"\n'
    )
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    mib = 1024**2
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert visible_gpu_memory() == [81559 * mib, 40960 * mib, 23034 * mib]
    for visible, expected in (
        ("2,0", [23034, 81559]),
        ("GPU-bbbb", [40960]),  # a UUID's prefix, as CUDA takes it
        ("1,7,0", [40960]),  # CUDA stops at the first entry that names no GPU
        ("", []),
        ("-1", []),
    ):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        assert visible_gpu_memory() == [m * mib for m in expected], visible
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    assert visible_gpu_memory() == []


def test_the_gpu_guide_s_table_is_the_plan_s() -> None:
    """The guide's table is made from the plan when the docs are built (scripts/docs_hooks.py)."""
    guide = (ROOT / "docs" / "guides" / "gpu.md").read_text()
    assert "<!-- generated: gpu-fit -->" in guide
    assert docs_hooks().generate("<!-- generated: gpu-fit -->") == fit_table()
