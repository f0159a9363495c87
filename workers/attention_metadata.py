"""What one forward pass needs to read and write the paged caches.

The batch is flattened: prefill chunks and decode tokens of many sequences mix in one [T] axis,
each token carrying its own position and the block-table row of its sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    positions: torch.Tensor  # [T] int64, position of each token within its sequence
    slot_mapping: torch.Tensor  # [T] int64, flat cache slot to write each token's keys (-1: skip)
    seq_idx: torch.Tensor  # [T] int64, row of block_tables that holds the token's sequence
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32
    rope_cache: dict = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]
