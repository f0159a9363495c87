"""Our model's logits against transformers' own DeepseekV32ForCausalLM (fp32, CPU).

Tolerance: 1e-4 absolute on logits of magnitude ~4 (about 2.5e-5 relative). Both sides compute in
fp32 but in different orders (absorbed latent attention, paged gathers, grouped experts), which
measured at 2e-6..5e-6 here; the bound leaves headroom for other BLAS builds without hiding any
algorithmic slip (a wrong RoPE layout or top-k set moves logits by > 1e-2).
"""

from __future__ import annotations

import torch

from kernels.fp8_cache import is_fp8_cache
from tests.workers.paged_harness import PagedHarness
from workers.loader import load_model

ATOL = 1e-4


def _oracle(model_dir: str):
    from transformers import DeepseekV32ForCausalLM

    return DeepseekV32ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@torch.no_grad()
def run_mixed_batch_parity(
    model_dir: str,
    prompt_lens=(40, 7, 23, 18),
    decode_steps: int = 8,
    oracle_dir: str | None = None,
) -> float:
    """Prefill several prompts in one flattened batch, then decode all of them together."""
    model, config = load_model(model_dir, dtype=torch.float32)
    oracle = _oracle(oracle_dir or model_dir)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(3, config.vocab_size, (n,), generator=g) for n in prompt_lens]
    harness = PagedHarness(model, len(seqs), max(prompt_lens) + decode_steps + 1)
    worst = 0.0
    # Step 0: every prompt prefilled at once; then decode steps, each adding one token per seq.
    new = {i: s for i, s in enumerate(seqs)}
    for step in range(decode_steps + 1):
        meta = harness.metadata({i: len(t) for i, t in new.items()})
        logits = model.compute_logits(model(torch.cat(list(new.values())), meta))
        offset = 0
        for i, toks in new.items():
            full = torch.cat([seqs[i], toks]) if step else seqs[i]
            expected = oracle(full[None]).logits[0, -len(toks) :]
            got = logits[offset : offset + len(toks)]
            offset += len(toks)
            worst = max(worst, (got - expected).abs().max().item())
            if step:
                seqs[i] = full
        new = {
            i: logits[o - 1 : o].argmax(-1)
            for i, o in zip(new, torch.tensor([len(t) for t in new.values()]).cumsum(0).tolist())
        }
    assert max(len(s) for s in seqs) > config.index_topk  # selection really drops tokens
    return worst


def test_mixed_prefill_then_decode_matches_transformers(tiny_model_dir):
    assert run_mixed_batch_parity(tiny_model_dir) < ATOL


@torch.no_grad()
def test_indexer_selection_matters(tiny_model_dir):
    """Guards the test above: attending densely past index_topk changes logits by far more than
    ATOL, so matching the oracle means our top-k sets are its top-k sets."""
    model, config = load_model(tiny_model_dir, dtype=torch.float32)
    tokens = torch.randint(3, config.vocab_size, (48,), generator=torch.Generator().manual_seed(2))
    sparse = model.compute_logits(model(tokens, PagedHarness(model, 1, 64).metadata({0: 48})))
    config.index_topk = 10_000
    for layer in model.model.layers:
        layer.self_attn.indexer.topk = 10_000
    dense = model.compute_logits(model(tokens, PagedHarness(model, 1, 64).metadata({0: 48})))
    assert (sparse[:16] - dense[:16]).abs().max() < ATOL  # up to index_topk both are dense
    assert (sparse[20:] - dense[20:]).abs().max() > 100 * ATOL


@torch.no_grad()
def test_dense_prompt_steps_match_transformers(tiny_model_dir):
    """Prompt steps whose tokens all lie before index_topk take the dense path (unabsorbed
    causal attention, no indexer scoring: `AttentionMetadata.dense`). Three prompts in two
    chunks each, the second after a context (queries the last of their keys), against the
    oracle and against the same steps on the sparse path; then a decode step on the sparse
    path reads the index keys the dense steps wrote."""
    model, config = load_model(tiny_model_dir, dtype=torch.float32)
    oracle = _oracle(tiny_model_dir)
    g = torch.Generator().manual_seed(3)
    chunks = [{0: 9, 1: 5, 2: 12}, {0: 4, 1: 7, 2: 3}]
    totals = [sum(c[i] for c in chunks) for i in range(3)]
    assert max(totals) <= config.index_topk  # every token's top-k is every position
    seqs = [torch.randint(3, config.vocab_size, (n + 1,), generator=g) for n in totals]
    worst = {True: 0.0, False: 0.0}
    for dense in (True, False):
        harness = PagedHarness(model, 3, 32)
        for step in chunks:
            meta = harness.metadata(step, dense=dense)
            assert (meta.dense is not None) == dense
            ids = torch.cat(
                [seqs[i][harness.lengths[i] - n : harness.lengths[i]] for i, n in step.items()]
            )
            logits = model.compute_logits(model(ids, meta))
            offset = 0
            for i, n in step.items():
                expected = oracle(seqs[i][None, : harness.lengths[i]]).logits[0, -n:]
                got = logits[offset : offset + n]
                worst[dense] = max(worst[dense], (got - expected).abs().max().item())
                offset += n
        # One decode each, on the sparse path, over the keys the prompt steps wrote.
        meta = harness.metadata({0: 1, 1: 1, 2: 1})
        logits = model.compute_logits(model(torch.stack([s[-1] for s in seqs]), meta))
        for i, s in enumerate(seqs):
            expected = oracle(s[None]).logits[0, -1]
            worst[dense] = max(worst[dense], (logits[i] - expected).abs().max().item())
    assert worst[True] < ATOL and worst[False] < ATOL, worst


