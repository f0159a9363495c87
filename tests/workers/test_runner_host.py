"""The runner's host side of a step: the packed inputs (workers.step_tensors) against a per-token
reference, and the decode-graph path (one copy into static inputs, the argmax inside the graph)
run on CPU through a stand-in for CUDA graphs, token for token against the eager path."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from cluster.llm import LLM
from cluster.sampling_params import SamplingParams
from kernels import ops
from tests.workers.arrivals import generate_staggered, record_graph_keys
from workers.batch import SeqWork, carries_only_prompts
from workers.cuda_graph import DecodeGraphs, ProposeGraphs, SamplerGraphs
from workers.sampler import NO_TOP_P
from workers.step_tensors import StepLayout, pack_step

BLOCK = 4


def _reference(seqs: list[SeqWork], layout: StepLayout) -> tuple[list, ...]:
    """Per token, the obvious way: (ids, positions, slots, seq_idx, tables), padded as the
    layout says."""
    ids, positions, slots, seq_idx = [], [], [], []
    for i, s in enumerate(seqs):
        for j, t in enumerate(s.token_ids):
            p = s.start_position + j
            ids.append(t)
            positions.append(p)
            slots.append(s.block_ids[p // BLOCK] * BLOCK + p % BLOCK)
            seq_idx.append(i)
    per_seq = layout.num_rows // layout.num_table_rows
    for r in range(len(ids), layout.num_rows):
        ids.append(0)
        positions.append(0)
        slots.append(-1)
        seq_idx.append(r // per_seq)
    tables = [[0] * layout.table_width for _ in range(layout.num_table_rows)]
    for i, s in enumerate(seqs):
        tables[i][: len(s.block_ids)] = s.block_ids
    return ids, positions, slots, seq_idx, tables


def _seq(rng: random.Random, i: int, num_tokens: int) -> SeqWork:
    start = rng.randrange(0, 300)
    num_blocks = (start + num_tokens - 1) // BLOCK + 1 + rng.randrange(0, 3)
    return SeqWork(
        f"r{i}",
        [rng.randrange(0, 1000) for _ in range(num_tokens)],
        start,
        [rng.randrange(1, 5000) for _ in range(num_blocks)],
        0,
        True,
    )


@pytest.mark.parametrize("lens", [[1], [7], [131], [1, 7, 131], [3, 1, 1, 2], [1] * 9])
def test_packed_inputs_match_per_token_reference(lens):
    rng = random.Random(sum(lens))
    seqs = [_seq(rng, i, n) for i, n in enumerate(lens)]
    width = max(len(s.block_ids) for s in seqs)
    layout = StepLayout(sum(lens), len(seqs), width)
    flat = torch.full((layout.numel,), 12345, dtype=torch.long)  # garbage: all overwritten
    pack_step(seqs, BLOCK, layout, flat.numpy())
    got = [t.tolist() for t in layout.views(flat)]
    assert got == list(_reference(seqs, layout))


@pytest.mark.parametrize("num_seqs,bucket,q", [(1, 1, 1), (3, 4, 1), (5, 8, 4), (2, 2, 3)])
def test_packed_inputs_pad_a_graph_bucket(num_seqs, bucket, q):
    rng = random.Random(num_seqs * 10 + q)
    seqs = [_seq(rng, i, q) for i in range(num_seqs)]
    layout = StepLayout(bucket * q, bucket, 150)
    flat = torch.full((layout.numel,), 12345, dtype=torch.long)
    pack_step(seqs, BLOCK, layout, flat.numpy())
    got = [t.tolist() for t in layout.views(flat)]
    assert got == list(_reference(seqs, layout))
    # What the graph's padding needs: rows of padded sequences write nowhere, in zero tables.
    ids, positions, slots, seq_idx, tables = got
    assert all(s == -1 for s in slots[num_seqs * q :])
    assert np.asarray(tables)[num_seqs:].sum() == 0


class _EagerGraph:
    """Stands in for a CUDA graph on CPU: a replay runs the captured function again on the
    static inputs and writes its outputs into the captured ones, as a real replay does."""

    def __init__(self, forward, out):
        self.forward, self.out, self.replays = forward, out, 0

    def replay(self) -> None:
        new = self.forward()
        if isinstance(new, torch.Tensor):
            new, out = (new,), (self.out,)
        else:
            out = self.out
        for o, n in zip(out, new):
            o.copy_(n)
        self.replays += 1


def _with_cpu_graphs(
    llm: LLM, max_batch: int, max_rows: int = 0, sampler_rows: int = 0
) -> tuple[DecodeGraphs, ProposeGraphs | None]:
    runner = llm.engine.executor.worker.runner
    graphs = DecodeGraphs(runner.model, max_batch, 64, runner.device, max_rows)

    def capture_graph(forward):
        out = forward()
        return _EagerGraph(forward, out), out

    graphs.capture_graph = capture_graph
    runner.graphs = graphs
    if sampler_rows:
        vocab = runner.model.config.vocab_size
        runner.sampler_graphs = SamplerGraphs(graphs, vocab, sampler_rows)
    propose = None
    if runner.proposer is not None:
        propose = runner.proposer.graphs = ProposeGraphs(runner.model, graphs)
    return graphs, propose


PROMPT_LENS = [3, 41, 12, 27, 5, 33, 18]


def _arrivals(seed: int, lens: list[int]) -> tuple[list[list[int]], list[SamplingParams]]:
    """Prompts of these lengths (random token ids) and greedy parameters asking each next one
    for 3 more tokens (5, 8, 11, ...): requests that arrive and finish at different steps."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in lens]
    params = [
        SamplingParams(max_tokens=5 + 3 * i, temperature=0.0, ignore_eos=True)
        for i in range(len(prompts))
    ]
    return prompts, params


