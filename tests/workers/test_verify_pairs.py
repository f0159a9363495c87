"""The proposal's pair rows after a step of verifies, built on the device (`verify_pairs`, what
the proposal graph runs after a verify graph), against the host's `build_pairs`, row for row:
greedy requests' acceptance from the argmax, the others' from the host, padded rows and padded
requests writing nothing. A wrong pair row changes only the drafts (greedy output stays the
same), so the engine's identity tests cannot see one: this test can."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from workers.attention_metadata import AttentionMetadata
from workers.batch import SamplingSpec, SeqResult, SeqWork, verify_rows
from workers.mtp_proposer import build_pairs, verify_pairs
from workers.sampler import verify_and_sample
from workers.step_tensors import StepLayout, StepTensors, pack_step

BLOCK = 4
VOCAB = 6  # few tokens, so drafts often equal the argmax


def _step(rng: random.Random, num_seqs: int, q: int, bucket: int):
    """A verify step of `num_seqs` requests, q rows each, packed into a `bucket`-request layout
    (as a verify graph's static inputs) -> the step, the bucket's input ids, its argmax rows
    and, per request, the host's decision (None: greedy, from the argmax)."""
    seqs, tables = [], []
    for i in range(num_seqs):
        start = rng.randrange(0, 40)
        table = np.array(rng.sample(range(1, 500), (start + q - 1) // BLOCK + 1), dtype=np.int32)
        tokens = [rng.randrange(VOCAB) for _ in range(q)]
        seqs.append(SeqWork(f"r{i}", tokens, start, list(table), q - 1, True))
        tables.append(table)
    layout = StepLayout(bucket * q, bucket, 16)
    flat = torch.zeros(layout.numel, dtype=torch.long)
    pack_step(seqs, BLOCK, layout, flat.numpy(), tables)
    input_ids, positions, slots, seq_idx, device_tables = layout.views(flat)
    meta = AttentionMetadata(positions, slots, seq_idx, device_tables)
    argmax = torch.randint(0, VOCAB, (bucket * q,), generator=torch.Generator().manual_seed(q))
    decisions = []
    for _ in range(num_seqs):
        if rng.random() < 0.5:
            decisions.append(None)
        else:
            accepted = rng.randrange(q)
            decisions.append((accepted, rng.randrange(VOCAB)))
    batch = StepTensors(
        seqs=seqs,
        block_tables=tables,
        input_ids=input_ids[: num_seqs * q],
        meta=meta,
        offsets=[i * q for i in range(num_seqs)],
        logit_rows=list(range(num_seqs * q)),
        graphable=True,
    )
    return batch, input_ids, argmax, decisions


def _results(batch: StepTensors, argmax: torch.Tensor, decisions: list) -> list[SeqResult]:
    """What the host's sampler gives each request: greedy acceptance from the argmax rows, or
    the decision (drafts accepted, then the token) as a draw would make it."""
    results, q = [], len(batch.seqs[0].token_ids)
    for i, (s, decision) in enumerate(zip(batch.seqs, decisions)):
        drafts = s.token_ids[1:]
        if decision is None:
            rows = argmax[i * q : (i + 1) * q].tolist()
            tokens, accepted = verify_and_sample(None, drafts, SamplingSpec(), None, rows)
        else:
            accepted, token = decision
            tokens = drafts[:accepted] + [token]
        results.append(SeqResult(s.request_id, tokens, accepted))
    return results


@pytest.mark.parametrize(
    "num_seqs,q,bucket", [(1, 1, 1), (1, 2, 1), (3, 4, 4), (5, 3, 8), (8, 2, 8)]
)
def test_device_pairs_are_the_host_pairs(num_seqs, q, bucket):
    rng = random.Random(num_seqs * 100 + q * 10 + bucket)
    for _ in range(20):
        batch, input_ids, argmax, decisions = _step(rng, num_seqs, q, bucket)
        assert verify_rows(batch.seqs) == q
        hidden = torch.randn(bucket * q, 3)
        results = _results(batch, argmax, decisions)
        host = build_pairs(batch, results, hidden, pending={}, block_size=BLOCK)
        decided = torch.full((2, bucket), -1, dtype=torch.long)
        for i, decision in enumerate(decisions):
            if decision is not None:
                decided[:, i] = torch.tensor(decision)
        got, taken = verify_pairs(input_ids, batch.meta, hidden, argmax, decided, q)
        expected = [(r.num_accepted_drafts, r.sampled_token_ids[-1]) for r in results]
        assert [tuple(t) for t in taken.T.tolist()[:num_seqs]] == expected

        slots = got.meta.slot_mapping.tolist()
        assert slots[num_seqs * q :] == [-1] * ((bucket - num_seqs) * q)  # padding requests
        assert got.valid.tolist() == [True] * num_seqs + [False] * (bucket - num_seqs)
        # The rows that write a slot are build_pairs' rows, in order.
        real = [r for r, slot in enumerate(slots) if slot >= 0]
        assert [slots[r] for r in real] == host.slots
        assert [got.tokens[r].item() for r in real] == host.tokens
        assert [got.meta.positions[r].item() for r in real] == host.positions
        assert [got.meta.seq_idx[r].item() for r in real] == host.seq_idx
        assert torch.equal(got.hidden[real], hidden[host.hidden_rows])
        # Each request drafts from its last accepted pair.
        assert host.drafting_seqs == list(range(num_seqs))
        last = got.last_rows[:num_seqs].tolist()
        assert [real.index(r) for r in last] == host.last_rows
        # A request's rows past its accepted ones: its verify's positions, the last pair's
        # hidden state, token 0, no slot.
        for i in range(num_seqs):
            for r in range(last[i] + 1, (i + 1) * q):
                assert got.meta.positions[r].item() == batch.seqs[i].start_position + r - i * q
                assert torch.equal(got.hidden[r], got.hidden[last[i]])
                assert got.tokens[r].item() == 0 and slots[r] == -1
        assert torch.equal(got.meta.block_tables, batch.meta.block_tables)


def test_only_steps_of_equal_verifies_have_verify_rows():
    def work(tokens: int, drafts: int, samples: bool = True) -> SeqWork:
        return SeqWork("r", [1] * tokens, 10, [1, 2, 3, 4], drafts, samples)

    assert verify_rows([work(3, 2), work(3, 2)]) == 3
    assert verify_rows([work(1, 0)]) == 1  # drafts cut to none near max_tokens
    assert verify_rows([work(3, 2), work(2, 1)]) is None  # unequal
    assert verify_rows([work(3, 2), work(5, 0)]) is None  # a prompt's last chunk beside
    assert verify_rows([work(3, 0, samples=False)]) is None  # a non-final chunk
