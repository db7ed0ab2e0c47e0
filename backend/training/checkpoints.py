"""A step's checkpoint on disk: the adapter, the optimizer state and the trainer's state, no pickle.

``checkpoints/<step:04d>/`` holds ``adapter/`` (peft's format, what vLLM loads), ``optimizer.safetensors``
(AdamW's state by parameter name, and torch's RNG states, the GPUs' included) and the JSON state file. The store writes the
folder atomically (:meth:`~journeyman.store.ModelStore.write_checkpoint`), so a killed write leaves
the previous checkpoint as the latest.
"""

from __future__ import annotations

import errno
import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from journeyman.store import CHECKPOINT_STATE, ModelStore

__all__ = [
    "ADAPTER",
    "OPTIMIZER",
    "STATE",
    "checkpoint_tensors",
    "read_optimizer",
    "restore_rng",
    "rng_states",
    "write_checkpoint",
]

ADAPTER = "adapter"
OPTIMIZER = "optimizer.safetensors"
STATE = CHECKPOINT_STATE

Trainable = list[tuple[str, torch.nn.Parameter]]


def checkpoint_tensors(
    trainable: Trainable, optimizer: torch.optim.Optimizer | None
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The adapter's weights and the optimizer state (``<parameter>/<key>``), by parameter name."""
    adapter = {name: p.detach() for name, p in trainable}
    state: dict[str, torch.Tensor] = {}
    if optimizer is not None:
        index = {id(p): name for name, p in trainable}
        for parameter, values in optimizer.state.items():
            for key, value in values.items():
                state[f"{index[id(parameter)]}/{key}"] = torch.as_tensor(value).detach().clone()
    return adapter, state


def write_checkpoint(
    store: ModelStore,
    step: int,
    save_adapter: Callable[[Path, dict[str, torch.Tensor]], Any],
    adapter: dict[str, torch.Tensor],
    optimizer: dict[str, torch.Tensor],
    state: dict[str, Any],
) -> Path:
    """Write step ``step``'s checkpoint; ``save_adapter(folder, weights)`` writes the adapter (the
    model's ``save_pretrained``). A full disk is an OSError, as the store's handling expects."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    with store.write_checkpoint(step) as folder:
        try:
            save_adapter(folder / ADAPTER, adapter)
            tensors = rng_states()
            tensors |= {key: value.contiguous() for key, value in optimizer.items()}
            save_file(tensors, str(folder / OPTIMIZER))
        except SafetensorError as error:
            raise _os_error(error) from error
        (folder / STATE).write_text(json.dumps({"step": step, **state}, indent=2) + "\n")
    return store.checkpoint_path(step)


def rng_states() -> dict[str, torch.Tensor]:
    """torch's RNG states: the CPU's, and each visible GPU's where CUDA is in use."""
    states = {"rng/torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        states |= {f"rng/cuda:{i}": state for i, state in enumerate(torch.cuda.get_rng_state_all())}
    return states


def restore_rng(tensors: dict[str, torch.Tensor]) -> None:
    """Restore the RNG states :func:`rng_states` saved (taking them out of ``tensors``); a GPU's
    state is restored where that GPU is visible."""
    if "rng/torch" in tensors:
        torch.set_rng_state(tensors.pop("rng/torch"))
    for key in [key for key in tensors if key.startswith("rng/cuda:")]:
        state, index = tensors.pop(key), int(key.removeprefix("rng/cuda:"))
        if torch.cuda.is_available() and index < torch.cuda.device_count():
            torch.cuda.set_rng_state(state, index)


def read_optimizer(folder: Path) -> tuple[dict[str, dict[str, torch.Tensor]], float | None]:
    """A checkpoint's optimizer state by parameter name, on the CPU (the trainer moves each
    value to its parameter's device), and the learning rate it was trained at; torch's RNG
    states are restored on the way."""
    from safetensors.torch import load_file

    tensors = load_file(str(folder / OPTIMIZER))
    restore_rng(tensors)
    by_parameter: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        name, _, part = key.partition("/")
        by_parameter.setdefault(name, {})[part] = value
    learning_rate = json.loads((folder / STATE).read_text()).get("learning_rate") if by_parameter else None
    return by_parameter, learning_rate


def _os_error(error: Exception) -> OSError:
    """The OSError behind a failed safetensors write: it reports one (a full disk, for instance:
    "I/O error: No space left on device (os error 28)") as a SafetensorError, which the store's
    handling of failed writes would not recognise."""
    found = re.search(r"os error (\d+)", str(error))
    code = int(found.group(1)) if found else errno.EIO
    return OSError(code, os.strerror(code))
