"""Helpers shared by the reference twins that read paged caches."""

from __future__ import annotations

import torch

# Elements a twin materializes per chunk of tokens (64 MiB of fp32): bounds the memory of long
# prefills while a decode batch runs as one chunk.
GATHER_BUDGET_ELEMENTS = 2**24


def token_chunks(num_tokens: int, elements_per_token: int) -> list[slice]:
    """Consecutive token ranges whose gathered rows stay within GATHER_BUDGET_ELEMENTS."""
    step = max(1, GATHER_BUDGET_ELEMENTS // max(1, elements_per_token))
    return [slice(i, min(i + step, num_tokens)) for i in range(0, num_tokens, step)]


def gather_token_rows(
    cache: torch.Tensor, block_tables: torch.Tensor, seq_idx: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """cache rows at positions [T, K] of each token's sequence (seq_idx [T]): [T, K, width]."""
    block_size = cache.shape[1]
    blocks = block_tables.long()[seq_idx[:, None], positions // block_size]
    return cache[blocks, positions % block_size]