def _generate(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    """Each prompt with its own parameters -> token ids, in prompt order."""
    engine = llm.engine
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    final = {}
    while engine.has_unfinished:
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out.token_ids
    return [final[i] for i in ids]


@pytest.mark.parametrize("k", [0, 2, 3])
def test_graph_path_is_the_eager_path_token_for_token(tiny_model_dir, k):
    """Decode and verify steps through the graph path (buckets padded: 7 requests finishing at
    different times pass through buckets 8, 4, 2 and 1) give exactly the eager path's greedy
    tokens, with MTP proposals graphed as well."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in PROMPT_LENS]
    params = [
        SamplingParams(max_tokens=6 + 8 * i, temperature=0.0, ignore_eos=True)
        for i in range(len(prompts))
    ]
    eager = LLM(tiny_model_dir, num_draft_tokens=k, dtype="float32", max_num_seqs=8)
    expected = _generate(eager, prompts, params)
    graphed = LLM(tiny_model_dir, num_draft_tokens=k, dtype="float32", max_num_seqs=8)
    graphs, propose = _with_cpu_graphs(graphed, max_batch=8)
    assert _generate(graphed, prompts, params) == expected
    assert [len(t) for t in expected] == [p.max_tokens for p in params]
    replayed = {key for key, (graph, _, _) in graphs.graphs.items() if graph.replays}
    assert {b for b, _ in replayed} >= {1, 2, 4, 8}
    if k:
        assert any(graph.replays for graph, _, _ in propose.graphs.values())


@pytest.mark.parametrize("k", [0, 2, 3])
def test_sampler_graphs_draw_what_the_eager_sampler_draws(tiny_model_dir, k):
    """Seeded sampling requests (temperature alone, top-k, top-p, penalties, logprobs) drawn
    through the sampler's graphs (rows padded to buckets of 1-16; steps with more rows sample
    eagerly) give the tokens the eager sampler gives on the same logits: a seeded request's
    noise comes from its own generator on both paths, and padding rows change nothing."""
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in PROMPT_LENS]
    settings = [
        dict(temperature=1.0),
        dict(temperature=0.7, top_p=0.9),
        dict(temperature=1.3, top_k=5),
        dict(temperature=0.8, top_k=20, top_p=0.8, repetition_penalty=1.3),
        dict(temperature=0.9, logprobs=2),
        dict(temperature=0.0),
        dict(temperature=1.1, frequency_penalty=0.5),
    ]
    params = [
        SamplingParams(max_tokens=6 + 4 * i, seed=100 + i, ignore_eos=True, **kw)
        for i, kw in enumerate(settings)
    ]

    def generate(sampler_rows: int) -> tuple[list[list[int]], SamplerGraphs | None]:
        llm = LLM(tiny_model_dir, num_draft_tokens=k, dtype="float32", max_num_seqs=8)
        _with_cpu_graphs(llm, max_batch=8, sampler_rows=sampler_rows)
        runner = llm.engine.executor.worker.runner
        return _generate(llm, prompts, params), runner.sampler_graphs

    expected, _ = generate(0)
    got, sampler = generate(16)
    assert got == expected
    assert [len(t) for t in got] == [p.max_tokens for p in params]
    replayed = {size for (size, _), (graph, _) in sampler.graphs.items() if graph.replays}
    assert len(replayed) >= 3  # several buckets, as requests finished
    assert any(truncates for (_, truncates), (graph, _) in sampler.graphs.items() if graph.replays)


def test_sampler_graph_buckets_share_one_buffer_of_logits_and_noise():
    """Powers of two up to max_rows (which need not be one); past it, no bucket (eager). A
    bucket's logits, noise and the gather target are prefixes of the same two buffers, and a
    bucket's padding settings are rows that verify no draft and truncate nothing."""
    decode = DecodeGraphs(None, 1, 1, torch.device("cpu"))
    sampler = SamplerGraphs(decode, 10, 48)
    assert sampler.buckets == [1, 2, 4, 8, 16, 32, 48]
    assert [sampler.bucket(n) for n in (1, 3, 17, 33, 48, 49)] == [1, 4, 32, 48, 48, None]
    assert sampler.keys() == [(b, t) for b in sampler.buckets for t in (False, True)]
    settings, noise = sampler.inputs(8)
    assert noise.shape == (8, 2) and settings.shape == (4, 8)  # on CPU: the inverse CDF's
    assert noise.data_ptr() == sampler.inputs(48)[1].data_ptr()
    assert sampler.logits(5).data_ptr() == sampler.logits(48).data_ptr()
    assert sampler.logits(5).shape == (5, 10)
    assert settings.tolist() == [[1.0] * 8, [9.0] * 8, [NO_TOP_P] * 8, [-1.0] * 8]


