"""Exporting a checkpoint (backend/export.py) on tiny Llama and Qwen2 models with real BPE tokenizers:
each format loads back and answers as the step does; bad requests are refused with nothing written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from journeyman.backend.export import MANIFEST, check_export, export_step
from journeyman.errors import ConfigError, ExportError
from journeyman.store import CHECKPOINT_STATE, ModelStore

PROMPTS = ["add 12 and 30", "the sea is wide", "what is 47 times 86?"]
CHATML = (
    "{%- for m in messages -%}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)
QWEN2_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"


def _tokenizer(folder: Path, family: str) -> int:
    """A byte-level BPE tokenizer trained on a few lines, split like SmolLM2 (digits) or Qwen2 (regex)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=family != "qwen2")
    first = (
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated")
        if family == "qwen2"
        else pre_tokenizers.Digits(individual_digits=True)
    )
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([first, byte_level])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    corpus = ["the sea is wide and the sky is blue", "add twelve and thirty", "what is 47 times 86"] * 20
    tokenizer.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )
    fast.save_pretrained(folder)
    (folder / "chat_template.jinja").write_text(CHATML)
    return len(fast)


def _store(
    tmp_path: Path, family: str, *, tied: bool = True, steps: tuple[int, ...] = (3,), shard: str | None = None
) -> ModelStore:
    """A store whose checkpoints hold random (non-zero) LoRA adapters on a tiny base model."""
    from peft import LoraConfig, get_peft_model
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    base = tmp_path / f"base-{family}"
    base.mkdir()
    tokens = _tokenizer(base, family)
    torch.manual_seed(0)
    shape = dict(
        vocab_size=tokens + 20, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=tied, eos_token_id=2, bos_token_id=0,
    )  # fmt: skip
    if family == "qwen2":
        model: torch.nn.Module = Qwen2ForCausalLM(Qwen2Config(**shape))
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if name.endswith("bias"):
                    parameter.normal_()
    else:
        model = LlamaForCausalLM(LlamaConfig(**shape))
    model.to(torch.bfloat16).save_pretrained(base, **({"max_shard_size": shard} if shard else {}))
    GenerationConfig(eos_token_id=[2], bos_token_id=0).save_pretrained(base)
    store = ModelStore("p", "agent", root=tmp_path / "root")
    for step in steps:
        torch.manual_seed(step)
        fresh = type(model).from_pretrained(base, dtype=torch.float32)
        config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
        with store.write_checkpoint(step) as folder:
            get_peft_model(fresh, config).save_pretrained(folder / "adapter")  # type: ignore[arg-type]
            (folder / CHECKPOINT_STATE).write_text(json.dumps({"step": step, "base_model": str(base)}))
    return store


BF16 = 0.05  # merged weights are rounded once to the base model's dtype (bf16 here), as served merged


@pytest.mark.parametrize(
    ("family", "tied", "fmt", "gguf_type", "tolerance"),
    [
        ("llama", True, "hf", "f16", BF16),
        ("llama", True, "peft", "f16", 1e-5),
        ("llama", True, "gguf", "f32", BF16),
        ("llama", True, "gguf", "f16", BF16),
        ("llama", True, "gguf", "q8_0", 0.5),
        ("qwen2", False, "hf", "f16", BF16),
        ("qwen2", False, "gguf", "f32", BF16),
        ("qwen2", True, "gguf", "q8_0", 0.5),
    ],
)
def test_export_loads_back_and_answers_as_the_step(
    tmp_path: Path, family: str, tied: bool, fmt: str, gguf_type: str, tolerance: float
) -> None:
    store = _store(tmp_path, family, tied=tied)
    export = export_step(store, tmp_path / "out", format=fmt, gguf_type=gguf_type)  # type: ignore[arg-type]
    assert export.step == 3 and export.main_file.is_file()
    manifest = json.loads((export.path / MANIFEST).read_text())
    assert manifest["format"] == fmt and manifest["step"] == 3
    check = check_export(export, PROMPTS, max_new_tokens=8)
    assert check.greedy_equal == check.prompts, check.texts
    assert check.lossy == (gguf_type == "q8_0" and fmt == "gguf")
    assert check.max_logit_diff <= tolerance
    # The merge does change the model: the base alone answers otherwise.
    assert check.max_logit_diff < _base_vs_step_logit_diff(store)


def _base_vs_step_logit_diff(store: ModelStore) -> float:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = json.loads((store.checkpoint_path(3) / CHECKPOINT_STATE).read_text())["base_model"]
    ids = torch.tensor([[1, 5, 9, 30, 2]])
    plain = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    tuned = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), store.checkpoint_path(3) / "adapter"
    ).eval()
    with torch.inference_mode():
        return float((plain(ids).logits - tuned(ids).logits).abs().max())


def test_gguf_holds_the_tokenizer_template_and_every_weight(tmp_path: Path) -> None:
    import gguf

    store = _store(tmp_path, "llama")
    export = export_step(store, tmp_path / "out", format="gguf", gguf_type="q8_0")
    reader = gguf.GGUFReader(export.main_file)
    fields = {
        name: field.contents()
        for name, field in reader.fields.items()
        if not name.startswith("tokenizer.ggml.t")
    }
    assert fields["general.architecture"] == "llama"
    assert fields["tokenizer.ggml.model"] == "gpt2" and fields["tokenizer.ggml.pre"] == "smollm"
    assert fields["tokenizer.chat_template"] == CHATML
    assert fields["tokenizer.ggml.eos_token_id"] == 2
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    assert (
        len(tokens) == fields["llama.vocab_size"]
        and tokens[1] == "<|im_start|>"
        and tokens[-1].startswith("[PAD")
    )
    names = {t.name: t.tensor_type.name for t in reader.tensors}
    assert len(names) == 2 + 2 * 9  # embeddings, final norm, and per block 4 attention, 3 MLP, 2 norms
    assert "output.weight" not in names  # tied: llama.cpp reuses the embeddings
    assert names["blk.0.attn_q.weight"] == "Q8_0" and names["blk.0.attn_norm.weight"] == "F32"
    modelfile = (export.path / "Modelfile").read_text()
    assert modelfile.startswith(f"FROM ./{export.main_file.name}\n")
    assert 'PARAMETER stop "<|im_end|>"' in modelfile and "<tool_call>" in modelfile


