"""A trained step out of journeyman: a merged Hugging Face folder, the PEFT adapter, or a GGUF file.

- ``hf``: the base model's folder (config, tokenizer, generation config, and the chat template
  journeyman served it with) with the step's adapter merged into its weights
  (:func:`~journeyman.backend.serving.merge.merge_adapter`): transformers, vLLM or TGI load it
  with no journeyman installed.
- ``peft``: the adapter as trained, for ``PeftModel.from_pretrained(base, folder)`` or vLLM's
  ``--lora-modules``; its config names the base model it was trained on.
- ``gguf``: the merged weights in one GGUF file for llama.cpp and Ollama (Llama and Qwen2
  architectures), with the byte-level BPE tokenizer, the chat template and an Ollama
  ``Modelfile`` beside it. Matrices are stored as ``f16`` (the default), ``q8_0`` or ``f32``;
  norms and biases stay ``f32``.

Every export is written under a temporary name and appears whole, with a ``journeyman-export.json``
saying what it holds. :func:`check_export` loads one back (transformers; for GGUF its GGUF loader)
and compares greedy text and logits with the step's adapter applied to its base model by peft,
which is what the trainer trained and the server served.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

from journeyman.errors import ConfigError, ExportError
from journeyman.store import CHECKPOINT_STATE, ModelStore, atomic_dir

from .models import MARKER
from .serving.families import serving_defaults
from .serving.merge import merge_adapter

__all__ = [
    "CHECK_PROMPTS",
    "ExportCheck",
    "ExportFormat",
    "GGUFType",
    "ModelExport",
    "check_export",
    "export_step",
]

ExportFormat = Literal["hf", "peft", "gguf"]
GGUFType = Literal["f16", "q8_0", "f32"]
MANIFEST = "journeyman-export.json"
CHECK_PROMPTS = (
    "What is 47 times 86?",
    "Write one sentence about the sea.",
    "Find the email about my flight to Denver and tell me its confirmation code.",
    "List three prime numbers.",
    "What does a LoRA adapter change in a model?",
)
"""What :func:`check_export` compares on by default (``journeyman export --check``)."""

# The base folder's files that travel with merged weights (the weights themselves are rewritten).
_HF_FILES = (
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
    "special_tokens_map.json", "vocab.json", "merges.txt", "added_tokens.json",
)  # fmt: skip
_ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}
# llama.cpp's pre-tokenizer names, by the regex (or digit split) the tokenizer applies first.
_QWEN2_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"


@dataclass(frozen=True)
class ModelExport:
    """What :func:`export_step` wrote."""

    format: ExportFormat
    path: Path
    """The export's folder."""
    step: int
    base_model: str
    """The base model's folder the step was trained on."""
    files: tuple[str, ...]
    """File names in the folder, the main one first (for ``gguf``, the ``.gguf`` file)."""
    bytes: int
    seconds: float
    gguf_type: GGUFType | None = None

    @property
    def main_file(self) -> Path:
        return self.path / self.files[0]


@dataclass(frozen=True)
class ExportCheck:
    """An export loaded back and compared with its step (base model + adapter, by peft)."""

    prompts: int
    greedy_equal: int
    """Prompts whose greedy continuation is the same text from both."""
    max_logit_diff: float
    """Largest absolute difference of next-token logits over the prompts' positions."""
    texts: tuple[tuple[str, str], ...]
    """(the step's continuation, the export's) per prompt."""
    export_tokens: tuple[tuple[int, ...], ...]
    """The export's greedy continuation per prompt, as token ids."""
    lossy: bool = False
    """The export rounds the weights further (GGUF ``q8_0``): a greedy text may part ways where
    two tokens were nearly tied, so a difference there is reported, not a failure."""

    @property
    def ok(self) -> bool:
        """Every greedy text equal, or a lossy export (whose differences are only reported)."""
        return self.lossy or self.greedy_equal == self.prompts


