"""GPU: the batched rejection sampler on CUDA, chi-square of each setting's first and second
tokens against its own target rows (the CPU tests' check, on the device).

    python benchmarks/check_sampler_cuda.py
"""

import torch
from scipy.stats import chisquare

from workers.batch import SamplingSpec
from workers.sampler import processed_probs, verify_and_sample_batch

torch.manual_seed(0)
logits = torch.tensor(
    [
        [2.0, 1.0, 0.5, 0.0, -1.0, -3.0],
        [0.0, 1.5, 1.0, 0.2, -0.5, 0.3],
        [1.0, 0.0, 2.0, 0.5, 0.1, -1.0],
    ]
)
specs = [
    SamplingSpec(temperature=1.0),
    SamplingSpec(temperature=0.7, top_k=4, top_p=0.9),
    SamplingSpec(temperature=1.3, top_p=0.6),
    SamplingSpec(temperature=0.5, top_k=2),
]
n = 20000
drafts = [1, 3]
allspecs = [s for s in specs for _ in range(n)]
out = verify_and_sample_batch(
    torch.cat([logits] * len(allspecs)).cuda(), [drafts] * len(allspecs), allspecs
)
for g, spec in enumerate(specs):
    group = out[g * n : (g + 1) * n]
    first = torch.bincount(torch.tensor([t[0] for t, _ in group]), minlength=6).float()
    p0 = processed_probs(logits[0:1], spec)[0]
    keep = p0 > 0
    seconds = [t[1] for t, _ in group if t[0] == drafts[0]]
    second = torch.bincount(torch.tensor(seconds), minlength=6).float()
    p1 = processed_probs(logits[1:2], spec)[0]
    k1 = p1 > 0
    p_first = chisquare(first[keep], p0[keep] * n).pvalue
    p_second = chisquare(second[k1], p1[k1] * len(seconds)).pvalue
    print(
        f"spec {g}: first outside support {int(first[~keep].sum())}, p {p_first:.3f}; "
        f"second outside {int(second[~k1].sum())}, p {p_second:.3f}"
    )
