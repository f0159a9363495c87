"""Turns a StepInput into device tensors, runs the target, samples, and lets the MTP layer propose.

One step serves every scheduled request at once: `execute()` is prepare -> forward -> sample ->
propose.
  1. prepare: the flattened batch's tensors (prefill chunks and verifies mixed), built on the host;
  2. forward: the target over every token (a CUDA graph for decode steps on GPU);
  3. sample: per sampling request, accept drafts / sample (workers.sampler);
  4. propose: the MTP layer drafts the next k (workers.mtp_proposer, the round's one home);
     after a step of verifies, launched before step 3 reads a token where the device knows
     each request's acceptance: behind the forward (plain greedy) or behind the draw.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kernels import ops
from parallel.collectives import tp_broadcast
from parallel.state import get_parallel_state
from workers.attention_metadata import AttentionMetadata, dense_prompts_on, dense_spans
from workers.batch import (
    SeqResult,
    SeqWork,
    StepInput,
    StepOutput,
    carries_only_prompts,
    verify_rows,
)
from workers.block_tables import BlockTables
from workers.host_copy import start_copy_to_host
from workers.kv_cache import CacheFormat, allocate_kv_caches, max_blocks_per_seq
from workers.logits_processors import (
    OutputCounts,
    process_logits,
    prompt_token_mask,
    record_step_tokens,
)
from workers.mtp_proposer import MtpProposer
from workers.sampler import (
    generator_seed,
    token_logprobs,
    verify_and_sample,
    verify_and_sample_batch,
)
from workers.step_ahead import StepAhead, choose_rows, gather_tokens, plain_greedy
from workers.step_tensors import StepLayout, StepTensors, pack_step

# Rows of the largest sampler graph (workers.cuda_graph.SamplerGraphs): 64 requests verifying
# three drafts. Its static logits and noise take 2 x rows x V x 4 bytes (265 MB at
# DeepSeek-V3.2's vocabulary); a step sampling more rows samples eagerly.
SAMPLER_GRAPH_MAX_ROWS = 256


@dataclass
class _SeqState:
    """What the runner keeps for a request between steps."""

    generator: torch.Generator | None = None
    # Prompt and output so far, kept only for requests with logits processors (penalties count
    # tokens): the worker sees every token once, so the coordinator never resends history.
    token_ids: list[int] = field(default_factory=list)
    # The repetition penalty's prompt tokens as a [V] mask (built on the request's first
    # sampling step; the prompt never changes), and the penalties' output token counts.
    prompt_mask: torch.Tensor | None = None
    output_counts: OutputCounts | None = None


class ModelRunner:
    def __init__(
        self,
        model,
        num_blocks: int,
        block_size_tokens: int,
        device: torch.device,
        cuda_graph_max_batch: int = 0,
        max_seq_slots: int = 8192,  # context + MTP lookahead: the block tables' width
        cache_format: CacheFormat | None = None,  # None: the model's dtype throughout
        cuda_graph_max_rows: int = 0,  # q = 1 graphs' rows for steps that prefill (>= max batch)
        overlap: bool = False,  # launch the next step's greedy decodes ahead (workers.step_ahead)
    ):
        self.model = model
        self.device = device
        self.block_size = block_size_tokens
        kv, idx = allocate_kv_caches(
            model.config,
            num_blocks,
            block_size_tokens,
            model.dtype,
            device,
            with_mtp=model.mtp is not None,
            cache_format=cache_format or CacheFormat(),
        )
        model.bind_caches(kv, idx)
        self.states: dict[str, _SeqState] = {}
        self.block_tables = BlockTables()
        self.graphs = None
        # Steps that prefill replay the decode graph where they can (`_graph_key`); the
        # worker's warm-up turns this off for its dummy prefills, which are there to compile
        # the eager path's kernel variants.
        self.prefill_in_graphs = True
        # An eager step's prompt tokens before the indexer's top-k size attend densely
        # (`_dense_rows`): their top-k would be every position. The warm-up turns this off for
        # its dummy prefills of the sparse path's kernels.
        self.dense_prompts = dense_prompts_on(device, model.dtype)
        # From this many tokens a step of prompt tokens only runs eagerly inside
        # `ops.prompt_step`, so an FP8 model's matmuls take the w8a8 kernels there (the graphs
        # hold the w8a16 ones); None: never (no FP8 weights, or w8a8 not for prompt steps here).
        holds_fp8 = any(getattr(m, "is_fp8", False) for m in model.modules())
        self.w8a8_prompt_rows = ops.w8a8_prompt_rows(device) if holds_fp8 else None
        if device.type == "cuda" and cuda_graph_max_batch > 0:
            from workers.cuda_graph import DecodeGraphs

            max_blocks = max_blocks_per_seq(max_seq_slots, block_size_tokens)
            self.graphs = DecodeGraphs(
                model, cuda_graph_max_batch, max_blocks, device, cuda_graph_max_rows
            )
        self.proposer = (
            MtpProposer(model, block_size_tokens, self.graphs) if model.mtp is not None else None
        )
        self.sampler_graphs = None  # the batched sampler's graphs, beside the decode graphs
        if self.graphs is not None:
            from workers.cuda_graph import SamplerGraphs

            self.sampler_graphs = SamplerGraphs(
                self.graphs, model.config.vocab_size, SAMPLER_GRAPH_MAX_ROWS
            )
        self.overlap = overlap
        self._ahead: StepAhead | None = None
        # Decode rows launched ahead, and those a step then took (the rest were wasted)
        self.num_rows_ahead = 0
        self.num_rows_reused = 0

    @property
    def has_mtp(self) -> bool:
        return self.proposer is not None

    # --- the step --------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, step: StepInput) -> StepOutput:
        """Run the step. With `overlap`, the next step's greedy decodes are launched before this
        step's tokens are read, so the GPU runs them while the engine does its bookkeeping; the
        next call takes what matches and runs the rest."""
        ahead, self._ahead = self._ahead, None  # a failed step leaves nothing launched ahead
        self._forget(step.finished_request_ids)
        if self.proposer is not None:
            self.proposer.forget(step.preempted_request_ids)
        if not step.seqs:
            return StepOutput([])
        tables = [self.block_tables.update(s) for s in step.seqs]
        reused = ahead.reusable(step) if ahead is not None else {}
        rest = [i for i in range(len(step.seqs)) if i not in reused]
        batch = hidden = logits = argmax = None
        drafting = self.proposer is not None and step.num_draft_tokens > 0
        if rest:
            batch = self._prepare([step.seqs[i] for i in rest], [tables[i] for i in rest])
            hidden, logits, argmax = self._forward(batch)
            if drafting:  # plain greedy verifies: the proposal goes on behind the forward
                self.proposer.launch_early(step, batch, hidden)
        # A step whose rows' logits are read after the forward (draws, logits processors,
        # logprobs) launches ahead only once they are read: a replay of the same graph would
        # rewrite them.
        ahead_after = batch is not None and any(
            s.samples and not plain_greedy(s.sampling) for s in batch.seqs
        )
        overlap = self.overlap and step.num_draft_tokens == 0
        if overlap and not ahead_after:
            self._ahead = self._launch_ahead(step, tables, reused, ahead, rest, batch)
        results: list[SeqResult | None] = [None] * len(step.seqs)
        if reused:
            for i, result in ahead.results(step, reused).items():
                results[i] = result
            self.num_rows_reused += len(reused)
        if batch is not None:
            on_draws = None  # verifies that draw: the proposal goes on behind the draw
            if drafting and batch.proposal is None:
                on_draws = self.proposer.after_draws(step, batch, hidden)
            for i, result in zip(rest, self._sample(batch, logits, argmax, on_draws)):
                results[i] = result
            if drafting:
                self._agree_on_samples(batch.seqs, results)
                self.proposer.propose(step, batch, hidden, results)
        if overlap and ahead_after:
            self._ahead = self._launch_ahead(step, tables, reused, ahead, rest, batch)
        if self._ahead is not None:
            self._ahead.record_tokens(step.seqs, results)
        return StepOutput(results)

    def _launch_ahead(
        self,
        step: StepInput,
        tables: list,
        reused: dict[int, int],
        ahead: StepAhead | None,
        rest: list[int],
        batch: StepTensors | None,
    ) -> StepAhead | None:
        """Launch the next step's decodes of `step`'s plain greedy sequences (workers.step_ahead),
        fed on the device from this step's argmax: of `ahead` for the `reused` sequences, of
        `batch` for the rest. None when no sequence qualifies."""
        chosen = choose_rows(step, tables, reused, rest, batch, self.block_size)
        if chosen is None:
            return None
        tokens = gather_tokens(chosen.sources, ahead, batch, self.device)
        next_batch = self._prepare(chosen.seqs, chosen.tables)
        next_batch.input_ids.copy_(tokens, non_blocking=True)
        _, _, argmax = self._forward(next_batch)
        self.num_rows_ahead += len(chosen.rows)
        return StepAhead(
            chosen.rows, argmax, next_batch.argmax_device.clone(), next_batch.argmax_copied
        )

    def _forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.states.pop(rid, None)
        self.block_tables.forget(request_ids)
        if self.proposer is not None:
            self.proposer.forget(request_ids)

    def checkpoint(self, step: StepInput) -> dict[str, tuple]:
        """What a step changes of its requests' state: seeded random streams (when the step may
        draw) and the MTP layer's pending hidden states. `restore` puts it back, so a failed step
        can be re-run without its failing request and the others draw and draft exactly what
        they would have. Measured: get_state of a CPU generator takes 1.2 us."""
        saved = {}
        for s in step.seqs:
            state = self.states.get(s.request_id)
            draws = state is not None and state.generator is not None and not s.sampling.greedy
            pending = self.proposer.pending.get(s.request_id) if self.proposer else None
            rng = state.generator.get_state() if draws else None
            saved[s.request_id] = (state is not None, rng, pending)
        return saved

    def restore(self, step: StepInput, saved: dict[str, tuple]) -> None:
        self._ahead = None  # launched from a failed step's tokens: nothing to take from it
        for s in step.seqs:
            existed, rng, pending = saved[s.request_id]
            if not existed:
                self.states.pop(s.request_id, None)  # made by the failed step
            elif rng is not None:
                self.states[s.request_id].generator.set_state(rng)
            if self.proposer is not None:
                if pending is None:
                    self.proposer.pending.pop(s.request_id, None)
                else:
                    self.proposer.pending[s.request_id] = pending

    def _prepare(self, seqs: list[SeqWork], tables: list) -> StepTensors:
        """The step's inputs, packed on the host and sent in one copy (workers.step_tensors):
        into the decode graph's static inputs on the graph path, else a fresh device buffer.
        `tables`: each sequence's whole block table (`self.block_tables`)."""
        q = verify_rows(seqs)
        graphable = self._graphable(seqs, q)
        w8a8_prompt_step = self._w8a8_prompt_step(seqs)
        graph_key = None if w8a8_prompt_step else self._graph_key(seqs, graphable)
        if graph_key is not None:
            layout = self.graphs.layout(*graph_key)
        else:
            num_tokens = sum(len(s.token_ids) for s in seqs)
            layout = StepLayout(num_tokens, len(seqs), max(len(t) for t in tables))
        # Pinned, so the copy below is asynchronous; the host allocator keeps this buffer from
        # being reused before that copy has run.
        host = torch.empty(layout.numel, dtype=torch.long, pin_memory=self.device.type == "cuda")
        pack_step(seqs, self.block_size, layout, host.numpy(), tables)
        if graph_key is not None:
            input_ids, positions, slots, seq_idx, device_tables = self.graphs.load(host, *graph_key)
        else:
            inputs = host.to(self.device, non_blocking=True)
            input_ids, positions, slots, seq_idx, device_tables = layout.views(inputs)
        offsets, logit_rows = [], []
        start = 0
        for s in seqs:
            offsets.append(start)
            if s.samples:
                first = start + len(s.token_ids) - 1 - s.num_draft_tokens
                logit_rows.extend(range(first, start + len(s.token_ids)))
            start += len(s.token_ids)
        meta = AttentionMetadata(positions, slots, seq_idx, device_tables)
        dense = self._dense_rows(seqs) if graph_key is None else []
        if dense:
            meta.dense = dense_spans(
                [seqs[i].start_position for i, _ in dense],
                [n for _, n in dense],
                [tables[i] for i, _ in dense],
                self.block_size,
                self.device,
                [offsets[i] for i, _ in dense],
                start,  # the step's rows
            )
        return StepTensors(
            seqs=seqs,
            block_tables=tables,
            input_ids=input_ids,
            meta=meta,
            offsets=offsets,
            logit_rows=logit_rows,
            graphable=graphable,
            graph_key=graph_key,
            verify_rows=q,
            w8a8_prompt_step=w8a8_prompt_step,
        )

    def _forward(self, batch: StepTensors) -> tuple[torch.Tensor, ...]:
        """-> (hidden [T, hidden], logits [R, vocab] and their argmax [R] for the R logit rows;
        None and None when no row samples). The argmax is on its way to the host (pinned) when
        this returns: see `_sample`."""
        if batch.graph_key is not None:
            hidden, logits, argmax = self.graphs.replay(*batch.graph_key)
            if not batch.graphable:  # prefill rows: only the rows that sample
                rows = batch.logit_rows
                if not rows:
                    return hidden, None, None
                index = torch.tensor(rows, dtype=torch.long, pin_memory=self.device.type == "cuda")
                index = index.to(self.device, non_blocking=True)
                logits, argmax = logits.index_select(0, index), argmax.index_select(0, index)
        else:
            with ops.prompt_step(batch.w8a8_prompt_step):
                hidden = self.model(batch.input_ids, batch.meta)  # [T, hidden]
            rows = batch.logit_rows
            if not rows:
                return hidden, None, None
            logits = self.model.compute_logits(hidden[rows])
            argmax = ops.argmax(logits)
        batch.argmax_device = argmax
        argmax, batch.argmax_copied = start_copy_to_host(argmax)
        return hidden, logits, argmax

    def _sample(
        self,
        batch: StepTensors,
        logits: torch.Tensor | None,
        argmax: torch.Tensor | None,
        on_draws=None,  # called with the batched draw's device results and the drawn requests
    ) -> list[SeqResult]:
        """Accept drafts and sample, per request (its logits processors first, if it has any:
        each draft row then sees the drafts before it, so acceptance runs on the processed
        distribution and MTP stays exact).

        The host work that needs no sampled token is done first, while the device still runs
        the forward: the sampling requests' draw is queued behind it (its settings, noise and
        launches prepared meanwhile) before the host waits for anything; then the argmax of
        every row, which arrived in the one device-to-host copy `_forward` started, is all
        greedy requests need."""
        work = []  # per sampling request: (index in the step, state, first logit row, drafts)
        cursor = 0
        for i, s in enumerate(batch.seqs):
            if s.sampling.has_logits_processors:
                record_step_tokens(self._state(s).token_ids, s.start_position, s.token_ids)
            if s.samples:
                drafts = s.token_ids[len(s.token_ids) - s.num_draft_tokens :]
                work.append((i, self._state(s), cursor, drafts))
                cursor += s.num_draft_tokens + 1
        results = [None] * len(batch.seqs)
        # Sampling requests draw together (one batched sampler, one copy to the host); a
        # seeded one takes its random numbers from its own generator there.
        together = []  # (index in the step, first logit row, its processed rows or None, drafts)
        generators = []  # each of together's own random stream (None: no seed)
        greedy = []
        for i, state, first, drafts in work:
            spec = batch.seqs[i].sampling
            if spec.greedy:
                greedy.append((i, state, first, drafts))
                continue
            processed = None
            if spec.has_logits_processors:
                processed = self._process(
                    state, spec, logits[first : first + len(drafts) + 1], drafts
                )
            together.append((i, first, processed, drafts))
            generators.append(state.generator)
        if together:
            num_rows = sum(len(drafts) + 1 for _, _, _, drafts in together)
            graphs = self.sampler_graphs
            if graphs is not None and graphs.bucket(num_rows) is None:
                graphs = None
            hook = None
            if on_draws is not None:
                drawn_seqs = [i for i, _, _, _ in together]
                hook = lambda draws: on_draws(draws, drawn_seqs)  # noqa: E731
            drawn = verify_and_sample_batch(
                self._rows_together(logits, together, graphs),
                [drafts for _, _, _, drafts in together],
                [batch.seqs[i].sampling for i, _, _, _ in together],
                generators,
                graphs,
                hook,
            )
            for (i, _, _, _), (tokens, accepted) in zip(together, drawn):
                results[i] = SeqResult(batch.seqs[i].request_id, tokens, accepted)
        if greedy:
            if batch.argmax_copied is not None:
                batch.argmax_copied.synchronize()
            argmax = argmax.tolist()
        for i, state, first, drafts in greedy:
            s, end = batch.seqs[i], first + len(drafts) + 1
            if s.sampling.has_logits_processors:
                processed = self._process(state, s.sampling, logits[first:end], drafts)
                tokens, accepted = verify_and_sample(processed, drafts, s.sampling, None, None)
            else:  # the argmax is all it needs
                tokens, accepted = verify_and_sample(
                    None, drafts, s.sampling, None, argmax[first:end]
                )
            results[i] = SeqResult(s.request_id, tokens, accepted)
        self._add_logprobs(batch.seqs, results, work, logits)
        return [r or SeqResult(s.request_id, []) for r, s in zip(results, batch.seqs)]

    @staticmethod
    def _add_logprobs(seqs, results, work: list, logits) -> None:
        """The logprobs of the emitted tokens of every request that asked, in one batched
        computation (`token_logprobs`) for the whole step. `work`: `_sample`'s (index, state,
        first logit row, drafts) per sampling request."""
        asking = [
            (i, first) for i, _, first, _ in work if seqs[i].sampling.num_logprobs is not None
        ]
        if not asking:
            return
        rows, token_ids, num_tops = [], [], []
        for i, first in asking:
            tokens = results[i].sampled_token_ids
            rows += range(first, first + len(tokens))
            token_ids += tokens
            num_tops += [seqs[i].sampling.num_logprobs] * len(tokens)
        entries = iter(token_logprobs(logits, rows, token_ids, num_tops))
        for i, _ in asking:
            results[i].logprobs = [next(entries) for _ in results[i].sampled_token_ids]

    def _rows_together(self, logits: torch.Tensor, together: list, graphs=None) -> torch.Tensor:
        """The logit rows of the requests sampled together, in one gather (fp32; into the
        sampler graphs' static logits when given), with the rows of requests that have logits
        processors replaced by their processed ones."""
        index, spans = [], []
        for _, first, processed, drafts in together:
            if processed is not None:
                spans.append((len(index), processed))
            index += range(first, first + len(drafts) + 1)
        pinned = self.device.type == "cuda"
        index = torch.tensor(index, dtype=torch.long, pin_memory=pinned)
        index = index.to(logits.device, non_blocking=True)
        if graphs is not None:
            rows = torch.index_select(logits, 0, index, out=graphs.logits(len(index)))
        else:
            rows = logits.index_select(0, index).float()
        for start, processed in spans:
            rows[start : start + processed.shape[0]] = processed
        return rows

    def _process(self, state: _SeqState, spec, logits: torch.Tensor, drafts: list[int]):
        """The request's logits processors on its rows, with what the runner keeps of its
        history: the prompt's mask and the output's counts, built once and then kept up."""
        history = state.token_ids  # the context, then this step's drafts: read, not copied
        context_len = len(history) - len(drafts)
        vocab, num_prompt = logits.shape[-1], spec.num_prompt_tokens
        output_counts = None
        if spec.repetition_penalty != 1.0 or spec.presence_penalty or spec.frequency_penalty:
            if spec.repetition_penalty != 1.0 and state.prompt_mask is None:
                state.prompt_mask = prompt_token_mask(history[:num_prompt], vocab, logits.device)
            if state.output_counts is None:
                state.output_counts = OutputCounts(vocab, logits.device)
            output_counts = state.output_counts.update(history, num_prompt, context_len)
        return process_logits(
            logits, spec, history, drafts, state.prompt_mask, output_counts, context_len
        )

    # --- tensors -------------------------------------------------------------------------------

    def _state(self, seq: SeqWork) -> _SeqState:
        """A seeded request's random stream lives as long as the request, across preemptions:
        a recompute replays no draw."""
        state = self.states.get(seq.request_id)
        if state is None:
            state = _SeqState()
            if seq.sampling.seed is not None:
                state.generator = torch.Generator(self.device).manual_seed(
                    generator_seed(seq.sampling.seed)
                )
            self.states[seq.request_id] = state
        return state

    def _agree_on_samples(self, seqs: list[SeqWork], results: list[SeqResult]) -> None:
        """Give every TP rank rank 0's sampled tokens before drafting from them.

        Greedy picks agree already (every rank holds the same gathered logits); random draws do
        not (each process has its own RNG stream), and the MTP layer's collectives need every
        rank to draft from the same tokens.
        """
        state = get_parallel_state()
        if state.tp_size == 1 or all(s.sampling.greedy for s in seqs):
            return
        width = max(s.num_draft_tokens for s in seqs) + 1
        # [num_seqs, 2 + width]: number of tokens, drafts accepted, tokens (-1 padded)
        packed = torch.full((len(seqs), 2 + width), -1, dtype=torch.long)
        for i, r in enumerate(results):
            packed[i, 0], packed[i, 1] = len(r.sampled_token_ids), r.num_accepted_drafts
            packed[i, 2 : 2 + len(r.sampled_token_ids)] = torch.tensor(r.sampled_token_ids)
        packed = tp_broadcast(packed.to(self.device)).cpu()
        for r, row in zip(results, packed.tolist()):
            r.sampled_token_ids, r.num_accepted_drafts = row[2 : 2 + row[0]], row[1]

    def _graph_key(self, seqs: list[SeqWork], graphable: bool) -> tuple[int, int] | None:
        """The decode graph that replays this step's target forward: (num_seqs, q) for a decode
        or verify step; for any other step (prefill chunks, alone or beside decodes or
        verifies; verifies of unequal lengths), (num_tokens, 1): every token one row of the
        q = 1 graph of its bucket, since the forward reads each row's own position and table
        row (workers.attention_metadata) and writes every row's keys before any row attends.
        With MTP the proposal after such a step replays a rows graph of its own
        (`MtpProposer.propose`).

        A prompt arriving while others decode then costs one graph replay instead of an eager
        forward of the whole batch (a prompt's prefill step on the default model: 0.70 ms
        against 8.1 on the H200, bench_mixed_step.py, BENCHMARKS.md). The q = 1 graphs' row
        buckets go past the decode batches (`DecodeGraphs.max_rows`), so a prompt arriving
        beside a full batch of decodes replays one too; steps with more tokens than the
        largest row bucket stay eager."""
        if graphable:
            return len(seqs), len(seqs[0].token_ids)
        if self.graphs is None or not self.prefill_in_graphs:
            return None
        num_tokens = sum(len(s.token_ids) for s in seqs)
        return (num_tokens, 1) if num_tokens <= self.graphs.max_rows else None

    def _w8a8_prompt_step(self, seqs: list[SeqWork]) -> bool:
        """A step of prompt tokens only, at least `w8a8_prompt_rows` of them: it runs eagerly
        inside `ops.prompt_step`, so its FP8 matmuls take the w8a8 kernels (compute-bound
        GEMMs on the FP8 tensor cores) whatever its size, not the w8a16 kernels a decode
        graph's row bucket holds."""
        return (
            self.w8a8_prompt_rows is not None
            and carries_only_prompts(seqs)  # first: a decode step stops at its first sequence
            and sum(len(s.token_ids) for s in seqs) >= self.w8a8_prompt_rows
        )

    def _dense_rows(self, seqs: list[SeqWork]) -> list[tuple[int, int]]:
        """(sequence, its first n tokens) of an eager step that attend densely: the tokens of
        prompt chunks (no drafts, not a decode's one sampled token) that lie before
        index_topk, each one's top-k then every position up to its own (the indexer keeps
        min(index_topk, p + 1)). Their attention is dense and causal and runs so
        (`MLAAttention._dense`), without the indexer's scoring; the step's other rows (a
        chunk's tokens from index_topk on, decodes and verifies, which keep it in the graphs
        too) take the sparse path. The keys the dense rows up-project (every position up to
        theirs) stay within twice the larger of index_topk and their tokens: their transient
        keys and values then take about what the sparse path's absorbed queries and outputs
        would."""
        if not self.dense_prompts:
            return []
        topk = self.model.config.index_topk
        dense = [
            (i, min(len(s.token_ids), topk - s.start_position))
            for i, s in enumerate(seqs)
            if carries_only_prompts([s]) and s.start_position < topk
        ]
        keys = sum(seqs[i].start_position + n for i, n in dense)
        tokens = sum(n for _, n in dense)
        return dense if keys <= 2 * max(topk, tokens) else []

    def _graphable(self, seqs: list[SeqWork], q: int | None) -> bool:
        """Decode steps replay a CUDA graph: every sequence samples every one of its tokens'
        logits (1 + drafts), all with the same token count q (`verify_rows`), within the
        largest bucket."""
        return self.graphs is not None and q is not None and len(seqs) <= self.graphs.max_batch
