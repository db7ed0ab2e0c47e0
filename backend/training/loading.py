"""The policy as the trainer holds it: a base model with a trainable LoRA adapter.

Two engines load it: transformers + peft everywhere (with our fused LoRA kernels on CPU), and
Unsloth where CUDA and Unsloth are both present. Both read and write peft's adapter format, so a
checkpoint made by one resumes in the other and vLLM serves either.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import torch

from journeyman.config import LoRAConfig
from journeyman.errors import ConfigError

from . import fused_lora
from .checkpoints import ADAPTER

__all__ = [
    "TRAINING_ENGINES",
    "bf16_supported",
    "load_transformers",
    "load_unsloth",
    "training_dtype",
    "unsloth_chosen",
]

TRAINING_ENGINES = ("auto", "transformers", "unsloth")


def bf16_supported() -> bool:
    if torch.cuda.is_available():
        return bool(torch.cuda.is_bf16_supported())
    check = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
    return bool(check and check())


def training_dtype(precision: str) -> torch.dtype:
    """fp32 when asked for, or by default where the host has no bf16 instructions; else bf16."""
    if precision == "fp32" or (precision == "auto" and not bf16_supported()):
        return torch.float32
    return torch.bfloat16


def unsloth_chosen(engine: str) -> bool:
    """Unsloth when asked for, or by default where CUDA and Unsloth are both present."""
    if engine == "unsloth":
        if not (torch.cuda.is_available() and importlib.util.find_spec("unsloth")):
            raise ConfigError("engine='unsloth' needs a CUDA GPU and `pip install 'journeyman[unsloth]'`")
        return True
    return engine == "auto" and torch.cuda.is_available() and importlib.util.find_spec("unsloth") is not None


def _peft_config(lora: LoRAConfig) -> Any:
    from peft import LoraConfig

    return LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,  # type: ignore[arg-type]  # peft accepts floats
        lora_dropout=lora.dropout,
        target_modules=list(lora.effective_target_modules),
        task_type="CAUSAL_LM",
    )


def load_transformers(
    path: Path | str,
    checkpoint: Path | None,
    *,
    dtype: torch.dtype,
    lora: LoRAConfig,
    seed: int,
    fused: bool,
) -> tuple[Any, Any]:
    """The model and tokenizer: a fresh adapter (the same for the same ``seed``) when
    ``checkpoint`` is None, else the checkpoint's, trainable."""
    from peft import PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    base = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    if checkpoint is None:
        with torch.random.fork_rng(devices=[]):  # the same initial adapter for the same seed
            torch.manual_seed(seed)
            model = get_peft_model(base, _peft_config(lora))
    else:
        model = PeftModel.from_pretrained(base, checkpoint / ADAPTER, is_trainable=True)
    if fused:
        fused_lora.install(model)
    return model, tokenizer


def load_unsloth(
    path: Path | str, checkpoint: Path | None, *, dtype: torch.dtype, lora: LoRAConfig
) -> tuple[Any, Any]:  # pragma: no cover - GPU only
    """Unsloth's fused kernels on CUDA; the same peft adapter format on disk."""
    from unsloth import FastLanguageModel

    source = str(checkpoint / ADAPTER) if checkpoint is not None else str(path)
    model, tokenizer = FastLanguageModel.from_pretrained(model_name=source, dtype=dtype, load_in_4bit=False)
    if checkpoint is None:
        model = FastLanguageModel.get_peft_model(
            model,
            r=lora.rank,
            lora_alpha=lora.alpha,
            lora_dropout=lora.dropout,
            target_modules=list(lora.effective_target_modules),
        )
    FastLanguageModel.for_training(model)
    return model, tokenizer
