"""FP8 cache rows: the quantizer against DeepSeek's act_quant math, the packed layout against
FlashMLA's V3.2 format, the Triton write against its twin (bit for bit), and the attention and
indexer kernels reading FP8 caches against their twins."""

from __future__ import annotations

import math

import pytest
import torch

from kernels.fp8_cache import (
    FP8_CACHE_DTYPE,
    Fp8CacheLayout,
    fp8_cache_write_reference,
    fp8_cache_write_triton,
    quantize_fp8_rows_reference,
    unpack_fp8_rows_reference,
)
from kernels.indexer import indexer_topk_reference, indexer_topk_triton
from kernels.sparse_mla import (
    latent_cache_layout,
    sparse_mla_attention_reference,
    sparse_mla_attention_triton,
)
from tests.kernels.conftest import DEVICE, DTYPES, assert_close, needs_triton, overlap


def _deepseek_act_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3.2's act_quant with scale_fmt "ue8m0", one 1x128 group at a time, in float64:
    amax clamped to 1e-4, s = 2 ** ceil(log2(amax / 448)), y = x / s in e4m3."""
    q = torch.empty(x.shape, dtype=FP8_CACHE_DTYPE)
    scales = []
    for row in range(x.shape[0]):
        row_scales = []
        for start in range(0, x.shape[1], 128):
            group = x[row, start : start + 128].double()
            amax = max(group.abs().max().item(), 1e-4)
            s = 2.0 ** math.ceil(math.log2(amax / 448))
            q[row, start : start + 128] = (group / s).float().to(FP8_CACHE_DTYPE)
            row_scales.append(s)
        scales.append(row_scales)
    return q, torch.tensor(scales, dtype=torch.float32)


def test_quantizer_is_deepseeks_act_quant():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 300, generator=g) * torch.logspace(-3, 3, 300)  # wide dynamic range
    x[1] = 0  # all-zero groups: amax floor 1e-4
    x[2, :128] = 1.75 * 2.0 ** torch.arange(-4, 124).clamp(max=20)  # amax exactly 448 x 2**k
    x[3, 5] = 1.75 * 2**3 * (1 + 2**-20)  # just past one: the next power of two
    x[4, :] = x[4, :] * 1e-6  # amax below the floor
    q, scale = quantize_fp8_rows_reference(x)
    expected_q, expected_scale = _deepseek_act_quant(x)
    assert torch.equal(scale, expected_scale)
    assert torch.equal(q.view(torch.uint8), expected_q.view(torch.uint8))
    assert (q.float().abs() <= 448).all()


def test_layout_is_flashmlas_v32_format():
    # DeepSeek-V3.2: 512 e4m3 + 4 float32 scales + 64 bf16 = 656 bytes; the indexer's 128 + 4.
    latent = Fp8CacheLayout(512, 64, torch.bfloat16)
    assert (latent.scale_offset, latent.tail_offset, latent.bytes_per_token) == (512, 528, 656)
    assert Fp8CacheLayout(128).bytes_per_token == 144  # 132 rounded up to 16 bytes
    # Odd widths stay aligned for the float32 and tail views.
    odd = Fp8CacheLayout(7, 3, torch.float32)
    assert (odd.scale_offset, odd.tail_offset, odd.bytes_per_token) == (8, 12, 32)  # 24 -> 32


@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_error_and_exact_tail(dtype):
    g = torch.Generator().manual_seed(1)
    layout = Fp8CacheLayout(200, 16, dtype)
    rows = (torch.randn(9, 216, generator=g) * torch.logspace(-2, 2, 216)).to(dtype)
    cache = torch.zeros(2, 8, layout.bytes_per_token, dtype=FP8_CACHE_DTYPE)
    slots = torch.tensor([3, -1, 5, 0, 7, 8, 15, 9, 1])
    fp8_cache_write_reference(cache, slots, rows, 200)
    back = unpack_fp8_rows_reference(
        cache.view(-1, layout.bytes_per_token)[slots[slots >= 0]], layout
    )
    kept = rows[slots >= 0].float()
    assert torch.equal(back[:, 200:], kept[:, 200:])  # the tail is stored as it is
    _, scale = quantize_fp8_rows_reference(kept[:, :200])
    step = scale.repeat_interleave(128, -1)[:, :200]
    err = (back[:, :200] - kept[:, :200]).abs()
    # e4m3: 3 mantissa bits (relative error <= 2**-4), subnormal steps of 2**-9 x the scale.
    assert (err <= kept[:, :200].abs() / 16 + step * 2**-10).all()
    assert (err > 0).any()
    assert not cache.view(-1, layout.bytes_per_token)[2].view(torch.uint8).any()  # slot -1's


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("quant_width,tail_width", [(7, 3), (130, 0), (512, 64)])
def test_triton_write_matches_twin_bit_for_bit(dtype, quant_width, tail_width):
    g = torch.Generator().manual_seed(quant_width)
    width = quant_width + tail_width
    rows = torch.randn(11, width, generator=g) * torch.logspace(-3, 2, width)
    rows = rows.to(dtype).to(DEVICE)
    rows[2] = 0
    slots = torch.tensor([3, -1, 5, 0, 7, 8, 100, 64, 1, 127, 40], device=DEVICE)
    layout = Fp8CacheLayout(quant_width, tail_width, dtype)
    expected = torch.zeros(2, 64, layout.bytes_per_token, dtype=FP8_CACHE_DTYPE, device=DEVICE)
    actual = expected.clone()
    fp8_cache_write_reference(expected, slots, rows, quant_width)
    fp8_cache_write_triton(actual, slots, rows, quant_width)
    assert torch.equal(actual.view(torch.uint8), expected.view(torch.uint8))


def _paged_fp8(rows: torch.Tensor, layout: Fp8CacheLayout) -> torch.Tensor:
    """rows [6 * 64, W] written to every slot of a 6-block FP8 cache."""
    cache = torch.zeros(6, 64, layout.bytes_per_token, dtype=FP8_CACHE_DTYPE, device=rows.device)
    slots = torch.arange(rows.shape[0], device=rows.device)
    fp8_cache_write_reference(cache, slots, rows, layout.quant_width)
    return cache


BLOCK_TABLES = [[4, 1, 0], [2, 5, 3]]
SEQ_IDX = [0, 0, 1, 1, 1, 0, 1]


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "num_heads,kv_lora_rank,rope_dim,num_topk", [(3, 40, 8, 37), (17, 160, 16, 131)]
)
def test_sparse_mla_reads_fp8_latent_cache(dtype, num_heads, kv_lora_rank, rope_dim, num_topk):
    torch.manual_seed(num_topk)
    width = kv_lora_rank + rope_dim
    layout = latent_cache_layout(kv_lora_rank, width, dtype)
    cache = _paged_fp8(torch.randn(6 * 64, width, dtype=dtype, device=DEVICE), layout)
    block_tables = torch.tensor(BLOCK_TABLES, dtype=torch.int32, device=DEVICE)
    seq_idx = torch.tensor(SEQ_IDX, dtype=torch.int32, device=DEVICE)
    topk = torch.stack([torch.randperm(192)[:num_topk] for _ in range(7)]).to(torch.int32)
    topk = topk.to(DEVICE)
    topk[1, 1:] = -1
    q = torch.randn(7, num_heads, width, dtype=dtype, device=DEVICE)
    args = (q, cache, block_tables, seq_idx, topk, width**-0.5, kv_lora_rank)
    expected = sparse_mla_attention_reference(*args)
    assert_close(sparse_mla_attention_triton(*args), expected)
    # Reading FP8 rows is exactly reading their dequantized values (power-of-two scales).
    dequantized = unpack_fp8_rows_reference(cache, layout).to(dtype)
    assert torch.equal(expected, sparse_mla_attention_reference(q, dequantized, *args[2:]))


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads,head_dim", [(4, 64), (3, 160)])
def test_indexer_reads_fp8_key_cache(dtype, num_heads, head_dim):
    torch.manual_seed(head_dim)
    layout = Fp8CacheLayout(head_dim)
    cache = _paged_fp8(torch.randn(6 * 64, head_dim, dtype=dtype, device=DEVICE), layout)
    block_tables = torch.tensor(BLOCK_TABLES, dtype=torch.int32, device=DEVICE)
    seq_idx = torch.tensor(SEQ_IDX, dtype=torch.int32, device=DEVICE)
    positions = torch.tensor([0, 5, 100, 150, 191, 64, 20], device=DEVICE)
    q = torch.randn(7, num_heads, head_dim, dtype=dtype, device=DEVICE)
    weights = torch.randn(7, num_heads, dtype=dtype, device=DEVICE)
    args = (q, weights, cache, block_tables, seq_idx, positions, 16, head_dim**-0.5)
    expected = indexer_topk_reference(*args)
    assert overlap(indexer_topk_triton(*args), expected).min() == 1.0
    dequantized = unpack_fp8_rows_reference(cache, layout).to(dtype)
    assert torch.equal(expected, indexer_topk_reference(q, weights, dequantized, *args[3:]))


@needs_triton
def test_fused_writes_without_a_cache_return_the_same_rows():
    """An FP8 cache is written from the rows the fused norm + RoPE kernels return (no cache)."""
    from kernels.cache_write import indexer_k_cache_write_triton, mla_kv_cache_write_triton

    torch.manual_seed(3)
    cos, sin = torch.randn(5, 4, device=DEVICE), torch.randn(5, 4, device=DEVICE)
    slots = torch.tensor([0, 3, -1, 7, 2], device=DEVICE)
    kv_a, weight = torch.randn(5, 40, device=DEVICE), torch.randn(32, device=DEVICE)
    cache = torch.zeros(1, 8, 40, device=DEVICE)
    with_cache = mla_kv_cache_write_triton(kv_a, weight, 1e-6, cos, sin, cache, slots)
    assert torch.equal(
        mla_kv_cache_write_triton(kv_a, weight, 1e-6, cos, sin, None, slots), with_cache
    )
    assert torch.equal(cache[0, 3], with_cache[1])
    k, bias = torch.randn(5, 32, device=DEVICE), torch.randn(32, device=DEVICE)
    cache = torch.zeros(1, 8, 32, device=DEVICE)
    with_cache = indexer_k_cache_write_triton(k, weight, bias, 1e-6, cos, sin, cache, slots)
    without = indexer_k_cache_write_triton(k, weight, bias, 1e-6, cos, sin, None, slots)
    assert torch.equal(without, with_cache)
