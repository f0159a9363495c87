"""Warm before ready: which graphs a rank captures, in which order, and that the engine has
warmed its ranks up before anyone can reach it (CPU: nothing to capture, the path still runs)."""

from __future__ import annotations

import contextlib

import pytest

from kernels.settings import reload_settings
from tests.workers.arrivals import record_graph_keys
from workers.batch import SeqWork, StepInput
from workers.worker import (
    WARM_UP_REQUEST_ID,
    WarmUp,
    Worker,
    warm_up_keys,
    warm_up_prefill_lengths,
)


def test_warm_up_keys_cover_every_bucket_in_one_order():
    assert warm_up_keys([1, 2, 4], 0, False, True) == [
        ("decode", (1, 1)),
        ("decode", (2, 1)),
        ("decode", (4, 1)),
    ]
    assert warm_up_keys([1, 8], 3, True, True) == [
        ("decode", (1, 4)),
        ("propose", (1, 4, 3, True)),
        ("decode", (8, 4)),
        ("propose", (8, 4, 3, True)),
    ]
    assert warm_up_keys([1, 8], 2, False, False) == [("decode", (1, 3)), ("decode", (8, 3))]
    assert warm_up_keys([], 2, False, True) == []  # eager: nothing
    # Row buckets (q = 1) after, each once: MTP off they extend the decode buckets.
    assert warm_up_keys([1, 2], 0, False, True, [1, 2, 4]) == [
        ("decode", (1, 1)),
        ("decode", (2, 1)),
        ("decode", (4, 1)),
    ]
    assert warm_up_keys([1], 1, False, True, [1, 2]) == [
        ("decode", (1, 2)),
        ("propose", (1, 2, 1, False)),
        ("decode", (1, 1)),
        ("propose_rows", (1, 1, False)),
        ("decode", (2, 1)),
        ("propose_rows", (2, 1, False)),
    ]


class _Graphs:
    """Stands in for DecodeGraphs / ProposeGraphs (CUDA only): records what is captured."""

    def __init__(self, buckets, log, row_buckets=None, decode=None):
        self.buckets, self.graphs, self.row_graphs, self.log = buckets, {}, {}, log
        self.row_buckets = row_buckets or buckets
        self.max_batch, self.max_rows = buckets[-1], self.row_buckets[-1]
        self.decode = decode or self  # whose pool the captures go to (ProposeGraphs: the decode's)
        self.sharing = False

    @contextlib.contextmanager
    def shared_pool(self):
        self.sharing = True
        yield
        self.sharing = False

    def capture_rows(self, *key):
        assert self.decode.sharing  # the warm-up's graphs share one pool
        self.log.append(("propose_rows", key))
        self.row_graphs[key] = object()

    def capture(self, *key):  # DecodeGraphs: (batch, q); ProposeGraphs: (batch, q, k, share)
        assert self.decode.sharing
        self.log.append(("propose" if len(key) == 4 else "decode", key))
        self.graphs[key] = object()


@pytest.fixture(scope="module")
def worker(tiny_model_dir):
    return Worker(tiny_model_dir, device="cpu", dtype="float32", num_kv_blocks=8)


def test_cpu_worker_has_nothing_to_capture(worker):
    assert worker.runner.graphs is None
    assert worker.warm_up(2, True).num_graphs == 0


def test_worker_captures_every_key_once(worker, monkeypatch):
    monkeypatch.setattr(worker, "_warm_up_prefill", lambda *args: None)  # eager, not graphs
    log: list = []
    proposer = worker.runner.proposer
    graphs, propose = worker.runner.graphs, proposer.graphs
    worker.runner.graphs = _Graphs([1, 2, 4], log)
    proposer.graphs = _Graphs([1, 2, 4], log, decode=worker.runner.graphs)
    try:
        worker.runner.graphs.graphs[(2, 3)] = object()  # already captured: kept
        result = worker.warm_up(2, False)
        keys = warm_up_keys([1, 2, 4], 2, False, True, [1, 2, 4])
        assert log == [k for k in keys if k[1] != (2, 3)]
        assert result.num_graphs == 12  # 3 verifies, 3 proposals, per row bucket 2
        log.clear()
        worker.warm_up(2, False)
        assert log == []  # a second warm-up captures nothing again
    finally:
        worker.runner.graphs, proposer.graphs = graphs, propose


