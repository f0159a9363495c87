"""The MTP layer's side of a round, in one home: the proposal of the next k drafts.

`MtpProposer` owns everything the proposal needs between and within steps: the target hidden
state a request's unfinished prefill left pending, the CUDA graphs of whole proposals, and top-k
sharing between draft steps (an argument of `draft_chain`, see workers.topk_share). One host-side
builder, `build_pairs`, turns a step into the proposal's inputs; after a step of verifies only,
`verify_pairs` builds the same rows on the device, eagerly or inside the proposal's graph.

Draft step 0 runs over every (h_i, t_{i+1}) pair the step made known: the target's hidden state
after the final norm at position i and the token that followed it, at rotary position i. The
MTP output of each request's last accepted pair gives its first draft; steps 1..k-1 feed the MTP
layer its own previous output (after shared_head.norm) and its previous draft, one token each.

Worked example (block size 64; request 0's blocks [7, 3]):
  - A verify of request 0 at start position 70 with k = 2 drafts [d1, d2]: the target accepted
    d1 and then sampled t, so results[0].sampled_token_ids = [d1, t]. Known now: the token after
    position 70 is d1, after 71 it is t. Pairs: (h_70, d1) at position 70 and (h_71, t) at 71,
    the latter the last accepted row. Slots: block 3 (positions 64..127), so 3 * 64 + 6 = 198 and
    199. A step of verifies only builds its pairs on the device (`verify_pairs`), each request
    keeping its verify's k + 1 = 3 rows: the third is (h_71, 0) at position 72 with slot -1 (it
    writes nothing). Its acceptance comes from the step's argmax there for plain greedy requests,
    so their proposal is launched right behind the verify, before the host reads a token.
  - A prompt of 100 tokens prefilled in chunks of 64: the first chunk (positions 0..63) makes
    pairs (h_0, t_1) .. (h_62, t_63) known and leaves h_63 pending (t_64 is not known yet); no
    request drafts, but step 0 still runs so the MTP cache holds those positions. The second
    chunk (64..99, the last) pairs the pending h_63 with t_64 first, then (h_64, t_65) ..
    (h_98, t_99), then (h_99, t) with t the sampled token: its last accepted row.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kernels import ops
from parallel.state import get_parallel_state
from workers.attention_metadata import AttentionMetadata
from workers.batch import SeqResult, StepInput
from workers.host_copy import start_copy_to_host
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
) -> DraftPairs:
    """The proposal's pair rows for one step (the module docstring works an example)."""
    pairs = DraftPairs()
    num_step_rows = hidden.shape[0]
    offsets = batch.offsets
    for i, (s, res) in enumerate(zip(batch.seqs, results)):
        blocks = batch.block_tables[i]
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


def verify_pairs(
    input_ids: torch.Tensor,  # [B * q] each request's last token, then its q - 1 drafts
    meta: AttentionMetadata,  # the verify step's (positions, slots, seq_idx, tables)
    hidden: torch.Tensor,  # [>= B * q, hidden] the verify's target hidden states
    argmax: torch.Tensor,  # [>= B * q] the argmax of each row's logits
    decided: torch.Tensor,  # [2, B] drafts accepted, the target's token; -1: from the argmax
    q: int,
) -> tuple[DraftInputs, torch.Tensor]:
    """The proposal's pair rows after a step of B verifies of q rows each, on the device: the
    rows `build_pairs` makes, each request padded to q rows (the module docstring's example);
    and [2, B] what each request was taken to have accepted: drafts, then the target's token.

    A request whose `decided` entry is -1 (plain greedy) accepts its drafts while they equal the
    argmax of the row before, and its token is the argmax of the row after them; the others'
    come from the host (draws, logits processors). Pair row r of a request that accepted a
    drafts: the verify's hidden state at row min(r, a), at the verify's position r; the token
    after it is draft r (r < a) or the target's token (r = a); rows past a write no slot. A
    request drafts from row a. Pure device work with no host sync: the same code runs eagerly
    and inside the proposal's CUDA graph."""
    num_seqs = decided.shape[1]
    n = num_seqs * q
    device = input_ids.device
    ids = input_ids[:n].view(num_seqs, q)
    targets = argmax[:n].view(num_seqs, q)
    drafts = ids[:, 1:]
    leading = (drafts == targets[:, :-1]).long().cumprod(1).sum(1)  # [B] drafts the argmax took
    greedy = decided[0] < 0
    accepted = torch.where(greedy, leading, decided[0])
    token = torch.where(greedy, targets.gather(1, leading[:, None])[:, 0], decided[1])
    rows = torch.arange(q, device=device).expand(num_seqs, q)
    pair = rows <= accepted[:, None]
    known = torch.cat([drafts, torch.zeros_like(ids[:, :1])], 1)  # draft r after row r
    tokens = torch.where(rows == accepted[:, None], token[:, None], known)
    first = torch.arange(num_seqs, device=device) * q
    hidden_rows = first[:, None] + torch.minimum(rows, accepted[:, None])
    slots = meta.slot_mapping[:n].view(num_seqs, q)
    inputs = DraftInputs(
        tokens=torch.where(pair, tokens, 0).view(n),
        hidden=hidden.index_select(0, hidden_rows.view(n)),
        meta=AttentionMetadata(
            meta.positions[:n],
            torch.where(pair, slots, -1).view(n),
            meta.seq_idx[:n],
            meta.block_tables,
        ),
        last_rows=first + accepted,
        valid=slots[:, 0] >= 0,  # a graph bucket's padding requests write nothing
    )
    return inputs, torch.stack([accepted, token])