@pytest.mark.parametrize("k", [0, 2])
def test_prompts_arriving_mid_decode_replay_the_decode_graph(tiny_model_dir, k):
    """A step that prefills a prompt beside decoding (k = 0) or verifying (k = 2) requests
    runs its target forward as rows of the q = 1 decode graph (`ModelRunner._graph_key`; with
    MTP the proposal after it runs eagerly), token for token the eager path's greedy tokens,
    with padded buckets; a chunk longer than the largest bucket stays eager."""
    # 70 > the largest bucket (64): that prefill stays eager
    prompts, params = _arrivals(2, [9, 41, 3, 30, 17, 70, 5])
    eager = LLM(tiny_model_dir, num_draft_tokens=k, dtype="float32", max_num_seqs=64)
    expected = generate_staggered(eager, prompts, params, every=2)
    graphed = LLM(tiny_model_dir, num_draft_tokens=k, dtype="float32", max_num_seqs=64)
    _, propose = _with_cpu_graphs(graphed, max_batch=64)
    keys = record_graph_keys(graphed.engine.executor.worker.runner)
    got = generate_staggered(graphed, prompts, params, every=2)
    assert got == expected
    assert [len(t) for t in got] == [p.max_tokens for p in params]
    prefill_keys = [key for graphable, prefill, key in keys if prefill]
    # Every prefill step but the 70-token one replayed a graph, beside decodes or alone.
    assert sum(key is None for key in prefill_keys) == 1
    assert all(key[1] == 1 for key in prefill_keys if key is not None)
    assert any(graphable for graphable, prefill, key in keys if not prefill)
    if k:  # the proposals after those steps ran as rows of a graph too
        assert any(graph.replays for graph, _, _ in propose.row_graphs.values())


