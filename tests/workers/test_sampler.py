"""The rejection sampler keeps the target distribution exactly (statistical test, fixed seed).

Significance: each chi-square test rejects a correct sampler with probability alpha = 1e-3; the
file runs 10 such tests, so a correct implementation fails with probability < 1%, while a
sampler that, e.g., always accepts drafts or forgets to remove the draft from the residual
shifts the first token's distribution by >= 0.1 in probability and fails with certainty at
N = 10,000 draws.
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

import workers.sampler
from workers.batch import SamplingSpec
from workers.sampler import (
    CANDIDATES,
    NO_TOP_P,
    batched_probs,
    candidate_probs,
    noise_width,
    num_candidates,
    processed_probs,
    sample_rows,
    token_logprobs,
    truncation,
    verify_and_sample,
    verify_and_sample_batch,
)

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


LOGITS = torch.tensor(
    [
        [2.0, 1.0, 0.5, 0.0, -1.0, 0.3],
        [0.1, 1.5, -0.5, 0.7, 0.0, 1.0],
        [0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
    ]
)
SPECS = [
    SamplingSpec(temperature=1.0),
    SamplingSpec(temperature=0.7, top_k=4, top_p=0.9),
    SamplingSpec(temperature=1.3, top_p=0.6),
    SamplingSpec(temperature=0.5, top_k=2),
]


@pytest.fixture(params=["sort", "candidates"])
def truncate_among(request, monkeypatch):
    """The batched sampler's top-k / top-p by the sort of whole rows, or among 3 candidates of
    LOGITS' 6 entries (`candidate_probs`): then SPECS[1]'s top-k of 4 and top-p over the flat
    row 2 do not fit, and those rows are redone with the sort (`resample_inexact`)."""
    if request.param == "candidates":
        monkeypatch.setattr(workers.sampler, "CANDIDATES", 3)
        monkeypatch.setattr(workers.sampler, "CANDIDATES_MIN_VOCAB", 1)
    assert (num_candidates(6, torch.device("cpu")) is not None) == (request.param == "candidates")
    return request.param


def test_candidates_by_device_and_vocabulary():
    """Candidates at large vocabularies on CPU and CUDA, the sort below CANDIDATES_MIN_VOCAB and
    on a device not named."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert num_candidates(129280, cpu) == num_candidates(129280, cuda) == CANDIDATES
    assert num_candidates(4096, cpu) is None and num_candidates(4096, cuda) is None
    assert num_candidates(129280, torch.device("meta")) is None


def test_batched_probs_are_each_rows_own():
    rows = torch.cat([LOGITS] * len(SPECS))
    per_row = [s for s in SPECS for _ in range(len(LOGITS))]
    vocab = LOGITS.shape[-1]
    cuts = [truncation(s, vocab) for s in per_row]
    assert None not in cuts[len(LOGITS) :] and cuts[0] is None  # SPECS[0] truncates nothing
    cuts = [cut or (vocab - 1, NO_TOP_P) for cut in cuts]
    got = batched_probs(
        rows,
        torch.tensor([s.temperature for s in per_row]),
        torch.tensor([k for k, _ in cuts]),
        torch.tensor([p for _, p in cuts]),
    )
    want = torch.cat([processed_probs(LOGITS, s) for s in SPECS])
    torch.testing.assert_close(got, want)
    # No row truncates: no sort, the same probabilities.
    plain = batched_probs(LOGITS, torch.full((3,), 1.3))
    torch.testing.assert_close(plain, processed_probs(LOGITS, SamplingSpec(temperature=1.3)))


def test_truncation_of_each_setting():
    assert truncation(SamplingSpec(temperature=0.7), 6) is None
    assert truncation(SamplingSpec(temperature=0.7, top_k=6), 6) is None  # keeps the vocabulary
    assert truncation(SamplingSpec(temperature=0.7, top_k=2), 6) == (1, NO_TOP_P)
    assert truncation(SamplingSpec(temperature=0.7, top_p=0.5), 6) == (5, 0.5)
    assert truncation(SamplingSpec(temperature=0.7, top_k=3, top_p=0.9), 6) == (2, 0.9)