@torch.no_grad()
def test_dense_prompt_steps_read_an_fp8_latent_cache_as_the_sparse_path_does(tiny_model_dir):
    """With the FP8 latent cache (kv_cache_dtype="fp8") the dense path attends to the latents
    dequantized from it, as the sparse path does (exact: e4m3 times a power of two): two
    chunked prompts' logits on both paths agree to fp32 rounding."""
    model, config = load_model(tiny_model_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(4)
    chunks = [{0: 7, 1: 10}, {0: 9, 1: 2}]
    seqs = [torch.randint(3, config.vocab_size, (16,), generator=g) for _ in range(2)]
    logits = {}
    for dense in (True, False):
        harness = PagedHarness(model, 2, 32, kv_cache_dtype="fp8")
        logits[dense] = []
        for step in chunks:
            meta = harness.metadata(step, dense=dense)
            ids = [seqs[i][harness.lengths[i] - n : harness.lengths[i]] for i, n in step.items()]
            logits[dense].append(model.compute_logits(model(torch.cat(ids), meta)))
    for a, b in zip(logits[True], logits[False], strict=True):
        assert (a - b).abs().max() < ATOL
    assert is_fp8_cache(model.kv_caches[0])
    assert logits[False][0].abs().max() > 100 * ATOL  # logits, not zeros


@torch.no_grad()
def test_dense_prompt_chunks_beside_sparse_rows_match_transformers(tiny_model_dir):
    """A step that mixes dense prompt rows (before index_topk) with rows on the sparse path: a
    decode past index_topk, the tokens of two chunks from index_topk on. Each row's logits
    against the oracle's, the dense rows first, last and between the others."""
    model, config = load_model(tiny_model_dir, dtype=torch.float32)
    oracle = _oracle(tiny_model_dir)
    topk = config.index_topk
    g = torch.Generator().manual_seed(5)
    seqs = [torch.randint(3, config.vocab_size, (40,), generator=g) for _ in range(5)]
    harness = PagedHarness(model, 5, 48)
    # Before: seq 0 holds topk + 4 positions, seq 2 topk - 3, seq 3 five.
    first = {0: topk + 4, 2: topk - 3, 3: 5}
    meta = harness.metadata(first)
    ids = torch.cat([seqs[i][:n] for i, n in first.items()])
    model.compute_logits(model(ids, meta))
    # The step: seq 1's first chunk (dense), seq 0's decode (sparse), seq 3's second chunk up
    # to topk (dense), seq 2's chunk across topk (its first 3 tokens dense), seq 4's whole
    # prompt, past topk by 2 (all but its last 2 dense).
    step = {1: 9, 0: 1, 3: topk - 5, 2: 6, 4: topk + 2}
    meta = harness.metadata(step, dense={1: 9, 3: topk - 5, 2: 3, 4: topk})
    starts = dict(zip(step, [0, 9, 10, 5 + topk, 11 + topk], strict=True))
    dense_rows = ((1, 9), (3, topk - 5), (2, 3), (4, topk))
    want = [r for seq, n in dense_rows for r in range(starts[seq], starts[seq] + n)]
    assert meta.dense.rows.tolist() == want
    ids = torch.cat([seqs[i][harness.lengths[i] - n : harness.lengths[i]] for i, n in step.items()])
    logits = model.compute_logits(model(ids, meta))
    worst, offset = 0.0, 0
    for i, n in step.items():
        expected = oracle(seqs[i][None, : harness.lengths[i]]).logits[0, -n:]
        worst = max(worst, (logits[offset : offset + n] - expected).abs().max().item())
        offset += n
    assert worst < ATOL
