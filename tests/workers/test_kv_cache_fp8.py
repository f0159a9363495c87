"""The FP8 caches end to end: on the trained default model the FP8 latent cache stays close to
the exact one; on the tiny model MTP stays lossless against the same cache dtype, and the plan
counts the bytes the engine allocates."""

from __future__ import annotations

import torch
from transformers import DeepseekV32Config

from kernels.fp8_cache import FP8_CACHE_DTYPE
from tests.workers.paged_harness import PagedHarness
from workers.default_model import SHIPPED_DIR
from workers.kv_cache import CacheFormat, allocate_kv_caches, cache_bytes_per_block
from workers.loader import load_model
from workers.memory_plan import plan_memory
from workers.model_config import DEEPSEEK_V32


@torch.no_grad()
def _logits(model_dir, kv_cache_dtype):
    model, config = load_model(model_dir, dtype=torch.float32)
    tokens = torch.randint(3, config.vocab_size, (48,), generator=torch.Generator().manual_seed(2))
    harness = PagedHarness(model, 1, 64, kv_cache_dtype=kv_cache_dtype)
    # A prefill chunk, then decode steps that read the chunk's cached rows.
    logits = [model.compute_logits(model(tokens[:40], harness.metadata({0: 40})))]
    for t in range(40, 48):
        logits.append(model.compute_logits(model(tokens[t : t + 1], harness.metadata({0: 1}))))
    return torch.cat(logits), model


def test_fp8_latent_cache_is_close_to_the_exact_one():
    # The trained model: the tiny random one's large weights amplify any rounding (its logits
    # moved by up to 100% with FP8 latents, which says nothing about a real model).
    exact, _ = _logits(SHIPPED_DIR, "auto")
    fp8, model = _logits(SHIPPED_DIR, "fp8")
    assert all(c.dtype == FP8_CACHE_DTYPE for c in model.kv_caches)
    assert all(c.dtype == torch.float32 for c in model.index_caches)
    rel = (fp8 - exact).norm(dim=-1) / exact.norm(dim=-1)
    # Measured: mean 0.028, max 0.17 over the 48 positions; argmax agrees at 46 of 48.
    assert 0 < rel.mean() < 0.06
    assert (fp8.argmax(-1) == exact.argmax(-1)).float().mean() > 0.9


def test_engine_with_fp8_caches_mtp_lossless(tiny_model_dir):
    from cluster.llm import LLM
    from cluster.sampling_params import SamplingParams

    options = dict(dtype="float32", kv_cache_dtype="fp8", indexer_numerics="fp8")
    llm = LLM(tiny_model_dir, num_draft_tokens=2, **options)
    model = llm.engine.executor.worker.model
    assert all(c.dtype == FP8_CACHE_DTYPE for c in model.kv_caches + model.index_caches)
    assert len(model.kv_caches) == model.config.num_hidden_layers + 1  # the MTP layer's too
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompt = torch.randint(3, 500, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    assert len(prompt) > model.config.index_topk  # the indexer really selects
    plain = LLM(tiny_model_dir, **options)
    mtp_tokens = llm.generate([prompt], params)[0].token_ids
    assert mtp_tokens == plain.generate([prompt], params)[0].token_ids
    assert len(mtp_tokens) == 12


def test_bad_kv_cache_dtype_is_a_clear_error(tiny_model_dir):
    import pytest

    from cluster.config import EngineConfig

    with pytest.raises(ValueError, match="kv_cache_dtype 'int8' is not one of"):
        EngineConfig(model=tiny_model_dir, kv_cache_dtype="int8")


def test_bytes_per_token_deepseek_v32():
    config = DeepseekV32Config(**DEEPSEEK_V32)
    per_token = {
        (kv, numerics): cache_bytes_per_block(
            config, 1, torch.bfloat16, True, CacheFormat.of(kv, numerics)
        )
        for kv in ("auto", "fp8")
        for numerics in ("exact", "fp8")
    }
    layers = 61 + 1  # and the MTP layer
    # bf16: 576-wide latent + 128-wide key; FP8: FlashMLA's 656-byte rows, 144-byte keys (132
    # aligned to 16 bytes).
    assert per_token["auto", "exact"] == layers * (576 + 128) * 2
    assert per_token["auto", "fp8"] == layers * (576 * 2 + 144)
    assert per_token["fp8", "exact"] == layers * (656 + 128 * 2)
    assert per_token["fp8", "fp8"] == layers * (656 + 144)


def test_plan_counts_the_fp8_caches_the_engine_allocates(tiny_model_dir):
    _, config = load_model(tiny_model_dir, dtype=torch.float32)
    exact = plan_memory(tiny_model_dir, dtype=torch.float32)
    for kv, numerics in (("fp8", "exact"), ("auto", "fp8"), ("fp8", "fp8")):
        plan = plan_memory(
            tiny_model_dir, dtype=torch.float32, kv_cache_dtype=kv, indexer_numerics=numerics
        )
        caches = allocate_kv_caches(
            config, 3, 64, torch.float32, "cpu", True, CacheFormat.of(kv, numerics)
        )
        allocated = sum(c.numel() * c.element_size() for group in caches for c in group)
        assert plan.kv_bytes_per_token * 3 * 64 == allocated
        assert plan.kv_bytes_per_token < exact.kv_bytes_per_token
        assert plan.max_cached_tokens > exact.max_cached_tokens
