"""Turns a StepInput into device tensors, runs the target and the MTP draft steps, and samples.

One step serves every scheduled request at once:
  1. target forward over the flattened batch (prefill chunks and verifies mixed);
  2. per sampling request: accept drafts / sample (workers.sampler);
  3. MTP draft step 0 over every (h_i, t_{i+1}) pair the step made known (the last accepted
     token's row last), then draft steps 1..k-1 with one token per request.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from parallel.collectives import tp_broadcast
from parallel.state import get_parallel_state
from workers.attention_metadata import AttentionMetadata
from workers.batch import SeqResult, SeqWork, StepInput, StepOutput
from workers.kv_cache import allocate_kv_caches, max_blocks_per_seq
from workers.logits_processors import process_logits, record_step_tokens
from workers.mtp_proposer import draft_chain
from workers.sampler import generator_seed, token_logprobs, verify_and_sample
from workers.topk_share import DraftTopkShare


@dataclass
class _SeqState:
    """What the runner keeps for a request between steps."""

    # Target hidden state of the last computed position whose next token was not yet known
    # (the end of a non-final prefill chunk); the MTP layer consumes it next step.
    pending_hidden: torch.Tensor | None = None
    pending_position: int = -1
    generator: torch.Generator | None = None
    # Prompt and output so far, kept only for requests with logits processors (penalties count
    # tokens): the worker sees every token once, so the coordinator never resends history.
    token_ids: list[int] = field(default_factory=list)

    def checkpoint(self, draws: bool) -> tuple:
        """What a step changes here; `restore` puts it back (a failed step is re-run). `draws`:
        the step may draw from the generator (sampling, not greedy). Measured: get_state of a
        CPU generator takes 1.2 us."""
        rng = self.generator.get_state() if draws and self.generator is not None else None
        return self.pending_hidden, self.pending_position, rng

    def restore(self, checkpoint: tuple) -> None:
        self.pending_hidden, self.pending_position, rng = checkpoint
        if rng is not None:
            self.generator.set_state(rng)


class ModelRunner:
    def __init__(
        self,
        model,
        num_blocks: int,
        block_size_tokens: int,
        device: torch.device,
        cuda_graph_max_batch: int = 0,
        max_model_len: int = 8192,
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
        )
        model.bind_caches(kv, idx)
        self.states: dict[str, _SeqState] = {}
        self.topk_share = DraftTopkShare()
        self.graphs = None
        self.propose_graphs = None
        if device.type == "cuda" and cuda_graph_max_batch > 0:
            from workers.cuda_graph import DecodeGraphs, ProposeGraphs

            max_blocks = max_blocks_per_seq(max_model_len, block_size_tokens)
            self.graphs = DecodeGraphs(model, cuda_graph_max_batch, max_blocks, device)
            if model.mtp is not None:
                self.propose_graphs = ProposeGraphs(model, self.topk_share, self.graphs)

    @property
    def has_mtp(self) -> bool:
        return self.model.mtp is not None

    # --- tensors -------------------------------------------------------------------------------

    def _metadata(
        self, rows: list[tuple[int, int]], tables_cpu: torch.Tensor, block_tables: torch.Tensor
    ) -> AttentionMetadata:
        """rows: (seq index into block_tables, position) per token. Slots are computed from the
        host copy of the block tables, so building a step's tensors never waits on the device."""
        seq_idx = torch.tensor([s for s, _ in rows], dtype=torch.long)
        positions = torch.tensor([p for _, p in rows], dtype=torch.long)
        blocks = tables_cpu[seq_idx, positions // self.block_size].long()
        slots = blocks * self.block_size + positions % self.block_size
        return AttentionMetadata(
            positions=positions.to(self.device),
            slot_mapping=slots.to(self.device),
            seq_idx=seq_idx.to(self.device),
            block_tables=block_tables,
        )

    def _block_tables(self, seqs: list[SeqWork]) -> torch.Tensor:
        width = max(len(s.block_ids) for s in seqs)
        table = torch.zeros(len(seqs), width, dtype=torch.int32)
        for i, s in enumerate(seqs):
            table[i, : len(s.block_ids)] = torch.tensor(s.block_ids, dtype=torch.int32)
        return table

    def _state(self, seq: SeqWork) -> _SeqState:
        state = self.states.get(seq.request_id)
        if state is None:
            state = _SeqState()
            if seq.sampling.seed is not None:
                state.generator = torch.Generator(self.device).manual_seed(
                    generator_seed(seq.sampling.seed)
                )
            self.states[seq.request_id] = state
        elif seq.start_position == 0:
            # A recompute after preemption: the cache is rebuilt from scratch, but a seeded
            # request's random stream goes on where it was (no draw is replayed).
            state.pending_hidden = None
        return state

    # --- the step --------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, step: StepInput) -> StepOutput:
        for rid in step.finished_request_ids:
            self.states.pop(rid, None)
        seqs = step.seqs
        if not seqs:
            return StepOutput([])
        states = [self._state(s) for s in seqs]
        tables_cpu = self._block_tables(seqs)
        tables = tables_cpu.to(self.device)
        rows = [
            (i, s.start_position + j) for i, s in enumerate(seqs) for j in range(len(s.token_ids))
        ]
        input_ids = torch.tensor([t for s in seqs for t in s.token_ids], device=self.device)
        meta = self._metadata(rows, tables_cpu, tables)
        # Rows whose logits are needed: a verify's 1 + k positions, a final chunk's last one.
        offsets, logit_rows = [], []
        start = 0
        for s in seqs:
            offsets.append(start)
            if s.samples:
                logit_rows.extend(
                    range(
                        start + len(s.token_ids) - 1 - s.num_draft_tokens, start + len(s.token_ids)
                    )
                )
            start += len(s.token_ids)
        if self._graphable(seqs):
            hidden, logits = self.graphs.run(
                input_ids, meta.positions, meta.slot_mapping, tables, len(seqs[0].token_ids)
            )
        else:
            hidden = self.model(input_ids, meta)  # [T, hidden]
            logits = self.model.compute_logits(hidden[logit_rows]) if logit_rows else None

        # Every row's argmax in one device-to-host copy: greedy requests need nothing else.
        argmax = logits.argmax(-1).tolist() if logits is not None else []
        results = self._sample(seqs, states, logits, argmax)

        if self.has_mtp and step.num_draft_tokens > 0:
            self._agree_on_samples(seqs, results)
            self._propose(step, seqs, states, tables_cpu, tables, hidden, offsets, results)
        return StepOutput(results)

    def _sample(self, seqs, states, logits, argmax: list[int]) -> list[SeqResult]:
        """Accept drafts and sample, per request (logits processors first, when it has any)."""
        results, cursor = [], 0
        for s, state in zip(seqs, states):
            if s.sampling.has_logits_processors:
                record_step_tokens(state.token_ids, s.start_position, s.token_ids)
            if not s.samples:
                results.append(SeqResult(s.request_id, []))
                continue
            n = s.num_draft_tokens + 1
            seq_logits = logits[cursor : cursor + n]
            seq_argmax = argmax[cursor : cursor + n]
            cursor += n
            drafts = (
                s.token_ids[len(s.token_ids) - s.num_draft_tokens :] if s.num_draft_tokens else []
            )
            sample_logits = seq_logits
            if s.sampling.has_logits_processors:
                context = state.token_ids[: len(state.token_ids) - s.num_draft_tokens]
                sample_logits = process_logits(seq_logits, s.sampling, context, drafts)
                seq_argmax = None
            tokens, accepted = verify_and_sample(
                sample_logits, drafts, s.sampling, state.generator, seq_argmax
            )
            logprobs = None
            if s.sampling.num_logprobs is not None:
                logprobs = token_logprobs(
                    seq_logits[: len(tokens)], tokens, s.sampling.num_logprobs
                )
            results.append(SeqResult(s.request_id, tokens, accepted, [], logprobs))
        return results

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

    def _graphable(self, seqs: list[SeqWork]) -> bool:
        """Decode steps replay a CUDA graph: every sequence samples every one of its tokens'
        logits (1 + drafts), all with the same token count, within the largest bucket."""
        if self.graphs is None or len(seqs) > self.graphs.max_batch:
            return False
        q = len(seqs[0].token_ids)
        return all(s.samples and len(s.token_ids) == q == 1 + s.num_draft_tokens for s in seqs)

    # --- MTP drafting ----------------------------------------------------------------------------

    def _propose(self, step, seqs, states, tables_cpu, tables, hidden, offsets, results) -> None:
        """Draft step 0 over every newly known (h_i, t_{i+1}) pair, then steps 1..k-1."""
        no_pending = all(state.pending_hidden is None for state in states)
        if self.propose_graphs is not None and self._graphable(seqs) and no_pending:
            return self._propose_graphed(step, seqs, tables_cpu, tables, hidden, offsets, results)
        pair_rows, pair_tokens, pair_hidden = [], [], []
        last_row = {}  # seq index -> row of its last accepted token in the step-0 batch
        for i, (s, state, res) in enumerate(zip(seqs, states, results)):
            base = offsets[i]
            # Tokens now known at positions start+1 ..: the rest of this chunk, then what was
            # sampled (accepted drafts + the target's token) for a sampling step.
            accepted_len = len(s.token_ids) - s.num_draft_tokens
            known_next = s.token_ids[1:accepted_len] + res.sampled_token_ids
            if state.pending_hidden is not None and state.pending_position == s.start_position - 1:
                pair_rows.append((i, state.pending_position))
                pair_tokens.append(s.token_ids[0])
                pair_hidden.append(state.pending_hidden[None])
            state.pending_hidden = None
            num_pairs = min(len(known_next), accepted_len + res.num_accepted_drafts)
            for j in range(num_pairs):
                pair_rows.append((i, s.start_position + j))
                pair_tokens.append(known_next[j])
            pair_hidden.append(hidden[base : base + num_pairs])
            if s.samples:
                last_row[i] = len(pair_rows) - 1
            else:
                end = s.start_position + len(s.token_ids) - 1
                # A copy of the one row: a view would keep the whole chunk's hidden states alive.
                state.pending_hidden = hidden[base + len(s.token_ids) - 1].clone()
                state.pending_position = end
        if not pair_rows:
            return
        if not last_row:
            # Only non-final prefill chunks: nothing to draft yet, but the MTP layer's cache
            # must hold these positions before any later draft attends to them.
            self.model.mtp_forward(
                torch.tensor(pair_tokens, device=self.device),
                torch.cat(pair_hidden),
                self._metadata(pair_rows, tables_cpu, tables),
            )
            return
        seq_ids = list(last_row)
        last_idx = torch.tensor(list(last_row.values()), device=self.device)
        drafts = draft_chain(
            self.model,
            self.topk_share,
            torch.tensor(pair_tokens, device=self.device),
            torch.cat(pair_hidden),
            self._metadata(pair_rows, tables_cpu, tables),
            last_idx,
            torch.ones(len(seq_ids), dtype=torch.bool, device=self.device),
            step.num_draft_tokens,
            step.share_topk,
        )
        proposals = drafts.tolist()  # [R, k]
        for i, tokens in zip(seq_ids, proposals):
            results[i].next_draft_token_ids = tokens

    def _propose_graphed(self, step, seqs, tables_cpu, tables, hidden, offsets, results) -> None:
        """The decode-step proposal through ProposeGraphs: every request is a verify, so its
        pairs are its accepted drafts plus the target's token (at most k + 1), padded to k + 1."""
        width = step.num_draft_tokens + 1
        tokens, hidden_rows, positions, slots, last_idx = [], [], [], [], []
        table_rows = tables_cpu.tolist()
        for i, (s, res) in enumerate(zip(seqs, results)):
            num_pairs = res.num_accepted_drafts + 1
            blocks = table_rows[i]
            for r in range(width):
                position = s.start_position + r
                tokens.append(res.sampled_token_ids[r] if r < num_pairs else 0)
                hidden_rows.append(offsets[i] + min(r, num_pairs - 1))
                positions.append(position)
                # Padding rows write nothing, and their positions may lie past the blocks the
                # scheduler allocated (a verify with fewer than k drafts).
                slots.append(
                    blocks[position // self.block_size] * self.block_size
                    + position % self.block_size
                    if r < num_pairs
                    else -1
                )
            last_idx.append(i * width + num_pairs - 1)
        drafts = self.propose_graphs.run(
            tokens,
            hidden_rows,
            positions,
            slots,
            last_idx,
            hidden,
            tables,
            step.num_draft_tokens,
            step.share_topk,
        )
        for res, proposal in zip(results, drafts.tolist()):
            res.next_draft_token_ids = proposal
