"""GPU: every kernel against its twin at DeepSeek-V3.2's real shapes, and PDL on vs off inside
CUDA graphs over >= 1,000 replays. Run on the H200 with `pytest -m gpu tests/kernels`."""

from __future__ import annotations

import pytest
import torch

from kernels import ops
from kernels.activation import silu_and_mul_reference, silu_and_mul_triton
from kernels.cache_write import (
    indexer_k_cache_write_reference,
    indexer_k_cache_write_triton,
    mla_kv_cache_write_reference,
    mla_kv_cache_write_triton,
)
from kernels.indexer import indexer_topk_reference, indexer_topk_triton, topk_select_triton
from kernels.moe_experts import grouped_moe_reference, grouped_moe_triton
from kernels.moe_routing import moe_route_reference, moe_route_triton
from kernels.platform import pdl_enabled
from kernels.rmsnorm import rms_norm_reference, rms_norm_triton
from kernels.rope import rope_cos_sin, rope_reference, rope_triton
from kernels.sparse_mla import sparse_mla_attention_reference, sparse_mla_attention_triton
from tests.kernels.conftest import assert_close, overlap, pdl_on_and_off_over_graph_replays

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# DeepSeek-V3.2
HIDDEN, NUM_HEADS, Q_LORA, KV_LORA, ROPE = 7168, 128, 1536, 512, 64
INDEX_HEADS, INDEX_DIM, INDEX_TOPK = 64, 128, 2048
NUM_EXPERTS, TOP_K, NUM_GROUPS, TOPK_GROUPS, MOE_INTER = 256, 8, 8, 4, 2048
BLOCK = 64
BF16 = torch.bfloat16
CUDA = torch.device("cuda")


def _paged(num_seqs: int, context: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A cache with each sequence's blocks shuffled over the pool: (cache, block_tables)."""
    blocks_per_seq = context // BLOCK
    cache = torch.randn(num_seqs * blocks_per_seq, BLOCK, width, dtype=BF16, device=CUDA)
    block_tables = torch.randperm(num_seqs * blocks_per_seq, device=CUDA).to(torch.int32)
    return cache, block_tables.view(num_seqs, blocks_per_seq)


def _cos_sin(positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, ROPE, 2, device=CUDA).float() / ROPE))
    return rope_cos_sin(positions, inv_freq)


@pytest.mark.parametrize("width", [HIDDEN, Q_LORA, KV_LORA])
def test_rms_norm_real_shapes(width: int) -> None:
    x = torch.randn(32, width, dtype=BF16, device=CUDA)
    weight = torch.randn(width, dtype=BF16, device=CUDA)
    assert_close(rms_norm_triton(x, weight, 1e-6), rms_norm_reference(x, weight, 1e-6))


def test_silu_and_mul_real_shapes() -> None:
    x = torch.randn(32 * TOP_K, 2 * MOE_INTER, dtype=BF16, device=CUDA) * 3
    assert_close(silu_and_mul_triton(x), silu_and_mul_reference(x))


@pytest.mark.parametrize("num_tokens", [1, 32])
def test_rope_real_shapes(num_tokens: int) -> None:
    """MLA's q rope part (a view of q_b's output) and the indexer's q, in bf16."""
    positions = torch.randint(0, 163840, (num_tokens,), device=CUDA)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, ROPE, 2, device=CUDA).float() / ROPE)
    cos, sin = rope_cos_sin(positions, inv_freq, 1.2)
    q = torch.randn(num_tokens, NUM_HEADS, 128 + ROPE, dtype=BF16, device=CUDA)
    q_rope = q[..., 128:]
    assert_close(rope_triton(q_rope, cos, sin, True), rope_reference(q_rope, cos, sin, True))
    qi = torch.randn(num_tokens, INDEX_HEADS, INDEX_DIM, dtype=BF16, device=CUDA)
    got = rope_triton(qi, cos, sin, False, ROPE)
    assert_close(got, rope_reference(qi, cos, sin, False, ROPE))


