"""Vocabulary-parallel embedding and LM head: each TP rank holds a contiguous slice of the vocab."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from parallel.collectives import tp_all_gather_last_dim, tp_all_reduce
from parallel.state import get_parallel_state


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype | None = None):
        super().__init__()
        state = get_parallel_state()
        self.tp_rank, self.tp_size = state.tp_rank, state.tp_size
        self.vocab_size = vocab_size
        self.vocab_per_rank = -(-vocab_size // self.tp_size)
        self.vocab_start = self.tp_rank * self.vocab_per_rank
        self.weight = nn.Parameter(torch.zeros(self.vocab_per_rank, hidden_size, dtype=dtype))
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
        if loaded.shape != (self.vocab_size, param.shape[1]):
            raise ValueError(
                f"expected {(self.vocab_size, param.shape[1])}, got {tuple(loaded.shape)}"
            )
        part = loaded[self.vocab_start : self.vocab_start + self.vocab_per_rank]
        param.data.zero_()
        param.data[: part.shape[0]].copy_(part)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        mask = (local < 0) | (local >= self.vocab_per_rank)
        y = F.embedding(local.clamp(0, self.vocab_per_rank - 1), self.weight)
        y = y.masked_fill(mask[:, None], 0)
        return tp_all_reduce(y)


class ParallelLMHead(VocabParallelEmbedding):
    """logits = h W^T over this rank's vocab slice, gathered to the full vocab on every rank."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, self.weight)
        if self.tp_size > 1:
            logits = tp_all_gather_last_dim(logits)
        return logits[..., : self.vocab_size]
