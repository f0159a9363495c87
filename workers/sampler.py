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

from kernels import ops
from workers.batch import SamplingSpec
from workers.host_copy import start_copy_to_host

# `batched_probs` top-p of a row that has none: no prefix mass reaches it.
NO_TOP_P = 2.0


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
        targets = argmax if argmax is not None else ops.argmax(logits).tolist()
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
    index = torch.tensor([rows, token_ids], device=logits.device)  # one copy to the device
    logp = logits.index_select(0, index[0]).float().log_softmax(-1)
    chosen = logp.gather(1, index[1][:, None]).squeeze(1)
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


def truncation(spec: SamplingSpec, vocab: int) -> tuple[int, float] | None:
    """A request's top-k and top-p as `batched_probs` takes them: (the index, in descending
    order, of the least logit top-k keeps (vocab - 1: no top-k), top-p (NO_TOP_P: none)), or
    None when the request truncates nothing."""
    use_k = bool(spec.top_k) and 0 < spec.top_k < vocab
    if not use_k and spec.top_p >= 1.0:
        return None
    return (spec.top_k - 1 if use_k else vocab - 1), (spec.top_p if spec.top_p < 1.0 else NO_TOP_P)


def batched_probs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    kth_index: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """`processed_probs` with each row's own settings: [R, V] fp32 logits, [R] temperature,
    and each row's `truncation` as [R] kth_index (long) and top_p -> [R, V] fp32
    probabilities. One sort of the rows serves top-k and top-p; without kth_index (no row
    truncates) there is no sort."""
    logits = logits / temperature[:, None]
    if kth_index is None:
        return logits.softmax(-1)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    # Top-k: below the k-th largest value (ties with it stay, as in processed_probs).
    kth = sorted_logits.gather(1, kth_index[:, None])
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    sorted_probs = sorted_logits.softmax(-1)
    # Top-p: the smallest prefix whose mass reaches top_p (the first token always stays).
    drop = sorted_probs.cumsum(-1) - sorted_probs >= top_p[:, None]
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    sorted_probs = sorted_probs / sorted_probs.sum(-1, keepdim=True)
    return torch.empty_like(sorted_probs).scatter_(-1, order, sorted_probs)


# Top-k / top-p among each row's CANDIDATES most likely tokens (`candidate_probs`) instead of a
# sort of the whole vocabulary, at vocabularies of at least CANDIDATES_MIN_VOCAB: DeepSeek-V3.2's
# 129,280 entries sorted for every sampled row was most of a sampled step's device time. Below it
# the sort is cheap and stays. Measured with `benchmarks/bench_sampler_graphs.py --device-time`
# at 129,280 entries, top-p 0.9 (BENCHMARKS.md): on the H200 one graph replay took 4,394 us
# sorting against 1,282 among candidates at 256 rows, 379 against 232 at 2, but 191 against 225
# at 1 row (one row's top-k is one block's work); on CPU 113 ms against 15 at 16 rows, 13.9
# against 1.1 at 1. Used at every row count even so: a seeded request then computes its
# probabilities the same way whatever else is in its step (README: what a seed reproduces), for
# 34 us more on a one-row step. A device not named sorts.
CANDIDATES = 1024
CANDIDATES_MIN_VOCAB = 16384
CANDIDATE_DEVICES = ("cpu", "cuda")


def num_candidates(vocab: int, device: torch.device) -> int | None:
    """How many candidates `sample_rows` truncates among at this vocabulary on this device
    (None: it sorts the whole row)."""
    if device.type not in CANDIDATE_DEVICES:
        return None
    return CANDIDATES if vocab >= CANDIDATES_MIN_VOCAB and CANDIDATES < vocab else None