def export_step(
    store: ModelStore,
    out: Path,
    *,
    step: int | None = None,
    format: ExportFormat = "hf",
    gguf_type: GGUFType = "f16",
) -> ModelExport:
    """Write ``store``'s checkpoint at ``step`` (default: the latest) to the folder ``out``.

    Refuses an ``out`` that exists and is not empty (nothing is overwritten), a step with no
    complete checkpoint, and a GGUF export of an architecture it cannot map.
    """
    if format not in get_args(ExportFormat):
        raise ConfigError(f"format must be one of {', '.join(get_args(ExportFormat))}, got {format!r}")
    if gguf_type not in get_args(GGUFType):
        raise ConfigError(f"gguf_type must be one of {', '.join(get_args(GGUFType))}, got {gguf_type!r}")
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(
            f"{out} already exists and is not an empty folder; give a new folder to export into"
        )
    step, checkpoint = _checkpoint(store, step)
    state = json.loads((checkpoint / CHECKPOINT_STATE).read_text())
    base = Path(state["base_model"])
    if format != "peft" and not (base / "config.json").is_file():
        raise ExportError(
            f"step {step} was trained on {base}, which is not a model folder here; prepare the base model "
            "(journeyman model prepare) or export --format peft, which needs only the adapter"
        )
    adapter = checkpoint / "adapter"
    started = time.perf_counter()
    with atomic_dir(out) as folder:
        if format == "peft":
            files = _write_peft(adapter, folder)
        elif format == "hf":
            files = _write_hf(base, adapter, folder)
        else:
            merged = folder / ".merged"
            _write_hf(base, adapter, merged)
            name = f"{store.model}-step{step}-{gguf_type}.gguf"
            files = [name, *_write_gguf(
                merged, folder / name, gguf_type, title=f"{store.model} step {step}", alias=_embedded_alias(base)
            )]  # fmt: skip
            shutil.rmtree(merged)
        manifest = {
            "format": format, "project": store.project, "model": store.model, "step": step,
            "base_model": str(base), "checkpoint": str(checkpoint), "gguf_type": gguf_type if format == "gguf" else None,
            "trainer_state": {k: state.get(k) for k in ("lora", "learning_rate", "metrics")},
        }  # fmt: skip
        (folder / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    return ModelExport(
        format, out, step, str(base), (*files, MANIFEST), size, time.perf_counter() - started,
        gguf_type if format == "gguf" else None,
    )  # fmt: skip


def _checkpoint(store: ModelStore, step: int | None) -> tuple[int, Path]:
    steps = store.checkpoint_steps()
    if not steps:
        raise ExportError(f"{store.path} holds no complete checkpoint; train a step first")
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise ExportError(f"{store.path} holds no checkpoint of step {step}; it has steps {steps}")
    return step, store.checkpoint_path(step)


def _write_peft(adapter: Path, folder: Path) -> list[str]:
    files = sorted(p.name for p in adapter.iterdir() if p.is_file())
    for name in files:
        shutil.copyfile(adapter / name, folder / name)
    return ["adapter_model.safetensors", *(n for n in files if n != "adapter_model.safetensors")]


def _write_hf(base: Path, adapter: Path, folder: Path) -> list[str]:
    merge_adapter(base, adapter, folder)
    for name in _HF_FILES:
        if (base / name).is_file():
            shutil.copyfile(base / name, folder / name)
    # The template the model was served (and so trained) with becomes the folder's own.
    template = serving_defaults(base).chat_template or base / "chat_template.jinja"
    if template.is_file():
        shutil.copyfile(template, folder / "chat_template.jinja")
    weights = sorted(
        p.name for p in folder.iterdir() if p.suffix == ".safetensors" or p.name.endswith(".index.json")
    )
    return [*weights, *sorted(p.name for p in folder.iterdir() if p.is_file() and p.name not in weights)]


# GGUF -------------------------------------------------------------------------------------------


def _write_gguf(hf: Path, path: Path, gguf_type: GGUFType, *, title: str, alias: str | None) -> list[str]:
    """The merged folder ``hf`` as one GGUF file at ``path`` and an Ollama ``Modelfile``."""
    import gguf
    import numpy as np
    from safetensors import safe_open

    config = json.loads((hf / "config.json").read_text())
    arch_name = _ARCHITECTURES.get((config.get("architectures") or [""])[0])
    if arch_name is None:
        raise ExportError(
            f"GGUF export knows the Llama and Qwen2 architectures, not {config.get('architectures')}; "
            "export --format hf and convert that folder with llama.cpp's convert_hf_to_gguf.py"
        )
    arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch_name)
    heads, kv_heads = int(config["num_attention_heads"]), int(config["num_key_value_heads"])
    hidden, layers = int(config["hidden_size"]), int(config["num_hidden_layers"])
    rope = config.get("rope_parameters") or {}
    writer = gguf.GGUFWriter(path, arch_name)
    writer.add_name(title)
    writer.add_context_length(int(config["max_position_embeddings"]))
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(int(config["intermediate_size"]))
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(float(rope.get("rope_theta", config.get("rope_theta", 10000.0))))
    writer.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
    writer.add_rope_dimension_count(int(config.get("head_dim") or hidden // heads))
    writer.add_vocab_size(int(config["vocab_size"]))
    file_type = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                 "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[gguf_type]  # fmt: skip
    writer.add_file_type(int(file_type))
    template = (hf / "chat_template.jinja").read_text() if (hf / "chat_template.jinja").is_file() else None
    tokenizer = json.loads((hf / "tokenizer.json").read_text())
    _add_tokenizer(writer, hf, tokenizer, int(config["vocab_size"]), template, alias)

    names = gguf.get_tensor_name_map(arch, layers)
    qtype = {"f32": gguf.GGMLQuantizationType.F32, "f16": gguf.GGMLQuantizationType.F16,
             "q8_0": gguf.GGMLQuantizationType.Q8_0}[gguf_type]  # fmt: skip
    for file in sorted(hf.glob("*.safetensors")):  # one file, or the shards of a larger model
        with safe_open(file, framework="pt") as weights:
            for key in weights.keys():  # noqa: SIM118 (safe_open is no dict)
                if key == "lm_head.weight" and config.get("tie_word_embeddings"):
                    continue
                name = names.get_name(key, try_suffixes=(".weight", ".bias"))
                if name is None:
                    raise ExportError(f"no GGUF name for the weight {key} of a {arch_name} model")
                data = weights.get_tensor(key).float().numpy()
                if arch_name == "llama" and key.endswith(("q_proj.weight", "k_proj.weight")):
                    # llama.cpp applies rotary embeddings to interleaved pairs; HF to halves.
                    data = _permute(data, heads if "q_proj" in key else kv_heads)
                if data.ndim == 1 or qtype == gguf.GGMLQuantizationType.F32 or data.shape[-1] % 32:
                    writer.add_tensor(name, data.astype(np.float32))
                elif qtype == gguf.GGMLQuantizationType.F16:
                    writer.add_tensor(name, data.astype(np.float16))
                else:
                    writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
    generation = (
        json.loads((hf / "generation_config.json").read_text())
        if (hf / "generation_config.json").is_file()
        else {}
    )
    stops = generation.get("eos_token_id") or config.get("eos_token_id") or []
    by_id = {t["id"]: t["content"] for t in tokenizer.get("added_tokens", [])}
    stop_texts = [by_id[i] for i in (stops if isinstance(stops, list) else [stops]) if i in by_id]
    (path.parent / "Modelfile").write_text(_modelfile(path.name, stop_texts, template))
    return ["Modelfile"]


def _permute(weights: Any, heads: int) -> Any:
    """HF's rotary layout (first half, second half) -> llama.cpp's (interleaved pairs), per head."""
    rows = weights.shape[0]
    return (
        weights.reshape(heads, 2, rows // heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def _add_tokenizer(
    writer: Any, hf: Path, tokenizer: dict[str, Any], vocab_size: int, template: str | None, alias: str | None
) -> None:
    """A byte-level BPE tokenizer (``tokenizer.json``) as llama.cpp's ``gpt2`` model."""
    import gguf

    model = tokenizer["model"]
    if model.get("type") != "BPE" or (tokenizer.get("decoder") or {}).get("type") != "ByteLevel":
        raise ExportError(
            f"{hf / 'tokenizer.json'} is not a byte-level BPE tokenizer, the only kind GGUF export writes; "
            "export --format hf and convert that folder with llama.cpp's convert_hf_to_gguf.py"
        )
    tokens = dict(model["vocab"])
    special = {t["content"] for t in tokenizer.get("added_tokens", []) if t.get("special")}
    for added in tokenizer.get("added_tokens", []):
        tokens[added["content"]] = added["id"]
    by_id = {i: t for t, i in tokens.items()}
    texts, types = [], []
    for i in range(vocab_size):
        if i not in by_id:  # the embedding matrix is padded past the tokenizer
            texts.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
            continue
        texts.append(by_id[i])
        is_added = by_id[i] not in model["vocab"] or by_id[i] in special
        types.append(
            gguf.TokenType.CONTROL if by_id[i] in special
            else gguf.TokenType.USER_DEFINED if is_added else gguf.TokenType.NORMAL
        )  # fmt: skip
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(_pre_tokenizer(tokenizer, alias))
    writer.add_token_list(texts)
    writer.add_token_types(types)
    special_vocab = gguf.SpecialVocab(hf, load_merges=True, n_vocab=vocab_size)
    special_vocab.chat_template = template
    special_vocab.add_to_gguf(writer, quiet=True)


def _pre_tokenizer(tokenizer: dict[str, Any], alias: str | None) -> str:
    """llama.cpp's name for how the tokenizer splits text before BPE."""
    pre = tokenizer.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    kinds = [s.get("type") for s in steps]
    if kinds[:1] == ["Split"] and (steps[0].get("pattern") or {}).get("Regex") == _QWEN2_SPLIT:
        return "qwen2"
    if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits"):
        return "smollm"
    # An embedded model's tokenizer.json comes from its GGUF, whose own name is the one to keep.
    if kinds == ["ByteLevel"] and alias is not None and alias.startswith("smollm"):
        return "smollm"
    raise ExportError(
        f"GGUF export does not know this tokenizer's pre-tokenizer ({kinds}); export --format hf and "
        "convert that folder with llama.cpp's convert_hf_to_gguf.py"
    )


def _embedded_alias(folder: Path) -> str | None:
    try:
        alias = json.loads((folder / MARKER).read_text()).get("alias")
    except (OSError, ValueError):
        return None
    return str(alias) if alias else None


def _modelfile(gguf_name: str, stops: Sequence[str], template: str | None) -> str:
    """An Ollama Modelfile: the weights, ChatML with hermes-style tool calls, the stop tokens.

    Ollama writes prompts with Go templates, not the Jinja template in the GGUF; this one renders
    the same turns as the ChatML templates journeyman serves (system, tools listed as JSON lines,
    ``<tool_call>`` blocks, results in ``<tool_response>`` blocks of a user turn).
    """
    if template is not None and "<|im_start|>" not in template:
        lines = [f"FROM ./{gguf_name}", ""]  # not ChatML: Ollama picks a template from the GGUF
    else:
        lines = [f"FROM ./{gguf_name}", "", f'TEMPLATE """{_CHATML_GO}"""', ""]
    lines += [f'PARAMETER stop "{stop}"' for stop in stops]
    return "\n".join(lines) + "\n"


_CHATML_GO = """{{- if or .System .Tools }}<|im_start|>system
{{ if .System }}{{ .System }}{{ end }}
{{- if .Tools }}

# Tools

These functions are available, one JSON signature per line:
<tools>
{{- range .Tools }}
{{ .Function }}
{{- end }}
</tools>

To call a function, answer with a JSON object holding its name and arguments inside <tool_call></tool_call> tags.
Each result comes back inside <tool_response></tool_response> tags.
{{- end }}<|im_end|>
{{ end }}
{{- range $i, $_ := .Messages }}
{{- $last := eq (len (slice $.Messages $i)) 1 }}
{{- if eq .Role "user" }}<|im_start|>user
{{ .Content }}<|im_end|>
{{ else if eq .Role "assistant" }}<|im_start|>assistant
{{ .Content }}
{{- range .ToolCalls }}
<tool_call>
{"name": "{{ .Function.Name }}", "arguments": {{ .Function.Arguments }}}
</tool_call>
{{- end }}{{ if not $last }}<|im_end|>
{{ end }}
{{- else if eq .Role "tool" }}<|im_start|>user
<tool_response>
{{ .Content }}
</tool_response><|im_end|>
{{ end }}
{{- if and (ne .Role "assistant") $last }}<|im_start|>assistant
{{ end }}
{{- end }}"""


# Loading back -----------------------------------------------------------------------------------


def check_export(export: ModelExport, prompts: Sequence[str], *, max_new_tokens: int = 16) -> ExportCheck:
    """Load ``export`` back and compare it with its step on ``prompts`` (each a user turn).

    The reference is the checkpoint's adapter on its base model through peft, in fp32; the export
    is loaded by transformers (``hf``: the folder; ``peft``: the base model and the exported
    adapter; ``gguf``: transformers' GGUF loader, which dequantises to fp32). Logits are compared
    on the same tokens: each prompt followed by the reference's greedy continuation.
    """
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    manifest = json.loads((export.path / MANIFEST).read_text())
    base, adapter = Path(export.base_model), Path(manifest["checkpoint"]) / "adapter"
    tokenizer = AutoTokenizer.from_pretrained(base)
    encoded = prompt_ids(base, prompts, tokenizer)

    def load(which: str) -> Any:
        model: Any
        if which == "reference" or export.format == "peft":
            model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
            model = PeftModel.from_pretrained(model, adapter if which == "reference" else export.path)
        elif export.format == "gguf":
            model = AutoModelForCausalLM.from_pretrained(
                export.path, gguf_file=export.files[0], dtype=torch.float32
            )
        else:
            model = AutoModelForCausalLM.from_pretrained(export.path, dtype=torch.float32)
        return model.eval()

    def greedy(model: Any, ids: list[int]) -> Any:
        input_ids = torch.tensor([ids])
        return model.generate(
            input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens,
            do_sample=False, pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
        )[0]  # fmt: skip

    texts: list[list[str]] = [[], []]
    logits: list[list[Any]] = [[], []]
    sequences: list[Any] = []
    exported: list[Any] = []
    for side, which in enumerate(("reference", "export")):
        model = load(which)
        with torch.inference_mode():
            for number, ids in enumerate(encoded):
                out = greedy(model, ids)
                texts[side].append(str(tokenizer.decode(out[len(ids) :])))
                (sequences if side == 0 else exported).append(out)
                logits[side].append(model(sequences[number][None]).logits[0].float())
        del model
    diff = max(float((a - b).abs().max()) for a, b in zip(*logits, strict=True))
    pairs = tuple(zip(*texts, strict=True))
    continuations = tuple(
        tuple(int(t) for t in out[len(ids) :]) for out, ids in zip(exported, encoded, strict=True)
    )
    lossy = export.format == "gguf" and export.gguf_type == "q8_0"
    return ExportCheck(len(prompts), sum(a == b for a, b in pairs), diff, pairs, continuations, lossy)


def prompt_ids(base: Path, prompts: Sequence[str], tokenizer: Any = None) -> list[list[int]]:
    """Each prompt as one user turn, rendered with the chat template ``base`` is served with
    (``tokenizer``: base's, when the caller has it loaded already)."""
    from transformers import AutoTokenizer

    tokenizer = tokenizer if tokenizer is not None else AutoTokenizer.from_pretrained(base)
    template_file = serving_defaults(base).chat_template
    template = template_file.read_text() if template_file is not None else None
    rendered: list[Any] = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], chat_template=template, add_generation_prompt=True,
            tokenize=True, return_dict=False,
        )
        for prompt in prompts
    ]  # fmt: skip
    return [[int(token) for token in ids] for ids in rendered]
