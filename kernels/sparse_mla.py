"""MLA attention over the top-k selected positions, in the latent space (absorbed weights)."""

from __future__ import annotations

import torch

from kernels.paged import gather_positions


def sparse_mla_attention_reference(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_idx: torch.Tensor,
    topk_indices: torch.Tensor,
    softmax_scale: float,
    kv_lora_rank: int,
) -> torch.Tensor:
    """out[t, h] = sum_s softmax_s(scale * q[t, h] . c[s]) * c[s, :kv_lora_rank].

    q [T, H, kv_lora_rank + rope_dim] (q_nope already absorbed through W_UK), kv_cache
    [num_blocks, block_size, kv_lora_rank + rope_dim], topk_indices [T, K] positions within the
    token's sequence, -1 = unused. Returns the latent output [T, H, kv_lora_rank] in q's dtype.
    """
    num_tokens, num_heads, _ = q.shape
    out = torch.empty(num_tokens, num_heads, kv_lora_rank, dtype=q.dtype, device=q.device)
    for seq in seq_idx.unique().tolist():
        rows = (seq_idx == seq).nonzero().squeeze(1)
        idx = topk_indices[rows].long()  # [t, K]
        num_keys = int(idx.max()) + 1
        keys = gather_positions(kv_cache, block_tables[seq], num_keys).float()  # [S, W]
        picked = keys[idx.clamp(min=0)]  # [t, K, W]
        scores = torch.einsum("thw,tkw->thk", q[rows].float(), picked) * softmax_scale
        scores = scores.masked_fill((idx < 0)[:, None, :], float("-inf"))
        probs = scores.softmax(-1)
        out[rows] = torch.einsum("thk,tkl->thl", probs, picked[..., :kv_lora_rank]).to(q.dtype)
    return out
