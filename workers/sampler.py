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


def token_logprobs(
    logits: torch.Tensor, rows: list[int], token_ids: list[int], num_tops: list[int]
) -> list[dict]:
    """Raw log-probabilities (before sampling transforms) of emitted tokens and their top-n:
    entry e is token_ids[e] at row rows[e] of `logits` with its num_tops[e] most likely tokens.
    All entries of a step at once: one gather, one log-softmax, one top-k, one copy to the
    host (not a synchronizing read per token)."""
    device = logits.device
    logp = logits.index_select(0, torch.tensor(rows, device=device)).float().log_softmax(-1)
    chosen = logp.gather(1, torch.tensor(token_ids, device=device)[:, None]).squeeze(1)
    most = max(num_tops)
    if most:  # one copy of the values (the chosen one first in each row), one of the ids
        top_values, top_ids = logp.topk(most, dim=-1)
        values = torch.cat([chosen[:, None], top_values], dim=1).tolist()
        top_ids = top_ids.tolist()
    else:
        values = chosen[:, None].tolist()
    out = []
    for e, (token, num_top) in enumerate(zip(token_ids, num_tops)):
        top = list(zip(top_ids[e][:num_top], values[e][1 : 1 + num_top])) if num_top else []
        out.append({"token_id": token, "logprob": values[e][0], "top": top})
    return out


def batched_probs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    truncates: bool = True,
) -> torch.Tensor:
    """`processed_probs` with each row's own settings: [R, V] logits, [R] temperature, top_k
    (0: off) and top_p (1: off) -> [R, V] fp32 probabilities. One sort of the rows serves
    top-k and top-p; `truncates` False (the caller knows no row asks for either, without
    reading the tensors back from the device) skips it."""
    logits = logits.float() / temperature[:, None]
    if not truncates:
        return logits.softmax(-1)
    vocab = logits.shape[-1]
    use_k = (top_k > 0) & (top_k < vocab)
    use_p = top_p < 1.0
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    # Top-k: below the k-th largest value (ties with it stay, as in processed_probs).
    kth_index = torch.where(use_k, top_k - 1, torch.full_like(top_k, vocab - 1))
    kth = sorted_logits.gather(1, kth_index[:, None])
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    sorted_probs = sorted_logits.softmax(-1)
    # Top-p: the smallest prefix whose mass reaches top_p (the first token always stays).
    drop = (sorted_probs.cumsum(-1) - sorted_probs >= top_p[:, None]) & use_p[:, None]
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    sorted_probs = sorted_probs / sorted_probs.sum(-1, keepdim=True)
    return torch.zeros_like(sorted_probs).scatter_(-1, order, sorted_probs)


def verify_and_sample_batch(
    logits: torch.Tensor,  # [R, V]: each request's drafts + 1 rows, request after request
    draft_token_ids: list[list[int]],
    specs: list[SamplingSpec],  # none greedy
) -> list[tuple[list[int], int]]:
    """`verify_and_sample` for many sampling requests without a seed of their own, in a fixed
    number of batched operations and one copy to the host, instead of a dozen small ones and a
    synchronizing draw per request. The same rule: draft d at row j is accepted when u < p_j(d)
    (u uniform), the first rejected row draws from its residual (p_j without d; the draw does
    not need it renormalized), and when every draft is accepted the last row draws the bonus
    token. Every row's draw is made, and the host keeps the one the acceptances point at: the
    draws are independent of the acceptances, so each emitted token keeps its distribution."""
    device = logits.device
    rows_per = [len(drafts) + 1 for drafts in draft_token_ids]

    def per_row(values) -> torch.Tensor:
        return torch.tensor([v for v, n in zip(values, rows_per) for _ in range(n)], device=device)

    probs = batched_probs(
        logits,
        per_row([s.temperature for s in specs]).float(),
        per_row([s.top_k or 0 for s in specs]),
        per_row([s.top_p for s in specs]).float(),
        truncates=any((s.top_k or 0) > 0 or s.top_p < 1.0 for s in specs),
    )
    draft_rows, flat_drafts, start = [], [], 0
    for drafts, n in zip(draft_token_ids, rows_per):
        draft_rows += range(start, start + len(drafts))
        flat_drafts += drafts
        start += n
    accepted = []
    residual = probs
    if draft_rows:
        rows = torch.tensor(draft_rows, device=device)
        ids = torch.tensor(flat_drafts, device=device)
        accept = torch.rand(len(draft_rows), device=device) < probs[rows, ids]
        residual = probs.clone()
        residual[rows, ids] = 0.0
        # A row one-hot at its draft always accepts it; give its unused draw a valid row.
        empty = residual.sum(-1, keepdim=True) <= 0
        residual = torch.where(empty, probs, residual)
    draws = torch.multinomial(residual, 1).squeeze(1)
    if draft_rows:  # one copy to the host: the draws, then the acceptances
        both = torch.cat([draws, accept.long()]).tolist()
        draws, accepted = both[: len(draws)], both[len(draws) :]
    else:
        draws = draws.tolist()
    results, start, flat = [], 0, 0
    for drafts, n in zip(draft_token_ids, rows_per):
        num_accepted = 0
        while num_accepted < len(drafts) and accepted[flat + num_accepted]:
            num_accepted += 1
        tokens = list(drafts[:num_accepted]) + [draws[start + num_accepted]]
        results.append((tokens, num_accepted))
        start += n
        flat += len(drafts)
    return results
