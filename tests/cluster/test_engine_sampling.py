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
