"""The parallel layers over a real 2-rank gloo group (two Ray actors): every sharded layer's
result equals the unsharded computation done here, in one process."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.timeout(180)

TP = 2
# fp32: a matmul over a slice of the weight may block its sums differently than over the whole.
TOL = dict(rtol=1e-6, atol=1e-6)


@pytest.fixture(scope="module")
def ranks(ray_local):
    """Two bare WorkerActors (no model) that have formed a TP=2 gloo group."""
    ray = ray_local
    from cluster.ray_executor import RayExecutor
    from workers.worker import bare_worker_spec
    from workers.worker_actor import WorkerActor

    # The functions below run inside the actors: ship them by value, not by module name.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    spec = bare_worker_spec(TP, topk_src_rank=0)
    actor_cls = ray.remote(WorkerActor).options(num_cpus=0.25)
    actors = [actor_cls.remote(rank, spec) for rank in range(TP)]
    address = ray.get(actors[0].open_store.remote(), timeout=60)
    RayExecutor._get_all([a.init_distributed.remote(address) for a in actors], 120)
    yield actors
    for a in actors:
        ray.kill(a)


def on_all_ranks(ranks, fn, *args) -> list:
    import ray

    return ray.get([a.run.remote(fn, *args) for a in ranks], timeout=60)


def _column(actor, w, x):
    from parallel.collectives import tp_all_gather_last_dim
    from parallel.linear import ColumnParallelLinear

    layer = ColumnParallelLinear(w.shape[1], w.shape[0], torch.float32)
    layer.weight.weight_loader(layer.weight, w)
    local = layer(x)
    return local, tp_all_gather_last_dim(local.clone())


def _merged(actor, gate, up, x):
    from parallel.linear import MergedColumnParallelLinear

    layer = MergedColumnParallelLinear(gate.shape[1], [gate.shape[0], up.shape[0]], torch.float32)
    layer.weight.weight_loader(layer.weight, gate, 0)
    layer.weight.weight_loader(layer.weight, up, 1)
    return layer(x)


def _row(actor, w, x):
    from parallel.linear import RowParallelLinear
    from parallel.state import get_parallel_state

    layer = RowParallelLinear(w.shape[1], w.shape[0], torch.float32)
    layer.weight.weight_loader(layer.weight, w)
    state = get_parallel_state()
    part = x.shape[1] // state.tp_size
    return layer(x[:, state.tp_rank * part : (state.tp_rank + 1) * part])


def _embedding_and_head(actor, w, ids, hidden):
    from parallel.embedding import ParallelLMHead, VocabParallelEmbedding

    emb = VocabParallelEmbedding(w.shape[0], w.shape[1], torch.float32)
    emb.weight.weight_loader(emb.weight, w)
    head = ParallelLMHead(w.shape[0], w.shape[1], torch.float32)
    head.weight.weight_loader(head.weight, w)
    return emb(ids), head(hidden)


def _compute_on_rank0(actor, x):
    from parallel.collectives import tp_compute_on_one_rank

    calls = []

    def compute():
        calls.append(1)
        return x * 2

    out = tp_compute_on_one_rank(compute, tuple(x.shape), x.dtype, x.device, src_tp_rank=0)
    return out, len(calls)


@pytest.mark.parametrize("num_tokens", [1, 7])
def test_column_parallel(ranks, num_tokens):
    g = torch.Generator().manual_seed(num_tokens)
    w, x = torch.randn(12, 9, generator=g), torch.randn(num_tokens, 9, generator=g)
    expected = x @ w.T
    outs = on_all_ranks(ranks, _column, w, x)
    for rank, (local, gathered) in enumerate(outs):
        torch.testing.assert_close(local, expected[:, rank * 6 : (rank + 1) * 6], **TOL)
        torch.testing.assert_close(gathered, expected, **TOL)
    torch.testing.assert_close(outs[0][1], outs[1][1], rtol=0, atol=0)  # one gathered result


def test_merged_column_parallel(ranks):
    g = torch.Generator().manual_seed(1)
    gate, up = torch.randn(6, 5, generator=g), torch.randn(10, 5, generator=g)
    x = torch.randn(7, 5, generator=g)
    outs = on_all_ranks(ranks, _merged, gate, up, x)
    for rank, local in enumerate(outs):
        # This rank's slice of gate, then its slice of up.
        expected = torch.cat(
            [(x @ gate.T)[:, rank * 3 : rank * 3 + 3], (x @ up.T)[:, rank * 5 : rank * 5 + 5]],
            dim=-1,
        )
        torch.testing.assert_close(local, expected, **TOL)


@pytest.mark.parametrize("num_tokens", [1, 7])
def test_row_parallel(ranks, num_tokens):
    g = torch.Generator().manual_seed(10 + num_tokens)
    w, x = torch.randn(5, 10, generator=g), torch.randn(num_tokens, 10, generator=g)
    outs = on_all_ranks(ranks, _row, w, x)
    for out in outs:  # two partial sums in another order: rounding only
        torch.testing.assert_close(out, x @ w.T, **TOL)
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)  # all-reduce: identical bits


def test_vocab_parallel_embedding_and_head(ranks):
    # 11 rows over 2 ranks: rank 1 holds 5 real rows and one zero pad row.
    g = torch.Generator().manual_seed(2)
    w = torch.randn(11, 6, generator=g)
    ids = torch.tensor([0, 5, 6, 10, 3, 10, 7])
    hidden = torch.randn(3, 6, generator=g)
    for emb, logits in on_all_ranks(ranks, _embedding_and_head, w, ids, hidden):
        torch.testing.assert_close(emb, F.embedding(ids, w), rtol=0, atol=0)  # a copy: exact
        torch.testing.assert_close(logits, hidden @ w.T, **TOL)


def test_compute_on_one_rank_broadcasts(ranks):
    x = torch.arange(12, dtype=torch.int32).view(3, 4)
    outs = on_all_ranks(ranks, _compute_on_rank0, x)
    assert [calls for _, calls in outs] == [1, 0]  # rank 1 skipped the work
    for out, _ in outs:
        assert torch.equal(out, x * 2)