def test_worker_captures_the_row_buckets(worker, monkeypatch):
    """Every q = 1 row bucket (steps that prefill replay them), after the decode or verify
    graphs of the decode buckets, each once."""
    monkeypatch.setattr(worker, "_warm_up_prefill", lambda *args: None)
    log: list = []
    proposer = worker.runner.proposer
    graphs, propose = worker.runner.graphs, proposer.graphs
    worker.runner.graphs = _Graphs([1, 2, 4], log, row_buckets=[1, 2, 4, 8, 16])
    proposer.graphs = _Graphs([1, 2, 4], log, decode=worker.runner.graphs)
    try:
        worker.warm_up(0, False)
        assert log == [("decode", (b, 1)) for b in (1, 2, 4, 8, 16)]
        log.clear()
        worker.runner.graphs = _Graphs([1, 2, 4], log, row_buckets=[1, 2, 4, 8, 16])
        proposer.graphs.decode = worker.runner.graphs
        worker.warm_up(1, False)
        decode = [(1, 2), (2, 2), (4, 2), (1, 1), (2, 1), (4, 1), (8, 1), (16, 1)]
        assert [key for kind, key in log if kind == "decode"] == decode
        proposals = [(b, 2, 1, False) for b in (1, 2, 4)]
        assert [key for kind, key in log if kind == "propose"] == proposals
        rows = [key for kind, key in log if kind == "propose_rows"]
        assert rows == [(b, 1, False) for b in (1, 2, 4, 8, 16)]
    finally:
        worker.runner.graphs, proposer.graphs = graphs, propose


def test_prefill_warm_up_runs_each_length_and_leaves_no_trace(worker):
    """The warm-up's dummy requests: per length a prefill and one verify step, each with the
    proposal after it; afterwards the runner holds nothing of the dummy request, and a real
    request samples and drafts exactly what it did before."""

    def real_request(request_id):
        prompt = [5, 9, 2, 7, 11, 3, 8, 1, 4, 6]
        step = StepInput([SeqWork(request_id, prompt, 0, [5, 6], 0, samples=True)], 2)
        [result] = worker.runner.execute(step).results
        worker.runner.execute(StepInput([], finished_request_ids=[request_id]))
        return result.sampled_token_ids, result.next_draft_token_ids

    before = real_request("before")
    seen, dense = [], []
    execute, prepare = worker.runner.execute, worker.runner._prepare

    def spy(step):
        seen.append([(len(s.token_ids), s.samples, step.num_draft_tokens) for s in step.seqs])
        return execute(step)

    def spy_prepare(seqs, tables):
        batch = prepare(seqs, tables)
        dense.append(batch.meta.dense is not None)
        return batch

    worker.runner.execute, worker.runner._prepare = spy, spy_prepare
    assert worker.runner.dense_prompts  # the CPU's default
    try:
        worker._warm_up_prefill(2, False)
    finally:
        del worker.runner.execute, worker.runner._prepare
    assert worker.runner.dense_prompts  # restored
    # Per length: the prefill, then a verify of the sampled token and its 2 drafts; the first
    # length first with its prompt step dense (prompts before index_topk attend so), then every
    # length on the sparse path.
    lengths = warm_up_prefill_lengths(worker.runner.block_size, False, worker.max_seq_slots)
    lengths = lengths[:1] + lengths
    expected = [[step] for n in lengths for step in ((n, True, 2), (3, True, 2))]
    assert [entry for entry in seen if entry] == expected
    assert dense == [True] + [False] * (len(expected) - 1)
    assert WARM_UP_REQUEST_ID not in worker.runner.states
    assert WARM_UP_REQUEST_ID not in worker.runner.proposer.pending
    assert real_request("after") == before


