"""MLA attention over the top-k selected positions, in the latent space (absorbed weights).

The latent cache is the model's dtype, or FP8 (`kv_cache_dtype="fp8"`, kernels/fp8_cache.py):
e4m3 latents with a power-of-two float32 scale per 128 and the RoPE part in the model's dtype,
dequantized as keys are loaded (exactly: an e4m3 value times 2**e fits bf16)."""

from __future__ import annotations

import torch

from kernels.fp8_cache import (
    FP8_CACHE_GROUP,
    Fp8CacheLayout,
    check_fp8_cache,
    is_fp8_cache,
    unpack_fp8_rows_reference,
)
from kernels.launch import FLOAT_DTYPES, INDEX_DTYPES, check_tensor, dot_in_fp32, launch
from kernels.paged import gather_token_rows, row_chunks, sequence_runs
from kernels.platform import tl, triton


def sparse_mla_attention_reference(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_idx: torch.Tensor,
    topk_indices: torch.Tensor,
    softmax_scale: float,
    kv_lora_rank: int,
    q_rope: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """out[t, h] = sum_s softmax_s(scale * q[t, h] . c[s]) * c[s, :kv_lora_rank].

    q [T, H, kv_lora_rank + rope_dim] (q_nope already absorbed through W_UK), or, given
    `q_rope` [T, H, rope_dim], q [T, H, kv_lora_rank] is the absorbed part alone (the two are
    read in place rather than concatenated); kv_cache [num_blocks, block_size, kv_lora_rank +
    rope_dim] in q's dtype, or FP8 rows [num_blocks, block_size, bytes_per_token]
    (`latent_cache_layout`), topk_indices [T, K] positions within the token's sequence, -1 =
    unused. Returns the latent output [T, H, kv_lora_rank] in q's dtype.

    `positions` [T] (optional), each token's position p: its row's entries past the first
    min(K, p + 1) are unused whatever they hold. The indexer's rows are made so (a token at p
    has seen p + 1 positions; its picks come first, then -1); given it, the kernel reads only
    those entries (a prefill at context 0, or any sequence shorter than K, would otherwise walk
    K entries to use fewer than half of them). Not for rows laid out otherwise (the MTP draft
    steps' shared rows: the steps' own positions follow the kept row's -1 padding).
    """
    if positions is not None:
        unused = torch.arange(topk_indices.shape[1], device=topk_indices.device)[None, :]
        topk_indices = topk_indices.masked_fill(unused > positions[:, None], -1)
    if q_rope is not None:
        q = torch.cat([q, q_rope], -1)
    num_tokens, num_heads, width = q.shape
    layout = latent_cache_layout(kv_lora_rank, width, q.dtype)
    out = torch.empty(num_tokens, num_heads, kv_lora_rank, dtype=q.dtype, device=q.device)
    num_picks = topk_indices.shape[1]

    def rows_of(cache_rows: torch.Tensor) -> torch.Tensor:
        unpacked = (
            unpack_fp8_rows_reference(cache_rows, layout) if is_fp8_cache(kv_cache) else cache_rows
        )
        return unpacked.float()

    def attend_own_picks(rows) -> None:  # each token gathers its picks
        idx = topk_indices[rows].long()  # [t, K]
        picked = gather_token_rows(kv_cache, block_tables, seq_idx[rows], idx.clamp(min=0))
        picked = rows_of(picked)  # [t, K, W] fp32
        scores = torch.einsum("thw,tkw->thk", q[rows].float(), picked) * softmax_scale
        scores = scores.masked_fill((idx < 0)[:, None, :], float("-inf"))
        probs = scores.softmax(-1)
        out[rows] = torch.einsum("thk,tkl->thl", probs, picked[..., :kv_lora_rank]).to(q.dtype)

    # A run of a prompt's tokens whose picks lie among few of its sequence's positions: the
    # latents of those positions gathered once, and each token's softmax over its picks as a
    # softmax over them all, weighted by how often the token picked each (0: -inf). The same sum.
    runs, rest = sequence_runs(seq_idx)
    for run in runs:
        num_keys = int(topk_indices[run].max()) + 1
        if num_keys > MASKED_KEYS_PER_PICK * num_picks:
            for rows in row_chunks(run, num_picks * width):
                attend_own_picks(rows)
            continue
        span = torch.arange(num_keys, device=q.device)[None, :]
        latents = rows_of(gather_token_rows(kv_cache, block_tables, seq_idx[run][:1], span))[0]
        for rows in row_chunks(run, num_heads * num_keys):
            idx = topk_indices[rows].long()
            counts = torch.zeros(idx.shape[0], num_keys, device=q.device)
            counts.scatter_add_(1, idx.clamp(min=0), (idx >= 0).float())
            scores = torch.einsum("thw,sw->ths", q[rows].float(), latents) * softmax_scale
            probs = (scores + counts.log()[:, None, :]).softmax(-1)
            out[rows] = torch.einsum("ths,sl->thl", probs, latents[:, :kv_lora_rank]).to(q.dtype)
    # The other tokens (decodes, verifies, short chunks).
    for rows in row_chunks(rest, num_picks * width):
        attend_own_picks(rows)
    return out


# A run of prompt tokens attends over its sequence's first positions up to its latest pick at
# once where those are at most this many times the picks a token has (else a token's gather of
# its picks alone costs less).
MASKED_KEYS_PER_PICK = 4


def latent_cache_layout(kv_lora_rank: int, width: int, dtype: torch.dtype) -> Fp8CacheLayout:
    """An FP8 latent cache row: kv_lora_rank e4m3 values, then the RoPE part in the model's dtype
    (FlashMLA's V3.2 format: 512 + 16 + 128 = 656 bytes)."""
    return Fp8CacheLayout(kv_lora_rank, width - kv_lora_rank, dtype)


# --- Triton ---------------------------------------------------------------------------------------
#
# Flash-decoding over the selected positions: each program takes one token, BLOCK_H heads and one
# split of the top-k list, keeps an online softmax over BLOCK_K keys at a time, and writes a
# partial (max, sum, unnormalized output); a second kernel merges the splits. Splits give batch-1
# decode enough programs to fill the GPU; heads share each key tile through registers, so a key
# is read from HBM once per BLOCK_H heads (and from L2 for the other head blocks).

# Tiles measured on the H200 (batch 32, context 8192, 128 heads, top-2048; bench_kernels.py
# --sweep-mla, commit 754cbe5): (BLOCK_H, BLOCK_K, warps) (64, 32, 8) 143 us, (32, 64, 8) 163,
# (16, 32, 4) 190, (64, 16, 8) 212, (16, 64, 4) 245, (32, 32, 8) 252.
_MLA_BLOCK_K = 32  # keys per step
_MLA_BLOCK_H = 64  # heads per program: a key tile feeds 64 heads' MMAs
_MLA_TARGET_PROGRAMS = 264  # two waves over the H200's 132 SMs
_MLA_NUM_WARPS = 8
_MLA_NUM_STAGES = 2
_MLA_PREFETCH = True  # the next tile's indices loaded ahead (bench_kernels.py --sweep-mla)
# Keys per step where the top-k is not split (prefill chunks, large batches: one program per
# token and head block fills the GPU). A 2048-token chunk on the H100 (bench_kernels.py
# --sweep-mla-prefill): 2.72 / 5.06 / 5.10 ms at context 0 / 8192 / 30000 against 3.49 / 6.57 /
# 6.74 with _MLA_BLOCK_K (bf16); 3 stages of 64 keys run out of shared memory, and so would
# fp32's 2, which keep _MLA_BLOCK_K.
_MLA_DIRECT_BLOCK_K = 64
_MERGE_TILE = 4096  # partials per merge program: splits x latent columns


@triton.jit
def _used_bound(positions_ptr, token, num_topk, BLOCK_K: tl.constexpr, HAS_POSITIONS: tl.constexpr):
    """How far into a top-k row the steps go: every entry, or with positions, up to the BLOCK_K
    tile that holds the row's last used entry (entries past the first p + 1 are -1, the
    caller's promise). A bound that is a multiple of BLOCK_K keeps the row's loads as wide as
    without positions (an exact bound and a mask of its own cost 3-6% on the H200 where every
    entry is used: BENCHMARKS.md, session 12)."""
    if HAS_POSITIONS:
        num_used = tl.minimum(tl.load(positions_ptr + token).to(tl.int32) + 1, num_topk)
        return tl.minimum(tl.cdiv(num_used, BLOCK_K) * BLOCK_K, num_topk)
    else:
        return num_topk


# Batch-dependent sizes, strides and index-tensor offsets are not specialized on: a new batch
# shape must not compile a variant mid-serving (Worker.warm_up compiles the rest).
@triton.jit(
    do_not_specialize=["block_tables_row_stride"],
    do_not_specialize_on_alignment=["block_tables_ptr", "seq_idx_ptr", "topk_ptr", "positions_ptr"],
)
def _sparse_mla_split_kernel(
    q_ptr,
    q_rope_ptr,
    cache_ptr,
    scale_ptr,
    rope_ptr,
    block_tables_ptr,
    seq_idx_ptr,
    topk_ptr,
    positions_ptr,
    partial_out_ptr,
    partial_max_ptr,
    partial_sum_ptr,
    out_ptr,
    q_token_stride,
    q_head_stride,
    q_rope_token_stride,
    q_rope_head_stride,
    out_token_stride,
    out_head_stride,
    block_tables_row_stride,
    topk_row_stride,
    num_topk,
    softmax_scale,
    NUM_HEADS: tl.constexpr,
    KV_LORA_RANK: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    BLOCK_SIZE_TOKENS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    FP8_CACHE: tl.constexpr,
    ROW_BYTES: tl.constexpr,
    SCALE_OFFSET: tl.constexpr,
    ROPE_OFFSET: tl.constexpr,
    ROPE_ITEMSIZE: tl.constexpr,
    GROUP: tl.constexpr,
    DIRECT_OUT: tl.constexpr,
    HAS_POSITIONS: tl.constexpr,
    PREFETCH: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    token = tl.program_id(0)
    head_block = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    width: tl.constexpr = KV_LORA_RANK + ROPE_DIM
    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    head_mask = heads < NUM_HEADS
    lat = tl.arange(0, BLOCK_L)
    lat_mask = lat < KV_LORA_RANK
    rope = tl.arange(0, BLOCK_R)
    rope_mask = rope < ROPE_DIM

    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    bound = _used_bound(positions_ptr, token, num_topk, BLOCK_K, HAS_POSITIONS)
    # The splits take the BLOCK_K tiles in turn (split s: tiles s, s + splits, ...). A split
    # whose first tile is past the bound has nothing to do: it reads no q and writes no partial
    # (the merge reads none for it either), where it would write what a split of -1 entries
    # does (max -1e30, sum 0, acc 0). One split always works (the bound is at least 1).
    works = tl.full([BLOCK_H], split * BLOCK_K, tl.int32) < bound  # [BLOCK_H], all alike
    head_mask = head_mask & works  # the heads this program reads and writes
    q_rows = q_ptr + token * q_token_stride + heads[:, None] * q_head_stride
    q_nope = tl.load(
        q_rows + lat[None, :], mask=head_mask[:, None] & lat_mask[None, :], other=0.0
    )  # [BLOCK_H, BLOCK_L]
    q_rope = tl.load(
        q_rope_ptr
        + token * q_rope_token_stride
        + heads[:, None] * q_rope_head_stride
        + rope[None, :],
        mask=head_mask[:, None] & rope_mask[None, :],
        other=0.0,
    )  # [BLOCK_H, BLOCK_R]
    if UPCAST_DOT:
        q_nope = q_nope.to(tl.float32)
        q_rope = q_rope.to(tl.float32)
    seq = tl.load(seq_idx_ptr + token).to(tl.int64)

    running_max = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)
    running_sum = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_L], dtype=tl.float32)
    # A row whose used entries fill only part of it still spreads them over every split. A
    # tile wholly past them runs no step and leaves what an all -1 tile leaves (max, sum and
    # acc unchanged): the output is the same bits as reading them.
    topk_row = topk_ptr + token * topk_row_stride
    table_row = block_tables_ptr + seq * block_tables_row_stride
    offs = tl.arange(0, BLOCK_K)
    tile_stride = num_splits * BLOCK_K
    first = split * BLOCK_K
    # With PREFETCH the next tile's picks and block ids are loaded while this tile's keys are
    # on their way (their loads depend on them): a tile then waits for one load, not three
    # in a row (3-19% of the split's time at batch 32 on the H200, every tile config).
    picks = tl.load(topk_row + first + offs, mask=first + offs < bound, other=-1)
    blocks = tl.load(table_row + picks // BLOCK_SIZE_TOKENS, mask=picks >= 0, other=0)
    for k0 in range(first, bound, tile_stride):
        if not PREFETCH:
            picks = tl.load(topk_row + k0 + offs, mask=k0 + offs < bound, other=-1)
            blocks = tl.load(table_row + picks // BLOCK_SIZE_TOKENS, mask=picks >= 0, other=0)
        valid = picks >= 0
        slots = blocks.to(tl.int64) * BLOCK_SIZE_TOKENS + picks % BLOCK_SIZE_TOKENS  # [BLOCK_K]
        if FP8_CACHE:
            # e4m3 latents x their group's scale; the RoPE part as stored. All one byte row.
            lat_in = valid[:, None] & lat_mask[None, :]
            row_bytes = slots * ROW_BYTES
            k_nope = tl.load(cache_ptr + row_bytes[:, None] + lat[None, :], mask=lat_in, other=0.0)
            scales = tl.load(
                scale_ptr + (row_bytes + SCALE_OFFSET)[:, None] // 4 + lat[None, :] // GROUP,
                mask=lat_in,
                other=0.0,
            )
            k_nope = (k_nope.to(tl.float32) * scales).to(q_nope.dtype)  # [BLOCK_K, BLOCK_L]
            k_rope = tl.load(
                rope_ptr + (row_bytes + ROPE_OFFSET)[:, None] // ROPE_ITEMSIZE + rope[None, :],
                mask=valid[:, None] & rope_mask[None, :],
                other=0.0,
            )
        else:
            rows = slots * width
            k_nope = tl.load(
                cache_ptr + rows[:, None] + lat[None, :],
                mask=valid[:, None] & lat_mask[None, :],
                other=0.0,
            )  # [BLOCK_K, BLOCK_L]
            k_rope = tl.load(
                cache_ptr + rows[:, None] + KV_LORA_RANK + rope[None, :],
                mask=valid[:, None] & rope_mask[None, :],
                other=0.0,
            )
        if PREFETCH:
            ahead = k0 + tile_stride + offs
            picks = tl.load(topk_row + ahead, mask=ahead < bound, other=-1)
            blocks = tl.load(table_row + picks // BLOCK_SIZE_TOKENS, mask=picks >= 0, other=0)
        if UPCAST_DOT:
            k_nope = k_nope.to(tl.float32)
            k_rope = k_rope.to(tl.float32)
            scores = tl.dot(q_nope, tl.trans(k_nope), input_precision="ieee")
            scores = tl.dot(q_rope, tl.trans(k_rope), scores, input_precision="ieee")
        else:
            scores = tl.dot(q_nope, tl.trans(k_nope.to(q_nope.dtype)))
            scores = tl.dot(q_rope, tl.trans(k_rope.to(q_rope.dtype)), scores)
        scores = tl.where(valid[None, :], scores * softmax_scale, float("-inf"))  # [H, K]
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        probs = tl.exp(scores - new_max[:, None])
        rescale = tl.exp(running_max - new_max)
        running_sum = running_sum * rescale + tl.sum(probs, axis=1)
        if UPCAST_DOT:
            acc = tl.dot(probs, k_nope, acc * rescale[:, None], input_precision="ieee")
        else:
            acc = tl.dot(probs.to(k_nope.dtype), k_nope, acc * rescale[:, None])
        running_max = new_max
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()

    if DIRECT_OUT:
        # One split: the merge would compute exactly acc / running_sum (its rescale is exp(0)).
        tl.store(
            out_ptr + token * out_token_stride + heads[:, None] * out_head_stride + lat[None, :],
            (acc / running_sum[:, None]).to(out_ptr.dtype.element_ty),
            mask=head_mask[:, None] & lat_mask[None, :],
        )
        return
    # partial_* are [T, splits, H(, L)] fp32
    row = (token * num_splits + split) * NUM_HEADS + heads
    tl.store(partial_max_ptr + row, running_max, mask=head_mask)
    tl.store(partial_sum_ptr + row, running_sum, mask=head_mask)
    tl.store(
        partial_out_ptr + row[:, None] * KV_LORA_RANK + lat[None, :],
        acc,
        mask=head_mask[:, None] & lat_mask[None, :],
    )


@triton.jit(do_not_specialize_on_alignment=["positions_ptr"])
def _sparse_mla_merge_kernel(
    partial_out_ptr,
    partial_max_ptr,
    partial_sum_ptr,
    out_ptr,
    positions_ptr,
    out_token_stride,
    out_head_stride,
    num_splits,
    num_topk,
    NUM_HEADS: tl.constexpr,
    KV_LORA_RANK: tl.constexpr,
    BLOCK_SPLITS: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_K: tl.constexpr,  # the split kernel's
    HAS_POSITIONS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, BLOCK_SPLITS)
    split_mask = splits < num_splits
    lat = tl.program_id(2) * BLOCK_L + tl.arange(0, BLOCK_L)
    lat_mask = lat < KV_LORA_RANK
    rows = (token * num_splits + splits) * NUM_HEADS + head  # [BLOCK_SPLITS]
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    # The splits that had no tile wrote nothing: read as what they would have written.
    bound = _used_bound(positions_ptr, token, num_topk, BLOCK_K, HAS_POSITIONS)
    split_mask = split_mask & (splits * BLOCK_K < bound)
    split_max = tl.load(partial_max_ptr + rows, mask=split_mask, other=-1.0e30)
    split_sum = tl.load(partial_sum_ptr + rows, mask=split_mask, other=0.0)
    partial = tl.load(
        partial_out_ptr + rows[:, None] * KV_LORA_RANK + lat[None, :],
        mask=split_mask[:, None] & lat_mask[None, :],
        other=0.0,
    )
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    scale = tl.exp(split_max - tl.max(split_max, axis=0))  # [BLOCK_SPLITS]
    total = tl.sum(split_sum * scale, axis=0)
    out = tl.sum(partial * scale[:, None], axis=0) / total
    tl.store(
        out_ptr + token * out_token_stride + head * out_head_stride + lat,
        out.to(out_ptr.dtype.element_ty),
        mask=lat_mask,
    )


def split_plan(
    num_tokens: int, num_heads: int, num_topk: int, dtype: torch.dtype
) -> tuple[int, int, int]:
    """-> (heads per program, splits of the top-k list, keys per step) of a launch. Splits fill
    the GPU where tokens times head blocks do not; with one split, `_MLA_DIRECT_BLOCK_K` keys a
    step in 16-bit (fp32 tiles that wide would not fit shared memory at DeepSeek's width)."""
    block_h = max(16, min(_MLA_BLOCK_H, triton.next_power_of_2(num_heads)))
    num_head_blocks = triton.cdiv(num_heads, block_h)
    max_splits = max(1, triton.cdiv(num_topk, _MLA_BLOCK_K))
    num_splits = min(
        max_splits, max(1, _MLA_TARGET_PROGRAMS // max(1, num_tokens * num_head_blocks))
    )
    one_split_wide = num_splits == 1 and dtype.itemsize <= 2
    return block_h, num_splits, _MLA_DIRECT_BLOCK_K if one_split_wide else _MLA_BLOCK_K


def sparse_mla_attention_triton(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_idx: torch.Tensor,
    topk_indices: torch.Tensor,
    softmax_scale: float,
    kv_lora_rank: int,
    q_rope: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton twin of `sparse_mla_attention_reference` (split top-k + merge, two launches; one
    when the top-k is not split, as in prefill, whose programs then write the output). Given
    `positions`, each row's entries past the first min(K, p + 1) must be -1, as the indexer
    makes them: the kernel skips the tiles wholly past them and reads the rest as it would
    without positions (the same bits), where the twin ignores whatever they hold."""
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
    device = q.device
    if q_rope is None:
        q_rope = q[..., kv_lora_rank:]
        q = q[..., :kv_lora_rank]
    else:
        check_tensor("q_rope", q_rope, ndim=3, dtypes=(q.dtype,), device=device)
        if q.shape[-1] != kv_lora_rank or q_rope.shape[:2] != q.shape[:2]:
            raise ValueError(
                f"q {tuple(q.shape)} and q_rope {tuple(q_rope.shape)} for kv_lora_rank "
                f"{kv_lora_rank}"
            )
    if q.stride(-1) != 1 or q_rope.stride(-1) != 1:
        raise ValueError("q and q_rope need their last dimension contiguous")
    num_tokens, num_heads = q.shape[:2]
    width = kv_lora_rank + q_rope.shape[-1]
    fp8 = is_fp8_cache(kv_cache)
    layout = latent_cache_layout(kv_lora_rank, width, q.dtype)
    if fp8:
        check_fp8_cache("kv_cache", kv_cache, layout, device)
    else:
        check_tensor(
            "kv_cache", kv_cache, ndim=3, dtypes=FLOAT_DTYPES, contiguous=True, device=device
        )
    check_tensor("block_tables", block_tables, ndim=2, dtypes=INDEX_DTYPES, device=device)
    check_tensor("seq_idx", seq_idx, ndim=1, dtypes=INDEX_DTYPES, device=device)
    check_tensor("topk_indices", topk_indices, ndim=2, dtypes=INDEX_DTYPES, device=device)
    if positions is not None:
        check_tensor("positions", positions, ndim=1, dtypes=INDEX_DTYPES, device=device)
        if positions.shape[0] != q.shape[0]:
            raise ValueError("positions needs one entry per token")
    if (not fp8 and kv_cache.shape[-1] != width) or not 0 < kv_lora_rank < width:
        raise ValueError(
            f"q heads {width} wide, cache rows {kv_cache.shape[-1]}, kv_lora_rank {kv_lora_rank}"
        )
    if seq_idx.shape[0] != num_tokens or topk_indices.shape[0] != num_tokens:
        raise ValueError("seq_idx and topk_indices need one row per token")
    rope_dim = width - kv_lora_rank
    num_topk = topk_indices.shape[1]
    block_h, num_splits, block_k = split_plan(num_tokens, num_heads, num_topk, q.dtype)
    num_head_blocks = triton.cdiv(num_heads, block_h)

    out = torch.empty(num_tokens, num_heads, kv_lora_rank, dtype=q.dtype, device=device)
    if num_tokens == 0:
        return out
    # One split: its programs write `out` and no partial is made (empty, never read).
    direct = num_splits == 1
    num_partials = 0 if direct else num_tokens * num_splits * num_heads
    # [T, splits, H, L] and [T, splits, H], fp32, flattened
    partial_out = torch.empty(num_partials * kv_lora_rank, dtype=torch.float32, device=device)
    partial_max = torch.empty(num_partials, dtype=torch.float32, device=device)
    partial_sum = torch.empty_like(partial_max)
    block_l = max(16, triton.next_power_of_2(kv_lora_rank))
    launch(
        _sparse_mla_split_kernel,
        (num_tokens, num_head_blocks, num_splits),
        q,
        q,
        q_rope,
        kv_cache,
        kv_cache.view(torch.float32) if fp8 else kv_cache,
        kv_cache.view(q.dtype) if fp8 else kv_cache,
        block_tables,
        seq_idx,
        topk_indices,
        seq_idx if positions is None else positions,  # not read without positions
        partial_out,
        partial_max,
        partial_sum,
        out,
        q.stride(0),
        q.stride(1),
        q_rope.stride(0),
        q_rope.stride(1),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        topk_indices.stride(0),
        num_topk,
        softmax_scale,
        NUM_HEADS=num_heads,
        KV_LORA_RANK=kv_lora_rank,
        ROPE_DIM=rope_dim,
        BLOCK_SIZE_TOKENS=kv_cache.shape[1],
        BLOCK_H=block_h,
        BLOCK_L=block_l,
        BLOCK_R=max(16, triton.next_power_of_2(rope_dim)),
        BLOCK_K=block_k,
        UPCAST_DOT=dot_in_fp32(q.dtype),
        FP8_CACHE=fp8,
        ROW_BYTES=layout.bytes_per_token,
        SCALE_OFFSET=layout.scale_offset,
        ROPE_OFFSET=layout.tail_offset,
        ROPE_ITEMSIZE=layout.tail_itemsize,
        GROUP=FP8_CACHE_GROUP,
        DIRECT_OUT=direct,
        HAS_POSITIONS=positions is not None,
        PREFETCH=_MLA_PREFETCH,
        num_warps=_MLA_NUM_WARPS,
        num_stages=_MLA_NUM_STAGES,
    )
    if direct:
        return out
    # A program merges a BLOCK_L slice of one head's latent over every split: its tile of
    # partials stays at 4096 fp32 (32 registers a thread), where a whole 512-wide row over 64
    # splits (b = 1) spilled and took 25 us on the H200.
    block_splits = triton.next_power_of_2(num_splits)
    merge_block_l = max(16, min(block_l, _MERGE_TILE // block_splits))
    launch(
        _sparse_mla_merge_kernel,
        (num_tokens, num_heads, triton.cdiv(kv_lora_rank, merge_block_l)),
        q,
        partial_out,
        partial_max,
        partial_sum,
        out,
        seq_idx if positions is None else positions,  # not read without positions
        out.stride(0),
        out.stride(1),
        num_splits,
        num_topk,
        NUM_HEADS=num_heads,
        KV_LORA_RANK=kv_lora_rank,
        BLOCK_SPLITS=block_splits,
        BLOCK_L=merge_block_l,
        BLOCK_K=_MLA_BLOCK_K,
        HAS_POSITIONS=positions is not None,
        num_warps=4,
    )
    return out
