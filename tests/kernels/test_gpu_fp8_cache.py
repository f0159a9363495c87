"""GPU: the FP8 caches at DeepSeek-V3.2's real shapes (656-byte latent rows, 144-byte indexer
keys) against their twins. Run on the H200 with `pytest -m gpu tests/kernels`."""

from __future__ import annotations

import pytest
import torch

from kernels.fp8_cache import (
    FP8_CACHE_DTYPE,
    Fp8CacheLayout,
    fp8_cache_write_reference,
    fp8_cache_write_triton,
)
from kernels.indexer import indexer_topk_reference, indexer_topk_triton
from kernels.sparse_mla import sparse_mla_attention_reference, sparse_mla_attention_triton
from tests.kernels.conftest import assert_close, overlap

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

NUM_HEADS, KV_LORA, ROPE, INDEX_HEADS, INDEX_DIM, INDEX_TOPK = 128, 512, 64, 64, 128, 2048
BLOCK, CONTEXT, NUM_SEQS = 64, 4096, 4
CUDA, BF16 = torch.device("cuda"), torch.bfloat16


def _fp8_cache(layout: Fp8CacheLayout, use_triton: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Every slot of NUM_SEQS sequences' blocks written; returns (cache, block_tables)."""
    blocks = NUM_SEQS * CONTEXT // BLOCK
    rows = torch.randn(blocks * BLOCK, layout.width, device=CUDA, dtype=BF16)
    cache = torch.zeros(blocks, BLOCK, layout.bytes_per_token, dtype=FP8_CACHE_DTYPE, device=CUDA)
    write = fp8_cache_write_triton if use_triton else fp8_cache_write_reference
    write(cache, torch.arange(rows.shape[0], device=CUDA), rows, layout.quant_width)
    tables = torch.randperm(blocks, device=CUDA).to(torch.int32).view(NUM_SEQS, -1)
    return cache, tables


def test_write_bit_for_bit_and_sparse_mla_at_real_shapes():
    torch.manual_seed(0)
    layout = Fp8CacheLayout(KV_LORA, ROPE, BF16)
    assert layout.bytes_per_token == 656
    torch.manual_seed(1)
    cache, tables = _fp8_cache(layout, use_triton=True)
    torch.manual_seed(1)
    expected_cache, _ = _fp8_cache(layout, use_triton=False)
    assert torch.equal(cache.view(torch.uint8), expected_cache.view(torch.uint8))
    num_tokens = 32
    seq_idx = torch.arange(num_tokens, device=CUDA) % NUM_SEQS
    topk = torch.stack([torch.randperm(CONTEXT, device=CUDA)[:INDEX_TOPK] for _ in range(32)])
    q = torch.randn(num_tokens, NUM_HEADS, KV_LORA + ROPE, device=CUDA, dtype=BF16)
    args = (q, cache, tables, seq_idx, topk.to(torch.int32), (192) ** -0.5, KV_LORA)
    assert_close(sparse_mla_attention_triton(*args), sparse_mla_attention_reference(*args))


def test_indexer_fp8_keys_at_real_shapes():
    torch.manual_seed(2)
    cache, tables = _fp8_cache(Fp8CacheLayout(INDEX_DIM), use_triton=True)
    num_tokens = 8
    seq_idx = torch.arange(num_tokens, device=CUDA) % NUM_SEQS
    positions = torch.randint(INDEX_TOPK, CONTEXT, (num_tokens,), device=CUDA)
    q = torch.randn(num_tokens, INDEX_HEADS, INDEX_DIM, device=CUDA, dtype=BF16)
    weights = torch.randn(num_tokens, INDEX_HEADS, device=CUDA, dtype=torch.float32)
    args = (q, weights, cache, tables, seq_idx, positions, INDEX_TOPK, INDEX_DIM**-0.5)
    # bf16 dot products in different orders: near-ties may flip (DESIGN: compare sets).
    assert overlap(indexer_topk_triton(*args), indexer_topk_reference(*args)).mean() > 0.99