def test_batched_rejection_sampling_preserves_each_requests_distribution(truncate_among):
    """NUM_DRAWS requests of each of SPECS in one batch, all verifying the same two drafts:
    each group's first token (and, after an accepted first draft, its second) follows its own
    target rows, as `verify_and_sample` does one request at a time."""
    torch.manual_seed(0)
    drafts = [1, 3]
    specs = [s for s in SPECS for _ in range(NUM_DRAWS)]
    out = verify_and_sample_batch(torch.cat([LOGITS] * len(specs)), [drafts] * len(specs), specs)
    for g, spec in enumerate(SPECS):
        group = out[g * NUM_DRAWS : (g + 1) * NUM_DRAWS]
        assert all(tokens[:accepted] == drafts[:accepted] for tokens, accepted in group)
        assert all(len(tokens) == accepted + 1 for tokens, accepted in group)
        first = torch.bincount(torch.tensor([t[0] for t, _ in group]), minlength=6).float()
        p0 = processed_probs(LOGITS[0:1], spec)[0]
        keep = p0 > 0
        assert first[~keep].sum() == 0
        assert chisquare(first[keep], p0[keep] * NUM_DRAWS).pvalue > ALPHA
        seconds = [t[1] for t, _ in group if t[0] == drafts[0]]
        second = torch.bincount(torch.tensor(seconds), minlength=6).float()
        p1 = processed_probs(LOGITS[1:2], spec)[0]
        keep1 = p1 > 0
        assert second[~keep1].sum() == 0
        assert chisquare(second[keep1], p1[keep1] * len(seconds)).pvalue > ALPHA


def test_batched_sampler_without_drafts_and_with_a_certain_draft():
    """No drafts: one draw per request from its row. A draft the target is sure of (one-hot at
    it) is always accepted, and its empty residual breaks nothing."""
    torch.manual_seed(1)
    sure = torch.full((2, 6), -1e9)
    sure[0, 2] = 0.0  # row 0: certain of token 2
    sure[1, 4] = 0.0
    out = verify_and_sample_batch(torch.cat([LOGITS[:1], sure]), [[], [2]], [SPECS[0], SPECS[0]])
    assert len(out[0][0]) == 1 and out[0][1] == 0
    assert out[1] == ([2, 4], 1)


def test_token_logprobs_of_a_step_at_once():
    """Entries for several requests' rows in one call: each is its row's log-softmax at the
    token, and that row's own number of most likely tokens, most likely first."""
    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(2))
    rows, tokens, tops = [0, 1, 3, 4], [7, 0, 39, 12], [2, 0, 5, 1]
    got = token_logprobs(logits, rows, tokens, tops)
    logp = logits.log_softmax(-1)
    for entry, row, token, top in zip(got, rows, tokens, tops, strict=True):
        assert entry["token_id"] == token
        assert entry["logprob"] == pytest.approx(logp[row, token].item(), abs=1e-6)
        values, ids = logp[row].topk(top) if top else (torch.tensor([]), torch.tensor([]))
        assert [t for t, _ in entry["top"]] == ids.tolist()
        assert [v for _, v in entry["top"]] == pytest.approx(values.tolist(), abs=1e-6)


