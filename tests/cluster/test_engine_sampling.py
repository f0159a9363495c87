"""Random sampling through the engine, with and without MTP: seeds reproduce a request's output
(the acceptance rule's distribution is tested statistically in tests/workers/test_sampler.py)."""

from __future__ import annotations

import pytest

from cluster.llm import LLM
from cluster.sampling_params import SamplingParams

PROMPTS = [[5, 6, 7, 8], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57]]


@pytest.mark.parametrize("k", [0, 2])
def test_seeded_sampling_reproduces(tiny_model_dir, k):
    llm = LLM(tiny_model_dir, num_draft_tokens=k, dtype="float32")

    def run(seed):
        params = SamplingParams(
            max_tokens=16, temperature=0.8, top_p=0.95, seed=seed, ignore_eos=True
        )
        return [o.token_ids for o in llm.generate(PROMPTS, params)]

    first, again, other = run(7), run(7), run(8)
    assert first == again
    assert first != other
    greedy = [
        o.token_ids
        for o in llm.generate(
            PROMPTS, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
        )
    ]
    assert first != greedy  # temperature 0.8 over a 512-token vocabulary really samples


def test_seeded_sampling_survives_preemption(tiny_model_dir):
    """A preempted request is recomputed, not re-seeded: its random stream goes on, so its
    output is what it would have been without the preemption."""
    import torch

    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (40, 35, 50, 45, 30)]
    params = SamplingParams(max_tokens=30, temperature=0.8, seed=11, ignore_eos=True)
    roomy = LLM(tiny_model_dir, num_draft_tokens=0, dtype="float32")
    tight = LLM(
        tiny_model_dir, num_draft_tokens=0, dtype="float32", num_kv_blocks=4, max_model_len=128
    )
    preempted = []
    original = tight.engine.scheduler._preempt
    tight.engine.scheduler._preempt = lambda r, o: (preempted.append(r.request_id), original(r, o))
    expected = [o.token_ids for o in roomy.generate(prompts, params)]
    assert [o.token_ids for o in tight.generate(prompts, params)] == expected
    assert preempted


def test_candidates_through_the_engine_draw_the_sorts_tokens(tmp_path, monkeypatch):
    """At a 20,000-entry vocabulary on CPU, seeded requests with top-p and top-k, verifying MTP
    drafts, truncated among 64 candidates (`workers.sampler.candidate_probs`; the rows that do
    not fit redone with the sort) produce the very tokens of the sort of whole rows, and both
    kinds of row occur (low temperatures make the random model's rows peaked enough to fit)."""
    import torch

    import workers.sampler
    from workers.tiny_model import make_tiny_model

    model = make_tiny_model(str(tmp_path / "vocab20k"), seed=0, mtp_echo=0.1, vocab_size=20000)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 20000, (n,), generator=g).tolist() for n in (5, 17, 9, 30)]
    settings = [(0.1, 0.9, 0), (0.05, 1.0, 50), (1.0, 0.95, 0), (0.2, 0.8, 20)]
    params = [
        SamplingParams(max_tokens=12, temperature=t, top_p=p, top_k=k, seed=10 + i, ignore_eos=True)
        for i, (t, p, k) in enumerate(settings)
    ]
    rows = {"exact": 0, "redone": 0}  # rows truncated among candidates, by outcome
    sample_rows = workers.sampler.sample_rows

    def counting(logits, settings, noise, truncates, candidates=None):
        out = sample_rows(logits, settings, noise, truncates, candidates)
        if truncates and candidates is not None:
            rows["exact"] += int(out[2].sum())
            rows["redone"] += int((out[2] == 0).sum())
        return out

    monkeypatch.setattr(workers.sampler, "sample_rows", counting)
    monkeypatch.setattr(workers.sampler, "CANDIDATES", 64)

    def generate(min_vocab: int) -> list[list[int]]:
        monkeypatch.setattr(workers.sampler, "CANDIDATES_MIN_VOCAB", min_vocab)
        engine = LLM(model, num_draft_tokens=2, dtype="float32", max_num_seqs=4).engine
        ids = [engine.add_request(p, q) for p, q in zip(prompts, params)]
        final = {}
        while engine.has_unfinished:
            final.update((o.request_id, o) for o in engine.step() if o.finished)
        return [final[i].token_ids for i in ids]

    want = generate(10**9)  # the sort
    assert rows == {"exact": 0, "redone": 0}
    got = generate(1)
    assert got == want
    assert rows["exact"] > 0 and rows["redone"] > 0  # both kinds of row
    assert all(len(t) == 12 for t in got)
