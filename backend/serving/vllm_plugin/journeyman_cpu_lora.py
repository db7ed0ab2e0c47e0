"""A vLLM general plugin: LoRA on vLLM's CPU backend with one matmul per adapter and slice.

vLLM's CPU punica wrapper applies LoRA token by token: it gathers a copy of the adapter's
weights for every token (``lora_b_weights[indices]``) and multiplies with ``einsum``, which on a
small model is a large share of a decode step. Grouping the tokens by adapter and doing one ``mm``
per adapter and slice gives the same numbers in a fraction of the time (see docs/results/).

The server finds this module through ``PYTHONPATH`` (journeyman's ``VLLMServer`` adds this
folder and its ``dist-info``, so nothing is installed into the vLLM environment). vLLM loads
general plugins in every process; ``register`` is idempotent and does nothing off CPU or when
``JOURNEYMAN_CPU_LORA=0``.
"""

from __future__ import annotations

import logging
import os
from typing import Any

_PATCHED = "_journeyman_cpu_lora"


def register() -> None:
    if os.environ.get("JOURNEYMAN_CPU_LORA", "1") == "0":
        return
    from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU

    if getattr(PunicaWrapperCPU, _PATCHED, False):
        return
    original_update = PunicaWrapperCPU.update_metadata
    original_linear = PunicaWrapperCPU.add_lora_linear

    def update_metadata(self: Any, *args: Any, **kwargs: Any) -> None:
        original_update(self, *args, **kwargs)
        self._jm_groups = _token_groups(self.token_lora_indices)

    def add_lora_linear(
        self: Any,
        y: Any,
        x: Any,
        lora_a_stacked: tuple[Any, ...],
        lora_b_stacked: tuple[Any, ...],
        scale: float,
        output_slices: tuple[int, ...],
        *,
        buffer: Any = None,
        **kwargs: Any,
    ) -> None:
        groups = getattr(self, "_jm_groups", None)
        x2 = x.view(-1, x.shape[-1])
        if groups is None or x2.size(0) != self.token_lora_indices.numel():
            original_linear(
                self, y, x, lora_a_stacked, lora_b_stacked, scale, output_slices, buffer=buffer, **kwargs
            )
            return
        y2 = y.view(-1, y.shape[-1])
        for slot, rows in groups:
            xs = (x2 if rows is None else x2.index_select(0, rows)).float()
            offset = 0
            for a, b, size in zip(lora_a_stacked, lora_b_stacked, output_slices, strict=True):
                # Same precision as vLLM's own ops: shrink in float32, expand in the output dtype.
                h = (xs @ a[slot, 0].float().t()) * scale
                out = h.to(y2.dtype) @ b[slot, 0].to(y2.dtype).t()
                target = y2[:, offset : offset + size]
                if rows is None:
                    target += out[:, :size]
                else:
                    target.index_add_(0, rows, out[:, :size])
                offset += size

    PunicaWrapperCPU.update_metadata = update_metadata
    PunicaWrapperCPU.add_lora_linear = add_lora_linear
    setattr(PunicaWrapperCPU, _PATCHED, True)
    # A child of vLLM's logger, so the line lands in the server log with vLLM's own format.
    logging.getLogger("vllm.journeyman_cpu_lora").info("journeyman CPU LoRA kernels active")


def _token_groups(indices: Any) -> list[tuple[int, Any]]:
    """(adapter slot, token rows) for every adapter in the batch; rows is None when one adapter
    covers every token. Slot -1 means no adapter and is skipped."""
    import torch

    slots = torch.unique(indices).tolist()
    if len(slots) == 1:
        return [] if slots[0] < 0 else [(int(slots[0]), None)]
    return [(int(s), (indices == s).nonzero().squeeze(1)) for s in slots if s >= 0]
