"""Lightning-indexer logits over the paged key cache, and causal top-k."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.launch import FLOAT_DTYPES, INDEX_DTYPES, check_tensor, dot_in_fp32, launch
from kernels.paged import gather_token_rows, token_chunks


def indexer_topk_reference(
    q: torch.Tensor,
    weights: torch.Tensor,
    k_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_idx: torch.Tensor,
    positions: torch.Tensor,
    topk: int,
    softmax_scale: float,
) -> torch.Tensor:
    """Top-k past positions per query token.

    q [T, H, D], weights [T, H] (already times index_n_heads**-0.5), k_cache
    [num_blocks, block_size, D], block_tables [B, max_blocks], seq_idx [T] (row of block_tables),
    positions [T]. Token t scores keys 0..positions[t] of its sequence:
    score[s] = sum_h weights[t, h] * relu(softmax_scale * q[t, h] . k[s]).
    Returns int32 [T, topk]: the positions of the min(topk, positions[t] + 1) best keys, highest
    score first, then -1. The current token is not forced in.
    """
    num_tokens, _, head_dim = q.shape
    out = torch.full((num_tokens, topk), -1, dtype=torch.int32, device=q.device)
    if num_tokens == 0:
        return out
    num_keys = int(positions.max()) + 1  # keys 0..S-1 of every token's sequence
    keys_range = torch.arange(num_keys, device=q.device)
    k = min(topk, num_keys)
    for rows in token_chunks(num_tokens, num_keys * head_dim):
        pos = positions[rows]
        span = keys_range.expand(pos.shape[0], num_keys)
        keys = gather_token_rows(k_cache, block_tables, seq_idx[rows], span).float()  # [t, S, D]
        scores = torch.einsum("thd,tsd->ths", q[rows].float(), keys) * softmax_scale
        logits = torch.einsum("th,ths->ts", weights[rows].float(), scores.relu())  # [t, S]
        logits = logits.masked_fill(keys_range[None, :] > pos[:, None], float("-inf"))
        idx = logits.topk(k, dim=-1).indices.to(torch.int32)
        out[rows, :k] = idx.masked_fill(keys_range[None, :k] > pos[:, None], -1)
    return out


# --- Triton ---------------------------------------------------------------------------------------
#
# Two kernels. The logits kernel scores every key up to each token's position over the paged
# cache; its buffer spans every position the block table can address (no host sync, so CUDA-graph
# capturable), but programs whose keys all lie past the token's position exit at once, so a decode
# step costs what its context costs, not what the table could hold. The selection kernel is a
# radix select, one program per token, over that token's own positions 0..p: four passes of an
# 8-bit histogram over the logits' order-preserving integer keys find the k-th largest key, and a
# last pass writes the positions above it (and the first ones equal to it) in position order.
# With p + 1 <= topk it writes 0..p without reading a logit. The twin returns the same set best
# first; consumers treat a row as a set.
#
# One program scans a row, so the select's cost grows with the context on one SM: on the H200 it
# beat torch's sort/topk over the whole table at every context up to a 33k-position table
# (BENCHMARKS.md, issue 8). Wider tables (longer max_model_len) keep torch.topk over the row,
# measured before; a select split over several programs per row is the next step.

# The widest logits row (positions the block table addresses) the radix select takes.
_RADIX_MAX_POSITIONS = 33 * 1024

# Keys per program. 32 keys x 128 dims of bf16 is 8 KiB a program: enough programs at batch 1
# and 8k context (256) to cover the H200's 132 SMs twice.
_INDEXER_BLOCK_S = 32
# Logits per iteration of the selection kernel's passes.
_SELECT_BLOCK = 2048


@triton.jit
def _indexer_logits_kernel(
    q_ptr,
    weights_ptr,
    cache_ptr,
    block_tables_ptr,
    seq_idx_ptr,
    positions_ptr,
    logits_ptr,
    q_token_stride,
    q_head_stride,
    weights_token_stride,
    block_tables_row_stride,
    logits_row_stride,
    softmax_scale,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE_TOKENS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    token = tl.program_id(0)
    first_key = tl.program_id(1) * BLOCK_S
    keys = first_key + tl.arange(0, BLOCK_S)  # [BLOCK_S] positions
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    position = tl.load(positions_ptr + token)
    if first_key > position:  # every key here is in the token's future: nothing to score
        return
    seq = tl.load(seq_idx_ptr + token).to(tl.int64)
    causal = keys <= position
    # [BLOCK_S] flat cache rows through the block table
    blocks = tl.load(
        block_tables_ptr + seq * block_tables_row_stride + keys // BLOCK_SIZE_TOKENS,
        mask=causal,
        other=0,
    ).to(tl.int64)
    rows = blocks * BLOCK_SIZE_TOKENS + keys % BLOCK_SIZE_TOKENS
    dim_mask = dims < HEAD_DIM
    k = tl.load(
        cache_ptr + rows[:, None] * HEAD_DIM + dims[None, :],
        mask=causal[:, None] & dim_mask[None, :],
        other=0.0,
    )  # [BLOCK_S, BLOCK_D]
    head_mask = heads < NUM_HEADS
    q = tl.load(
        q_ptr + token * q_token_stride + heads[:, None] * q_head_stride + dims[None, :],
        mask=head_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )  # [BLOCK_H, BLOCK_D]
    w = tl.load(weights_ptr + token * weights_token_stride + heads, mask=head_mask, other=0.0).to(
        tl.float32
    )
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    if UPCAST_DOT:
        scores = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        scores = tl.dot(q, tl.trans(k.to(q.dtype)))  # [BLOCK_H, BLOCK_S], fp32 accumulate
    scores = tl.maximum(scores * softmax_scale, 0.0)
    logits = tl.sum(scores * w[:, None], axis=0)  # [BLOCK_S]
    logits = tl.where(causal, logits, float("-inf"))
    tl.store(logits_ptr + token * logits_row_stride + keys, logits)


def indexer_logits_triton(
    q: torch.Tensor,
    weights: torch.Tensor,
    k_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_idx: torch.Tensor,
    positions: torch.Tensor,
    softmax_scale: float,
) -> torch.Tensor:
    """fp32 logits [T, padded positions]: row t holds the logits of keys 0..positions[t], then -inf
    to the end of that key block; entries past it are never written (callers read 0..p only)."""
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
    device = q.device
    check_tensor("weights", weights, ndim=2, dtypes=FLOAT_DTYPES, device=device)
    check_tensor("k_cache", k_cache, ndim=3, dtypes=FLOAT_DTYPES, contiguous=True, device=device)
    check_tensor("block_tables", block_tables, ndim=2, dtypes=INDEX_DTYPES, device=device)
    check_tensor("seq_idx", seq_idx, ndim=1, dtypes=INDEX_DTYPES, device=device)
    check_tensor("positions", positions, ndim=1, dtypes=INDEX_DTYPES, device=device)
    num_tokens, num_heads, head_dim = q.shape
    if weights.shape != (num_tokens, num_heads):
        raise ValueError(f"weights {tuple(weights.shape)}, expected {(num_tokens, num_heads)}")
    if k_cache.shape[-1] != head_dim:
        raise ValueError(f"k_cache rows are {k_cache.shape[-1]} wide, q heads {head_dim}")
    if seq_idx.shape[0] != num_tokens or positions.shape[0] != num_tokens:
        raise ValueError("seq_idx and positions need one entry per token")
    block_size_tokens = k_cache.shape[1]
    num_blocks_s = triton.cdiv(block_tables.shape[1] * block_size_tokens, _INDEXER_BLOCK_S)
    logits = torch.empty(
        num_tokens, num_blocks_s * _INDEXER_BLOCK_S, dtype=torch.float32, device=device
    )
    if num_tokens > 0:
        launch(
            _indexer_logits_kernel,
            (num_tokens, num_blocks_s),
            q,
            q,
            weights,
            k_cache,
            block_tables,
            seq_idx,
            positions,
            logits,
            q.stride(0),
            q.stride(1),
            weights.stride(0),
            block_tables.stride(0),
            logits.stride(0),
            softmax_scale,
            NUM_HEADS=num_heads,
            HEAD_DIM=head_dim,
            BLOCK_SIZE_TOKENS=block_size_tokens,
            BLOCK_H=max(16, triton.next_power_of_2(num_heads)),
            BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
            BLOCK_S=_INDEXER_BLOCK_S,
            UPCAST_DOT=dot_in_fp32(q.dtype),
            num_warps=4,
        )
    return logits


@triton.jit
def _ordered_key(x):
    """fp32 -> int32 whose unsigned order is x's order (sign bit set for x >= 0, else all bits
    flipped)."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, ~bits, bits ^ -2147483648)


