"""Exact ties in the indexer's scores are common, not rare: a key whose every head's score is
negative scores exactly 0 after the ReLU, so with few indexer heads a quarter or more of the keys
tie. Which tied keys make the top-k must depend on the token alone, never on the batch around it:
a verify step's rows are scored in a table as wide as the batch's latest position, a decode
step's as wide as the token's own. The twin once took torch.topk's pick among ties, which moves
with the row's width, and MTP changed greedy output on such checkpoints (issue 14).
"""

from __future__ import annotations

import torch

from kernels.indexer import indexer_topk_reference, topk_select_reference


def _earliest_first_oracle(values: list[float], p: int, topk: int) -> list[int]:
    return sorted(sorted(range(p + 1), key=lambda i: (-values[i], i))[:topk])


def test_ties_go_to_the_earlier_position_whatever_the_width() -> None:
    torch.manual_seed(0)
    topk, p = 8, 14
    row = torch.zeros(64)
    row[[1, 5, 7]] = 1.0  # three clear winners, two clear losers, the rest tie at exactly 0
    row[[2, 3]] = -1.0
    expected = _earliest_first_oracle(row.tolist(), p, topk)
    for width in range(p + 1, 64):
        logits = row[:width].clone()[None]
        logits[0, p + 1 :] = torch.randn(width - p - 1)  # keys past the position: never read
        got = topk_select_reference(logits, torch.tensor([p]), topk)[0]
        assert sorted(got.tolist()) == expected, width


def test_a_token_picks_the_same_keys_alone_and_in_a_verify_batch() -> None:
    """The same query at position 14 scored alone (a decode step) and next to a later token of
    its sequence (a verify step): two indexer heads, keys whose scores are often exactly 0."""
    torch.manual_seed(5)
    heads, dim, topk = 2, 16, 12
    k_cache = torch.randn(1, 64, dim)
    tables = torch.zeros(1, 1, dtype=torch.int32)
    q = torch.randn(1, heads, dim)
    weights = torch.rand(1, heads) + 0.5
    alone = indexer_topk_reference(
        q, weights, k_cache, tables, torch.zeros(1, dtype=torch.long), torch.tensor([14]), topk, 1.0
    )
    verify = indexer_topk_reference(
        q.expand(4, heads, dim),
        weights.expand(4, heads),
        k_cache,
        tables,
        torch.zeros(4, dtype=torch.long),
        torch.tensor([14, 15, 16, 17]),
        topk,
        1.0,
    )
    scores = torch.einsum("hd,sd->hs", q[0], k_cache[0, :15]).relu()
    logits = (weights[0, :, None] * scores).sum(0)
    # The boundary falls inside the tie at 0: fewer than topk keys score above it.
    assert (logits > 0).sum() < topk < 15
    assert sorted(verify[0].tolist()) == sorted(alone[0].tolist())
    assert sorted(alone[0].tolist()) == _earliest_first_oracle(logits.tolist(), 14, topk)


def test_a_prompt_chunks_tokens_pick_what_each_picks_alone() -> None:
    """The twin scores a run of a prompt's tokens against one gather of its sequence's keys
    (`RUN_MIN_TOKENS` or more) and the step's other tokens each against their own: a step of a
    20-token chunk, a decode, a 4-row verify and a 9-token chunk over shuffled blocks, with two
    indexer heads (ties at exactly 0 common). Every row equals the token's row scored alone (a
    decode step) and the earliest-first oracle's."""
    from kernels.paged import RUN_MIN_TOKENS

    torch.manual_seed(11)
    heads, dim, topk, block = 2, 16, 12, 8
    k_cache = torch.randn(24, block, dim)
    tables = torch.randperm(24, dtype=torch.int32).view(4, 6)
    runs = [(0, range(10, 30)), (1, range(40, 41)), (2, range(20, 24)), (3, range(0, 9))]
    assert [len(r) >= RUN_MIN_TOKENS for _, r in runs] == [True, False, False, True]
    seq_idx = torch.tensor([s for s, r in runs for _ in r])
    positions = torch.tensor([p for _, r in runs for p in r])
    q = torch.randn(len(positions), heads, dim)
    weights = torch.rand(len(positions), heads) + 0.5
    step = indexer_topk_reference(q, weights, k_cache, tables, seq_idx, positions, topk, 1.0)
    for t, (s, p) in enumerate(zip(seq_idx.tolist(), positions.tolist())):
        alone = indexer_topk_reference(
            q[t : t + 1],
            weights[t : t + 1],
            k_cache,
            tables,
            seq_idx[t : t + 1],
            positions[t : t + 1],
            topk,
            1.0,
        )[0]
        slots = torch.arange(p + 1)
        keys = k_cache[tables[s, slots // block].long(), slots % block]
        logits = (weights[t, :, None] * torch.einsum("hd,sd->hs", q[t], keys).relu()).sum(0)
        expected = _earliest_first_oracle(logits.tolist(), p, topk)
        assert sorted(v for v in step[t].tolist() if v >= 0) == expected, (t, s, p)
        assert torch.equal(step[t], alone), (t, s, p)
