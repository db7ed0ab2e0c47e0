"""The trainer's hand-written pieces compute what plain autograd computes."""

from __future__ import annotations

import pytest
import torch

from journeyman.backend.training import fused_lora
from journeyman.backend.training.logprobs import ChosenLogprobs, chunk_logprobs


def test_chosen_logprobs_match_autograd_through_the_full_logits() -> None:
    generator = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=False).double().requires_grad_(False)
    hidden = torch.randn(7, 16, dtype=torch.float64, generator=generator) * 3
    targets = torch.randint(0, 50, (7,), generator=generator)
    weights = torch.randn(7, dtype=torch.float64, generator=generator)

    ours = hidden.clone().requires_grad_()
    chosen, entropy = ChosenLogprobs.apply(ours, targets, head.weight)
    (chosen * weights).sum().backward()
    plain = hidden.clone().requires_grad_()
    expected, expected_entropy = chunk_logprobs(plain, targets, head)
    (expected * weights).sum().backward()

    assert torch.allclose(chosen, expected.to(chosen.dtype), atol=1e-6)
    assert torch.allclose(entropy, expected_entropy.to(entropy.dtype), atol=1e-6)
    assert torch.allclose(ours.grad, plain.grad, atol=1e-6)


def _tiny_peft_model(seed: int) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2,
    )  # fmt: skip
    model = get_peft_model(
        LlamaForCausalLM(config),
        LoraConfig(
            r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False
        ),
    )
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_lora_forward_matches_peft(dtype: torch.dtype) -> None:
    peft_model, fused_model = _tiny_peft_model(1), _tiny_peft_model(1)
    for model in (peft_model, fused_model):
        for name, p in model.named_parameters():
            p.data = p.data.float() if "lora_" in name else p.data.to(dtype)
    assert fused_lora.install(fused_model) == 6
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(2))
    outputs, grads = [], []
    for model in (peft_model, fused_model):
        logits = model(input_ids=ids).logits.float()
        logits.logsumexp(-1).sum().backward()
        outputs.append(logits.detach())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    assert torch.allclose(outputs[0], outputs[1], atol=tolerance, rtol=tolerance)
    for name, grad in grads[0].items():
        assert grad.abs().max() > 0
        relative = (grad - grads[1][name]).norm() / grad.norm()
        assert relative < (1e-5 if dtype == torch.float32 else 3e-2), (name, float(relative))
    with fused_model.disable_adapter():  # the reference (KL) pass still sees the base model alone
        base = fused_model(input_ids=ids).logits
    with peft_model.disable_adapter():
        assert torch.allclose(base, peft_model(input_ids=ids).logits)
