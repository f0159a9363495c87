"""Routed experts as one grouped matmul over the tokens each expert received."""

from __future__ import annotations

import torch

from kernels.activation import silu_and_mul_reference


def grouped_moe_reference(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    first_expert: int = 0,
) -> torch.Tensor:
    """sum_k topk_weights[t, k] * expert_{ids[t, k]}(x[t]) over the experts held here.

    x [T, hidden], w13 [E_local, 2 * I, hidden] ([gate | up]), w2 [E_local, hidden, I].
    This rank holds experts first_expert .. first_expert + E_local - 1; routes to others
    contribute nothing (expert parallelism sums the ranks' partial outputs).
    """
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)
    local_ids = topk_ids.long() - first_expert
    for e in local_ids.unique().tolist():
        if e < 0 or e >= w13.shape[0]:
            continue
        token, slot = (local_ids == e).nonzero(as_tuple=True)
        h = silu_and_mul_reference(x[token] @ w13[e].t())
        y = (h @ w2[e].t()).float() * topk_weights[token, slot, None].float()
        out.index_add_(0, token, y)
    return out.to(x.dtype)
