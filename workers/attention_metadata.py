"""What one forward pass needs to read and write the paged caches.

The batch is flattened: prefill chunks and decode tokens of many sequences mix in one [T] axis,
each token carrying its own position and the block-table row of its sequence.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from kernels.settings import settings


@dataclass
class DenseSpans:
    """A step whose every token sees no more positions than the indexer keeps (position <
    index_topk): each token's top-k is then every position up to its own, and the attention is
    dense and causal (`MLAAttention` runs it unabsorbed, with no indexer scoring). Sequence i's
    q_lens[i] tokens are its last of k_lens[i] positions 0..k_lens[i] - 1, whose cache slots
    are key_slots[cu_k[i]:cu_k[i + 1]]."""

    q_lens: list[int]
    k_lens: list[int]
    cu_q: torch.Tensor  # int32 [N + 1]
    cu_k: torch.Tensor  # int32 [N + 1]
    key_slots: torch.Tensor  # int64 [sum(k_lens)]


def dense_prompts_on(device: torch.device) -> bool:
    """Whether prompt steps before index_topk attend densely on this device by default
    (MTPSERVE_DENSE_PROMPTS): `auto` where the dense path is verified, the CPU. On CUDA it
    runs PyTorch's flash-attention kernel, not yet measured on a GPU here: `on` there opts in."""
    mode = settings().dense_prompts
    return mode == "on" or (mode == "auto" and device.type == "cpu")


def dense_spans(
    starts: Sequence[int],
    lens: Sequence[int],
    tables: Sequence[Sequence[int]],
    block_size: int,
    device: torch.device,
) -> DenseSpans:
    """The spans of a step whose sequence i computes lens[i] tokens from position starts[i], its
    blocks `tables[i]`; the index tensors built on the host and sent in one copy."""
    k_lens = [start + n for start, n in zip(starts, lens, strict=True)]
    num_seqs = len(lens)
    host = np.zeros(2 * (num_seqs + 1) + sum(k_lens), dtype=np.int64)
    host[1 : num_seqs + 1] = np.cumsum(lens)
    host[num_seqs + 2 : 2 * num_seqs + 2] = np.cumsum(k_lens)
    slots, at = host[2 * (num_seqs + 1) :], 0
    for table, m in zip(tables, k_lens, strict=True):
        pos = np.arange(m)
        slots[at : at + m] = np.asarray(table, dtype=np.int64)[pos // block_size] * block_size
        slots[at : at + m] += pos % block_size
        at += m
    pinned = device.type == "cuda"
    sent = torch.from_numpy(host)
    sent = (sent.pin_memory() if pinned else sent).to(device, non_blocking=pinned)
    cu = sent[: 2 * (num_seqs + 1)].to(torch.int32)
    return DenseSpans(
        list(lens), k_lens, cu[: num_seqs + 1], cu[num_seqs + 1 :], sent[2 * (num_seqs + 1) :]
    )


@dataclass
class AttentionMetadata:
    positions: torch.Tensor  # [T] int64, position of each token within its sequence
    slot_mapping: torch.Tensor  # [T] int64, flat cache slot to write each token's keys (-1: skip)
    seq_idx: torch.Tensor  # [T] int64, row of block_tables that holds the token's sequence
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32
    rope_cache: dict = field(default_factory=dict)
    # Set by the model runner for an eager step of prompt tokens that all lie before
    # index_topk: the model's attention layers then take the dense path (see DenseSpans).
    dense: DenseSpans | None = None

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]
