"""The MTP layer's side of a round, in one home: the proposal of the next k drafts.

`MtpProposer` owns everything the proposal needs between and within steps: the target hidden
state a request's unfinished prefill left pending, the CUDA graphs of whole proposals, and top-k
sharing between draft steps (an argument of `draft_chain`, see workers.topk_share). One host-side
builder, `build_pairs`, turns a step into the proposal's inputs for eager and graphed runs alike.

Draft step 0 runs over every (h_i, t_{i+1}) pair the step made known: the target's hidden state
after the final norm at position i and the token that followed it, at rotary position i. The
MTP output of each request's last accepted pair gives its first draft; steps 1..k-1 feed the MTP
layer its own previous output (after shared_head.norm) and its previous draft, one token each.

Worked example (block size 64; request 0's blocks [7, 3]):
  - A verify of request 0 at start position 70 with k = 2 drafts [d1, d2]: the target accepted
    d1 and then sampled t, so results[0].sampled_token_ids = [d1, t]. Known now: the token after
    position 70 is d1, after 71 it is t. Pairs: (h_70, d1) at position 70 and (h_71, t) at 71,
    the latter the last accepted row. Slots: block 3 (positions 64..127), so 3 * 64 + 6 = 198 and
    199. For a CUDA graph the request is padded to k + 1 = 3 rows: (h_71, 0) at position 72 with
    slot -1 (it writes nothing, and position 72 may lie past the blocks allocated).
  - A prompt of 100 tokens prefilled in chunks of 64: the first chunk (positions 0..63) makes
    pairs (h_0, t_1) .. (h_62, t_63) known and leaves h_63 pending (t_64 is not known yet); no
    request drafts, but step 0 still runs so the MTP cache holds those positions. The second
    chunk (64..99, the last) pairs the pending h_63 with t_64 first, then (h_64, t_65) ..
    (h_98, t_99), then (h_99, t) with t the sampled token: its last accepted row.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from workers.attention_metadata import AttentionMetadata
from workers.batch import SeqResult, StepInput
from workers.step_tensors import StepTensors
from workers.topk_share import keep_rows, rows_for_step


@dataclass
class DraftPairs:
    """The host-side inputs of one proposal, one entry per pair row.

    Row r pairs hidden state `hidden_rows[r]` (a row of the step's hidden states, or, past them,
    of `pending_hidden`) with token `tokens[r]`, at position `positions[r]` of the request in
    row `seq_idx[r]` of the step's block tables; `slots[r]` is the MTP cache slot it writes
    (-1: a padding row, written nowhere). Request `drafting_seqs[j]` drafts from row
    `last_rows[j]`, the pair of its last accepted token.
    """

    tokens: list[int] = field(default_factory=list)
    hidden_rows: list[int] = field(default_factory=list)
    seq_idx: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    drafting_seqs: list[int] = field(default_factory=list)
    last_rows: list[int] = field(default_factory=list)
    pending_hidden: list[torch.Tensor] = field(default_factory=list)  # [hidden] each

    def add(self, hidden_row: int, token: int, seq: int, position: int, slot: int) -> None:
        self.hidden_rows.append(hidden_row)
        self.tokens.append(token)
        self.seq_idx.append(seq)
        self.positions.append(position)
        self.slots.append(slot)


@dataclass
class _Pending:
    """The target's hidden state at the end of a non-final prefill chunk, whose next token is
    not known until the next chunk arrives."""

    hidden: torch.Tensor  # [hidden], a copy (a view would keep the whole chunk alive)
    position: int


def build_pairs(
    batch: StepTensors,
    results: list[SeqResult],
    hidden: torch.Tensor,  # [T, hidden] the step's target hidden states
    *,
    pending: dict[str, _Pending],  # consumed and refilled: see _Pending
    block_size: int,
    pad_to: int | None = None,  # rows per request, for a CUDA graph (every request a verify)
) -> DraftPairs:
    """The proposal's pair rows for one step (the module docstring works an example)."""
    pairs = DraftPairs()
    num_step_rows = hidden.shape[0]
    offsets = batch.offsets
    for i, (s, res) in enumerate(zip(batch.seqs, results)):
        blocks = batch.block_tables[i]
        first_row = len(pairs.tokens)
        # Tokens now known after positions start, start+1, ..: the rest of this chunk, then
        # what was sampled (accepted drafts + the target's token) for a sampling step.
        accepted_len = len(s.token_ids) - s.num_draft_tokens
        known_next = s.token_ids[1:accepted_len] + res.sampled_token_ids
        held = pending.pop(s.request_id, None)
        if held is not None and held.position == s.start_position - 1:
            row = num_step_rows + len(pairs.pending_hidden)
            pairs.pending_hidden.append(held.hidden)
            pairs.add(
                row, s.token_ids[0], i, held.position, _slot(blocks, held.position, block_size)
            )
        num_pairs = min(len(known_next), accepted_len + res.num_accepted_drafts)
        for j in range(num_pairs):
            position = s.start_position + j
            pairs.add(
                offsets[i] + j, known_next[j], i, position, _slot(blocks, position, block_size)
            )
        if s.samples:
            pairs.drafting_seqs.append(i)
            pairs.last_rows.append(len(pairs.tokens) - 1)
        else:
            end = len(s.token_ids) - 1
            pending[s.request_id] = _Pending(
                hidden[offsets[i] + end].clone(), s.start_position + end
            )
        if pad_to is not None:
            last = pairs.hidden_rows[-1]
            for r in range(len(pairs.tokens) - first_row, pad_to):
                pairs.add(last, 0, i, s.start_position + r, -1)
    return pairs