def test_seeded_requests_in_a_batch_draw_from_their_own_streams(truncate_among):
    """A seeded request's tokens depend on its generator only, not on the requests drawn with
    it or on the global stream; and seeded draws keep each request's distribution."""
    drafts = [1, 3]
    spec = SPECS[1]
    num_seeded = 200

    def draw(companions: int, global_seed: int) -> list[tuple[list[int], int]]:
        """The seeded requests (seeds 0..num_seeded-1), each after `companions` unseeded."""
        torch.manual_seed(global_seed)
        specs, generators = [], []
        for seed in range(num_seeded):
            specs += [SPECS[2]] * companions + [spec]
            generators += [None] * companions + [torch.Generator().manual_seed(seed)]
        logits = torch.cat([LOGITS] * len(specs))
        out = verify_and_sample_batch(logits, [drafts] * len(specs), specs, generators)
        return out[companions :: companions + 1]

    alone = draw(0, 0)
    assert draw(0, 5) == alone
    assert draw(2, 1) == alone
    assert len({tuple(tokens) for tokens, _ in alone}) > 1  # the seeds do draw differently
    # Each of NUM_DRAWS requests with a seed of its own: the first tokens follow row 0.
    generators = [torch.Generator().manual_seed(s) for s in range(NUM_DRAWS)]
    specs = [spec] * NUM_DRAWS
    out = verify_and_sample_batch(
        torch.cat([LOGITS] * NUM_DRAWS), [drafts] * NUM_DRAWS, specs, generators
    )
    first = torch.bincount(torch.tensor([t[0] for t, _ in out]), minlength=6).float()
    p0 = processed_probs(LOGITS[0:1], spec)[0]
    keep = p0 > 0
    assert first[~keep].sum() == 0
    assert chisquare(first[keep], p0[keep] * NUM_DRAWS).pvalue > ALPHA


def _settings(rows: list[tuple[SamplingSpec, int]], vocab: int) -> torch.Tensor:
    """`sample_rows`' settings for rows of (spec, draft verified or -1)."""
    cols = []
    for spec, draft in rows:
        kth, top_p = truncation(spec, vocab) or (vocab - 1, NO_TOP_P)
        cols.append([spec.temperature, kth, top_p, draft])
    return torch.tensor(cols, dtype=torch.float64).T.contiguous()


def test_sample_rows_accepts_below_the_drafts_probability_and_draws_from_the_residual():
    """Noise chosen so that every outcome is known: a row accepts its draft exactly when
    u = 1 - exp(-noise[:, V]) < p(draft); with E = 1 on every entry a row draws its most likely
    token, never its draft (removed from the residual) nor a token its truncation drops, even
    where that token's noise is 0 (0 / 0 would be a NaN, which argmax picks)."""
    vocab = LOGITS.shape[1]
    rows = [(SPECS[1], 0), (SPECS[1], 0), (SPECS[2], 1), (SPECS[3], -1), (SPECS[0], 0)]
    logits = torch.stack([LOGITS[0], LOGITS[0], LOGITS[1], LOGITS[0], LOGITS[0]])
    probs = torch.cat([processed_probs(logits[j : j + 1], s) for j, (s, _) in enumerate(rows)])
    noise = torch.ones(len(rows), vocab + 1)
    below, above = probs[0, 0] * 0.99, probs[1, 0] * 1.01
    u = torch.tensor([below, above, 0.0, 0.0, 1.0])
    noise[:, vocab] = -torch.log1p(-u)  # E = inf at u = 1
    noise[:, :vocab][probs == 0] = 0.0  # dropped by top-k / top-p: still never drawn
    draws, accepted, exact = sample_rows(logits, _settings(rows, vocab), noise, True).tolist()
    assert exact == [1] * len(rows)  # the sort: every row exact
    assert accepted == [1, 0, 1, 0, 0]  # u = 0 always accepts (p > 0); u = 1 never does
    # A draft of probability 1 is accepted even at a noise of exactly 0 (u = 0).
    sure = torch.full((1, vocab), -1e9)
    sure[0, 2] = 0.0
    out = sample_rows(sure, _settings([(SPECS[0], 2)], vocab), torch.zeros(1, vocab + 1), False)
    assert out[1].tolist() == [1]
    for j, (_, draft) in enumerate(rows):
        residual = probs[j].clone()
        if draft >= 0:
            residual[draft] = 0.0
        assert draws[j] == int(residual.argmax())
        assert probs[j, draws[j]] > 0
    assert draws[3] == 0  # no draft: the most likely token itself
    # Without truncation (no row cuts anything) the same function, no sort.
    plain = [(SPECS[0], 1), (SPECS[0], -1)]
    draws, accepted, exact = sample_rows(
        LOGITS[:2], _settings(plain, vocab), torch.ones(2, vocab + 1), False
    ).tolist()
    assert draws == [0, 1] and accepted == [0, 0] and exact == [1, 1]


