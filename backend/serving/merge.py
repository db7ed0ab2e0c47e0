"""A LoRA adapter merged into the weights it changes, for serving without LoRA.

vLLM answers faster without ``--enable-lora``: on CPU it then runs its compiled graphs, which is
why the demo serves SmolLM2 merged by default (see docs/results/). With
``VLLMConfig(merge_adapters=True)`` the router merges each new adapter, ``W + (alpha / r) B A``
(``alpha / sqrt(r)`` with rsLoRA), into the base weights, writes them next to the untouched ones
and has vLLM reload them in place.

The merge happens in fp32 and is rounded once to the base weights' dtype. In bf16 an update
smaller than about 1/256 of a weight is lost in that rounding; the trainer still measures the
sampling-vs-training mismatch on every step (``history.jsonl``), so such drift is visible.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from journeyman.errors import AdapterError

__all__ = ["merge_adapter"]

WEIGHTS = "model.safetensors"
INDEX = f"{WEIGHTS}.index.json"


def merge_adapter(base_dir: Path, adapter_dir: Path, out_dir: Path) -> list[str]:
    """Write the base model's weights into ``out_dir``, those the adapter changes merged.

    The files mirror the base folder's (one file or shards, same names, same index); returns the
    names of the merged weights. Every weight is written, not only the merged ones: vLLM stacks
    projections (q, k and v in one tensor), and a partial reload would leave the rest undefined.
    """
    import torch
    from safetensors.torch import load_file, save_file

    config = _adapter_config(adapter_dir)
    rank, alpha = int(config["r"]), float(config["lora_alpha"])
    scale = alpha / rank**0.5 if config.get("use_rslora") else alpha / rank
    adapter = load_file(Path(adapter_dir) / "adapter_model.safetensors")
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # weight name -> (A, B)
    for key, lora_a in adapter.items():
        if ".lora_A." not in key:
            continue
        module = key.split(".lora_A.")[0].removeprefix("base_model.model.")
        lora_b = adapter.get(key.replace(".lora_A.", ".lora_B."))
        if lora_b is None:
            raise AdapterError(f"{adapter_dir} holds lora_A but no lora_B for {module}")
        pairs[f"{module}.weight"] = (lora_a, lora_b)
    if not pairs:
        raise AdapterError(f"{adapter_dir} holds no LoRA weights (no lora_A tensors)")
    files = _weight_files(Path(base_dir))
    if missing := sorted(set(pairs) - set(files)):
        raise AdapterError(
            f"{adapter_dir} does not fit {base_dir}: it changes {missing[0]}, which the base model lacks. "
            "Was the adapter trained on another base model?"
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    for file in sorted(set(files.values())):
        tensors = load_file(file)
        for name in pairs.keys() & tensors.keys():
            (lora_a, lora_b), weight = pairs[name], tensors[name]
            if (lora_b.shape[0], lora_a.shape[1]) != weight.shape:
                raise AdapterError(
                    f"{adapter_dir}: {name} would change a {tuple(weight.shape)} weight by a "
                    f"{(lora_b.shape[0], lora_a.shape[1])} update; the adapter was trained on another base model"
                )
            merged = torch.addmm(weight.float(), lora_b.float(), lora_a.float(), alpha=scale)
            tensors[name] = merged.to(weight.dtype)
        save_file(tensors, out_dir / file.name)
    index = Path(base_dir) / INDEX
    if index.is_file():
        shutil.copyfile(index, out_dir / INDEX)
    return sorted(pairs)


def _adapter_config(adapter_dir: Path) -> dict[str, Any]:
    path = Path(adapter_dir) / "adapter_config.json"
    try:
        config: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise AdapterError(f"{adapter_dir} is not a peft adapter folder: {error}") from error
    if config.get("use_dora"):
        raise AdapterError(f"{adapter_dir} is a DoRA adapter; only plain LoRA adapters can be merged")
    if config.get("fan_in_fan_out"):
        raise AdapterError(
            f"{adapter_dir} stores fan_in_fan_out weights (GPT-2 style), which merging does not handle"
        )
    if config.get("modules_to_save"):
        raise AdapterError(
            f"{adapter_dir} also trains whole modules ({config['modules_to_save']}); serve it as a LoRA adapter"
        )
    return config


def _weight_files(base_dir: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file that holds it (single file or sharded)."""
    index = base_dir / INDEX
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        return {name: base_dir / file for name, file in weight_map.items()}
    single = base_dir / WEIGHTS
    if not single.is_file():
        raise AdapterError(f"{base_dir} holds no {WEIGHTS} (or sharded index): cannot merge into it")
    from safetensors import safe_open

    with safe_open(single, framework="pt") as f:
        return dict.fromkeys(f.keys(), single)
