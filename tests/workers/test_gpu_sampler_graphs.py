"""The batched sampler's CUDA graphs (workers.cuda_graph.SamplerGraphs) on a GPU: a replay
computes what `sample_rows` computes eagerly on the same inputs, bit for bit, and draws through
the graphs keep each request's distribution (MTP's rejection rule included)."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from workers.batch import SamplingSpec
from workers.cuda_graph import DecodeGraphs, SamplerGraphs
from workers.sampler import NO_TOP_P, processed_probs, sample_rows, verify_and_sample_batch

pytestmark = pytest.mark.gpu

ALPHA = 1e-3


def _sampler(vocab: int, max_rows: int, candidates: int | None = None) -> SamplerGraphs:
    decode = DecodeGraphs(None, 1, 1, torch.device("cuda"))
    return SamplerGraphs(decode, vocab, max_rows, candidates)


@pytest.mark.parametrize(
    "truncates,candidates", [(False, 0), (True, 0), (True, 100)], ids=["plain", "sort", "top-100"]
)
def test_replay_is_the_eager_function(truncates, candidates):
    """Every bucket up to 64 rows over a 1000-token vocabulary, random logits, settings and
    noise (drafts on some rows): the replay's draws, acceptances and exactness equal
    `sample_rows`', with top-k / top-p by the sort or among 100 candidates (a top-k captured
    in the graph)."""
    vocab = 1000
    sampler = _sampler(vocab, 64, candidates)
    g = torch.Generator(device="cuda").manual_seed(0)
    for size in sampler.buckets:
        settings, noise = sampler.inputs(size)
        logits = sampler.logits(size)
        for _ in range(3):
            logits.copy_(torch.randn(size, vocab, device="cuda", generator=g) * 3)
            noise.exponential_(generator=g)
            temperature = torch.rand(size, device="cuda", generator=g) + 0.3
            kth = torch.randint(0, vocab, (size,), device="cuda", generator=g)
            top_p = torch.where(
                torch.rand(size, device="cuda", generator=g) < 0.5,
                torch.rand(size, device="cuda", generator=g),
                torch.full((size,), NO_TOP_P, device="cuda"),
            )
            draft = torch.randint(-1, vocab, (size,), device="cuda", generator=g)
            settings.copy_(torch.stack([temperature, kth, top_p, draft]).double())
            got = sampler.replay(size, truncates).clone()
            want = sample_rows(
                logits.clone(), settings.clone(), noise.clone(), truncates, candidates or None
            )
            assert torch.equal(got, want)
    assert len(sampler.graphs) == len(sampler.buckets)


def test_draws_through_the_graphs_keep_each_requests_distribution():
    """20,000 requests of each setting verifying two drafts, in one replay of a 2**16-row
    bucket: the first token follows the target's first row (chi-square), as on the eager
    path (tests/workers/test_sampler.py)."""
    logits = torch.tensor(
        [[2.0, 1.0, 0.5, 0.0, -1.0, 0.3], [0.1, 1.5, -0.5, 0.7, 0.0, 1.0], [0.0] * 6]
    )
    draws = 20_000
    sampler = _sampler(6, 2**16)
    for spec in [
        SamplingSpec(temperature=1.0),
        SamplingSpec(temperature=0.7, top_k=4, top_p=0.9),
        SamplingSpec(temperature=1.3, top_p=0.6),
    ]:
        rows = sampler.logits(3 * draws)
        rows.copy_(logits.cuda().repeat(draws, 1))
        out = verify_and_sample_batch(rows, [[1, 3]] * draws, [spec] * draws, None, sampler)
        first = torch.bincount(torch.tensor([t[0] for t, _ in out]), minlength=6).float()
        p0 = processed_probs(logits[0:1], spec)[0]
        keep = p0 > 0
        assert first[~keep].sum() == 0
        assert chisquare(first[keep], p0[keep] * draws).pvalue > ALPHA
    assert sampler.graphs  # the draws replayed a graph


def test_engine_draws_among_candidates_what_the_sort_draws(tmp_path, monkeypatch):
    """Through the CUDA engine (sampler graphs, MTP k=2 verify rows, seeded requests with top-p
    / top-k) at a 20,000-entry vocabulary: truncating among 64 candidates draws the tokens the
    sort draws, with some rows redone by the sort (`resample_inexact`), through truncating
    replays among candidates. tests/cluster/test_engine_sampling.py is the CPU side."""
    import workers.sampler
    from cluster.llm import LLM
    from cluster.sampling_params import SamplingParams
    from workers.tiny_model import make_tiny_model

    model = make_tiny_model(str(tmp_path / "vocab20k"), seed=0, mtp_echo=0.1, vocab_size=20000)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 20000, (n,), generator=g).tolist() for n in (5, 17, 9, 30)]
    settings = [(0.1, 0.9, 0), (0.05, 1.0, 50), (1.0, 0.95, 0), (0.2, 0.8, 20)]
    params = [
        SamplingParams(max_tokens=12, temperature=t, top_p=p, top_k=k, seed=10 + i, ignore_eos=True)
        for i, (t, p, k) in enumerate(settings)
    ]
    redone = []
    resample = workers.sampler.resample_inexact

    def counting(logits, settings, noise, exact, draws, accepted):
        redone.append(exact.count(0))
        return resample(logits, settings, noise, exact, draws, accepted)

    monkeypatch.setattr(workers.sampler, "resample_inexact", counting)
    monkeypatch.setattr(workers.sampler, "CANDIDATES", 64)

    def generate(min_vocab: int):
        monkeypatch.setattr(workers.sampler, "CANDIDATES_MIN_VOCAB", min_vocab)
        engine = LLM(
            model, device="cuda", dtype="float32", num_draft_tokens=2, max_num_seqs=4
        ).engine
        ids = [engine.add_request(p, q) for p, q in zip(prompts, params)]
        final = {}
        while engine.has_unfinished:
            final.update((o.request_id, o) for o in engine.step() if o.finished)
        graphs = engine.executor.worker.runner.sampler_graphs
        return [final[i].token_ids for i in ids], graphs

    want, sorting = generate(10**9)
    assert not redone and sorting.candidates is None
    got, among = generate(1)
    assert got == want
    assert sum(redone) > 0
    assert among.candidates == 64 and any(truncates for _, truncates in among.graphs)
    assert all(len(t) == 12 for t in got)
