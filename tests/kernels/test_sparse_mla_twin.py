"""The sparse-MLA twin reads a run of a prompt's tokens (kernels.paged.RUN_MIN_TOKENS or more of
one sequence in a row) as one gather of the sequence's latents and a softmax over all of them,
weighted by how often each token picked each position; the step's other tokens gather their own
picks. Both must be the attention over each token's picks: checked against a closed form written
apart from the twin, per token, on the model's cache and on the FP8 latent cache."""

from __future__ import annotations

import pytest
import torch

from kernels import sparse_mla
from kernels.fp8_cache import pack_fp8_rows_reference, unpack_fp8_rows_reference
from kernels.paged import RUN_MIN_TOKENS
from kernels.sparse_mla import latent_cache_layout, sparse_mla_attention_reference

HEADS, LORA, ROPE, BLOCK, TOPK = 3, 128, 16, 8, 12


def _step(seed: int):
    """A 20-token chunk, a decode, a 4-row verify, a 9-token chunk whose picks repeat a
    position, over shuffled blocks; picks as the indexer makes them (a token at p has min(K,
    p + 1), then -1)."""
    g = torch.Generator().manual_seed(seed)
    runs = [(0, range(10, 30)), (1, range(40, 41)), (2, range(20, 24)), (3, range(30, 39))]
    assert [len(r) >= RUN_MIN_TOKENS for _, r in runs] == [True, False, False, True]
    seq_idx = torch.tensor([s for s, r in runs for _ in r])
    positions = torch.tensor([p for _, r in runs for p in r])
    picks = torch.full((len(positions), TOPK), -1, dtype=torch.int32)
    for t, p in enumerate(positions.tolist()):
        n = min(TOPK, p + 1)
        picks[t, :n] = torch.randperm(p + 1, generator=g)[:n].to(torch.int32)
    picks[-1, 1] = picks[-1, 0]  # a repeated pick counts twice, as a gather of it would
    tables = torch.randperm(32, generator=g).to(torch.int32).view(4, 8)
    latents = torch.randn(32, BLOCK, LORA + ROPE, generator=g)
    q = torch.randn(len(positions), HEADS, LORA + ROPE, generator=g)
    return q, latents, tables, seq_idx, picks, positions


def _closed_form(q, rows_of, tables, seq_idx, picks, scale):
    out = torch.empty(q.shape[0], HEADS, LORA)
    for t in range(q.shape[0]):
        chosen = picks[t][picks[t] >= 0].long()
        blocks = tables[seq_idx[t], chosen // BLOCK].long()
        keys = rows_of(blocks, chosen % BLOCK)  # [n, W]
        probs = (q[t] @ keys.t() * scale).softmax(-1)  # [H, n]
        out[t] = probs @ keys[:, :LORA]
    return out


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("masked_keys_per_pick", [sparse_mla.MASKED_KEYS_PER_PICK, 0])
def test_runs_and_single_tokens_match_the_closed_form(monkeypatch, fp8, masked_keys_per_pick):
    """With the runs on their path (the default bound) and with every token gathering its own
    picks (bound 0), on the model's cache and on the FP8 latent cache."""
    monkeypatch.setattr(sparse_mla, "MASKED_KEYS_PER_PICK", masked_keys_per_pick)
    q, latents, tables, seq_idx, picks, positions = _step(int(fp8))
    cache = latents
    if fp8:
        layout = latent_cache_layout(LORA, LORA + ROPE, torch.float32)
        cache = pack_fp8_rows_reference(latents.view(-1, LORA + ROPE), layout)
        cache = cache.view(*latents.shape[:2], -1)
        latents = unpack_fp8_rows_reference(cache, layout)
    scale = (LORA + ROPE) ** -0.5
    got = sparse_mla_attention_reference(
        q, cache, tables, seq_idx, picks, scale, LORA, None, positions
    )
    expected = _closed_form(q, lambda b, s: latents[b, s], tables, seq_idx, picks, scale)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