def _zipf_rows(num_rows: int, vocab: int, seed: int) -> torch.Tensor:
    """Peaked logits, as a trained model's next token mostly is (probability ~ 1 / rank^2 over a
    random order of the vocabulary: the top 64 of 2,000 hold 99%), each row its own order."""
    g = torch.Generator().manual_seed(seed)
    ranks = torch.arange(1, vocab + 1, dtype=torch.float32)
    rows = [(-2.0 * ranks.log())[torch.randperm(vocab, generator=g)] for _ in range(num_rows)]
    return torch.stack(rows)


def test_candidate_probs_are_the_sorts_where_they_fit():
    """Top-k / top-p among the 64 largest of 2,000 logits: a row whose kept set lies among its
    candidates gets the sort's probabilities (to fp32 rounding) and says it is exact; a row
    whose kept set does not fit says it is not (its values are then never used)."""
    vocab, candidates = 2000, 64
    peaked = _zipf_rows(6, vocab, 0)
    flat = torch.randn(2, vocab, generator=torch.Generator().manual_seed(1)) * 0.1
    ties = torch.zeros(1, vocab)
    ties[0, :3] = torch.tensor([5.0, 4.0, 3.0])
    ties[0, 3:100] = 3.0  # 98 logits equal to the 3rd largest: all kept by a top-k of 3
    logits = torch.cat([peaked, flat, ties])
    # (temperature, top_k, top_p, exact?) per row
    rows = [
        (1.0, 0, 0.9, True),  # top-p of a peaked row: well inside 64
        (0.7, 20, 0.95, True),
        (1.3, 0, 1.0, True),  # truncates nothing: the whole row's softmax
        (1.0, 64, 1.0, True),  # the 64th largest: the one taken past the candidates is below
        (1.0, 65, 1.0, False),  # a top-k past the candidates
        (1.0, 0, 0.999, False),  # a top-p past the candidates' mass
        (1.0, 0, 0.5, False),  # flat: half the mass needs far more than 64 tokens
        (1.0, 10, 0.9, True),  # flat, but a top-k of 10 bounds it
        (1.0, 3, 1.0, False),  # the 3rd largest ties with 97 more, past the candidates
    ]
    specs = [SamplingSpec(temperature=t, top_k=k, top_p=p) for t, k, p, _ in rows]
    cuts = [truncation(spec, vocab) or (vocab - 1, NO_TOP_P) for spec in specs]
    args = (
        logits,
        torch.tensor([spec.temperature for spec in specs]),
        torch.tensor([k for k, _ in cuts]),
        torch.tensor([p for _, p in cuts]),
    )
    got, exact = candidate_probs(*args, candidates)
    want = batched_probs(*args)
    assert exact.tolist() == [ok for *_, ok in rows]
    torch.testing.assert_close(got[exact], want[exact], atol=1e-6, rtol=1e-5)
    kept = want > 0
    assert torch.equal(got[exact] > 0, kept[exact])  # the same tokens kept
    assert kept[0].sum() < candidates < kept[5].sum()  # what made rows 0 and 5 differ
    assert kept[8].sum() == 100  # the sort keeps every tie with the 3rd largest


