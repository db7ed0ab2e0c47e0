"""The policy as the trainer holds it: a base model with a trainable LoRA adapter.

Two engines load it: transformers + peft everywhere (with our fused LoRA kernels on CPU), and
Unsloth where CUDA and Unsloth are both present. Both read and write peft's adapter format, so a
checkpoint made by one resumes in the other and vLLM serves either.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from pathlib import Path
from typing import Any

import torch

from journeyman.config import LoRAConfig
from journeyman.errors import ConfigError

from . import fused_lora
from .checkpoints import ADAPTER

__all__ = ["TRAINING_ENGINES", "load_transformers", "load_unsloth", "unsloth_chosen"]

TRAINING_ENGINES = ("auto", "transformers", "unsloth")

logger = logging.getLogger(__name__)


def unsloth_chosen(engine: str, device: torch.device) -> bool:
    """Unsloth when asked for, or by default when training on CUDA where Unsloth imports. A
    broken Unsloth install (``import unsloth`` raising) falls back to transformers with a warning
    under ``auto``, and is an error that shows the import's own error when asked for."""
    if engine == "transformers" or (engine == "auto" and device.type != "cuda"):
        return False
    if device.type != "cuda":
        raise ConfigError(f"engine='unsloth' trains on a CUDA GPU; the train device is {device}")
    if importlib.util.find_spec("unsloth") is None:
        if engine == "unsloth":
            raise ConfigError(
                "engine='unsloth' needs Unsloth installed beside journeyman (see the GPU guide)"
            )
        return False
    try:
        importlib.import_module("unsloth")
    except Exception as error:  # a broken install: anything its import raises
        if engine == "unsloth":
            raise ConfigError(f"engine='unsloth', but `import unsloth` fails: {error}") from error
        logger.warning(
            "Unsloth is installed but `import unsloth` fails (%s): training with transformers", error
        )
        return False
    return True


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
    device: torch.device,
) -> tuple[Any, Any]:
    """The model, loaded onto ``device``, and tokenizer: a fresh adapter (the same for the same
    ``seed``, on any device) when ``checkpoint`` is None, else the checkpoint's, trainable."""
    from peft import PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    placed = {} if device.type == "cpu" else {"device_map": {"": device}}  # straight onto the GPU
    base = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **placed)
    if checkpoint is None:
        with torch.random.fork_rng(devices=[]):  # the same initial adapter for the same seed
            torch.manual_seed(seed)
            model = get_peft_model(base, _peft_config(lora))  # drawn on the CPU, then moved
    else:
        model = PeftModel.from_pretrained(base, checkpoint / ADAPTER, is_trainable=True)
    if fused:
        fused_lora.install(model)
    return model, tokenizer


def load_unsloth(
    path: Path | str,
    checkpoint: Path | None,
    *,
    dtype: torch.dtype,
    lora: LoRAConfig,
    seed: int,
    device: torch.device,
    max_seq_length: int,
) -> tuple[Any, Any]:  # pragma: no cover - GPU only
    """Unsloth's fused kernels on ``device`` (a GPU of its own per rank); the same peft adapter
    format on disk. ``max_seq_length`` is the longest row it is given: Unsloth cuts longer
    inputs. Unsloth drops any attention mask while training, so its rows hold one sequence each
    (:func:`~journeyman.backend.training.batch.pack` with ``share_prefix=False``)."""
    from transformers import AutoConfig
    from unsloth import FastLanguageModel

    source = str(checkpoint / ADAPTER) if checkpoint is not None else str(path)
    # Above the model's own context Unsloth would scale RoPE, and its numbers would leave vLLM's
    limit = getattr(AutoConfig.from_pretrained(path), "max_position_embeddings", None) or max_seq_length
    model, tokenizer = FastLanguageModel.from_pretrained(
        model_name=source,
        dtype=dtype,
        load_in_4bit=False,
        max_seq_length=min(max_seq_length, limit),
        device_map={"": device.index or 0},
        use_exact_model_name=True,  # not a remap to an unsloth/... copy of the hub model
    )
    if checkpoint is None:
        model = FastLanguageModel.get_peft_model(
            model,
            r=lora.rank,
            lora_alpha=lora.alpha,
            lora_dropout=lora.dropout,
            target_modules=list(lora.effective_target_modules),
            random_state=seed,
        )
    FastLanguageModel.for_training(model)
    return model, tokenizer
