"""Helpers shared by the reference twins that read paged caches."""

from __future__ import annotations

import torch


def gather_positions(
    cache: torch.Tensor, block_table_row: torch.Tensor, num_positions: int
) -> torch.Tensor:
    """Rows of positions 0..num_positions-1 of one sequence: [num_positions, width]."""
    block_size = cache.shape[1]
    positions = torch.arange(num_positions, device=cache.device)
    blocks = block_table_row[positions // block_size].long()
    return cache[blocks, positions % block_size]