def test_prompts_past_the_decode_batches_replay_row_buckets(tiny_model_dir):
    """Decode graphs up to 8 sequences, q = 1 row buckets up to 48 rows: a step of decodes and
    an arriving prompt with more tokens than 8 (but at most 48) replays a row bucket past the
    decode batches, token for token the eager path's greedy tokens; the 70-token prompt's
    step stays eager."""
    prompts, params = _arrivals(3, [9, 30, 3, 21, 17, 70, 5])
    eager = LLM(tiny_model_dir, num_draft_tokens=0, dtype="float32", max_num_seqs=8)
    expected = generate_staggered(eager, prompts, params, every=2)
    graphed = LLM(tiny_model_dir, num_draft_tokens=0, dtype="float32", max_num_seqs=8)
    graphs, _ = _with_cpu_graphs(graphed, max_batch=8, max_rows=48)
    assert graphs.row_buckets == [1, 2, 4, 8, 16, 24, 32, 48]
    assert graphs.buckets == [1, 2, 4, 8]
    keys = record_graph_keys(graphed.engine.executor.worker.runner)
    assert generate_staggered(graphed, prompts, params, every=2) == expected
    prefill_keys = [key for graphable, prefill, key in keys if prefill]
    assert sum(key is None for key in prefill_keys) == 1  # the 70-token prompt
    assert any(key is not None and key[0] > 8 for key in prefill_keys)
    replayed = {key for key, (graph, _, _) in graphs.graphs.items() if graph.replays}
    assert any(rows > 8 for rows, q in replayed if q == 1)


def test_row_buckets_keep_the_decode_buckets_below_max_batch():
    """A decode step picks the same graph whatever max_rows is; verify steps and the MTP
    proposal never go past max_batch."""
    graphs = DecodeGraphs(None, 100, 4, torch.device("cpu"), max_rows=300)
    assert graphs.buckets == [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 100]
    assert graphs.row_buckets == graphs.buckets + [128, 192, 256, 300]
    for n in range(1, 101):
        assert graphs.bucket(n, 1) == graphs.bucket(n, 4) == graphs.bucket(n)
    assert graphs.bucket(101, 1) == 128 and graphs.bucket(101, 4) is None
    assert graphs.bucket(300, 1) == 300 and graphs.bucket(301, 1) is None
    assert DecodeGraphs(None, 64, 4, torch.device("cpu")).row_buckets[-1] == 64


@pytest.mark.parametrize("max_num_seqs", [8, 4])
def test_mtp_rows_proposals_with_chunked_prompts(tiny_model_dir, max_num_seqs):
    """MTP k = 2, prompts chunked by a 16-token step budget while others verify: the
    proposals after rows steps (pair rows of several requests, a chunk's end held for the
    next chunk, non-final chunks that draft nothing; with 4 sequences at most, as many
    drafting requests as the graph's draft rows) run as rows of a graph, and greedy tokens
    equal greedy without MTP, token for token."""
    g = torch.Generator().manual_seed(4)
    lens = [9, 41, 3, 30, 17, 5]
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in lens]
    params = [
        SamplingParams(max_tokens=6 + 2 * i, temperature=0.0, ignore_eos=True)
        for i in range(len(prompts))
    ]
    options = dict(dtype="float32", max_num_seqs=max_num_seqs, max_num_batched_tokens=16)
    plain = LLM(tiny_model_dir, num_draft_tokens=0, **options)
    expected = generate_staggered(plain, prompts, params, every=2)
    graphed = LLM(tiny_model_dir, num_draft_tokens=2, **options)
    _, propose = _with_cpu_graphs(graphed, max_batch=max_num_seqs, max_rows=16)
    assert generate_staggered(graphed, prompts, params, every=2) == expected
    replayed = [key for key, (graph, _, _) in propose.row_graphs.items() if graph.replays]
    assert replayed and all(k == 2 for _, k, _ in replayed)


