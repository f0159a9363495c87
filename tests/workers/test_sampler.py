"""The rejection sampler keeps the target distribution exactly (statistical test, fixed seed).

Significance: each chi-square test rejects a correct sampler with probability alpha = 1e-3; the
file runs 4 such tests, so a correct implementation fails with probability < 0.4%, while a
sampler that, e.g., always accepts drafts or forgets to remove the draft from the residual
shifts the first token's distribution by >= 0.1 in probability and fails with certainty at
N = 10,000 draws.
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from workers.batch import SamplingSpec
from workers.sampler import processed_probs, verify_and_sample

ALPHA = 1e-3
NUM_DRAWS = 10_000


def _first_token_counts(logits, drafts, spec, seed=0):
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(logits.shape[-1])
    second = torch.zeros(logits.shape[-1])
    for _ in range(NUM_DRAWS):
        tokens, accepted = verify_and_sample(logits, drafts, spec, gen)
        counts[tokens[0]] += 1
        if tokens[0] == drafts[0] and len(drafts) > 1:
            second[tokens[1]] += 1
    return counts, second


@pytest.mark.parametrize(
    "spec",
    [SamplingSpec(temperature=1.0), SamplingSpec(temperature=0.7, top_k=4, top_p=0.9)],
    ids=["plain", "top-k-top-p"],
)
def test_rejection_sampling_preserves_target_distribution(spec):
    vocab = 6
    logits = torch.tensor(
        [
            [2.0, 1.0, 0.5, 0.0, -1.0, 0.3],
            [0.1, 1.5, -0.5, 0.7, 0.0, 1.0],
            [0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
        ]
    )
    drafts = [1, 3]  # a likely-but-not-argmax first draft exercises both branches
    counts, second = _first_token_counts(logits, drafts, spec)
    p0 = processed_probs(logits[0:1], spec)[0]
    keep = p0 > 0
    assert counts[~keep].sum() == 0  # never a token the target excludes
    assert chisquare(counts[keep], p0[keep] * NUM_DRAWS).pvalue > ALPHA
    # Given the first draft was emitted, the next token follows the target's second row.
    p1 = processed_probs(logits[1:2], spec)[0]
    keep1 = p1 > 0
    assert second[~keep1].sum() == 0
    n = second.sum()
    assert chisquare(second[keep1], p1[keep1] * n).pvalue > ALPHA
    assert vocab == logits.shape[-1]


def test_greedy_acceptance_is_prefix_match():
    logits = torch.full((4, 8), -5.0)
    logits[0, 3] = logits[1, 5] = logits[2, 1] = logits[3, 7] = 5.0  # argmax 3, 5, 1, 7
    spec = SamplingSpec(temperature=0.0)
    assert verify_and_sample(logits, [3, 5, 1], spec, None) == ([3, 5, 1, 7], 3)
    assert verify_and_sample(logits, [3, 6, 1], spec, None) == ([3, 5], 1)
    assert verify_and_sample(logits, [0, 5, 1], spec, None) == ([3], 0)
