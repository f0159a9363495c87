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
    """Tokens of a step that see no more positions than the indexer keeps (position <
    index_topk), each sequence's a run of its rows: each token's top-k is then every position
    up to its own, and its attention is dense and causal (`MLAAttention` runs it unabsorbed,
    with no indexer scoring).
    Sequence i's q_lens[i] tokens are its last of k_lens[i] positions 0..k_lens[i] - 1, whose
    cache slots are key_slots[cu_k[i]:cu_k[i + 1]]. `rows`: the step's rows these tokens are,
    in order, and `sparse_rows` the step's other rows (decodes, verifies, longer prompts' chunks:
    the sparse path's); both None when the sequences are the whole step."""

    q_lens: list[int]
    k_lens: list[int]
    cu_q: torch.Tensor  # int32 [N + 1]
    cu_k: torch.Tensor  # int32 [N + 1]
    key_slots: torch.Tensor  # int64 [sum(k_lens)]
    rows: torch.Tensor | None = None  # int64 [sum(q_lens)]
    sparse_rows: torch.Tensor | None = None  # int64 [T - sum(q_lens)]


def dense_prompts_on(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether prompt tokens before index_topk attend densely for a model on this device in
    this dtype (MTPSERVE_DENSE_PROMPTS). `auto` turns it on for the CPU in fp32 (its default).
    On CUDA it is verified (the flash path, and fp32 greedy equal to the CPU's) and faster
    (BENCHMARKS.md, session 45), but which path a prompt token takes depends on its step: a
    graph-replayed step (prompt rows beside decodes) and a step past `_dense_rows`' memory
    bound stay sparse. In 16 bits the two paths round differently, by as much as bf16 itself
    moves the tiny model's logprobs (up to 0.7 against fp32), so greedy output would depend on
    the schedule: graphs against eager, MTP on against off. In fp32 they agree to its last
    bits. `on` opts in where prefill speed matters more than that identity."""
    mode = settings().dense_prompts
    return mode == "on" or (mode == "auto" and device.type == "cpu" and dtype == torch.float32)


def dense_spans(
    starts: Sequence[int],
    lens: Sequence[int],
    tables: Sequence[Sequence[int]],
    block_size: int,
    device: torch.device,
    first_rows: Sequence[int] | None = None,
    num_rows: int | None = None,
) -> DenseSpans:
    """The spans of the sequences that compute lens[i] tokens from position starts[i], their
    blocks `tables[i]`; the index tensors built on the host and sent in one copy. `first_rows`:
    each one's first row in a step of `num_rows` rows that holds other rows too, in the step's
    order (its tokens there from that row on; None: these sequences are the whole step, in
    order)."""
    k_lens = [start + n for start, n in zip(starts, lens, strict=True)]
    num_seqs, num_dense = len(lens), sum(lens)
    mixed = first_rows is not None and num_rows is not None and num_rows > num_dense
    head = 2 * (num_seqs + 1)
    host = np.zeros(head + sum(k_lens) + (num_rows if mixed else 0), dtype=np.int64)
    host[1 : num_seqs + 1] = np.cumsum(lens)
    host[num_seqs + 2 : head] = np.cumsum(k_lens)
    slots, at = host[head : head + sum(k_lens)], 0
    for table, m in zip(tables, k_lens, strict=True):
        pos = np.arange(m)
        slots[at : at + m] = np.asarray(table, dtype=np.int64)[pos // block_size] * block_size
        slots[at : at + m] += pos % block_size
        at += m
    if mixed:  # the dense rows, then the others, each in the step's order
        dense = np.zeros(num_rows, dtype=bool)
        for first, n in zip(first_rows, lens, strict=True):
            dense[first : first + n] = True
        order = host[head + sum(k_lens) :]
        order[:num_dense] = np.flatnonzero(dense)
        order[num_dense:] = np.flatnonzero(~dense)
    pinned = device.type == "cuda"
    sent = torch.from_numpy(host)
    sent = (sent.pin_memory() if pinned else sent).to(device, non_blocking=pinned)
    cu = sent[:head].to(torch.int32)
    key_slots = sent[head : head + sum(k_lens)]
    spans = DenseSpans(list(lens), k_lens, cu[: num_seqs + 1], cu[num_seqs + 1 :], key_slots)
    if mixed:
        order = sent[head + sum(k_lens) :]
        spans.rows, spans.sparse_rows = order[:num_dense], order[num_dense:]
    return spans


@dataclass
class AttentionMetadata:
    positions: torch.Tensor  # [T] int64, position of each token within its sequence
    slot_mapping: torch.Tensor  # [T] int64, flat cache slot to write each token's keys (-1: skip)
    seq_idx: torch.Tensor  # [T] int64, row of block_tables that holds the token's sequence
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32
    rope_cache: dict = field(default_factory=dict)
    # Set by the model runner for an eager step that holds prompt tokens before index_topk:
    # the model's attention layers take the dense path for those rows (see DenseSpans).
    dense: DenseSpans | None = None

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]
