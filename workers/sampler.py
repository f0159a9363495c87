"""Sampling and the MTP acceptance rule.

Greedy: accept drafts while they equal the target's argmax; the first mismatch is replaced by
the argmax, so greedy output with MTP is exactly greedy output without it.

Sampling (speculative rejection sampling, Leviathan et al. / Chen et al.): the MTP layer's drafts
are greedy, so the draft distribution q is one-hot at d. Draft d is accepted with probability
min(1, p(d) / q(d)) = p(d); on rejection the replacement is drawn from the residual
norm(max(0, p - q)), which is p with d removed, renormalized. Then every emitted token is
distributed exactly as p: P(d) = p(d) * 1 + 0, and for x != d,
P(x) = (1 - p(d)) * p(x) / (1 - p(d)).
When all k drafts are accepted, a bonus token is drawn from the target's next distribution.
"""

from __future__ import annotations

import torch

from workers.batch import SamplingSpec


def generator_seed(seed: int) -> int:
    """What a request's torch.Generator is seeded with: the seed modulo 2**64, the range
    `manual_seed` accepts (so no seed can fail a step there)."""
    return seed % 2**64


def processed_probs(logits: torch.Tensor, spec: SamplingSpec) -> torch.Tensor:
    """[N, V] fp32 logits -> the distribution sampling draws from (temperature, top-k, top-p)."""
    logits = logits.float() / spec.temperature
    if spec.top_k and spec.top_k > 0 and spec.top_k < logits.shape[-1]:
        kth = logits.topk(spec.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if spec.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = sorted_probs.cumsum(-1) - sorted_probs >= spec.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(probs, 1, generator=generator))


def verify_and_sample(
    # [num_drafts + 1, V]: row j is the target's prediction after draft j. Greedy reads only
    # `argmax` when the caller has it (then logits may be None).
    logits: torch.Tensor | None,
    draft_token_ids: list[int],
    spec: SamplingSpec,
    generator: torch.Generator | None,
    argmax: list[int] | None = None,  # logits.argmax(-1), if the caller has it on the host
) -> tuple[list[int], int]:
    """-> (emitted tokens: accepted drafts then one target token, number of drafts accepted)."""
    if spec.greedy:
        targets = argmax if argmax is not None else logits.argmax(-1).tolist()
        accepted = 0
        while accepted < len(draft_token_ids) and draft_token_ids[accepted] == targets[accepted]:
            accepted += 1
        return draft_token_ids[:accepted] + [targets[accepted]], accepted
    probs = processed_probs(logits, spec)
    for j, draft in enumerate(draft_token_ids):
        p = probs[j]
        u = torch.rand((), generator=generator, device=p.device)
        residual = p.clone()
        residual[draft] = 0.0
        # (A residual of zero mass means p is one-hot at the draft: rejection is impossible.)
        if u < p[draft] or residual.sum() <= 0:
            continue
        return draft_token_ids[:j] + [_draw(residual / residual.sum(), generator)], j
    return list(draft_token_ids) + [_draw(probs[-1], generator)], len(draft_token_ids)


def token_logprobs(logits: torch.Tensor, token_ids: list[int], num_top: int) -> list[dict]:
    """Raw log-probabilities (before sampling transforms) of the emitted tokens and the top-n."""
    logp = logits.float().log_softmax(-1)
    out = []
    for row, tok in zip(logp, token_ids):
        entry = {"token_id": tok, "logprob": float(row[tok]), "top": []}
        if num_top:
            values, ids = row.topk(num_top)
            entry["top"] = list(zip(ids.tolist(), values.tolist()))
        out.append(entry)
    return out