def test_rows_proposal_holds_requests_without_pair_rows(tiny_model_dir):
    """A step's requests can outnumber its pair rows (a one-token chunk of a longer prompt
    makes none): the rows graph's bucket holds every request's block-table row, and the
    drafts are those of an eager proposal."""
    from workers.mtp_proposer import DraftPairs, draft_chain

    llm = LLM(tiny_model_dir, num_draft_tokens=2, dtype="float32", max_num_seqs=4)
    graphs, propose = _with_cpu_graphs(llm, max_batch=4, max_rows=8)
    runner = llm.engine.executor.worker.runner
    device = runner.device  # the stand-in graphs run on a GPU machine's device too
    hidden = torch.randn(4, runner.model.config.hidden_size, device=device)
    pairs = DraftPairs()
    for row in range(4):  # requests 0..3 one pair row each, at positions 5.., writing nothing
        pairs.add(row, 7 + row, row, 5 + row, -1)
    pairs.drafting_seqs, pairs.last_rows = [0, 1, 2, 3], [0, 1, 2, 3]
    # 5 requests, blocks of their own (request 4 has no pair row)
    tables = torch.arange(1, 11, dtype=torch.int32, device=device).view(5, 2)
    got = propose.run_rows(pairs, hidden, tables, 2, False)
    assert got is not None and got.shape == (4, 2)
    assert min(rows for rows, _, _ in propose.row_graphs) >= 5  # not the 4-row bucket
    inputs = runner.proposer._inputs(pairs, hidden, tables)
    assert torch.equal(got, draft_chain(runner.model, inputs, 2, False))


def test_rows_proposals_draft_what_eager_proposals_draft(tiny_model_dir):
    """MTP k = 2 with prompts chunked beside verifies: every step's drafts through the graph
    path (verify proposals, launched behind the verify, and rows proposals after steps that
    prefill) are the eager path's, request for request. Greedy identity cannot see a proposal
    that reads the wrong block table (it only costs acceptance): the drafts are compared."""

    g = torch.Generator().manual_seed(4)
    lens = [9, 41, 3, 30, 17, 5, 12, 22]
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in lens]
    params = [
        SamplingParams(max_tokens=12 + 2 * i, temperature=0.0, ignore_eos=True)
        for i in range(len(prompts))
    ]
    options = dict(dtype="float32", max_num_seqs=8, max_num_batched_tokens=16)

    def drafts(graphed: bool) -> list:
        llm = LLM(tiny_model_dir, num_draft_tokens=2, **options)
        runner = llm.engine.executor.worker.runner
        if graphed:
            _, propose = _with_cpu_graphs(llm, max_batch=8, max_rows=16)
        steps, execute, launch_early = [], runner.execute, runner.proposer.launch_early
        early = []

        def recording(step):
            out = execute(step)
            steps.append([(r.request_id, r.next_draft_token_ids) for r in out.results])
            return out

        def launching(step, batch, hidden):
            launch_early(step, batch, hidden)
            early.append(batch.proposal is not None)

        runner.execute, runner.proposer.launch_early = recording, launching
        generate_staggered(llm, prompts, params, every=2)
        # Steps of verifies only (greedy here) launched their proposal behind the forward.
        assert 10 < sum(early) < len(early)
        if graphed:
            assert any(graph.replays for graph, _, _ in propose.row_graphs.values())
            assert any(graph.replays for graph, _, _ in propose.graphs.values())
        return steps

    expected = drafts(False)
    assert sum(len(d) == 2 for step in expected for _, d in step) > 50
    assert drafts(True) == expected