def after_verify(
    model,
    input_ids: torch.Tensor,
    meta: AttentionMetadata,
    hidden: torch.Tensor,
    argmax: torch.Tensor,
    decided: torch.Tensor,
    q: int,
    num_drafts: int,
    share_topk: bool,
) -> torch.Tensor:
    """The whole proposal after a step of verifies (`verify_pairs`' arguments) -> [B, k + 2]:
    each request's k drafts, then the drafts it was taken to have accepted and its token, so
    that the host can check them against its own acceptance in the same copy."""
    inputs, taken = verify_pairs(input_ids, meta, hidden, argmax, decided, q)
    return torch.cat([draft_chain(model, inputs, num_drafts, share_topk), taken.T], 1)


def draft_chain(model, inputs: DraftInputs, num_drafts: int, share_topk: bool) -> torch.Tensor:
    """Draft step 0 over every pair, then steps 1..k-1 -> draft token ids [R, num_drafts].

    Pure device work with no host sync: the same code runs eagerly and inside a CUDA graph."""
    mtp_hidden, step0_topk = model.mtp_forward(inputs.tokens, inputs.hidden, inputs.meta)
    kept = keep_rows(step0_topk, inputs.last_rows) if share_topk else None
    g = mtp_hidden.index_select(0, inputs.last_rows)  # [R, hidden]
    drafts = [ops.argmax(model.mtp_logits(g))]
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
        drafts.append(ops.argmax(model.mtp_logits(g)))
    return torch.stack(drafts, 1)