def test_engine_is_warm_before_it_exists(tiny_model_dir, monkeypatch):
    """The engine (so the Serve replica's __init__, so its readiness) returns only after the
    warm-up ran, with the draft length the engine will use."""
    from cluster.async_engine import AsyncEngine
    from cluster.config import EngineConfig

    calls = []

    def record(self, num_draft_tokens, share_topk):
        calls.append((num_draft_tokens, share_topk))
        return WarmUp(0, 0.0)

    monkeypatch.setattr(Worker, "warm_up", record)
    import asyncio

    config = EngineConfig(model=tiny_model_dir, dtype="float32", num_draft_tokens=2)
    engine = AsyncEngine(config)
    try:
        assert calls == [(2, False)]
        assert engine.engine.warm_up == WarmUp(0, 0.0)
    finally:
        asyncio.run(engine.shutdown())


def test_triton_cache_dir_is_persistent_unless_set(tmp_path, monkeypatch):
    import os

    from kernels.platform import ensure_triton_cache_dir

    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    reload_settings()  # the code reads the environment once
    path = ensure_triton_cache_dir()
    assert path == str(tmp_path / "mtpserve" / "triton") == os.environ["TRITON_CACHE_DIR"]
    assert os.path.isdir(path)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "mine"))
    reload_settings()  # the code reads the environment once
    assert ensure_triton_cache_dir() == str(tmp_path / "mine")


def test_warm_up_lengths_on_a_gpu_fit_the_context():
    """On a GPU the long dummy prompts (2 and 16 blocks) are capped where a short context's block
    tables end: a 1024-token context with 64-token blocks warms a 1023-token prompt at most."""
    assert warm_up_prefill_lengths(64, False, 4096) == (16, 17)
    assert warm_up_prefill_lengths(64, True, 4096) == (16, 17, 81, 1024)
    assert warm_up_prefill_lengths(64, True, 1023) == (16, 17, 81, 1023)
    assert warm_up_prefill_lengths(16, True, 40) == (16, 17, 33, 40)


def test_prefill_warm_up_runs_the_eager_path_with_graphs(worker):
    """With MTP off a step that prefills replays the decode graph when it fits; the warm-up's
    dummy prefills must not, they exist to compile the eager path's kernel variants (which a
    chunk past the largest bucket still runs). Graphs stand in on CPU: each step's graph key
    is recorded, and the step then runs eagerly."""
    runner = worker.runner
    runner.graphs = _Graphs([1, 2, 4, 8, 16, 32, 64, 128], [])
    keys = record_graph_keys(runner, replay=False)
    try:
        worker._warm_up_prefill(0, False)
        prefills = [key for _, prefill, key in keys if prefill]
        assert prefills and all(key is None for key in prefills)
        assert runner.prefill_in_graphs  # back on for served steps
        prefill = SeqWork("r", [5] * 16, 0, [5], 0, samples=True)
        del runner._graph_key
        assert runner._graph_key([prefill], False) == (16, 1)
    finally:
        runner.graphs = None
        runner.__dict__.pop("_graph_key", None)


def test_worker_warms_the_fp32_linears_on_the_models_own_weight_shapes(worker, monkeypatch):
    """The fp32 linears' variants specialize on the weight's sizes: the warm-up compiles them
    for the router's and the indexer head weights' shapes (MTP layer included), not a dummy's."""
    import workers.worker as worker_module

    calls: list = []
    monkeypatch.setattr(worker, "_warm_up_prefill", lambda *args: None)
    monkeypatch.setattr(worker_module, "warm_up_eager_kernels", lambda *a: calls.append(a))
    worker.warm_up(0, False)
    [args] = calls
    c = worker.config
    assert c.n_routed_experts != c.index_n_heads  # two shapes to tell apart
    assert args[-1] == sorted(
        {(c.n_routed_experts, c.hidden_size), (c.index_n_heads, c.hidden_size)}
    )
