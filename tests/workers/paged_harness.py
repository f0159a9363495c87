"""A minimal paged-cache driver for model tests: sequences, block tables, mixed batches."""

from __future__ import annotations

import numpy as np
import torch

from workers.attention_metadata import AttentionMetadata, dense_spans
from workers.kv_cache import CacheFormat, allocate_kv_caches

BLOCK = 64


class PagedHarness:
    """Feeds a model mixed batches (any number of new tokens per sequence) over a paged cache."""

    def __init__(
        self,
        model,
        num_seqs: int,
        max_len: int,
        num_blocks: int | None = None,
        kv_cache_dtype: str = "auto",
    ):
        self.model = model
        blocks_per_seq = -(-max_len // BLOCK)
        num_blocks = num_blocks or num_seqs * blocks_per_seq + 1
        # The indexer's key cache is FP8 when the model scores with the FP8 numerics.
        numerics = "fp8" if model.model.layers[0].self_attn.indexer.fp8 else "exact"
        cache_format = CacheFormat.of(kv_cache_dtype, numerics)
        kv, idx = allocate_kv_caches(
            model.config, num_blocks, BLOCK, model.dtype, "cpu", cache_format=cache_format
        )
        model.bind_caches(kv, idx)
        # Interleave block ids across sequences so a sequence's blocks are not contiguous.
        ids = torch.randperm(num_blocks - 1, generator=torch.Generator().manual_seed(0)) + 1
        self.block_tables = ids[: num_seqs * blocks_per_seq].view(blocks_per_seq, num_seqs).t()
        self.block_tables = self.block_tables.to(torch.int32).contiguous()
        self.lengths = [0] * num_seqs

    def metadata(
        self, chunks: dict[int, int], dense: bool | set[int] | dict[int, int] = False
    ) -> AttentionMetadata:
        """chunks: seq -> number of new tokens this step (positions continue from its length).
        `dense`: spans for the dense attention path (`AttentionMetadata.dense`), as the model
        runner sets them for prompt tokens before index_topk: every sequence's (True), these
        sequences' or these sequences' first n tokens ({seq: n}), beside the other rows on the
        sparse path."""
        if dense is True or isinstance(dense, set):
            dense = {seq: chunks[seq] for seq in chunks if dense is True or seq in dense}
        dense = dense or {}
        picked = [seq for seq in chunks if seq in dense]
        first_rows = dict(zip(chunks, np.cumsum([0, *chunks.values()]).tolist(), strict=False))
        starts = [self.lengths[seq] for seq in picked]
        positions, seq_idx, slots = [], [], []
        for seq, n in chunks.items():
            for p in range(self.lengths[seq], self.lengths[seq] + n):
                positions.append(p)
                seq_idx.append(seq)
                slots.append(int(self.block_tables[seq, p // BLOCK]) * BLOCK + p % BLOCK)
        for seq, n in chunks.items():
            self.lengths[seq] += n
        return AttentionMetadata(
            positions=torch.tensor(positions),
            slot_mapping=torch.tensor(slots),
            seq_idx=torch.tensor(seq_idx),
            block_tables=self.block_tables,
            dense=dense_spans(
                starts,
                [dense[seq] for seq in picked],
                [self.block_tables[seq].tolist() for seq in picked],
                BLOCK,
                torch.device("cpu"),
                [first_rows[seq] for seq in picked],
                len(positions),
            )
            if picked
            else None,
        )