class MtpProposer:
    """Proposes each sampling request's next k drafts after a step (see the module docstring)."""

    def __init__(self, model, block_size_tokens: int, decode_graphs=None):
        self.model = model
        self.block_size = block_size_tokens
        self.pending: dict[str, _Pending] = {}
        # Proposals launched before the host's acceptance that took another (`propose`)
        self.num_proposed_again = 0
        self.graphs = None
        if decode_graphs is not None:
            from workers.cuda_graph import ProposeGraphs

            self.graphs = ProposeGraphs(model, decode_graphs)

    def forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.pending.pop(rid, None)

    def launch_early(self, step: StepInput, batch: StepTensors, hidden: torch.Tensor) -> None:
        """Right after the target's forward: when every request verifies and is plain greedy
        (no draws, no logits processors), the proposal needs nothing from the host, so it is
        launched now, behind the verify on the device, its drafts on their way to the host
        (`batch.proposal`); `propose` then only reads them."""
        q = self._verify_rows(batch)
        if q is not None and all(s.sampling.decided_by_argmax for s in batch.seqs):
            batch.proposal = self._launch(step, batch, hidden, q, self._decided(batch, q))

    def after_draws(self, step: StepInput, batch: StepTensors, hidden: torch.Tensor):
        """For a step of verifies whose requests draw (and the rest plain greedy), on one rank
        (ranks draw apart until `_agree_on_samples`): a function that launches the proposal
        right behind the batched draw, from its results on the device (`sample_rows`: draws,
        acceptances, [3, rows]) and the step indices of the requests drawn, in order; else
        None. `propose` checks what it took against the host's acceptance and proposes again
        where they differ (a draw the host redid: `resample_inexact`)."""
        q = self._verify_rows(batch)
        seqs = batch.seqs
        if q is None or get_parallel_state().tp_size > 1:
            return None
        if any(s.sampling.greedy and not s.sampling.decided_by_argmax for s in seqs):
            return None  # a greedy request's processed logits are read on the host

        def launch(draws: torch.Tensor, drawn: list[int]) -> None:
            decided = self._decided(batch, q, draws.device)
            rows = draws[:2, : len(drawn) * q].view(2, len(drawn), q)
            accepted = rows[1, :, :-1].cumprod(1).sum(1)
            token = rows[0].gather(1, accepted[:, None])[:, 0]
            index = torch.tensor(drawn, dtype=torch.long).to(draws.device, non_blocking=True)
            decided[:, index] = torch.stack([accepted, token])
            batch.proposal = self._launch(step, batch, hidden, q, decided)

        return launch

    def propose(
        self, step: StepInput, batch: StepTensors, hidden: torch.Tensor, results: list[SeqResult]
    ) -> None:
        """Sets results[i].next_draft_token_ids for every request that sampled this step;
        `hidden` [T, hidden] holds the step's target hidden states.

        After a step of verifies only: the proposal from `verify_pairs` (the proposal graph
        after the verify's when its target replayed one), launched already by `launch_early`
        or `after_draws` when the device knew each request's acceptance; what it took is
        checked against `results`, and proposed again from them where it differs. After a step
        whose target ran as rows of a q = 1 graph (prompts beside verifies): a rows proposal
        graph, unless its pair rows exceed the largest row bucket. Otherwise (and on CPU)
        eagerly."""
        seqs, num_drafts = batch.seqs, step.num_draft_tokens
        if (q := self._verify_rows(batch)) is not None:
            # Every request sampled: its accepted drafts, then its token. Every TP rank takes
            # the same branch below: greedy requests' acceptance comes from the same argmax
            # on each, and draws are launched early on one rank only (`after_draws`).
            taken = [(r.num_accepted_drafts, r.sampled_token_ids[-1]) for r in results]
            rows = self._read(batch.proposal) if batch.proposal is not None else None
            if rows is not None and [tuple(row[num_drafts:]) for row in rows] != taken:
                rows = None  # the host's acceptance differs: propose from it
                self.num_proposed_again += 1
            if rows is None:
                decided = self._decided(batch, q)
                decided[:, : len(seqs)] = torch.tensor(taken, dtype=torch.long).T
                rows = self._read(self._launch(step, batch, hidden, q, decided))
            for result, row in zip(results, rows):
                result.next_draft_token_ids = row[:num_drafts]
            return
        pairs = build_pairs(
            batch, results, hidden, pending=self.pending, block_size=self.block_size
        )
        tables, share_topk = batch.meta.block_tables, step.share_topk
        if not pairs.tokens:
            return
        drafts = None
        if self.graphs is not None and batch.graph_key is not None:
            # The target ran as rows of a q = 1 graph (prompts beside verifies), whose static
            # tables have a row per bucket row: request i's is row i (`pack_step`). The
            # proposal runs as rows of a graph too, unless its pair rows exceed the largest
            # row bucket.
            tables = tables[: len(seqs)]
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

    def _verify_rows(self, batch: StepTensors) -> int | None:
        """q when the step is verifies only (`StepTensors.verify_rows`), its target ran eagerly
        or as its own verify graph, and no request holds a pending hidden state (a verify never
        does; `build_pairs` would consume one)."""
        if self.graphs is not None and batch.graph_key is not None and not batch.graphable:
            return None  # ran as rows of a q = 1 graph: the rows proposal graph's (`propose`)
        if self.pending and any(s.request_id in self.pending for s in batch.seqs):
            return None
        return batch.verify_rows

    def _graphed(self, batch: StepTensors) -> bool:
        return self.graphs is not None and batch.graphable

    def _decided(
        self, batch: StepTensors, q: int, device: torch.device | None = None
    ) -> torch.Tensor:
        """[2, width] all -1 (the argmax decides), on `device` or else on the host (pinned on
        CUDA): width is the proposal graph's bucket, or the step's requests when eager."""
        num_seqs = len(batch.seqs)
        width = self.graphs.decode.bucket(num_seqs, q) if self._graphed(batch) else num_seqs
        if device is not None:
            return torch.full((2, width), -1, dtype=torch.long, device=device)
        pinned = batch.input_ids.device.type == "cuda"
        return torch.full((2, width), -1, dtype=torch.long, pin_memory=pinned)

    def _launch(
        self,
        step: StepInput,
        batch: StepTensors,
        hidden: torch.Tensor,
        q: int,
        decided: torch.Tensor,  # [2, width] (`_decided`), host (pinned) or device
    ) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """The proposal after a step of verifies only (`after_verify`) -> its rows [B, k + 2]
        and, on CUDA, the event of their copy to the host (pinned), started here."""
        num_seqs, k, share = len(batch.seqs), step.num_draft_tokens, step.share_topk
        device = hidden.device
        if self._graphed(batch):
            rows = self.graphs.run(decided, num_seqs, q, k, share)
        else:
            rows = after_verify(
                self.model,
                batch.input_ids,
                batch.meta,
                hidden,
                batch.argmax_device,
                decided.to(device, non_blocking=True),
                q,
                k,
                share,
            )
        return start_copy_to_host(rows)

    @staticmethod
    def _read(proposal: tuple[torch.Tensor, torch.cuda.Event | None]) -> list[list[int]]:
        rows, copied = proposal
        if copied is not None:
            copied.synchronize()
        return rows.tolist()

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
