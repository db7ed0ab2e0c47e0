"""The one device a trainer trains on, and the dtype that device trains in.

``train_device="auto"`` is the first visible CUDA GPU when torch sees one (under ``torchrun``,
the rank's own: :func:`~journeyman.backend.training.distributed.rank_device`), else the CPU.
The model is loaded onto it and every tensor of a step is made there; the dtype follows it:
bf16 on a GPU that has it and on a CPU with bf16 instructions, fp32 elsewhere.
"""

from __future__ import annotations

import re

import torch

from journeyman.errors import ConfigError

__all__ = [
    "bf16_supported",
    "describe",
    "parse_train_device",
    "resolve_train_device",
    "synchronize",
    "training_dtype",
]

_CUDA = re.compile(r"cuda(?::(\d+))?")


def parse_train_device(spec: str | torch.device) -> str:
    """``spec`` checked for form (not for presence): the error says what is accepted."""
    text = str(spec)
    if text in ("auto", "cpu", "meta") or _CUDA.fullmatch(text):
        return text
    raise ConfigError(f"train_device must be 'auto', 'cpu', 'cuda' or 'cuda:N' (a GPU's index), got {text!r}")


def resolve_train_device(spec: str | torch.device = "auto") -> torch.device:
    """The device ``spec`` names on this machine. ``auto``: the current CUDA device when torch
    sees a GPU, else the CPU. ``cuda``/``cuda:N`` without that GPU is an error that says what is
    there, rather than a step that silently runs on the CPU."""
    text = parse_train_device(spec)
    if text == "auto":
        return (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
    if text in ("cpu", "meta"):  # meta: shapes only, for checking placement without a GPU
        return torch.device(text)
    found = _CUDA.fullmatch(text)
    assert found is not None
    if not torch.cuda.is_available():
        build = "a CPU build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
        raise ConfigError(
            f"train_device={text!r}, but torch {torch.__version__} ({build}) sees no CUDA GPU. Install "
            "torch's CUDA build on a machine with an NVIDIA GPU, or train with train_device='cpu'"
        )
    index = int(found.group(1)) if found.group(1) is not None else torch.cuda.current_device()
    count = torch.cuda.device_count()
    if index >= count:
        raise ConfigError(
            f"train_device={text!r}, but torch sees {count} GPU(s) (cuda:0 to cuda:{count - 1}; "
            "CUDA_VISIBLE_DEVICES limits them): name one of those"
        )
    return torch.device("cuda", index)


def bf16_supported(device: torch.device | None = None) -> bool:
    """Whether ``device`` (by default the one ``train_device="auto"`` picks) computes in bf16
    natively: a CUDA GPU of compute capability 8.0 or newer, a CPU with AVX512-BF16 or AMX
    (elsewhere bf16 is emulated, many times slower)."""
    device = device or resolve_train_device("auto")
    if device.type == "cuda":
        return bool(torch.cuda.is_bf16_supported(including_emulation=False))
    if device.type == "cpu":
        check = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
        return bool(check and check())
    return True


def training_dtype(precision: str, device: torch.device) -> torch.dtype:
    """fp32 when asked for, or by default where ``device`` has no bf16; else bf16."""
    if precision == "fp32" or (precision == "auto" and not bf16_supported(device)):
        return torch.float32
    return torch.bfloat16


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (a GPU runs asynchronously), so a phase's time is its own."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def describe(engine: str, device: torch.device, dtype: torch.dtype) -> str:
    """``"transformers on cuda:0 (NVIDIA H100 80GB HBM3) in bfloat16"``, what the trainer logs at load."""
    where = str(device)
    if device.type == "cuda":
        where += f" ({torch.cuda.get_device_name(device)})"
    return f"{engine} on {where} in {str(dtype).removeprefix('torch.')}"