@pytest.mark.parametrize("corrupt", [False, True])
def test_proposals_behind_the_draw_are_the_host_decided_ones(tiny_model_dir, corrupt):
    """Seeded sampling requests beside greedy ones, MTP k = 2, through the graph path: the
    proposal launched behind the batched draw, from its results on the device, drafts what
    the proposal from the host's acceptance drafts, step for step, and the outputs are the
    same. Where what it took differs from the host's acceptance (here made to differ: every
    draw's acceptances flipped on their way to it), the proposal is made again from the
    host's, with the same drafts."""
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in PROMPT_LENS]
    settings = [dict(temperature=1.0), dict(temperature=0.0), dict(temperature=0.8, top_k=20)]
    params = [
        SamplingParams(max_tokens=10 + 3 * i, seed=40 + i, ignore_eos=True, **settings[i % 3])
        for i in range(len(prompts))
    ]

    def run(behind_draws: bool) -> tuple[list, list, int]:
        llm = LLM(tiny_model_dir, num_draft_tokens=2, dtype="float32", max_num_seqs=8)
        _with_cpu_graphs(llm, max_batch=8, sampler_rows=32)
        runner = llm.engine.executor.worker.runner
        proposer, steps, launched = runner.proposer, [], []
        execute, after_draws = runner.execute, proposer.after_draws

        def recording(step):
            out = execute(step)
            steps.append([(r.request_id, r.next_draft_token_ids) for r in out.results])
            return out

        def behind(step, batch, hidden):
            launch = after_draws(step, batch, hidden) if behind_draws else None
            if launch is None:
                return None

            def counted(draws, drawn):
                if corrupt:
                    draws = draws.clone()
                    draws[1] = 1 - draws[1]
                launched.append(len(drawn))
                launch(draws, drawn)

            return counted

        runner.execute, proposer.after_draws = recording, behind
        outputs = _generate(llm, prompts, params)
        return outputs, steps, len(launched), proposer.num_proposed_again

    expected_outputs, expected_steps, none, _ = run(behind_draws=False)
    outputs, steps, launched, again = run(behind_draws=True)
    assert none == 0 and launched > 10
    if corrupt:  # every flip that changed a decision (not those of verifies without drafts)
        assert 10 < again <= launched
    else:
        assert again == 0
    assert steps == expected_steps
    assert outputs == expected_outputs


def test_prompt_only_steps_run_eagerly_in_a_prompt_step(tiny_model_dir):
    """Where an FP8 model's prompt steps take the w8a8 kernels (`ModelRunner.w8a8_prompt_rows`,
    set here as an FP8 model on an FP8-capable GPU has it): a step of prompt tokens only, at
    least that many, runs its forward eagerly inside `ops.prompt_step`; decodes, steps that mix
    a prompt with decodes and smaller prompt steps replay graphs outside it. Greedy tokens stay
    the eager path's."""
    prompts, params = _arrivals(4, [40, 9, 41, 3, 30, 17, 5])
    short = _arrivals(7, [5])[0]
    eager = LLM(tiny_model_dir, num_draft_tokens=0, dtype="float32", max_num_seqs=64)
    expected = generate_staggered(eager, prompts, params, every=2)
    expected_short = _generate(eager, short, params[:1])
    graphed = LLM(tiny_model_dir, num_draft_tokens=0, dtype="float32", max_num_seqs=64)
    _with_cpu_graphs(graphed, max_batch=64)
    runner = graphed.engine.executor.worker.runner
    assert runner.w8a8_prompt_rows is None  # bf16 weights, CPU: nothing to switch
    runner.w8a8_prompt_rows = 16
    steps = []  # (prompt tokens only, tokens, graph key, prompt_step at each model call)
    forward = runner._forward

    def spy(batch):
        inside = []
        hook = runner.model.register_forward_pre_hook(
            lambda module, args: inside.append(ops._in_prompt_step.get())
        )
        try:
            return forward(batch)
        finally:
            hook.remove()
            tokens = sum(len(s.token_ids) for s in batch.seqs)
            steps.append((carries_only_prompts(batch.seqs), tokens, batch.graph_key, inside))

    runner._forward = spy
    assert generate_staggered(graphed, prompts, params, every=2) == expected
    assert _generate(graphed, short, params[:1]) == expected_short
    for only_prompts, tokens, key, inside in steps:
        if only_prompts and tokens >= 16:
            assert key is None and inside == [True]
        else:
            assert key is not None and inside == [False]
    assert any(p and n >= 16 for p, n, _, _ in steps)  # the 40-token prompt, alone
    assert any(not p and n > 1 and key for p, n, key, _ in steps)  # a prompt beside decodes
    assert any(p and n == 5 for p, n, _, _ in steps)  # the short prompt, alone: a graph


