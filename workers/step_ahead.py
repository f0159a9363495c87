"""Steps that overlap (`EngineConfig.overlap_steps`): the next step's greedy decodes, launched
by the model runner before it reads this step's tokens, and what the next step takes from them.

Step n of requests A (greedy) and B (sampled): the runner replays n's forward, then at once
launches A's next decode (`choose_rows`, then the runner's prepare and forward), fed A's token
from n's argmax on the device (`gather_tokens`), at the next position, into the slot the
scheduler keeps for it (`cluster.config.lookahead_slots`). Only then does it read n's tokens
and return; the GPU runs A's decode while the engine updates and schedules. Step n + 1 comes
with A's decode (as launched: its token, position and block table) and B's: A's row is taken
(`StepAhead.reusable`), B runs as usual. A request that stopped or was aborted wastes its row;
the row's cache write lands in a slot that no one reads before writing it again (the request's
own next step, or a block's next owner, later on the same stream).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.batch import SamplingSpec, SeqResult, SeqWork, StepInput
from workers.step_tensors import StepTensors


def overlap_on(overlap_steps: str, device_type: str) -> bool:
    """Whether a rank on `device_type` launches steps ahead (`EngineConfig.overlap_steps`:
    "auto" on CUDA, where the launch is asynchronous; "on" anywhere; "off" never)."""
    return overlap_steps == "on" or (overlap_steps == "auto" and device_type == "cuda")


def plain_greedy(spec: SamplingSpec) -> bool:
    """Greedy with nothing read but the argmax: no logits processors, no logprobs."""
    return spec.decided_by_argmax and spec.num_logprobs is None


@dataclass
class AheadRow:
    """One request's decode in the step launched ahead: its row there, the position it computed
    and what the step it followed sampled (the token it was fed on the device)."""

    row: int
    position: int
    sampling: SamplingSpec
    table_len: int  # the block-table entries its slot was taken from
    token: int = -1  # set once the step before it has read its tokens (`record_tokens`)


@dataclass
class AheadRows:
    """The rows of a step to launch ahead, in order, and where each one's token comes from."""

    rows: dict[str, AheadRow]
    seqs: list[SeqWork]  # one token each (a placeholder: the device fills it) at the next position
    tables: list  # each one's whole block table
    sources: list[tuple[int, int]]  # (0: the step launched ahead / 1: the step's batch, row)


def choose_rows(
    step: StepInput,
    tables: list,
    reused: dict[int, int],
    rest: list[int],
    batch: StepTensors | None,
    block_size: int,
) -> AheadRows | None:
    """The next decode of every sequence of `step` that decodes greedily with nothing but the
    argmax and whose next slot is allocated; fed from the step launched ahead's argmax for the
    `reused` sequences (index in the step -> row there), from `batch`'s (the step's `rest`) for
    the others. None when no sequence qualifies."""
    rest_rows = {}  # index in the step -> its last logit row in `batch`
    if batch is not None:
        cursor = 0
        for i, s in zip(rest, batch.seqs):
            if s.samples:
                cursor += s.num_draft_tokens + 1
                rest_rows[i] = cursor - 1
    chosen = AheadRows({}, [], [], [])
    for i, s in enumerate(step.seqs):
        spec = s.sampling
        if not s.samples or s.num_draft_tokens or not plain_greedy(spec):
            continue
        position = s.start_position + len(s.token_ids)
        table = tables[i]
        if position // block_size >= len(table):
            continue  # its next slot is not allocated yet
        chosen.rows[s.request_id] = AheadRow(len(chosen.seqs), position, spec, len(table))
        chosen.seqs.append(SeqWork(s.request_id, [0], position, [], 0, True, spec))
        chosen.tables.append(table)
        row = reused.get(i)
        chosen.sources.append((0, row) if row is not None else (1, rest_rows[i]))
    return chosen if chosen.seqs else None


def gather_tokens(
    sources: list[tuple[int, int]],
    ahead: StepAhead | None,
    batch: StepTensors | None,
    device: torch.device,
) -> torch.Tensor:
    """The device tokens at `sources` ((0, row): of the step launched ahead, (1, row): of
    `batch`'s argmax), in order: a slice when they are one argmax's first rows."""
    parts = {0: ahead.argmax_device if ahead is not None else None}
    if batch is not None:
        parts[1] = batch.argmax_device
    kinds = sorted({kind for kind, _ in sources})
    if len(kinds) == 1:
        rows = [row for _, row in sources]
        if rows == list(range(len(rows))):
            return parts[kinds[0]][: len(rows)]
    # One index into the argmaxes the rows come from, laid end to end.
    offset = {0: 0, 1: len(parts[0]) if kinds[0] == 0 else 0}
    index = torch.tensor(
        [offset[kind] + row for kind, row in sources],
        dtype=torch.long,
        pin_memory=device.type == "cuda",
    )
    source = parts[kinds[0]] if len(kinds) == 1 else torch.cat([parts[0], parts[1]])
    return source.index_select(0, index.to(device, non_blocking=True))


@dataclass
class StepAhead:
    """A step launched ahead (the module docstring): its rows and its argmax on the way."""

    rows: dict[str, AheadRow]
    argmax: torch.Tensor  # [n] on the host (pinned on CUDA), valid once `copied` is done
    # [n] on the device, its own copy (a later replay of the same graph rewrites the graph's)
    argmax_device: torch.Tensor
    copied: torch.cuda.Event | None

    def reusable(self, step: StepInput) -> dict[int, int]:
        """The step's sequences this step already computed -> {index in the step: row here}: a
        plain greedy decode of the token it was fed, at the position it was fed at, over the
        block-table entries its slot came from (a preempted request's table is sent again from
        its start)."""
        preempted = step.preempted_request_ids
        reused = {}
        for i, s in enumerate(step.seqs):
            row = self.rows.get(s.request_id)
            if row is None:
                continue
            ids = s.token_ids
            if (
                len(ids) == 1
                and ids[0] == row.token
                and s.start_position == row.position
                and s.block_table_start >= row.table_len
                and s.samples
                and (s.sampling is row.sampling or s.sampling == row.sampling)
                and not (preempted and s.request_id in preempted)
            ):
                reused[i] = row.row
        return reused

    def results(self, step: StepInput, reused: dict[int, int]) -> dict[int, SeqResult]:
        """The `reused` sequences' results (waits for this step's tokens)."""
        if self.copied is not None:
            self.copied.synchronize()
        picked = self.argmax.tolist()
        return {i: SeqResult(step.seqs[i].request_id, [picked[row]]) for i, row in reused.items()}

    def record_tokens(self, seqs: list[SeqWork], results: list[SeqResult]) -> None:
        """What the step before this one sampled: the tokens its rows were fed."""
        for s, result in zip(seqs, results):
            if (row := self.rows.get(s.request_id)) is not None:
                row.token = result.sampled_token_ids[-1]
