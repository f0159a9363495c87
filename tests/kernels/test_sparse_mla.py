from __future__ import annotations

import pytest
import torch

from kernels.sparse_mla import sparse_mla_attention_reference, sparse_mla_attention_triton
from tests.kernels.conftest import DEVICE, DTYPES, assert_close, needs_triton

pytestmark = needs_triton


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "num_heads,kv_lora_rank,rope_dim,num_topk",
    [
        (1, 7, 2, 1),
        (3, 40, 8, 37),
        (17, 64, 16, 131),
    ],
)
def test_sparse_mla_matches_twin(
    dtype: torch.dtype, num_heads: int, kv_lora_rank: int, rope_dim: int, num_topk: int
) -> None:
    torch.manual_seed(num_topk)
    width = kv_lora_rank + rope_dim
    kv_cache = torch.randn(6, 64, width, dtype=dtype, device=DEVICE)
    block_tables = torch.tensor([[4, 1, 0], [2, 5, 3]], dtype=torch.int32, device=DEVICE)
    seq_idx = torch.tensor([0, 0, 1, 1, 1, 0, 1], dtype=torch.int32, device=DEVICE)
    picks = [torch.randperm(192)[:num_topk] for _ in range(7)]
    topk_indices = torch.stack(picks).to(torch.int32).to(DEVICE)
    topk_indices[1, 1:] = -1  # a token that has seen one position
    topk_indices[3, : num_topk // 2] = -1  # padding before valid picks, too
    q = torch.randn(7, num_heads, width, dtype=dtype, device=DEVICE)
    args = (q, kv_cache, block_tables, seq_idx, topk_indices, width**-0.5, kv_lora_rank)
    assert_close(sparse_mla_attention_triton(*args), sparse_mla_attention_reference(*args))