def test_cache_writes_real_shapes() -> None:
    num_tokens = 32
    positions = torch.randint(0, 8192, (num_tokens,), device=CUDA)
    cos, sin = _cos_sin(positions)
    slots = torch.randperm(64 * BLOCK, device=CUDA)[:num_tokens]
    slots[::5] = -1
    kv_a = torch.randn(num_tokens, KV_LORA + ROPE, dtype=BF16, device=CUDA)
    weight = torch.randn(KV_LORA, dtype=BF16, device=CUDA)
    cache_ref = torch.randn(64, BLOCK, KV_LORA + ROPE, dtype=BF16, device=CUDA)
    cache = cache_ref.clone()
    rows_ref = mla_kv_cache_write_reference(kv_a, weight, 1e-6, cos, sin, cache_ref, slots)
    assert_close(mla_kv_cache_write_triton(kv_a, weight, 1e-6, cos, sin, cache, slots), rows_ref)
    assert_close(cache, cache_ref)

    k = torch.randn(num_tokens, INDEX_DIM, dtype=BF16, device=CUDA)
    ln_w = torch.randn(INDEX_DIM, dtype=BF16, device=CUDA)
    ln_b = torch.randn(INDEX_DIM, dtype=BF16, device=CUDA)
    k_cache_ref = torch.randn(64, BLOCK, INDEX_DIM, dtype=BF16, device=CUDA)
    k_cache = k_cache_ref.clone()
    rows_ref = indexer_k_cache_write_reference(k, ln_w, ln_b, 1e-6, cos, sin, k_cache_ref, slots)
    rows = indexer_k_cache_write_triton(k, ln_w, ln_b, 1e-6, cos, sin, k_cache, slots)
    assert_close(rows, rows_ref)
    assert_close(k_cache, k_cache_ref)