def test_prompt_steps_before_index_topk_attend_densely(tiny_model_dir):
    """In an eager step the tokens of prompt chunks that lie before index_topk attend densely
    (`ModelRunner._dense_rows`), alone or beside decodes, verifies and tokens from index_topk
    on, which keep the sparse path. Greedy tokens, with MTP and without, equal those
    of the same engine with the dense path off."""
    prompts, params = _arrivals(5, [40, 12, 3, 16, 9])
    together, together_params = _arrivals(6, [9, 15, 2, 16])  # one step of four prompts
    for k in (0, 2):
        outputs, steps = {}, {False: [], True: []}
        for dense in (False, True):
            llm = LLM(tiny_model_dir, num_draft_tokens=k, dtype="float32", max_num_seqs=64)
            runner = llm.engine.executor.worker.runner
            assert runner.dense_prompts  # the CPU's default
            runner.dense_prompts = dense
            prepare = runner._prepare

            def spy(seqs, tables, prepare=prepare, seen=steps[dense]):
                batch = prepare(seqs, tables)
                seen.append((seqs, batch.offsets, batch.meta.dense))
                return batch

            runner._prepare = spy
            outputs[dense] = generate_staggered(llm, prompts, params, every=2)
            outputs[dense] += _generate(llm, together, together_params)
        assert outputs[True] == outputs[False]
        topk = llm.engine.executor.worker.config.index_topk
        assert not any(dense for *_, dense in steps[False])
        kinds = set()
        for seqs, offsets, dense in steps[True]:
            eligible = [
                (i, min(len(s.token_ids), topk - s.start_position))
                for i, s in enumerate(seqs)
                if carries_only_prompts([s]) and s.start_position < topk
            ]
            assert (dense is not None) == bool(eligible)
            if dense is None:
                continue
            rows = [offsets[i] + j for i, n in eligible for j in range(n)]
            assert dense.k_lens == [seqs[i].start_position + n for i, n in eligible]
            if len(rows) == sum(len(s.token_ids) for s in seqs):
                assert dense.rows is None and dense.sparse_rows is None
                kinds.add("all dense")
            else:
                assert dense.rows.tolist() == rows
                others = sorted(set(range(offsets[-1] + len(seqs[-1].token_ids))) - set(rows))
                assert dense.sparse_rows.tolist() == others
                kinds.add("mixed")
        assert kinds == {"all dense", "mixed"}


def test_dense_rows_are_prompt_tokens_before_index_topk():
    """`ModelRunner._dense_rows`' rule: the tokens of prompt chunks that lie before index_topk,
    whatever else the step holds, and at most twice max(index_topk, their tokens) positions
    over them."""
    from types import SimpleNamespace

    from workers.model_runner import ModelRunner

    def seq(start, n, samples=True, drafts=0):
        return SeqWork("r", [1] * n, start, [1], drafts, samples)

    runner = SimpleNamespace(
        dense_prompts=True, model=SimpleNamespace(config=SimpleNamespace(index_topk=16))
    )

    def dense(*seqs):
        return ModelRunner._dense_rows(runner, list(seqs))

    assert dense(seq(0, 16)) == [(0, 16)]  # a prompt of index_topk tokens
    assert dense(seq(0, 17)) == [(0, 16)]  # its last token has 17 positions to choose from
    assert dense(seq(16, 5)) == []  # a chunk from index_topk on
    assert dense(seq(10, 6), seq(0, 3, samples=False)) == [(0, 6), (1, 3)]  # after a context
    assert dense(seq(5, 1), seq(10, 9)) == [(1, 6)]  # beside a decode, across index_topk
    assert dense(seq(3, 2, drafts=1), seq(20, 3), seq(0, 4)) == [(2, 4)]  # a verify, a chunk
    assert dense(*[seq(6, 2) for _ in range(4)]) == [(i, 2) for i in range(4)]  # 32 positions
    assert dense(*[seq(7, 2) for _ in range(4)]) == []  # 36 positions for 8 tokens
    runner.dense_prompts = False
    assert dense(seq(0, 16)) == []
