from __future__ import annotations

import pytest
import torch

from kernels.cache_write import (
    cache_rows_write_reference,
    cache_rows_write_triton,
    indexer_k_cache_write_reference,
    indexer_k_cache_write_triton,
    mla_kv_cache_write_reference,
    mla_kv_cache_write_triton,
)
from kernels.rope import rope_cos_sin
from tests.kernels.conftest import DEVICE, DTYPES, assert_close, needs_triton

pytestmark = needs_triton

BLOCK_SIZE_TOKENS = 64


def _slots(num_tokens: int, num_blocks: int) -> torch.Tensor:
    """Distinct slots spread over the blocks, every third token skipped (-1)."""
    slots = torch.randperm(num_blocks * BLOCK_SIZE_TOKENS)[:num_tokens]
    slots[::3] = -1
    return slots.to(DEVICE)


def _cos_sin(num_tokens: int, rope_half: int) -> tuple[torch.Tensor, torch.Tensor]:
    positions = torch.randint(0, 4096, (num_tokens,), device=DEVICE)
    inv_freq = 1.0 / (10000 ** (torch.arange(rope_half, device=DEVICE).float() / rope_half))
    return rope_cos_sin(positions, inv_freq, attention_scaling=1.3)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "num_tokens,kv_lora_rank,rope_half", [(1, 7, 1), (7, 131, 5), (131, 64, 8)]
)
def test_mla_kv_cache_write_matches_twin(
    dtype: torch.dtype, num_tokens: int, kv_lora_rank: int, rope_half: int
) -> None:
    torch.manual_seed(num_tokens)
    kv_a = torch.randn(num_tokens, kv_lora_rank + 2 * rope_half, dtype=dtype, device=DEVICE)
    weight = torch.randn(kv_lora_rank, dtype=dtype, device=DEVICE)
    cos, sin = _cos_sin(num_tokens, rope_half)
    slots = _slots(num_tokens, 3)
    cache_ref = torch.randn(3, BLOCK_SIZE_TOKENS, kv_a.shape[1], dtype=dtype, device=DEVICE)
    cache_tri = cache_ref.clone()
    rows_ref = mla_kv_cache_write_reference(kv_a, weight, 1e-6, cos, sin, cache_ref, slots)
    rows_tri = mla_kv_cache_write_triton(kv_a, weight, 1e-6, cos, sin, cache_tri, slots)
    assert_close(rows_tri, rows_ref)
    assert_close(cache_tri, cache_ref)  # also: untouched slots keep their old contents


@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,head_dim,rope_half", [(1, 7, 2), (7, 37, 5), (131, 128, 32)])
def test_indexer_k_cache_write_matches_twin(
    dtype: torch.dtype, num_tokens: int, head_dim: int, rope_half: int, strided: bool
) -> None:
    """`strided`: k is the middle part of a wider output, as the model passes it (q_a | wk | kv_a,
    one matmul)."""
    torch.manual_seed(num_tokens)
    k = torch.randn(num_tokens, head_dim, dtype=dtype, device=DEVICE) * 2 + 0.5
    if strided:
        wide = torch.randn(num_tokens, 11 + head_dim + 5, dtype=dtype, device=DEVICE)
        wide[:, 11 : 11 + head_dim] = k
        k = wide[:, 11 : 11 + head_dim]
    ln_weight = torch.randn(head_dim, dtype=dtype, device=DEVICE)
    ln_bias = torch.randn(head_dim, dtype=dtype, device=DEVICE)
    cos, sin = _cos_sin(num_tokens, rope_half)
    slots = _slots(num_tokens, 3)
    cache_ref = torch.randn(3, BLOCK_SIZE_TOKENS, head_dim, dtype=dtype, device=DEVICE)
    cache_tri = cache_ref.clone()
    args = (1e-6, cos, sin)
    rows_ref = indexer_k_cache_write_reference(k, ln_weight, ln_bias, *args, cache_ref, slots)
    rows_tri = indexer_k_cache_write_triton(k, ln_weight, ln_bias, *args, cache_tri, slots)
    assert_close(rows_tri, rows_ref)
    assert_close(cache_tri, cache_ref)


def test_mla_kv_cache_write_rejects_wrong_cache_width() -> None:
    kv_a = torch.randn(2, 12, device=DEVICE)
    cos = sin = torch.ones(2, 2, device=DEVICE)
    cache = torch.zeros(1, BLOCK_SIZE_TOKENS, 11, device=DEVICE)
    with pytest.raises(ValueError, match="cache rows"):
        mla_kv_cache_write_triton(
            kv_a,
            torch.ones(8, device=DEVICE),
            1e-6,
            cos,
            sin,
            cache,
            torch.tensor([0, 1], device=DEVICE),
        )


@pytest.mark.parametrize("dtype", DTYPES)
def test_cache_rows_write_matches_twin(dtype: torch.dtype) -> None:
    """Rows land in their slots; slot -1 and every other slot stay."""
    torch.manual_seed(2)
    cache = torch.randn(3, BLOCK_SIZE_TOKENS, 40, dtype=dtype, device=DEVICE)
    slots = _slots(50, 3)
    rows = torch.randn(50, 40, dtype=dtype, device=DEVICE)
    expected, actual = cache.clone(), cache.clone()
    cache_rows_write_reference(expected, slots, rows)
    cache_rows_write_triton(actual, slots, rows)
    assert torch.equal(actual, expected)
    flat = actual.view(-1, 40)
    kept = slots[slots >= 0]
    assert torch.equal(flat[kept], rows[slots >= 0])
    untouched = torch.ones(flat.shape[0], dtype=torch.bool, device=DEVICE)
    untouched[kept] = False
    assert torch.equal(flat[untouched], cache.view(-1, 40)[untouched])
