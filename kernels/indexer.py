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
# A Triton logits kernel, then torch's sort (or topk) over the logits row. The logits buffer
# spans every position the block table can address (no host sync, so it is CUDA-graph
# capturable); keys past a token's position get -inf and their picks are replaced by -1, which
# reproduces the twin's k = min(topk, positions + 1). A Triton top-k (radix select of 2048 out
# of up to 128k logits) is not written yet; the selection costs 3-10x the logits kernel
# (BENCHMARKS.md).

# Keys per program. 32 keys x 128 dims of bf16 is 8 KiB a program: enough programs at batch 1
# and 8k context (256) to cover the H200's 132 SMs twice.
_INDEXER_BLOCK_S = 32
# Up to this many positions a full descending sort beats torch.topk(2048) on the H200
# (logits + select, CUDA graph, commit 754cbe5): 23 vs 38 us at batch 1 x 1k positions,
# 51 vs 74 us at batch 1 x 8k, 80 vs 82 at batch 8 x 8k, 128 vs 126 at batch 32 x 8k.
_SORT_MAX_POSITIONS = 16384


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
    keys = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)  # [BLOCK_S] positions
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    seq = tl.load(seq_idx_ptr + token).to(tl.int64)
    position = tl.load(positions_ptr + token)
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
    """fp32 logits [T, padded positions] of every addressable key; -inf past a token's position."""
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
    """Triton-logits twin of `indexer_topk_reference` (selection by torch.sort / torch.topk)."""
    logits = indexer_logits_triton(
        q, weights, k_cache, block_tables, seq_idx, positions, softmax_scale
    )
    num_tokens, num_positions = logits.shape
    k = min(topk, num_positions)
    if num_positions <= _SORT_MAX_POSITIONS:
        idx = logits.sort(dim=-1, descending=True).indices[:, :k].to(torch.int32)
    else:
        idx = logits.topk(k, dim=-1).indices.to(torch.int32)  # [T, k], best first
    rank = torch.arange(k, device=q.device)
    idx = idx.masked_fill(rank[None, :] > positions[:, None], -1)
    if k < topk:
        idx = torch.nn.functional.pad(idx, (0, topk - k), value=-1)
    return idx