@triton.jit
def _topk_select_kernel(
    logits_ptr,
    positions_ptr,
    out_ptr,
    logits_row_stride,
    out_row_stride,
    topk,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    token = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    n = tl.load(positions_ptr + token).to(tl.int32) + 1  # keys 0..n-1 are candidates
    row = logits_ptr + token.to(tl.int64) * logits_row_stride
    out_row = out_ptr + token.to(tl.int64) * out_row_stride
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    if n <= topk:
        for j0 in range(0, topk, BLOCK):
            j = j0 + offs
            tl.store(out_row + j, tl.where(j < n, j, -1), mask=j < topk)
    else:
        # Radix select of the topk-th largest key, 8 bits a pass from the top. `prefix` holds the
        # bits fixed so far (as unsigned bits in an int32); `remaining` how many of the keys that
        # share them are still to be taken.
        bins = tl.arange(0, 256)
        prefix = n * 0
        remaining = n * 0 + topk
        for p in tl.static_range(4):
            counts = tl.zeros([256], dtype=tl.int32)
            for s0 in range(0, n, BLOCK):
                idx = s0 + offs
                valid = idx < n
                key = _ordered_key(tl.load(row + idx, mask=valid, other=0.0))
                if p > 0:  # arithmetic shifts on both sides: equal high bits <=> equal shifts
                    valid = valid & ((key >> (32 - 8 * p)) == (prefix >> (32 - 8 * p)))
                counts += tl.histogram((key >> (24 - 8 * p)) & 255, 256, mask=valid)
            at_or_above = tl.sum(counts) - tl.cumsum(counts, 0) + counts  # keys with digit >= d
            digit = tl.max(tl.where(at_or_above >= remaining, bins, -1), 0)
            remaining -= tl.sum(tl.where(bins > digit, counts, 0))
            prefix = prefix | (digit << (24 - 8 * p))
        # Take every key above the threshold and the first `remaining` equal to it.
        threshold = prefix ^ -2147483648  # back to signed order for the comparisons
        written = n * 0
        ties = n * 0
        for s0 in range(0, n, BLOCK):
            idx = s0 + offs
            valid = idx < n
            key = _ordered_key(tl.load(row + idx, mask=valid, other=0.0)) ^ -2147483648
            equal = valid & (key == threshold)
            tie_rank = ties + tl.cumsum(equal.to(tl.int32), 0) - 1
            take = (valid & (key > threshold)) | (equal & (tie_rank < remaining))
            slot = written + tl.cumsum(take.to(tl.int32), 0) - 1
            tl.store(out_row + slot, idx, mask=take)
            written += tl.sum(take.to(tl.int32))
            ties += tl.sum(equal.to(tl.int32))


def topk_select_triton(logits: torch.Tensor, positions: torch.Tensor, topk: int) -> torch.Tensor:
    """int32 [T, topk]: the positions of the min(topk, p + 1) largest of logits[t, 0..p]
    (p = positions[t]; ties go to the earlier position) in position order, then -1."""
    check_tensor("logits", logits, ndim=2, dtypes=(torch.float32,))
    check_tensor("positions", positions, ndim=1, dtypes=INDEX_DTYPES, device=logits.device)
    num_tokens = logits.shape[0]
    if positions.shape[0] != num_tokens:
        raise ValueError(f"{positions.shape[0]} positions for {num_tokens} logits rows")
    out = torch.empty(num_tokens, topk, dtype=torch.int32, device=logits.device)
    if num_tokens > 0:
        launch(
            _topk_select_kernel,
            (num_tokens,),
            logits,
            logits,
            positions,
            out,
            logits.stride(0),
            out.stride(0),
            topk,
            BLOCK=_SELECT_BLOCK,
            num_warps=8,
        )
    return out


def indexer_topk_triton(
    q: torch.Tensor,
    weights: torch.Tensor,
    k_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_idx: torch.Tensor,
    positions: torch.Tensor,
    topk: int,
    softmax_scale: float,
) -> torch.Tensor:
    """Triton twin of `indexer_topk_reference`: the same set per row (in position order from the
    radix select, best first from torch.topk on wider tables)."""
    logits = indexer_logits_triton(
        q, weights, k_cache, block_tables, seq_idx, positions, softmax_scale
    )
    num_tokens, width = logits.shape
    if width <= _RADIX_MAX_POSITIONS:
        return topk_select_triton(logits, positions, topk)
    # Entries past each token's key block were never written: -inf before torch reads the row.
    past = torch.arange(width, device=logits.device)[None, :] > positions[:, None]
    k = min(topk, width)
    idx = logits.masked_fill_(past, float("-inf")).topk(k, dim=-1).indices.to(torch.int32)
    rank = torch.arange(k, device=logits.device)
    idx = idx.masked_fill_(rank[None, :] > positions[:, None], -1)
    return torch.nn.functional.pad(idx, (0, topk - k), value=-1) if k < topk else idx
