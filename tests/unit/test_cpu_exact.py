"""The pieces of the ``journeyman_cpu_exact`` vLLM plugin that need no vLLM: linear layers in tiles
of 16 rows, and a prefill batch handed to the attention kernel as one-token requests.
(tests/integration/test_batch_invariance.py checks the plugin inside a real server.)"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from journeyman.backend.serving.vllm_plugin.journeyman_cpu_exact import (
    _linear_in_tiles,
    _one_query_per_request,
)


@pytest.mark.parametrize("shape", [(576, 576), (1536, 576), (576, 1536)])
def test_a_row_comes_out_the_same_bits_whatever_rows_come_with_it(shape: tuple[int, int]) -> None:
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(*shape, generator=generator)
    bias = torch.randn(shape[0], generator=generator)
    rows = torch.randn(70, shape[1], generator=generator)
    alone = [_linear_in_tiles(rows[i : i + 1], weight, bias) for i in range(len(rows))]
    for count in (2, 3, 15, 16, 17, 33, 70):
        together = _linear_in_tiles(rows[:count], weight, bias)
        assert all(torch.equal(together[i : i + 1], alone[i]) for i in range(count)), count
    assert torch.allclose(
        _linear_in_tiles(rows, weight, bias), torch.nn.functional.linear(rows, weight, bias), atol=1e-4
    )
    # Leading dimensions are kept.
    assert _linear_in_tiles(rows[:12].view(3, 4, -1), weight).shape == (3, 4, shape[0])


@dataclasses.dataclass
class Common:
    """The fields of vLLM's CommonAttentionMetadata that the plugin reads and writes."""

    num_reqs: int
    max_query_len: int
    query_start_loc: torch.Tensor
    query_start_loc_cpu: torch.Tensor
    seq_lens: torch.Tensor
    block_table_tensor: torch.Tensor
    seq_lens_cpu_upper_bound: torch.Tensor | None = None
    is_prefilling: torch.Tensor | None = None
    req_idx: object = None


def test_each_prefill_query_becomes_a_request_over_its_own_prefix() -> None:
    # A decode (1 query, 9 tokens so far), a prefill chunk after a cache hit (3 queries, 7 tokens
    # in all) and a whole prompt (2 queries); the block table has a spare row, as vLLM's does.
    loc = torch.tensor([0, 1, 4, 6], dtype=torch.int32)
    common = Common(
        num_reqs=3, max_query_len=3, query_start_loc=loc, query_start_loc_cpu=loc.clone(),
        seq_lens=torch.tensor([9, 7, 2, 0], dtype=torch.int32),
        block_table_tensor=torch.tensor([[10, 11], [20, 21], [30, 31], [0, 0]], dtype=torch.int32),
    )  # fmt: skip
    one = _one_query_per_request(common)
    assert one.num_reqs == 6 and one.max_query_len == 1
    assert one.query_start_loc.tolist() == one.query_start_loc_cpu.tolist() == list(range(7))
    assert one.seq_lens.tolist() == [9, 5, 6, 7, 1, 2] and one.seq_lens.dtype == torch.int32
    assert [row[0] for row in one.block_table_tensor.tolist()] == [10, 20, 20, 20, 30, 30]
