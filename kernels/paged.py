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


# Tokens of one sequence in a row from which a twin reads that sequence's cache rows once for all
# of them (prompt chunks); shorter runs (decodes, verifies) are gathered per token, all at once.
RUN_MIN_TOKENS = 8


def sequence_runs(
    seq_idx: torch.Tensor, min_tokens: int = RUN_MIN_TOKENS
) -> tuple[list[slice], slice | torch.Tensor]:
    """The step's runs of at least `min_tokens` consecutive tokens of one sequence, and its
    other tokens: a slice of them all where there is no run (a decode step: views, no index
    built), else their indices (int64)."""
    num_tokens = seq_idx.numel()
    if num_tokens < min_tokens:
        return [], slice(0, num_tokens)
    _, counts = torch.unique_consecutive(seq_idx, return_counts=True)
    if int(counts.max()) < min_tokens:
        return [], slice(0, num_tokens)
    runs, rest, start = [], [], 0
    for n in counts.tolist():
        if n >= min_tokens:
            runs.append(slice(start, start + n))
        else:
            rest.extend(range(start, start + n))
        start += n
    return runs, torch.tensor(rest, dtype=torch.long, device=seq_idx.device)


def row_chunks(rows: slice | torch.Tensor, elements_per_token: int) -> list[slice | torch.Tensor]:
    """`rows` (a slice, or indices) in consecutive parts within GATHER_BUDGET_ELEMENTS."""
    if isinstance(rows, slice):
        parts = token_chunks(rows.stop - rows.start, elements_per_token)
        return [slice(rows.start + p.start, rows.start + p.stop) for p in parts]
    return [rows[p] for p in token_chunks(rows.numel(), elements_per_token)]
