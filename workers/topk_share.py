"""Sharing the MTP indexer's top-k across the draft steps of one proposal (opt-in): two pure
functions, used by `workers.mtp_proposer.draft_chain` eagerly and inside CUDA graphs alike.

Draft step 0 runs the MTP layer's own indexer; `keep_rows` keeps the row of each request's last
accepted token; steps 1..k-1 skip the indexer entirely and attend to that row plus the draft
positions written since (the step's own token included), which the indexer would have had to
consider (`rows_for_step`). With at most index_topk tokens in context the result equals running
the indexer each step; past it, drafts may differ (verification keeps the output exact either
way). The target's own top-k is never reused for drafts (that collapses acceptance).

There is no state to set or reset: whether a proposal shares is an argument of the proposal
(and part of its CUDA graph's key), so capture and replay cannot disagree.
"""

from __future__ import annotations

import torch


def keep_rows(step0_topk: torch.Tensor, last_rows: torch.Tensor) -> torch.Tensor:
    """Draft step 0's top-k rows [P, K] -> the rows of the requests' last accepted tokens,
    compacted to the front: [R, K]."""
    return step0_topk.index_select(0, last_rows).contiguous()


def rows_for_step(kept: torch.Tensor, step: int, positions: torch.Tensor) -> torch.Tensor:
    """Top-k for draft step `step` (>= 1) at `positions` [R]: the kept row + new positions,
    [R, K + step]."""
    # positions - step + 1 .. positions: the draft positions written since step 0's row.
    recent = positions[:, None] - torch.arange(step - 1, -1, -1, device=positions.device)
    return torch.cat([kept, recent.to(kept.dtype)], dim=1)
