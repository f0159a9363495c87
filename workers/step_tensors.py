"""A step's device tensors and the host-side facts built with them (by ModelRunner._prepare),
read by the target forward, the sampler and the MTP proposer; and the one packed host buffer they
are built from.

Every per-token and per-sequence input of a step travels to the device as one int64 buffer in one
copy (pinned and asynchronous on CUDA), laid out by a `StepLayout`; the device tensors are views
of it. A decode graph's static inputs are such a buffer too, in its bucket's layout, so filling
them is that same one copy. `pack_step` builds the buffer for either layout from the StepInput's
lists with a handful of numpy calls per step, none per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from workers.attention_metadata import AttentionMetadata
from workers.batch import SeqWork


@dataclass
class StepTensors:
    seqs: list[SeqWork]
    block_tables: list[np.ndarray]  # each sequence's whole block table (int32), on the host
    input_ids: torch.Tensor  # [T], every scheduled token of every request, flattened
    meta: AttentionMetadata  # meta.block_tables: [num_seqs, width >= any table] int32, device
    offsets: list[int]  # first row of each request in the flattened batch
    logit_rows: list[int]  # rows whose logits are sampled: a verify's 1 + k, a last chunk's last
    graphable: bool  # a decode or verify step that its decode graph replays, q rows a sequence
    # The (rows, tokens per row-group) key of the decode graph that replays this step, or None
    # (eager): (num_seqs, q) for a decode/verify step, (num_tokens, 1) for any other step (prefill
    # chunks alone or beside decodes or verifies), whose tokens are rows of the q = 1 graph.
    graph_key: tuple[int, int] | None = None
    # q when every sequence samples all of its q tokens (decodes, or verifies of equal length:
    # workers.batch.verify_rows), else None
    verify_rows: int | None = None
    # Prompt tokens only (workers.batch.carries_only_prompts), enough of them that its FP8
    # matmuls take the w8a8 kernels (ModelRunner.w8a8_prompt_rows): the forward runs eagerly
    # inside kernels.ops.prompt_step
    w8a8_prompt_step: bool = False
    # The logit rows' argmax on the device, set by the forward (ModelRunner._forward)
    argmax_device: torch.Tensor | None = None
    argmax_copied: torch.cuda.Event | None = None  # its copy to the host done (CUDA)
    # The MTP proposal launched before the host's acceptance (MtpProposer.launch_early,
    # after_draws): its rows [num_seqs, k + 2] (drafts, then the drafts accepted and the token
    # it took; pinned on CUDA) and the event of their copy to the host (None on CPU)
    proposal: tuple[torch.Tensor, torch.cuda.Event | None] | None = None


@dataclass(frozen=True)
class StepLayout:
    """Where a step's inputs lie in one int64 buffer, in order: input ids, positions, cache
    slots and block-table rows (int64, `num_rows` each: the step's tokens, then padding rows),
    then the block tables (int32, [num_table_rows, table_width], two to an int64 element).

    Padding rows (a graph bucket's unused sequences and tokens) hold token 0 at position 0 with
    slot -1 (they write no cache), in table rows that are all zeros (the null block)."""

    num_rows: int  # >= the step's tokens
    num_table_rows: int  # >= the step's sequences
    table_width: int  # blocks per table row, >= the longest table

    @property
    def numel(self) -> int:
        return 4 * self.num_rows + -(-self.num_table_rows * self.table_width // 2)

    def views(self, flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """A packed buffer (host or device) -> (input_ids, positions, slot_mapping, seq_idx,
        block_tables [num_table_rows, table_width] int32), all views of it."""
        n = self.num_rows
        tables = flat[4 * n :].view(torch.int32)[: self.num_table_rows * self.table_width]
        rows = flat[: 4 * n].view(4, n)
        return (*rows, tables.view(self.num_table_rows, self.table_width))


def pack_step(
    seqs: list[SeqWork],
    block_size: int,
    layout: StepLayout,
    out: np.ndarray,
    tables: list[np.ndarray] | None = None,
) -> None:
    """Write the step's inputs into `out` (int64 [layout.numel]) in `layout`'s order.
    `tables`: each sequence's whole block table; None: each `SeqWork.block_ids` is its whole
    table (`block_table_start` 0).

    Token rows follow the sequences in order, each sequence's tokens at consecutive positions
    from its start_position; a token's slot is its block (from the sequence's table) times the
    block size plus its offset in the block."""
    n = layout.num_rows
    num_seqs = len(seqs)
    lens = [len(s.token_ids) for s in seqs]
    num_tokens = sum(lens)
    token_ids, positions, slots, seq_idx = out[: 4 * n].reshape(4, n)
    if tables is None:
        tables = [s.block_ids for s in seqs]
    rows = out[4 * n :].view(np.int32)[: layout.num_table_rows * layout.table_width]
    rows = rows.reshape(layout.num_table_rows, layout.table_width)
    rows.fill(0)
    for i, table in enumerate(tables):
        rows[i, : len(table)] = table
    token_ids[:num_tokens] = [t for s in seqs for t in s.token_ids]
    starts = np.array([s.start_position for s in seqs], dtype=np.int64)
    if num_tokens == num_seqs:  # one token each (plain decode)
        seq, pos = np.arange(num_seqs), starts
    else:  # a token's position: its row, shifted by its sequence's (start - first row)
        seq = np.repeat(np.arange(num_seqs), lens)
        first_rows = np.cumsum(lens) - lens
        pos = np.arange(num_tokens) + np.repeat(starts - first_rows, lens)
    seq_idx[:num_tokens], positions[:num_tokens] = seq, pos
    slots[:num_tokens] = rows[seq, pos // block_size].astype(np.int64) * block_size
    slots[:num_tokens] += pos % block_size
    if num_tokens < n:
        token_ids[num_tokens:] = 0
        positions[num_tokens:] = 0
        slots[num_tokens:] = -1
        # A graph bucket's padding sequences have as many rows as its real ones.
        rows_per_seq = n // layout.num_table_rows
        seq_idx[num_tokens:] = np.arange(num_tokens, n) // rows_per_seq
