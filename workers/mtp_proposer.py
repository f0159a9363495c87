"""The MTP layer's proposal for the next round: draft step 0, then steps 1..k-1.

`draft_chain` is pure device work with no host sync, so the same code runs eagerly and inside a
CUDA graph (workers.cuda_graph.ProposeGraphs). Step 0 runs over every newly known (h_i, t_{i+1})
pair; each request's last accepted token's row gives draft 1; steps 1..k-1 feed the MTP layer its
own output after shared_head.norm, one token per request.
"""

from __future__ import annotations

import torch

from workers.attention_metadata import AttentionMetadata
from workers.topk_share import DraftTopkShare


def draft_chain(
    model,
    topk_share: DraftTopkShare,
    pair_tokens: torch.Tensor,  # [P] t_{i+1} of each pair
    pair_hidden: torch.Tensor,  # [P, hidden] target hidden h_i (after the final norm)
    pair_meta: AttentionMetadata,  # positions i, slots, block-table rows of the pairs
    last_idx: torch.Tensor,  # [R] row of each request's last accepted token among the pairs
    valid: torch.Tensor,  # [R] bool; False for padded requests (they write no cache slot)
    num_drafts: int,
    share_topk: bool,
) -> torch.Tensor:
    """-> draft token ids [R, num_drafts]."""
    with topk_share.prefill(share_topk):
        mtp_hidden = model.mtp_forward(pair_tokens, pair_hidden, pair_meta)
        shared_rows = topk_share.keep_rows(pair_meta, last_idx)
    g = mtp_hidden.index_select(0, last_idx)  # [R, hidden]
    drafts = [model.mtp_logits(g).argmax(-1)]
    base = pair_meta.positions.index_select(0, last_idx)  # [R] position of the last accepted
    seq_idx = pair_meta.seq_idx.index_select(0, last_idx)
    tables = pair_meta.block_tables
    block = model.kv_caches[0].shape[1]
    with topk_share.multi_step_decode(share_topk, shared_rows):
        for j in range(1, num_drafts):
            positions = base + j
            slots = tables[seq_idx, positions // block].long() * block + positions % block
            meta = AttentionMetadata(positions, torch.where(valid, slots, -1), seq_idx, tables)
            meta.shared_topk = topk_share.rows_for_step(j, positions)
            g = model.mtp_forward(drafts[-1], g, meta)
            drafts.append(model.mtp_logits(g).argmax(-1))
    return torch.stack(drafts, 1)