def candidate_probs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    kth_index: torch.Tensor,
    top_p: torch.Tensor,
    candidates: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`batched_probs` among each row's `candidates` largest logits and one more (which tells a
    tie with a top-k's k-th largest past them): a top-k of the row (partial selection) in place
    of its sort. -> ([R, V] probabilities, [R] exact).

    A row's result is `batched_probs`' (to fp32 rounding) wherever what it keeps lies among its
    candidates, which `exact` says per row: with a top-k, when the last candidate is below its
    k-th largest logit (k <= `candidates`, and no tie with it outside); with a top-p only,
    when the candidates' mass (under the whole row's softmax) reaches top-p, so the first token
    past them is dropped. A row that truncates nothing takes the whole row's softmax and is
    exact. The caller redoes the rows that are not with `batched_probs` (a flat distribution
    under a top-p near 1: rare for a trained model's next token)."""
    vocab = logits.shape[-1]
    scaled = logits / temperature[:, None]
    whole = scaled.softmax(-1)  # the rows that truncate nothing; a top-p-only row's mass
    width = min(candidates + 1, vocab)
    values, ids = scaled.topk(width, dim=-1)  # sorted, descending
    has_k = kth_index < vocab - 1
    kth = values.gather(1, kth_index.clamp(max=width - 1)[:, None])
    kth = torch.where(has_k[:, None], kth, float("-inf"))
    # With a top-k the row's softmax is over what it keeps (all candidates when exact); with
    # none, over the whole row.
    kept_logits = values.masked_fill(values < kth, float("-inf"))
    cand = torch.where(has_k[:, None], kept_logits.softmax(-1), whole.gather(1, ids))
    mass = cand.cumsum(-1)
    # Top-p: the smallest prefix whose mass reaches top_p (the first token always stays).
    kept = cand.masked_fill(mass - cand >= top_p[:, None], 0.0)
    kept = kept / kept.sum(-1, keepdim=True)
    truncating = has_k | (top_p < 1.0)
    within_k = has_k & (kth_index < width - 1) & (values[:, -1] < kth[:, 0])
    within_p = ~has_k & (mass[:, -1] >= top_p)
    exact = ~truncating | within_k | within_p
    probs = torch.where(truncating[:, None], torch.zeros_like(whole).scatter_(1, ids, kept), whole)
    return probs, exact


# How a row's token is drawn from its residual. On CUDA: the argmax of p / E over an Exp(1)
# entry per token (`multinomial`'s own method there; the noise is [R, V + 1], one fill). On the
# devices of CDF_DRAW_DEVICES: by the inverse of the row's cumulative distribution at one
# uniform (noise [R, 2]): on CPU, V exponentials a row were most of a sampled step's sampler
# (at 64 requests of 4,096 entries 5.5-8.2 ms, 0.6 ms by the inverse CDF; BENCHMARKS.md).
CDF_DRAW_DEVICES = ("cpu",)


def noise_width(vocab: int, device: torch.device) -> int:
    """Columns of `sample_rows`' noise on this device: the draw's (V, or 1 for the inverse
    CDF), then the acceptance's."""
    return 2 if device.type in CDF_DRAW_DEVICES else vocab + 1


def _draw_by_cdf(residual: torch.Tensor, exp_noise: torch.Tensor) -> torch.Tensor:
    """[R, V] unnormalized probabilities, [R, 1] Exp(1) -> [R] long: entry i with probability
    residual_i / sum(residual), by the first cumulative sum past u * sum, u = 1 - exp(-E)
    (uniform on [0, 1)). In float64, and never past the last entry with mass: an entry of zero
    probability is never drawn (a row with no mass draws one that is never used)."""
    cum = residual.double().cumsum(-1)
    total = cum[:, -1:].contiguous()
    u = -torch.expm1(-exp_noise.double())
    past = torch.searchsorted(cum, u * total, right=True)
    last_with_mass = torch.searchsorted(cum, total, right=False)
    return torch.minimum(past, last_with_mass)[:, 0]


def padding_settings(vocab: int) -> list[float]:
    """`sample_rows`' settings of a row that only pads a graph's bucket: temperature 1, no
    truncation, no draft (its draw is never read)."""
    return [1.0, vocab - 1, NO_TOP_P, -1]


def sample_rows(
    logits: torch.Tensor,  # [R, V] fp32
    settings: torch.Tensor,  # [4, R] float64: temperature, kth index, top-p, draft (-1: none)
    noise: torch.Tensor,  # [R, V + 1] or [R, 2] fp32 (`noise_width`), Exp(1) entries
    truncates: bool,  # any row with top-k or top-p (else no sort and no candidates)
    candidates: int | None = None,  # truncate among this many (`candidate_probs`), or sort
) -> torch.Tensor:
    """The batched sampler's device work, with no host work and no synchronization: what
    `workers.cuda_graph.SamplerGraphs` captures, and what runs eagerly where there is no graph.
    -> [3, R] long: each row's draw, whether the draft the row verifies is accepted, and
    whether the row's truncation was exact among its candidates (1 where there were none to
    choose: a row that is not is redone with `candidates=None`, `resample_inexact`).

    Row j verifying draft d accepts it when u < p_j(d), u = 1 - exp(-noise[j, -1]) (uniform
    on [0, 1) when the noise is Exp(1), as `uniform_` is: a draft of probability 1 is always
    accepted, even at a noise of exactly 0). The row's draw is from its residual (p_j without
    d; a row with no draft draws from p_j): with V + 1 columns the argmax of p / E over its
    noise E, `multinomial`'s own method, which picks entry i with probability p_i / sum(p);
    with 2, the inverse of its cumulative distribution at one uniform (`_draw_by_cdf`). A residual
    with no mass left (p one-hot at its draft, which is then always accepted) draws an entry
    that is never used."""
    temperature = settings[0].float()
    if truncates and candidates is not None:
        probs, exact = candidate_probs(
            logits, temperature, settings[1].long(), settings[2].float(), candidates
        )
    else:
        truncation_args = (settings[1].long(), settings[2].float()) if truncates else ()
        probs = batched_probs(logits, temperature, *truncation_args)
        exact = torch.ones(logits.shape[0], dtype=torch.bool, device=logits.device)
    draft = settings[3].long()[:, None]
    verifies = draft >= 0
    at = draft.clamp(min=0)
    p_draft = probs.gather(1, at)
    accept = verifies & (-torch.expm1(-noise[:, -1:]) < p_draft)
    # probs is this call's own tensor and `accept` has read it: the draft cleared in place.
    residual = probs.scatter_(1, at, torch.where(verifies, 0.0, p_draft))
    if noise.shape[1] == 2:  # one Exp(1) for the draw (`noise_width`)
        draws = _draw_by_cdf(residual, noise[:, :1])
    else:
        # An Exp(1) draw of exactly 0 would make 0 / 0 a NaN, which argmax would pick.
        tiny = torch.finfo(torch.float32).tiny
        draws = ops.argmax(residual / noise[:, :-1].clamp(min=tiny))
    return torch.stack([draws, accept[:, 0].long(), exact.long()])


def resample_inexact(
    logits: torch.Tensor,
    settings: torch.Tensor,
    noise: torch.Tensor,
    exact: list[int],
    draws: list[int],
    accepted: list[int],
) -> None:
    """Redo, with the whole rows sorted, the rows whose truncation did not fit among their
    candidates, from the same logits, settings and noise (so a seeded request's draw is its
    seed's either way); their draws and acceptances are replaced in place."""
    rows = [j for j, ok in enumerate(exact) if not ok]
    index = torch.tensor(rows, device=logits.device)
    redone = sample_rows(
        logits.index_select(0, index),
        settings.index_select(1, index),
        noise.index_select(0, index),
        True,
    ).tolist()
    for j, draw, accept in zip(rows, redone[0], redone[1]):
        draws[j], accepted[j] = draw, accept


def verify_and_sample_batch(
    logits: torch.Tensor,  # [R, V] fp32: each request's drafts + 1 rows, request after request
    draft_token_ids: list[list[int]],
    specs: list[SamplingSpec],  # none greedy
    generators: list[torch.Generator | None] | None = None,  # a seeded request's own stream
    graphs=None,  # workers.cuda_graph.SamplerGraphs; logits then its `logits(R)`
    on_draws=None,  # called with `sample_rows`' device results before the host reads them
) -> list[tuple[list[int], int]]:
    """`verify_and_sample` for many sampling requests at once (`sample_rows`): one copy to the
    device, one fill of noise, the batched device work (one graph replay where `graphs` has
    a bucket of R rows), one copy to the host; instead of a dozen small operations and a
    synchronizing draw per request. A request with a generator of its own (a seed) takes its
    noise from it, one operation more each and no synchronization, so its tokens depend on
    its seed and not on the step's other requests (nor on whether a graph ran).

    The same rule as `verify_and_sample`: draft d at row j is accepted when u < p_j(d), the
    first rejected row draws from its residual, and when every draft is accepted the last row
    draws the bonus token. Every row's draw is made, and the host keeps the one the
    acceptances point at: the draws are independent of the acceptances, so each emitted token
    keeps its distribution."""
    device, vocab = logits.device, logits.shape[-1]
    rows_per = [len(drafts) + 1 for drafts in draft_token_ids]
    num_rows = sum(rows_per)
    size = graphs.bucket(num_rows) if graphs is not None else num_rows
    cuts = [truncation(spec, vocab) for spec in specs]
    truncates = any(cut is not None for cut in cuts)
    # One host buffer, rows padded to the graph's: per row its temperature, its truncation and
    # the draft it verifies (-1: none); float64 holds each exactly.
    temperature, kth, top_p, draft, row_starts = [], [], [], [], []
    for spec, cut, drafts, n in zip(specs, cuts, draft_token_ids, rows_per):
        row_starts.append(len(draft))
        temperature += [spec.temperature] * n
        kth += [cut[0] if cut else vocab - 1] * n
        top_p += [cut[1] if cut else NO_TOP_P] * n
        draft += drafts
        draft.append(-1)
    host = torch.empty(4, size, dtype=torch.float64, pin_memory=device.type == "cuda")
    packed = host.numpy()
    packed[:, :num_rows] = temperature, kth, top_p, draft
    packed[:, num_rows:] = [[value] for value in padding_settings(vocab)]
    if graphs is not None:
        settings, noise = graphs.inputs(size)
        settings.copy_(host, non_blocking=True)
    else:
        settings = host.to(device, non_blocking=True)
        noise = torch.empty(size, noise_width(vocab, device), device=device)
    seeded = [(i, g) for i, g in enumerate(generators or ()) if g is not None]
    if len(seeded) < len(specs):  # the global stream for those without a seed
        noise.exponential_()
    for i, generator in seeded:
        noise[row_starts[i] : row_starts[i] + rows_per[i]].exponential_(generator=generator)
    if graphs is not None:
        out = graphs.replay(size, truncates)
    else:
        out = sample_rows(logits, settings, noise, truncates, num_candidates(vocab, device))
    if on_draws is not None:  # device work that goes on behind the draw (the MTP proposal)
        # The copy to the host first: a graph replayed behind the draw may reuse the shared
        # graph pool's memory that holds the sampler graph's output (captured after it).
        host, copied = start_copy_to_host(out)
        on_draws(out)
        if copied is not None:
            copied.synchronize()
        out = host
    draws, accepted, exact = out.tolist()  # one copy to the host
    # Only truncating rows among candidates can be inexact (`sample_rows`).
    if truncates and not all(exact[:num_rows]):
        resample_inexact(logits, settings, noise, exact[:num_rows], draws, accepted)
    results, start = [], 0
    for drafts, n in zip(draft_token_ids, rows_per):
        num_accepted = 0
        while num_accepted < len(drafts) and accepted[start + num_accepted]:
            num_accepted += 1
        tokens = list(drafts[:num_accepted]) + [draws[start + num_accepted]]
        results.append((tokens, num_accepted))
        start += n
    return results
