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
            block_tables=torch.zeros(
                batch, self.max_blocks_per_seq, dtype=torch.int32, device=self.device
            ),
        )

    def _forward(self, buf: dict) -> tuple[torch.Tensor, torch.Tensor]:
        meta = AttentionMetadata(
            buf["positions"], buf["slot_mapping"], buf["seq_idx"], buf["block_tables"]
        )
        hidden = self.model(buf["input_ids"], meta)
        return hidden, self.model.compute_logits(hidden)  # logits stay fp32

    def capture_graph(self, forward) -> tuple[torch.cuda.CUDAGraph, object]:
        """Warm `forward` up on a side stream (every Triton variant compiled outside the
        capture), then capture it into a graph sharing this runner's memory pool."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                forward()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = forward()
        self.pool = graph.pool()
        return graph, out

    def capture(self, batch: int, tokens_per_seq: int) -> None:
        buf = self._buffers(batch, tokens_per_seq)
        graph, out = self.capture_graph(lambda: self._forward(buf))
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


class ProposeGraphs:
    """CUDA graphs of a whole MTP proposal after a verify step: draft step 0 over k + 1 pair
    rows per request, then steps 1..k-1 (workers.mtp_proposer.draft_chain), keyed by (batch
    bucket, k, top-k sharing). Rows of pairs a request does not have write no cache slot."""

    def __init__(self, model, decode_graphs: DecodeGraphs):
        self.model = model
        self.decode = decode_graphs
        self.device = decode_graphs.device
        self.graphs: dict[
            tuple[int, int, bool], tuple[torch.cuda.CUDAGraph, dict, torch.Tensor]
        ] = {}

    def _buffers(self, batch: int, k: int) -> dict:
        rows = batch * (k + 1)
        hidden = self.model.config.hidden_size
        d = self.device
        return dict(
            tokens=torch.zeros(rows, dtype=torch.long, device=d),
            hidden=torch.zeros(rows, hidden, dtype=self.model.dtype, device=d),
            positions=torch.zeros(rows, dtype=torch.long, device=d),
            slot_mapping=torch.full((rows,), -1, dtype=torch.long, device=d),
            seq_idx=torch.arange(batch, device=d).repeat_interleave(k + 1),
            block_tables=torch.zeros(
                batch, self.decode.max_blocks_per_seq, dtype=torch.int32, device=d
            ),
            last_rows=torch.arange(batch, device=d) * (k + 1),
            valid=torch.zeros(batch, dtype=torch.bool, device=d),
        )

    def _forward(self, buf: dict, k: int, share: bool) -> torch.Tensor:
        from workers.mtp_proposer import DraftInputs, draft_chain

        meta = AttentionMetadata(
            buf["positions"], buf["slot_mapping"], buf["seq_idx"], buf["block_tables"]
        )
        inputs = DraftInputs(buf["tokens"], buf["hidden"], meta, buf["last_rows"], buf["valid"])
        return draft_chain(self.model, inputs, k, share)

    def _capture(self, batch: int, k: int, share: bool) -> None:
        buf = self._buffers(batch, k)
        graph, out = self.decode.capture_graph(lambda: self._forward(buf, k, share))
        self.graphs[(batch, k, share)] = (graph, buf, out)

    def run(
        self,
        pairs,  # workers.mtp_proposer.DraftPairs, padded to k + 1 rows per request
        hidden: torch.Tensor,  # the verify step's target hidden states
        block_tables: torch.Tensor,  # [R, width]
        k: int,
        share: bool,
    ) -> torch.Tensor:
        """-> drafts [R, k] (device)."""
        num_seqs = block_tables.shape[0]
        batch = self.decode.bucket(num_seqs)
        key = (batch, k, share)
        if key not in self.graphs:
            self._capture(batch, k, share)
        graph, buf, out = self.graphs[key]
        n = num_seqs * (k + 1)
        assert len(pairs.tokens) == n and not pairs.pending_hidden
        host = torch.tensor(
            [pairs.tokens, pairs.hidden_rows, pairs.positions, pairs.slots], dtype=torch.long
        )
        host = host.to(self.device, non_blocking=True)
        buf["tokens"][:n].copy_(host[0])
        buf["hidden"][:n].copy_(hidden.index_select(0, host[1]))
        buf["positions"][:n].copy_(host[2])
        buf["slot_mapping"][:n].copy_(host[3])
        buf["slot_mapping"][n:].fill_(-1)
        buf["block_tables"].zero_()
        buf["block_tables"][:num_seqs, : block_tables.shape[1]].copy_(block_tables)
        buf["last_rows"][:num_seqs].copy_(torch.tensor(pairs.last_rows, device=self.device))
        buf["valid"].zero_()
        buf["valid"][:num_seqs] = True
        graph.replay()
        return out[:num_seqs]
