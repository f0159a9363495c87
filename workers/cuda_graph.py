"""CUDA graphs for decode steps: the target forward plus its logits, replayed per step.

Decode of these models is a long chain of small kernels; a graph removes the launch overhead and
is where PDL pays (DESIGN.md: -26% per tiny kernel inside a graph, nothing outside one). A graph
is keyed by (batch bucket, tokens per sequence): a verify step has 1 + k tokens per sequence, a
plain decode 1. Padded sequences point at the block manager's null block 0 and write no cache
slot (slot -1), so they never touch a live request's KV. A step that prefills replays the q = 1
graph too, every token a row (ModelRunner._graph_key says why that is the same forward), and
with MTP the proposal after it replays a rows graph of its own (`ProposeGraphs.run_rows`): q = 1
graphs come in row buckets up to `max_rows`, past the decode steps' `max_batch`, so that a
prompt arriving beside a full batch of decodes still replays a graph.
"""

from __future__ import annotations

import bisect
import contextlib
from typing import NamedTuple

import torch

from kernels import ops
from workers.attention_metadata import AttentionMetadata
from workers.sampler import noise_width, num_candidates, padding_settings, sample_rows
from workers.step_tensors import StepLayout, pack_step

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)


class _StepViews(NamedTuple):
    graph: torch.cuda.CUDAGraph
    inputs: torch.Tensor  # the static packed inputs (workers.step_tensors.StepLayout)
    real_inputs: tuple  # (input_ids, positions, slot_mapping, seq_idx, block_tables): real rows
    outputs: tuple  # (hidden, logits, argmax) of the real rows