def _slot(blocks, position: int, block_size: int) -> int:
    return int(blocks[position // block_size]) * block_size + position % block_size


@dataclass
class DraftInputs:
    """The device side of DraftPairs: what `draft_chain` reads (graph buffers, or eager)."""

    tokens: torch.Tensor  # [P] t_{i+1} of each pair
    hidden: torch.Tensor  # [P, hidden] h_i
    meta: AttentionMetadata  # positions i, slots, block-table rows of the pairs
    last_rows: torch.Tensor  # [R] each drafting request's last accepted row
    valid: torch.Tensor  # [R] bool; False for a graph's padded requests (they write nothing)


def draft_chain(model, inputs: DraftInputs, num_drafts: int, share_topk: bool) -> torch.Tensor:
    """Draft step 0 over every pair, then steps 1..k-1 -> draft token ids [R, num_drafts].

    Pure device work with no host sync: the same code runs eagerly and inside a CUDA graph."""
    mtp_hidden, step0_topk = model.mtp_forward(inputs.tokens, inputs.hidden, inputs.meta)
    kept = keep_rows(step0_topk, inputs.last_rows) if share_topk else None
    g = mtp_hidden.index_select(0, inputs.last_rows)  # [R, hidden]
    drafts = [model.mtp_logits(g).argmax(-1)]
    meta = inputs.meta
    base = meta.positions.index_select(0, inputs.last_rows)  # [R] the last accepted positions
    seq_idx = meta.seq_idx.index_select(0, inputs.last_rows)
    block = model.kv_caches[0].shape[1]
    for j in range(1, num_drafts):
        positions = base + j
        slots = meta.block_tables[seq_idx, positions // block].long() * block + positions % block
        step_meta = AttentionMetadata(
            positions, torch.where(inputs.valid, slots, -1), seq_idx, meta.block_tables
        )
        topk = rows_for_step(kept, j, positions) if kept is not None else None
        g, _ = model.mtp_forward(drafts[-1], g, step_meta, topk)
        drafts.append(model.mtp_logits(g).argmax(-1))
    return torch.stack(drafts, 1)


class MtpProposer:
    """Proposes each sampling request's next k drafts after a step (see the module docstring)."""

    def __init__(self, model, block_size_tokens: int, decode_graphs=None):
        self.model = model
        self.block_size = block_size_tokens
        self.pending: dict[str, _Pending] = {}
        self.graphs = None
        if decode_graphs is not None:
            from workers.cuda_graph import ProposeGraphs

            self.graphs = ProposeGraphs(model, decode_graphs)

    def forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.pending.pop(rid, None)

    def propose(
        self, step: StepInput, batch: StepTensors, hidden: torch.Tensor, results: list[SeqResult]
    ) -> None:
        """Sets results[i].next_draft_token_ids for every request that sampled this step;
        `hidden` [T, hidden] holds the step's target hidden states.

        After a verify step whose target replayed its graph: the verify layout's proposal graph
        (k + 1 rows per request). After a step whose target ran as rows of a q = 1 graph
        (prompts beside verifies): a rows proposal graph, unless its pair rows exceed the
        largest row bucket. Otherwise (and on CPU) eagerly."""
        seqs, num_drafts = batch.seqs, step.num_draft_tokens
        graphed = (
            self.graphs is not None
            and batch.graphable
            and not any(s.request_id in self.pending for s in seqs)
        )
        pairs = build_pairs(
            batch,
            results,
            hidden,
            pending=self.pending,
            block_size=self.block_size,
            pad_to=num_drafts + 1 if graphed else None,
        )
        tables, share_topk = batch.meta.block_tables, step.share_topk
        if not pairs.tokens:
            return
        if batch.graph_key is not None and not batch.graphable:
            # The target ran as rows of a q = 1 graph, whose static tables have a row per
            # bucket row: request i's table is row i (`pack_step`), the rest padding.
            tables = tables[: len(seqs)]
        drafts = None
        if graphed:
            drafts = self.graphs.run(pairs, hidden, tables, num_drafts, share_topk)
        elif self.graphs is not None and batch.graph_key is not None:
            # The target ran as rows of a q = 1 graph (prompts beside verifies): the proposal
            # as rows of a graph too, unless its pair rows exceed the largest row bucket.
            drafts = self.graphs.run_rows(pairs, hidden, tables, num_drafts, share_topk)
        if drafts is None:
            inputs = self._inputs(pairs, hidden, tables)
            if not pairs.drafting_seqs:
                # Only non-final prefill chunks: nothing to draft yet, but the MTP layer's cache
                # must hold these positions before any later draft attends to them.
                self.model.mtp_forward(inputs.tokens, inputs.hidden, inputs.meta)
                return
            drafts = draft_chain(self.model, inputs, num_drafts, share_topk)
        for i, proposal in zip(pairs.drafting_seqs, drafts.tolist()):
            results[i].next_draft_token_ids = proposal

    def _inputs(self, pairs: DraftPairs, hidden: torch.Tensor, tables: torch.Tensor):
        device = hidden.device
        source = (
            torch.cat([hidden, torch.stack(pairs.pending_hidden)])
            if pairs.pending_hidden
            else hidden
        )
        host = torch.tensor(
            [pairs.tokens, pairs.hidden_rows, pairs.seq_idx, pairs.positions, pairs.slots],
            dtype=torch.long,
        ).to(device)
        num_drafting = len(pairs.last_rows)
        return DraftInputs(
            tokens=host[0],
            hidden=source.index_select(0, host[1]),
            meta=AttentionMetadata(
                positions=host[3], slot_mapping=host[4], seq_idx=host[2], block_tables=tables
            ),
            last_rows=torch.tensor(pairs.last_rows, dtype=torch.long, device=device),
            valid=torch.ones(num_drafting, dtype=torch.bool, device=device),
        )