@pytest.mark.parametrize("context", [1024, 8192])
def test_indexer_topk_real_shapes(context: int) -> None:
    num_seqs = 4
    k_cache, block_tables = _paged(num_seqs, context, INDEX_DIM)
    # two decode tokens per sequence: the last position and one earlier (an MTP draft row)
    seq_idx = torch.arange(num_seqs, device=CUDA).repeat_interleave(2).to(torch.int32)
    positions = torch.tensor([context - 1, context // 3] * num_seqs, device=CUDA, dtype=torch.int32)
    q = torch.randn(2 * num_seqs, INDEX_HEADS, INDEX_DIM, dtype=BF16, device=CUDA)
    weights = (torch.rand(2 * num_seqs, INDEX_HEADS, device=CUDA) * INDEX_HEADS**-0.5).to(BF16)
    args = (q, weights, k_cache, block_tables, seq_idx, positions, INDEX_TOPK, INDEX_DIM**-0.5)
    expected, actual = indexer_topk_reference(*args), indexer_topk_triton(*args)
    assert torch.equal(actual < 0, expected < 0)
    assert overlap(actual, expected).mean() >= 0.99


def test_topk_select_exact_at_long_context() -> None:
    """The radix select picks the set a stable sort does at up to 128k positions, ties included."""
    torch.manual_seed(0)
    positions = torch.tensor([131071, 32767, 8191, 2048, 2047, 5], device=CUDA, dtype=torch.int32)
    logits = torch.randn(positions.shape[0], 131072, device=CUDA)
    logits[0] = (logits[0] / 2).round()  # ~20k ties at the threshold: too many to list
    logits[1] = (logits[1] * 4).round()  # many exact ties at the threshold
    got = topk_select_triton(logits, positions, INDEX_TOPK)
    for t, p in enumerate(positions.tolist()):
        order = torch.sort(-logits[t, : p + 1], stable=True).indices[:INDEX_TOPK]
        chosen = got[t][got[t] >= 0]
        assert chosen.numel() == order.numel() and torch.all(got[t, chosen.numel() :] == -1), t
        assert torch.equal(chosen.sort().values, order.sort().values.to(torch.int32)), t


def test_sparse_mla_real_shapes() -> None:
    num_tokens, context = 8, 8192
    kv_cache, block_tables = _paged(num_tokens, context, KV_LORA + ROPE)
    seq_idx = torch.arange(num_tokens, device=CUDA, dtype=torch.int32)
    topk = torch.stack(
        [torch.randperm(context, device=CUDA)[:INDEX_TOPK] for _ in range(num_tokens)]
    ).to(torch.int32)
    topk[0, 1000:] = -1
    q = torch.randn(num_tokens, NUM_HEADS, KV_LORA + ROPE, dtype=BF16, device=CUDA)
    args = (q, kv_cache, block_tables, seq_idx, topk, (192**-0.5), KV_LORA)
    assert_close(sparse_mla_attention_triton(*args), sparse_mla_attention_reference(*args))


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_moe_route_real_shapes(dtype: torch.dtype) -> None:
    logits = torch.randn(32, NUM_EXPERTS, dtype=dtype, device=CUDA)
    bias = torch.randn(NUM_EXPERTS, device=CUDA) * 0.1
    args = (logits, bias, NUM_GROUPS, TOPK_GROUPS, TOP_K, True, 2.5)
    (w_ref, ids_ref), (w, ids) = moe_route_reference(*args), moe_route_triton(*args)
    ids_ref, order_ref = ids_ref.sort(-1)
    ids, order = ids.sort(-1)
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(w.gather(1, order), w_ref.gather(1, order_ref), atol=1e-6, rtol=1e-5)


@pytest.fixture(scope="module")
def experts() -> tuple[torch.Tensor, torch.Tensor]:
    """All 256 routed experts of one layer, bf16: 22.5 GB."""
    w13 = torch.randn(NUM_EXPERTS, 2 * MOE_INTER, HIDDEN, dtype=BF16, device=CUDA) * 0.02
    w2 = torch.randn(NUM_EXPERTS, HIDDEN, MOE_INTER, dtype=BF16, device=CUDA) * 0.02
    return w13, w2


@pytest.mark.parametrize("num_tokens", [1, 32, 512])
def test_grouped_moe_real_shapes(experts, num_tokens: int) -> None:
    w13, w2 = experts
    x = torch.randn(num_tokens, HIDDEN, dtype=BF16, device=CUDA)
    weights, ids = moe_route_triton(
        torch.randn(num_tokens, NUM_EXPERTS, device=CUDA),
        torch.zeros(NUM_EXPERTS, device=CUDA),
        NUM_GROUPS,
        TOPK_GROUPS,
        TOP_K,
        True,
        2.5,
    )
    expected = grouped_moe_reference(x, w13, w2, weights, ids)
    assert_close(grouped_moe_triton(x, w13, w2, weights, ids), expected)


def _decode_chain(experts, num_tokens: int = 8, context: int = 4096):
    """Inputs and a closure running one layer's kernels in order (a decode step's chain)."""
    w13, w2 = experts
    torch.manual_seed(0)
    kv_cache, block_tables = _paged(num_tokens, context, KV_LORA + ROPE)
    k_cache, _ = _paged(num_tokens, context, INDEX_DIM)
    seq_idx = torch.arange(num_tokens, device=CUDA, dtype=torch.int32)
    positions = torch.full((num_tokens,), context - 1, device=CUDA, dtype=torch.int32)
    slots = block_tables[:, -1].long() * BLOCK + BLOCK - 1
    cos, sin = _cos_sin(positions)
    hidden = torch.randn(num_tokens, HIDDEN, dtype=BF16, device=CUDA)
    norm_w = torch.randn(HIDDEN, dtype=BF16, device=CUDA)
    kv_a = torch.randn(num_tokens, KV_LORA + ROPE, dtype=BF16, device=CUDA)
    kv_norm_w = torch.randn(KV_LORA, dtype=BF16, device=CUDA)
    k = torch.randn(num_tokens, INDEX_DIM, dtype=BF16, device=CUDA)
    ln_w, ln_b = (
        torch.ones(INDEX_DIM, dtype=BF16, device=CUDA),
        torch.zeros(INDEX_DIM, dtype=BF16, device=CUDA),
    )
    q_index = torch.randn(num_tokens, INDEX_HEADS, INDEX_DIM, dtype=BF16, device=CUDA)
    index_w = torch.rand(num_tokens, INDEX_HEADS, dtype=BF16, device=CUDA)
    q = torch.randn(num_tokens, NUM_HEADS, KV_LORA + ROPE, dtype=BF16, device=CUDA)
    router = torch.randn(num_tokens, NUM_EXPERTS, device=CUDA)
    bias = torch.randn(NUM_EXPERTS, device=CUDA) * 0.1

    def step() -> tuple[torch.Tensor, ...]:
        normed = ops.rms_norm(hidden, norm_w, 1e-6)
        ops.mla_kv_cache_write(kv_a, kv_norm_w, 1e-6, cos, sin, kv_cache, slots)
        ops.indexer_k_cache_write(k, ln_w, ln_b, 1e-6, cos, sin, k_cache, slots)
        topk = ops.indexer_topk(
            q_index, index_w, k_cache, block_tables, seq_idx, positions, INDEX_TOPK, INDEX_DIM**-0.5
        )
        attn = ops.sparse_mla_attention(
            q, kv_cache, block_tables, seq_idx, topk, 192**-0.5, KV_LORA
        )
        weights, ids = ops.moe_route(router, bias, NUM_GROUPS, TOPK_GROUPS, TOP_K, True, 2.5)
        moe = ops.grouped_moe(normed, w13, w2, weights, ids)
        return normed, topk, attn, weights, ids, moe

    return step


def test_pdl_on_and_off_identical_over_graph_replays(experts, monkeypatch) -> None:
    assert pdl_enabled(CUDA), "this test is meant for Hopper or newer"
    with_pdl, without_pdl, mismatches = pdl_on_and_off_over_graph_replays(
        lambda: _decode_chain(experts), monkeypatch
    )
    assert mismatches == 0
    for on, off in zip(with_pdl, without_pdl):
        assert torch.equal(on, off)