class DecodeGraphs:
    def __init__(
        self,
        model,
        max_batch: int,
        max_blocks_per_seq: int,
        device: torch.device,
        max_rows: int = 0,  # rows of the largest q = 1 graph; at least max_batch
    ):
        self.model = model
        self.device = device
        self.buckets = [b for b in BATCH_BUCKETS if b < max_batch] + [max_batch]
        self.max_batch = max_batch
        self.max_rows = max(max_rows, max_batch)
        # q = 1: the decode buckets, then more rows for steps that prefill (the same buckets
        # below max_batch, so a decode step's graph does not depend on max_rows)
        self.row_buckets = self.buckets + [
            b for b in BATCH_BUCKETS if max_batch < b < self.max_rows
        ]
        if self.max_rows > max_batch:
            self.row_buckets.append(self.max_rows)
        self.max_blocks_per_seq = max_blocks_per_seq
        # The memory pool of the graphs captured by the warm-up (`shared_pool`); None: each
        # graph captured outside it gets a pool of its own.
        self.pool = None
        self._sharing = False
        # (bucket, tokens per sequence) -> (graph, static packed inputs, (hidden, logits, argmax))
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor, tuple]] = {}
        self._steps: dict[tuple[int, int], _StepViews] = {}  # (num_seqs, tokens per sequence)

    def bucket(self, num_seqs: int, tokens_per_seq: int = 0) -> int | None:
        """The graph batch that runs `num_seqs` sequences (rows, for q = 1), None past the
        largest. tokens_per_seq 0: the decode buckets (the MTP proposal's)."""
        buckets = self.row_buckets if tokens_per_seq == 1 else self.buckets
        i = bisect.bisect_left(buckets, num_seqs)
        return buckets[i] if i < len(buckets) else None

    def layout(self, num_seqs: int, tokens_per_seq: int) -> StepLayout:
        """The packed inputs' layout of the graph that runs `num_seqs` sequences: its bucket's."""
        batch = self.bucket(num_seqs, tokens_per_seq)
        return StepLayout(batch * tokens_per_seq, batch, self.max_blocks_per_seq)

    def _forward(self, layout: StepLayout, inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        input_ids, positions, slots, seq_idx, tables = layout.views(inputs)
        hidden = self.model(input_ids, AttentionMetadata(positions, slots, seq_idx, tables))
        logits = self.model.compute_logits(hidden)  # logits stay fp32
        # The argmax of every row in the graph too: exact (ties go to the lowest index, in any
        # reduction order), and one kernel launch less per step on the host.
        return hidden, logits, ops.argmax(logits)

    @contextlib.contextmanager
    def shared_pool(self):
        """Graphs captured inside share one memory pool (the warm-up's: their intermediates
        take the same memory once). A graph's capture may then place its outputs where a graph
        captured before it keeps its intermediates, so its outputs are safe only until a graph
        captured before it replays: the warm-up captures in an order where every step replays
        its graphs in capture order (`workers.worker.warm_up_keys`, the sampler's last) and the
        work behind a draw reads the draw's results from the host (`sample_batch`). A graph
        captured on first use after that (a verify of fewer drafts near max_tokens, then the
        sampler in the same step) gets a pool of its own: nothing can overwrite its outputs
        and it overwrites nothing."""
        self._sharing = True
        try:
            yield
        finally:
            self._sharing = False

    def capture_graph(self, forward) -> tuple[torch.cuda.CUDAGraph, object]:
        """Warm `forward` up on a side stream (every Triton variant compiled outside the
        capture), then capture it into a graph: in the shared pool inside `shared_pool`, else
        in a pool of its own."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                forward()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool if self._sharing else None):
            out = forward()
        if self._sharing:
            self.pool = graph.pool()
        return graph, out

    def _static_inputs(self, batch: int, tokens_per_seq: int) -> tuple[StepLayout, torch.Tensor]:
        """A bucket's static packed inputs (device), every row padding until a step's load."""
        layout = StepLayout(batch * tokens_per_seq, batch, self.max_blocks_per_seq)
        host = torch.zeros(layout.numel, dtype=torch.long)
        pack_step([], 1, layout, host.numpy())  # no sequence: every row is padding
        return layout, host.to(self.device)

    def capture(self, batch: int, tokens_per_seq: int) -> None:
        layout, inputs = self._static_inputs(batch, tokens_per_seq)
        graph, out = self.capture_graph(lambda: self._forward(layout, inputs))
        self.graphs[(batch, tokens_per_seq)] = (graph, inputs, out)
        self._steps.clear()

    def _step(self, num_seqs: int, tokens_per_seq: int) -> _StepViews:
        """The graph that runs this shape (captured now if new) and views of its real rows,
        made once per shape: slicing tensors every step costs the host microseconds."""
        views = self._steps.get((num_seqs, tokens_per_seq))
        if views is None:
            key = (self.bucket(num_seqs, tokens_per_seq), tokens_per_seq)
            if key not in self.graphs:
                self.capture(*key)
            graph, inputs, out = self.graphs[key]
            n = num_seqs * tokens_per_seq
            input_ids, positions, slots, seq_idx, tables = self.layout(*key).views(inputs)
            real_inputs = (input_ids[:n], positions[:n], slots[:n], seq_idx[:n], tables[:num_seqs])
            views = _StepViews(graph, inputs, real_inputs, tuple(t[:n] for t in out))
            self._steps[(num_seqs, tokens_per_seq)] = views
        return views

    def load(self, host: torch.Tensor, num_seqs: int, tokens_per_seq: int) -> tuple:
        """Copy a step's packed inputs (`host`, in `layout(num_seqs, tokens_per_seq)`; pinned on
        CUDA) into the graph's static inputs in one copy -> views of them for the real rows:
        (input_ids, positions, slot_mapping, seq_idx, block_tables), valid until the next load
        of this graph."""
        step = self._step(num_seqs, tokens_per_seq)
        step.inputs.copy_(host, non_blocking=True)
        return step.real_inputs

    def replay(self, num_seqs: int, tokens_per_seq: int) -> tuple[torch.Tensor, ...]:
        """Replay the graph last loaded for this shape -> (hidden [n, hidden], logits [n, vocab],
        argmax [n]) of the real rows, n = num_seqs * tokens_per_seq."""
        step = self._steps[(num_seqs, tokens_per_seq)]
        step.graph.replay()
        return step.outputs


class SamplerGraphs:
    """CUDA graphs of the batched sampler's device work (`workers.sampler.sample_rows`), keyed by
    (row bucket, whether any row truncates): eagerly it is ~25 small launches a sampled step
    (temperature, top-k / top-p by a sort or among candidates, softmax, cumulative sums, the
    draft's acceptance, the draw), each host time on a busy node; replayed it is one. The static
    inputs are the rows' logits, their settings and the step's noise (filled before the
    replay, so that a seeded request's noise still comes from its own generator); rows past
    a step's are padding, finite logits with no draft, whose draws are never read. Buckets are
    powers of two up to `max_rows`; a step with more rows samples eagerly."""

    def __init__(
        self, decode: DecodeGraphs, vocab: int, max_rows: int, candidates: int | None = None
    ):
        self.decode = decode
        self.buckets = [b for b in (1 << i for i in range(16)) if b < max_rows] + [max_rows]
        device = decode.device
        # Top-k / top-p among this many candidates (`workers.sampler.candidate_probs`; 0: the
        # sort). Default: the device's `num_candidates`, as the eager sampler takes it.
        self.candidates = num_candidates(vocab, device) if candidates is None else candidates
        # The buckets share one buffer of logits and one of noise (a bucket's rows are a
        # prefix of them): [max_rows, V] and [max_rows, `noise_width`] fp32.
        self._logits = torch.zeros(max_rows, vocab, device=device)
        self._noise = torch.ones(max_rows, noise_width(vocab, device), device=device)
        padding = torch.tensor(padding_settings(vocab), dtype=torch.float64, device=device)
        self._settings = {b: padding[:, None].repeat(1, b) for b in self.buckets}
        self.graphs: dict[tuple[int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def bucket(self, num_rows: int) -> int | None:
        i = bisect.bisect_left(self.buckets, num_rows)
        return self.buckets[i] if i < len(self.buckets) else None

    def logits(self, num_rows: int) -> torch.Tensor:
        """The static logits of the first `num_rows` rows: the caller gathers a step's into it."""
        return self._logits[:num_rows]

    def inputs(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A bucket's static settings [4, size] and noise [size, `noise_width`]."""
        return self._settings[size], self._noise[:size]

    def keys(self) -> list[tuple[int, bool]]:
        return [(b, truncates) for b in self.buckets for truncates in (False, True)]

    def capture(self, size: int, truncates: bool) -> None:
        settings, noise = self.inputs(size)
        logits = self._logits[:size]
        graph, out = self.decode.capture_graph(
            lambda: sample_rows(logits, settings, noise, truncates, self.candidates or None)
        )
        self.graphs[(size, truncates)] = (graph, out)

    def replay(self, size: int, truncates: bool) -> torch.Tensor:
        """-> [3, size] long (`sample_rows`) for the inputs last loaded into the bucket."""
        if (size, truncates) not in self.graphs:
            self.capture(size, truncates)
        graph, out = self.graphs[(size, truncates)]
        graph.replay()
        return out


class ProposeGraphs:
    """CUDA graphs of a whole MTP proposal (workers.mtp_proposer.draft_chain): draft step 0
    over the step's pair rows, then steps 1..k-1.

    After a step of verifies only (`run`): the pair rows are built inside the graph
    (`verify_pairs`) from the static inputs and outputs of the verify's own graph, keyed by
    (batch bucket, q, k, top-k sharing) with q the verify's rows per request; its one input is
    each request's acceptance ([2, bucket]: drafts accepted and token, -1 where the argmax
    decides). After any other step whose target ran as rows of a q = 1 graph (prompts arriving
    beside verifies, `run_rows`): any pair rows, each with its own request's block-table row,
    keyed by (row bucket, k, sharing); up to max_batch requests draft from them (padding rows
    draft nothing and write nothing)."""

    def __init__(self, model, decode_graphs: DecodeGraphs):
        self.model = model
        self.decode = decode_graphs
        self.device = decode_graphs.device
        # (bucket, q, k, share) -> (graph, static acceptance [2, bucket], rows [bucket, k + 2])
        self.graphs: dict[
            tuple[int, int, int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]
        ] = {}
        self.row_graphs: dict[
            tuple[int, int, bool], tuple[torch.cuda.CUDAGraph, dict, torch.Tensor]
        ] = {}

    def after_verify(
        self,
        layout: StepLayout,  # the verify's: q = layout.num_rows // layout.num_table_rows
        inputs: torch.Tensor,  # its packed inputs
        outputs: tuple[torch.Tensor, ...],  # its (hidden, logits, argmax)
        k: int,
        share: bool,
        decided: torch.Tensor,  # [2, layout.num_table_rows], as `run` takes it
    ) -> torch.Tensor:
        """What a proposal graph runs: the proposal after a verify, from its tensors (rows
        [bucket, k + 2], `workers.mtp_proposer.after_verify`)."""
        from workers.mtp_proposer import after_verify

        ids, positions, slots, seq_idx, tables = layout.views(inputs)
        meta = AttentionMetadata(positions, slots, seq_idx, tables)
        hidden, _, argmax = outputs
        q = layout.num_rows // layout.num_table_rows
        return after_verify(self.model, ids, meta, hidden, argmax, decided, q, k, share)

    def capture(
        self, batch: int, q: int, k: int, share: bool, decided: torch.Tensor | None = None
    ) -> None:
        """The proposal after the verify graph (batch, q), captured first if new. Its warm-up
        runs read the verify's static tensors as they are (padding before any step: nothing
        written; on first use, the step's own rows, with `decided` as `run` gives it)."""
        if (batch, q) not in self.decode.graphs:
            self.decode.capture(batch, q)
        static = torch.full((2, batch), -1, dtype=torch.long, device=self.device)
        if decided is not None:
            static.copy_(decided)
        _, inputs, outputs = self.decode.graphs[(batch, q)]
        layout = self.decode.layout(batch, q)
        graph, out = self.decode.capture_graph(
            lambda: self.after_verify(layout, inputs, outputs, k, share, static)
        )
        self.graphs[(batch, q, k, share)] = (graph, static, out)

    def run(self, decided: torch.Tensor, num_seqs: int, q: int, k: int, share: bool):
        """The proposal after the verify graph of (num_seqs, q) that replayed last -> rows
        [num_seqs, k + 2] (device): drafts, then what each request was taken to accept.
        `decided`: [2, bucket] (pinned host, or device), each request's drafts accepted and
        token, -1 where the graph takes them from the argmax; -1 for padding."""
        key = (self.decode.bucket(num_seqs, q), q, k, share)
        if key not in self.graphs:
            self.capture(*key, decided)
        graph, static, out = self.graphs[key]
        static.copy_(decided, non_blocking=True)
        graph.replay()
        return out[:num_seqs]

    def _buffers(self, rows: int, num_tables: int, num_drafting: int) -> dict:
        """A rows graph's static inputs: `rows` pair rows (none writing a slot until loaded),
        `num_tables` block-table rows, `num_drafting` drafting requests."""
        d = self.device
        return dict(
            tokens=torch.zeros(rows, dtype=torch.long, device=d),
            hidden=torch.zeros(
                rows, self.model.config.hidden_size, dtype=self.model.dtype, device=d
            ),
            positions=torch.zeros(rows, dtype=torch.long, device=d),
            slot_mapping=torch.full((rows,), -1, dtype=torch.long, device=d),
            seq_idx=torch.zeros(rows, dtype=torch.long, device=d),
            block_tables=torch.zeros(
                num_tables, self.decode.max_blocks_per_seq, dtype=torch.int32, device=d
            ),
            last_rows=torch.zeros(num_drafting, dtype=torch.long, device=d),
            valid=torch.zeros(num_drafting, dtype=torch.bool, device=d),
        )

    def _forward(self, buf: dict, k: int, share: bool) -> torch.Tensor:
        from workers.mtp_proposer import DraftInputs, draft_chain

        meta = AttentionMetadata(
            buf["positions"], buf["slot_mapping"], buf["seq_idx"], buf["block_tables"]
        )
        inputs = DraftInputs(buf["tokens"], buf["hidden"], meta, buf["last_rows"], buf["valid"])
        return draft_chain(self.model, inputs, k, share)

    def capture_rows(self, rows: int, k: int, share: bool) -> None:
        # A step has at most max_batch requests, so at most that many draft: the draft steps
        # (and their LM head) run over that many rows, not over every pair row.
        buf = self._buffers(rows, rows, min(rows, self.decode.max_batch))
        graph, out = self.decode.capture_graph(lambda: self._forward(buf, k, share))
        self.row_graphs[(rows, k, share)] = (graph, buf, out)

    def run_rows(
        self,
        pairs,  # workers.mtp_proposer.DraftPairs, unpadded
        hidden: torch.Tensor,  # the step's target hidden states
        block_tables: torch.Tensor,  # [num_seqs, width], one row per request of the step
        k: int,
        share: bool,
    ) -> torch.Tensor | None:
        """-> drafts [R, k] (device) for the R drafting requests, or None when the pair rows
        exceed the largest row bucket (the caller runs the proposal eagerly)."""
        num_rows = len(pairs.tokens)
        # A request may have no pair row (a one-token chunk of a longer prompt): the bucket
        # holds every request's block-table row as well.
        rows = self.decode.bucket(max(num_rows, block_tables.shape[0]), 1)
        if rows is None:
            return None
        key = (rows, k, share)
        if key not in self.row_graphs:
            self.capture_rows(*key)
        graph, buf, out = self.row_graphs[key]
        source = hidden
        if pairs.pending_hidden:  # rows past the step's: chunk ends held from earlier steps
            source = torch.cat([hidden, torch.stack(pairs.pending_hidden)])
        num_drafting = len(pairs.last_rows)
        # One host buffer, one copy: padding rows are token 0 at position 0 of request 0,
        # writing no slot; padding drafting rows draft from row 0 and are not valid.
        host = torch.zeros(6, rows, dtype=torch.long)
        host[:5, :num_rows] = torch.tensor(
            [pairs.tokens, pairs.hidden_rows, pairs.positions, pairs.seq_idx, pairs.slots],
            dtype=torch.long,
        )
        host[4, num_rows:] = -1
        host[5, :num_drafting] = torch.tensor(pairs.last_rows, dtype=torch.long)
        pinned = self.device.type == "cuda"
        host = (host.pin_memory() if pinned else host).to(self.device, non_blocking=True)
        buf["tokens"].copy_(host[0])
        buf["hidden"][:num_rows].copy_(source.index_select(0, host[1, :num_rows]))
        buf["positions"].copy_(host[2])
        buf["seq_idx"].copy_(host[3])
        buf["slot_mapping"].copy_(host[4])
        buf["last_rows"].copy_(host[5, : buf["last_rows"].shape[0]])
        buf["block_tables"].zero_()
        buf["block_tables"][: block_tables.shape[0], : block_tables.shape[1]].copy_(block_tables)
        buf["valid"].zero_()
        buf["valid"][:num_drafting] = True
        graph.replay()
        return out[:num_drafting]
