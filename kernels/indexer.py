"""Lightning-indexer logits over the paged key cache, and causal top-k."""

from __future__ import annotations

import torch

from kernels.paged import gather_positions


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
    num_tokens = q.shape[0]
    out = torch.full((num_tokens, topk), -1, dtype=torch.int32, device=q.device)
    for seq in seq_idx.unique().tolist():
        rows = (seq_idx == seq).nonzero().squeeze(1)
        pos = positions[rows]
        num_keys = int(pos.max()) + 1
        keys = gather_positions(k_cache, block_tables[seq], num_keys).float()  # [S, D]
        scores = torch.einsum("thd,sd->ths", q[rows].float(), keys) * softmax_scale
        logits = torch.einsum("th,ths->ts", weights[rows].float(), scores.relu())  # [t, S]
        causal = torch.arange(num_keys, device=q.device)[None, :] <= pos[:, None]
        logits = logits.masked_fill(~causal, float("-inf"))
        k = min(topk, num_keys)
        idx = logits.topk(k, dim=-1).indices.to(torch.int32)
        idx = idx.masked_fill(torch.arange(k, device=q.device)[None, :] > pos[:, None], -1)
        out[rows, :k] = idx
    return out
