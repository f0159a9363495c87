from __future__ import annotations

import pytest
import torch

from kernels.indexer import indexer_logits_triton, indexer_topk_reference, indexer_topk_triton
from kernels.paged import gather_positions
from tests.kernels.conftest import DEVICE, DTYPES, needs_triton, overlap

pytestmark = needs_triton


def _problem(dtype: torch.dtype, num_heads: int, head_dim: int, seed: int = 0):
    """Two sequences of 131 and 192 positions over shuffled blocks of 64; seven query tokens."""
    torch.manual_seed(seed)
    k_cache = torch.randn(6, 64, head_dim, dtype=dtype, device=DEVICE)
    block_tables = torch.tensor([[4, 1, 0], [2, 5, 3]], dtype=torch.int32, device=DEVICE)
    seq_idx = torch.tensor([0, 0, 1, 1, 1, 0, 1], dtype=torch.int32, device=DEVICE)
    positions = torch.tensor([130, 0, 5, 190, 100, 64, 191], dtype=torch.int32, device=DEVICE)
    # Large q and positive weights make ties (several all-negative heads -> logit 0) rare.
    q = torch.randn(7, num_heads, head_dim, dtype=dtype, device=DEVICE) * 4
    weights = torch.rand(7, num_heads, dtype=dtype, device=DEVICE) + 0.5
    return q, weights, k_cache, block_tables, seq_idx, positions


@pytest.mark.parametrize("dtype", DTYPES)
def test_indexer_logits_match_closed_form(dtype: torch.dtype) -> None:
    q, weights, k_cache, block_tables, seq_idx, positions = _problem(dtype, 5, 24)
    scale = 24**-0.5
    logits = indexer_logits_triton(q, weights, k_cache, block_tables, seq_idx, positions, scale)
    for t in range(q.shape[0]):
        num_keys = int(positions[t]) + 1
        keys = gather_positions(k_cache, block_tables[seq_idx[t]], num_keys).float()
        scores = (q[t].float() @ keys.t() * scale).relu()  # [H, S]
        expected = weights[t].float() @ scores
        torch.testing.assert_close(logits[t, :num_keys], expected, atol=1e-4, rtol=1e-5)
        assert torch.isneginf(logits[t, num_keys:]).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("topk", [1, 7, 131, 300])
def test_indexer_topk_matches_twin(dtype: torch.dtype, topk: int) -> None:
    args = _problem(dtype, 3, 37, seed=topk)
    expected = indexer_topk_reference(*args[:6], topk, 37**-0.5)
    actual = indexer_topk_triton(*args[:6], topk, 37**-0.5)
    assert actual.dtype == torch.int32 and actual.shape == expected.shape
    # -1 padding in the same places: k = min(topk, position + 1) picks per token.
    assert torch.equal(actual < 0, expected < 0)
    # Same sets (near-ties may swap order; fp32 logits from the same inputs rarely differ).
    assert overlap(actual, expected).min() >= 0.99
