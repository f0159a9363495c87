"""CUDA graphs for decode steps: the target forward plus its logits, replayed per step.

Decode of these models is a long chain of small kernels; a graph removes the launch overhead and
is where PDL pays (DESIGN.md: -26% per tiny kernel inside a graph, nothing outside one). A graph
is keyed by (batch bucket, tokens per sequence): a verify step has 1 + k tokens per sequence, a
plain decode 1. Padded sequences point at the block manager's null block 0 and write no cache
slot (slot -1), so they never touch a live request's KV.
"""

from __future__ import annotations

import bisect

import torch

from workers.attention_metadata import AttentionMetadata

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


class DecodeGraphs:
    def __init__(self, model, max_batch: int, max_blocks_per_seq: int, device: torch.device):
        self.model = model
        self.device = device
        self.buckets = [b for b in BATCH_BUCKETS if b < max_batch] + [max_batch]
        self.max_batch = max_batch
        self.max_blocks_per_seq = max_blocks_per_seq
        self.pool = None
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, dict, tuple]] = {}

    def bucket(self, num_seqs: int) -> int | None:
        i = bisect.bisect_left(self.buckets, num_seqs)
        return self.buckets[i] if i < len(self.buckets) else None

    def _buffers(self, batch: int, tokens_per_seq: int) -> dict:
        n = batch * tokens_per_seq
        return dict(
            input_ids=torch.zeros(n, dtype=torch.long, device=self.device),
            positions=torch.zeros(n, dtype=torch.long, device=self.device),
            slot_mapping=torch.full((n,), -1, dtype=torch.long, device=self.device),
            seq_idx=torch.arange(batch, device=self.device).repeat_interleave(tokens_per_seq),
            block_tables=torch.zeros(batch, self.max_blocks_per_seq, dtype=torch.int32,
                                     device=self.device),
        )

    def _forward(self, buf: dict) -> tuple[torch.Tensor, torch.Tensor]:
        meta = AttentionMetadata(buf["positions"], buf["slot_mapping"], buf["seq_idx"],
                                 buf["block_tables"])
        hidden = self.model(buf["input_ids"], meta)
        return hidden, self.model.compute_logits(hidden)  # logits stay fp32

    def capture(self, batch: int, tokens_per_seq: int) -> None:
        buf = self._buffers(batch, tokens_per_seq)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up: compile every Triton variant outside the capture
                self._forward(buf)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self._forward(buf)
        self.pool = graph.pool()
        self.graphs[(batch, tokens_per_seq)] = (graph, buf, out)

    def run(
        self,
        input_ids: torch.Tensor,  # [B * q]
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,  # [B, width <= max_blocks_per_seq]
        tokens_per_seq: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (hidden [B * q, hidden], logits [B * q, vocab]) for the real rows."""
        num_seqs = block_tables.shape[0]
        batch = self.bucket(num_seqs)
        key = (batch, tokens_per_seq)
        if key not in self.graphs:
            self.capture(batch, tokens_per_seq)
        graph, buf, out = self.graphs[key]
        n = num_seqs * tokens_per_seq
        buf["input_ids"][:n].copy_(input_ids)
        buf["positions"][:n].copy_(positions)
        buf["positions"][n:].zero_()
        buf["slot_mapping"][:n].copy_(slot_mapping)
        buf["slot_mapping"][n:].fill_(-1)
        buf["block_tables"].zero_()
        buf["block_tables"][:num_seqs, : block_tables.shape[1]].copy_(block_tables)
        graph.replay()
        hidden, logits = out
        return hidden[:n], logits[:n]
