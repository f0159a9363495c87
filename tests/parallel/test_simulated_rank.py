"""A simulated rank (ParallelState.simulated): one process with rank r's shards of tp_size ranks
and no group. Each layer computes what rank r computes before its collective, the collective
moves nothing but is recorded, and results keep the real collective's shape: so summing or
stacking the simulated ranks' results gives the unsharded computation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from parallel.state import ParallelState, get_parallel_state, set_parallel_state

TP = 4
TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture
def as_rank():
    previous = get_parallel_state()

    def become(rank: int) -> ParallelState:
        state = ParallelState(tp_rank=rank, tp_size=TP, ep_size=1, simulated=True)
        set_parallel_state(state)
        return state

    yield become
    set_parallel_state(previous)


def test_row_parallel_partials_sum_to_the_full_matmul(as_rank):
    from parallel.linear import RowParallelLinear

    gen = torch.Generator().manual_seed(0)
    w, x = torch.randn(5, 12, generator=gen), torch.randn(7, 12, generator=gen)
    total = torch.zeros(7, 5)
    for rank in range(TP):
        state = as_rank(rank)
        layer = RowParallelLinear(12, 5, torch.float32)
        layer.weight.weight_loader(layer.weight, w)
        # rank r's partial: its 3 input columns only (the all-reduce would add the others')
        partial = layer(x[:, rank * 3 : (rank + 1) * 3].contiguous())
        assert state.simulated_collectives == [("all_reduce", (7, 5), torch.float32)]
        total += partial
    torch.testing.assert_close(total, F.linear(x, w), **TOL)


def test_vocab_parallel_embedding_and_head(as_rank):
    from parallel.embedding import ParallelLMHead, VocabParallelEmbedding

    gen = torch.Generator().manual_seed(1)
    vocab, hidden = 10, 6  # 3 rows a rank; the last rank's slice is padded
    table = torch.randn(vocab, hidden, generator=gen)
    ids = torch.tensor([0, 9, 4, 3, 7])
    h = torch.randn(5, hidden, generator=gen)
    full_logits = h @ table.t()
    embedded = torch.zeros(5, hidden)
    for rank in range(TP):
        state = as_rank(rank)
        embed = VocabParallelEmbedding(vocab, hidden, torch.float32)
        embed.weight.weight_loader(embed.weight, table)
        embedded += embed(ids)
        head = ParallelLMHead(vocab, hidden, torch.float32)
        head.weight.weight_loader(head.weight, table)
        logits = head(h)
        # The gather's shape, with this rank's slice where the real gather puts it.
        assert logits.shape == (5, vocab)
        lo, hi = rank * 3, min(vocab, (rank + 1) * 3)
        torch.testing.assert_close(logits[:, lo:hi], full_logits[:, lo:hi], **TOL)
        assert state.simulated_collectives == [
            ("all_reduce", (5, hidden), torch.float32),
            ("all_gather", (5, 3), torch.float32),
        ]
    torch.testing.assert_close(embedded, F.embedding(ids, table), **TOL)


def test_the_top_k_source_computes_and_no_other_simulated_rank_can_receive(as_rank):
    from parallel.collectives import tp_compute_on_one_rank

    state = as_rank(0)
    out = tp_compute_on_one_rank(
        lambda: torch.arange(6, dtype=torch.int32).view(2, 3), (2, 3), torch.int32, "cpu", 0
    )
    assert out.tolist() == [[0, 1, 2], [3, 4, 5]]
    assert state.simulated_collectives == [("broadcast", (2, 3), torch.int32)]
    as_rank(1)
    with pytest.raises(ValueError, match="simulate the source rank"):
        tp_compute_on_one_rank(lambda: None, (2, 3), torch.int32, "cpu", 0)


def test_a_simulated_rank_has_no_group_and_serving_state_is_not_simulated():
    assert not ParallelState().simulated
    with pytest.raises(ValueError, match="no process group"):
        ParallelState(tp_size=2, simulated=True, tp_group=object())
