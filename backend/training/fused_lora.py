"""A faster forward for peft's LoRA linear layers while training on CPU (or GPU without Unsloth).

peft computes ``result + lora_B(lora_A(dropout(x))) * scaling`` in the adapter's dtype: with a
bf16 base model and fp32 LoRA weights, every one of the ~200 adapted projections converts its
input to fp32, multiplies the full output by ``scaling``, adds in fp32 and converts back. On a
135M model those element-wise passes cost about as much as the matmuls. Here the (tiny) LoRA
weights are cast to the compute dtype instead, ``scaling`` is folded into B, and the add is fused
into the second matmul (``addmm``); gradients still reach the fp32 weights through the casts.
The numbers are the same up to rounding in the compute dtype (identical math in fp32).
"""

from __future__ import annotations

import types
from typing import Any

import torch

__all__ = ["install"]


def _forward(self: Any, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    result: torch.Tensor = self.base_layer(x, *args, **kwargs)
    if self.disable_adapters or self.merged:
        return result
    for name in self.active_adapters:
        if name not in self.lora_A:
            continue
        a = self.lora_A[name].weight.to(result.dtype)  # (r, in)
        b = (self.lora_B[name].weight * self.scaling[name]).to(result.dtype)  # (out, r)
        h = self.lora_dropout[name](x).to(result.dtype) @ a.t()  # (..., r)
        flat = torch.addmm(result.reshape(-1, result.shape[-1]), h.reshape(-1, h.shape[-1]), b.t())
        result = flat.view(result.shape)
    return result


def install(model: torch.nn.Module) -> int:
    """Use the fused forward on every plain LoRA ``Linear`` of a peft model; returns how many.
    Layers with a LoRA variant (DoRA, ...) or extra kwargs keep peft's own forward."""
    from peft.tuners.lora.layer import Linear

    count = 0
    for module in model.modules():
        if (
            type(module) is Linear
            and not module.lora_variant
            and not getattr(module, "fan_in_fan_out", False)
        ):
            module.forward = types.MethodType(_forward, module)  # type: ignore[method-assign]
            count += 1
    return count
