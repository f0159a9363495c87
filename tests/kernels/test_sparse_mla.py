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


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [7, 140])  # 140 tokens: one split, no merge launch
def test_sparse_mla_reads_the_absorbed_and_rope_parts_in_place(dtype, num_tokens) -> None:
    """q's absorbed part as the model makes it (a head-major matmul's output, transposed: token
    stride narrower than head stride) and its RoPE part as a tensor of its own give the twin,
    and the same bits as one concatenated q, split over the top-k or not."""
    torch.manual_seed(num_tokens)
    num_heads, kv_lora_rank, rope_dim, num_topk = 3, 40, 8, 70
    kv_cache = torch.randn(6, 64, kv_lora_rank + rope_dim, dtype=dtype, device=DEVICE)
    block_tables = torch.tensor([[4, 1, 0], [2, 5, 3]], dtype=torch.int32, device=DEVICE)
    seq_idx = (torch.arange(num_tokens) % 2).to(torch.int32).to(DEVICE)
    picks = [torch.randperm(192)[:num_topk] for _ in range(num_tokens)]
    topk_indices = torch.stack(picks).to(torch.int32).to(DEVICE)
    topk_indices[1, 1:] = -1
    q_absorbed = torch.randn(num_heads, num_tokens, kv_lora_rank, dtype=dtype, device=DEVICE)
    q_absorbed = q_absorbed.transpose(0, 1)  # [T, H, L], strides (L, T * L, 1)
    q_rope = torch.randn(num_tokens, num_heads, rope_dim, dtype=dtype, device=DEVICE)
    rest = (kv_cache, block_tables, seq_idx, topk_indices, 0.3, kv_lora_rank)
    got = sparse_mla_attention_triton(q_absorbed, *rest, q_rope)
    joined = torch.cat([q_absorbed, q_rope], -1)
    assert torch.equal(got, sparse_mla_attention_triton(joined, *rest))
    assert_close(got, sparse_mla_attention_reference(joined, *rest))
    assert torch.equal(
        sparse_mla_attention_reference(q_absorbed, *rest, q_rope),
        sparse_mla_attention_reference(joined, *rest),
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [5, 140])  # 5: the top-k split and merged; 140: one split
def test_sparse_mla_reads_only_the_entries_a_tokens_position_allows(dtype, num_tokens) -> None:
    """Given positions, a token at p uses the first min(K, p + 1) entries of its row. On rows
    as the indexer makes them (picks first, then -1) the kernel gives the same bits as without
    positions, and the twin's value; it does not read the tiles wholly past a token's picks
    (garbage there changes nothing), where the twin ignores whatever lies past them."""
    from kernels import sparse_mla

    torch.manual_seed(num_tokens)
    num_heads, kv_lora_rank, rope_dim, num_topk = 3, 40, 8, 150
    width = kv_lora_rank + rope_dim
    kv_cache = torch.randn(6, 64, width, dtype=dtype, device=DEVICE)
    block_tables = torch.tensor([[4, 1, 0], [2, 5, 3]], dtype=torch.int32, device=DEVICE)
    seq_idx = (torch.arange(num_tokens) % 2).to(torch.int32).to(DEVICE)
    # Positions below, at and past the top-k's width (0, 31, 149, 150, 191, ...).
    positions = torch.tensor([0, 31, 100, 149, 150, 191] * 24, dtype=torch.int64)[:num_tokens]
    packed = torch.full((num_tokens, num_topk), -1, dtype=torch.int32)
    past_tiles = torch.randint(0, 192, (num_tokens, num_topk), dtype=torch.int32)
    past_any = past_tiles.clone()
    tile = sparse_mla.split_plan(num_tokens, num_heads, num_topk, dtype)[2]  # the launch's
    for t, p in enumerate(positions.tolist()):
        used = min(num_topk, p + 1)
        packed[t, :used] = torch.randperm(p + 1)[:used].to(torch.int32)
        past_any[t, :used] = packed[t, :used]
        past_tiles[t] = packed[t]  # garbage only in the tiles wholly past the picks
        whole_tiles_from = min(num_topk, -(-used // tile) * tile)
        past_tiles[t, whole_tiles_from:] = torch.randint(0, 192, (num_topk - whole_tiles_from,))
    positions = positions.to(DEVICE)
    packed, past_tiles, past_any = packed.to(DEVICE), past_tiles.to(DEVICE), past_any.to(DEVICE)
    q = torch.randn(num_tokens, num_heads, width, dtype=dtype, device=DEVICE)

    def run(impl, topk, pos):
        return impl(q, kv_cache, block_tables, seq_idx, topk, width**-0.5, kv_lora_rank, None, pos)

    expected = run(sparse_mla_attention_reference, packed, None)
    assert torch.equal(run(sparse_mla_attention_reference, past_any, positions), expected)
    assert torch.equal(run(sparse_mla_attention_reference, packed, positions), expected)
    with_positions = run(sparse_mla_attention_triton, packed, positions)
    assert_close(with_positions, expected)
    assert torch.equal(with_positions, run(sparse_mla_attention_triton, packed, None))
    assert torch.equal(run(sparse_mla_attention_triton, past_tiles, positions), with_positions)
    # Without positions the garbage is read: the checks above can tell.
    unbounded = run(sparse_mla_attention_triton, past_tiles, None)
    assert not torch.allclose(unbounded.float(), expected.float(), atol=1e-2)


@pytest.mark.parametrize("num_tokens", [1, 3])
def test_sparse_mla_at_deepseek_shapes_with_part_of_the_top_k_used(num_tokens) -> None:
    """DeepSeek-V3.2's decode shapes (128 heads, 512 + 64 wide, top-2048) for tokens whose
    context fills only part of the top-k: many splits over tiles taken in turn, and a merge
    over several slices of the latent. The twin's value, and the same bits as without
    positions."""
    torch.manual_seed(num_tokens)
    num_heads, kv_lora_rank, rope_dim, num_topk = 128, 512, 64, 2048
    dtype = torch.bfloat16
    width = kv_lora_rank + rope_dim
    kv_cache = torch.randn(70, 64, width, dtype=dtype, device=DEVICE)
    block_tables = torch.randperm(70)[:64].view(2, 32).to(torch.int32).to(DEVICE)
    seq_idx = (torch.arange(num_tokens) % 2).to(torch.int32).to(DEVICE)
    positions = torch.tensor([700, 1100, 2047][:num_tokens], dtype=torch.int64)
    topk = torch.full((num_tokens, num_topk), -1, dtype=torch.int32)
    for t, p in enumerate(positions.tolist()):
        topk[t, : p + 1] = torch.randperm(p + 1).to(torch.int32)
    topk, positions = topk.to(DEVICE), positions.to(DEVICE)
    q = torch.randn(num_tokens, num_heads, width, dtype=dtype, device=DEVICE)
    args = (q, kv_cache, block_tables, seq_idx, topk, width**-0.5, kv_lora_rank)
    got = sparse_mla_attention_triton(*args, None, positions)
    assert_close(got, sparse_mla_attention_reference(*args))
    assert torch.equal(got, sparse_mla_attention_triton(*args))


def test_sparse_mla_merge_over_latent_slices_with_a_partial_last_one() -> None:
    """One token over a 700-wide top-k: 22 splits, merged in slices of 128 latent columns of a
    200-wide latent (the last slice 72 wide): the twin's value."""
    torch.manual_seed(5)
    num_heads, kv_lora_rank, rope_dim, num_topk = 3, 200, 16, 700
    width = kv_lora_rank + rope_dim
    kv_cache = torch.randn(14, 64, width, dtype=torch.float32, device=DEVICE)
    block_tables = torch.randperm(14)[:12].view(1, 12).to(torch.int32).to(DEVICE)
    seq_idx = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    topk = torch.randperm(768)[:num_topk].view(1, -1).to(torch.int32).to(DEVICE)
    q = torch.randn(1, num_heads, width, dtype=torch.float32, device=DEVICE)
    args = (q, kv_cache, block_tables, seq_idx, topk, width**-0.5, kv_lora_rank)
    assert_close(sparse_mla_attention_triton(*args), sparse_mla_attention_reference(*args))


@pytest.mark.parametrize("position", [0, 40, 700])
def test_splits_past_a_tokens_picks_write_and_read_no_partial(monkeypatch, position) -> None:
    """A split whose first tile is past the token's picks writes no partial, and the merge reads
    none for it: with every buffer the call allocates filled with NaN, the output is still the
    bits of the call without positions (which reads every split) and holds no NaN."""
    from kernels import sparse_mla

    torch.manual_seed(position)
    num_heads, kv_lora_rank, rope_dim, num_topk = 3, 40, 8, 600  # 19 splits of one tile
    width = kv_lora_rank + rope_dim
    kv_cache = torch.randn(12, 64, width, dtype=torch.float32, device=DEVICE)
    block_tables = torch.randperm(12).view(1, 12).to(torch.int32).to(DEVICE)
    seq_idx = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    used = min(num_topk, position + 1)
    topk = torch.full((1, num_topk), -1, dtype=torch.int32)
    topk[0, :used] = torch.randperm(position + 1)[:used].to(torch.int32)
    topk = topk.to(DEVICE)
    positions = torch.tensor([position], device=DEVICE)
    q = torch.randn(1, num_heads, width, dtype=torch.float32, device=DEVICE)
    args = (q, kv_cache, block_tables, seq_idx, topk, width**-0.5, kv_lora_rank)
    expected = sparse_mla_attention_triton(*args)
    empty = torch.empty

    def nan_filled(*shape, **kwargs):
        out = empty(*shape, **kwargs)
        return out.fill_(float("nan")) if out.is_floating_point() else out

    monkeypatch.setattr(sparse_mla.torch, "empty", nan_filled)
    monkeypatch.setattr(
        sparse_mla.torch,
        "empty_like",
        lambda t: nan_filled(t.shape, dtype=t.dtype, device=t.device),
    )
    got = sparse_mla_attention_triton(*args, None, positions)
    assert not got.isnan().any()
    assert torch.equal(got, expected)
    assert_close(got, sparse_mla_attention_reference(*args))