def test_candidates_draw_the_sorts_tokens(monkeypatch):
    """Seeded requests at a 2,000-entry vocabulary, verifying drafts, truncated among 64
    candidates (rows that do not fit redone with the sort) draw the very tokens the sort of
    whole rows draws from the same noise; and some rows were redone."""
    vocab = 2000
    flat = torch.randn(6, vocab, generator=torch.Generator().manual_seed(3)) * 0.1
    logits = torch.cat([_zipf_rows(24, vocab, 2), flat])
    settings = [
        dict(temperature=1.0, top_p=0.9),
        dict(temperature=0.8, top_k=40),
        dict(temperature=1.0, top_p=0.99),
        dict(temperature=0.6, top_k=200, top_p=0.8),
        dict(temperature=1.2),
    ]
    specs, drafts = [], []
    for i in range(10):  # 10 requests of 3 rows: 2 drafts each
        specs.append(SamplingSpec(**settings[i % len(settings)]))
        drafts.append([int(logits[3 * i].argmax()), int(logits[3 * i + 1].argmax())])

    def draw(candidates: bool) -> list:
        monkeypatch.setattr(workers.sampler, "CANDIDATES", 64)
        monkeypatch.setattr(workers.sampler, "CANDIDATES_MIN_VOCAB", 1 if candidates else 10**9)
        generators = [torch.Generator().manual_seed(7 + i) for i in range(len(specs))]
        return verify_and_sample_batch(logits, drafts, specs, generators)

    redone = []
    resample = workers.sampler.resample_inexact

    def counting(*args):
        redone.append(args[3].count(0))
        resample(*args)

    monkeypatch.setattr(workers.sampler, "resample_inexact", counting)
    want = draw(candidates=False)
    assert not redone
    assert draw(candidates=True) == want
    assert redone and 0 < redone[0] < len(logits)
    assert any(accepted for _, accepted in want)  # drafts were verified, some accepted


def test_the_inverse_cdf_draw_never_picks_a_token_without_mass():
    """On CPU a row draws by the inverse of its cumulative distribution at u = 1 - exp(-E)
    (noise [R, 2]: the draw's Exp(1), the acceptance's). u = 0 picks the first entry with mass,
    u = 1 (E = inf: 1 - exp(-E) rounds to 1 from E ~ 17 in fp32) the last, never an entry of
    probability 0 at either end; a draft is removed from the residual first."""
    assert noise_width(6, torch.device("cpu")) == 2
    assert noise_width(6, torch.device("cuda")) == 7
    logits = torch.full((1, 6), float("-inf"))
    logits[0, 1], logits[0, 3] = 0.0, 1.0  # mass on tokens 1 and 3 only
    settings = _settings([(SPECS[0], -1)], 6)
    for e, want in ((0.0, 1), (float("inf"), 3), (40.0, 3), (0.1, 1), (3.0, 3)):
        noise = torch.tensor([[e, 1.0]])
        draws, accepted, exact = sample_rows(logits, settings, noise, False).tolist()
        assert draws == [want], e
    # p(1) = 1 / (1 + e) = 0.269: u = 1 - exp(-0.1) = 0.095 falls in token 1's share, u =
    # 1 - exp(-3) = 0.95 in token 3's. With draft 3 verified and rejected (u = 1 - exp(-E) = 1
    # is never below p(3)), the residual is token 1 alone, whatever the draw's noise.
    rejecting = _settings([(SPECS[0], 3)], 6)
    for e in (0.0, 3.0, float("inf")):
        noise = torch.tensor([[e, float("inf")]])
        draws, accepted, _ = sample_rows(logits, rejecting, noise, False).tolist()
        assert draws == [1] and accepted == [0]


def test_work_behind_the_draw_may_overwrite_its_device_output():
    """`on_draws` launches work behind the draw (the MTP proposal's graph), which may reuse the
    memory of the draw's device output (CUDA graphs share one pool): the host's results are
    read before it, so they are the draw's own, whatever that work writes."""
    drafts, seen = [1, 3], []

    def draw(on_draws=None) -> list[tuple[list[int], int]]:
        generators = [torch.Generator().manual_seed(seed) for seed in range(50)]
        specs = [SPECS[1]] * 50
        logits = torch.cat([LOGITS] * 50)
        return verify_and_sample_batch(logits, [drafts] * 50, specs, generators, None, on_draws)

    def clobber(out: torch.Tensor) -> None:
        seen.append(out.clone())
        out.fill_(-7)

    want = draw()
    assert draw(clobber) == want
    [out] = seen  # what it was given: the draws and acceptances the results come from
    assert [tokens[-1] for tokens, _ in want] == [
        out[0, 3 * i + accepted].item() for i, (_, accepted) in enumerate(want)
    ]
