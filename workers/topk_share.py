"""Sharing the MTP indexer's top-k across the draft steps of one proposal (opt-in).

Draft step 0 runs the MTP layer's own indexer; the row of each request's last accepted token is
compacted to the front of a buffer; steps 1..k-1 skip the indexer entirely and attend to that row
plus the draft positions written since (the step's own token included), which the indexer would
have had to consider. With at most index_topk tokens in context the result equals running the
indexer each step; past it, drafts may differ (verification keeps the output exact either way).

Lifecycle: `prefill()` wraps draft step 0 (on_prefill_begin/end), `multi_step_decode()` wraps
steps 1..k-1 (on_multi_step_decode_begin/end). Each resets its flag on exit unconditionally, so
a failed step never leaves sharing on, and the same flags hold at CUDA-graph capture and replay.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from workers.attention_metadata import AttentionMetadata


class DraftTopkShare:
    def __init__(self) -> None:
        self.capturing = False  # between on_prefill_begin and on_prefill_end
        self.sharing = False  # between on_multi_step_decode_begin and _end
        self.rows: torch.Tensor | None = None  # [R, index_topk], compacted

    def on_prefill_begin(self, enabled: bool) -> None:
        self.capturing = enabled
        self.rows = None

    def on_prefill_end(self) -> None:
        self.capturing = False

    def on_multi_step_decode_begin(self, enabled: bool, rows: torch.Tensor | None) -> None:
        self.sharing = enabled and rows is not None
        self.rows = rows if self.sharing else None

    def on_multi_step_decode_end(self) -> None:
        self.sharing = False
        self.rows = None

    @contextmanager
    def prefill(self, enabled: bool):
        self.on_prefill_begin(enabled)
        try:
            yield
        finally:
            self.on_prefill_end()

    @contextmanager
    def multi_step_decode(self, enabled: bool, rows: torch.Tensor | None):
        self.on_multi_step_decode_begin(enabled, rows)
        try:
            yield
        finally:
            self.on_multi_step_decode_end()

    def keep_rows(self, meta: AttentionMetadata, last_rows) -> torch.Tensor | None:
        """Compact the step-0 top-k rows of the requests' last accepted tokens (`last_rows`, a
        list or a device tensor of row indices) to the front: [R, index_topk]."""
        if not self.capturing or meta.computed_topk is None:
            return None
        index = torch.as_tensor(last_rows, device=meta.computed_topk.device)
        return meta.computed_topk.index_select(0, index).contiguous()

    def rows_for_step(self, step: int, positions: torch.Tensor) -> torch.Tensor | None:
        """Top-k for draft step `step` (>= 1) at `positions` [R]: the shared row + new positions."""
        if not self.sharing:
            return None
        # positions - step + 1 .. positions: the draft positions written since step 0's row.
        recent = positions[:, None] - torch.arange(step - 1, -1, -1, device=positions.device)
        return torch.cat([self.rows, recent.to(self.rows.dtype)], dim=1)
