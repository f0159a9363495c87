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