def test_qwen2_tokenizer_is_named_qwen2_and_its_output_kept_when_untied(tmp_path: Path) -> None:
    import gguf

    store = _store(tmp_path, "qwen2", tied=False)
    export = export_step(store, tmp_path / "out", format="gguf")
    reader = gguf.GGUFReader(export.main_file)
    assert reader.fields["tokenizer.ggml.pre"].contents() == "qwen2"
    names = {t.name for t in reader.tensors}
    assert {"output.weight", "blk.1.attn_q.bias", "blk.1.attn_k.bias", "blk.1.attn_v.bias"} <= names


def test_a_sharded_base_model_exports_every_weight(tmp_path: Path) -> None:
    store = _store(tmp_path, "llama", shard="40KB")
    base = Path(json.loads((store.checkpoint_path(3) / CHECKPOINT_STATE).read_text())["base_model"])
    assert len(list(base.glob("*.safetensors"))) > 2  # the tiny model in several shards
    export = export_step(store, tmp_path / "out", format="gguf", gguf_type="f32")
    check = check_export(export, PROMPTS, max_new_tokens=8)
    assert check.greedy_equal == check.prompts and check.max_logit_diff <= BF16


def test_export_takes_the_step_asked_for_else_the_latest(tmp_path: Path) -> None:
    store = _store(tmp_path, "llama", steps=(2, 5))
    assert export_step(store, tmp_path / "latest", format="peft").step == 5
    chosen = export_step(store, tmp_path / "two", format="peft", step=2)
    assert chosen.step == 2
    assert (chosen.path / "adapter_model.safetensors").read_bytes() == (
        store.checkpoint_path(2) / "adapter" / "adapter_model.safetensors"
    ).read_bytes()


def test_bad_requests_are_refused_and_write_nothing(tmp_path: Path) -> None:
    store = _store(tmp_path, "llama")
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("mine")
    with pytest.raises(ExportError, match="not an empty folder"):
        export_step(store, taken)
    assert [p.name for p in taken.iterdir()] == ["keep.txt"]
    with pytest.raises(ExportError, match="no checkpoint of step 4; it has steps \\[3\\]"):
        export_step(store, tmp_path / "a", step=4)
    with pytest.raises(ConfigError, match="format must be one of hf, peft, gguf"):
        export_step(store, tmp_path / "b", format="onnx")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="gguf_type must be one of"):
        export_step(store, tmp_path / "c", format="gguf", gguf_type="q4_k")  # type: ignore[arg-type]
    with pytest.raises(ExportError, match="holds no complete checkpoint"):
        export_step(ModelStore("p", "empty", root=tmp_path / "root"), tmp_path / "d")
    assert not any((tmp_path / name).exists() for name in "abcd")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folder left


def test_gguf_refuses_what_it_cannot_map_and_says_what_to_do(tmp_path: Path) -> None:
    store = _store(tmp_path, "llama")
    base = Path(json.loads((store.checkpoint_path(3) / CHECKPOINT_STATE).read_text())["base_model"])
    tokenizer = json.loads((base / "tokenizer.json").read_text())
    tokenizer["pre_tokenizer"] = {"type": "Whitespace"}
    (base / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(ExportError, match=r"convert_hf_to_gguf\.py"):
        export_step(store, tmp_path / "out", format="gguf")
    assert not (tmp_path / "out").exists()
    config = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ExportError, match="Llama and Qwen2 architectures, not \\['GPT2LMHeadModel'\\]"):
        export_step(store, tmp_path / "out", format="gguf")


def test_a_base_model_that_is_gone_is_named(tmp_path: Path) -> None:
    store = _store(tmp_path, "llama")
    state = store.checkpoint_path(3) / CHECKPOINT_STATE
    state.write_text(json.dumps({"step": 3, "base_model": str(tmp_path / "moved")}))
    with pytest.raises(ExportError, match="not a model folder here"):
        export_step(store, tmp_path / "out", format="hf")
    assert export_step(store, tmp_path / "adapter", format="peft").main_file.is_file()  # needs no base


def test_the_command_exports_checks_and_reports(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from journeyman.backend.app.cli import app

    _store(tmp_path, "qwen2")
    out = tmp_path / "gguf"
    args = [
        "export",
        "p",
        "agent",
        str(out),
        "--format",
        "gguf",
        "--gguf-type",
        "q8_0",
        "--root",
        str(tmp_path / "root"),
    ]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert f"step 3 -> {out}" in result.output
    assert "check: greedy text equal on 5 of 5 prompts" in result.output
    assert sorted(p.name for p in out.iterdir()) == sorted(["Modelfile", MANIFEST, "agent-step3-q8_0.gguf"])
    again = CliRunner().invoke(app, args)  # the folder is taken now
    assert again.exit_code != 0 and "not an empty folder" in str(again.exception)
