"""A small run of `benchmarks/load_test.py` against the session's Serve app: 8 closed-loop
streams for 10 s. Zero errors, every completion exactly max_tokens long, every greedy output
equal to the offline `LLM`'s for its prompt (whatever batch it ran in), and afterwards no request
left in the engine and the KV pool whole again.
"""

from __future__ import annotations

import asyncio
import importlib.util
import math
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(180)

LOAD_TEST = Path(__file__).resolve().parents[2] / "benchmarks" / "load_test.py"
CONCURRENCY, DURATION_S, MAX_TOKENS, PROMPT_LEN, NUM_PROMPTS = 8, 10.0, 16, 24, 12


def _load_test_module():
    spec = importlib.util.spec_from_file_location("load_test", LOAD_TEST)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_load_has_no_errors_matches_offline_and_frees_kv(
    serve_url, served_model, tiny_model_dir, offline_llm
):
    from cluster.sampling_params import SamplingParams

    load_test = _load_test_module()
    prompts = load_test.make_prompts(
        load_test.model_vocab_size(tiny_model_dir), NUM_PROMPTS, PROMPT_LEN, seed=1
    )
    texts: dict[int, set[str]] = {}
    result = asyncio.run(
        load_test.run_load(
            serve_url, served_model["id"], prompts, CONCURRENCY, DURATION_S, MAX_TOKENS, texts
        )
    )
    assert result.num_errors == 0, result.first_errors
    assert result.num_requests >= CONCURRENCY  # every client finished at least one request
    assert result.num_output_tokens == result.num_requests * MAX_TOKENS
    assert len(result.ttft_s) == result.num_requests
    assert DURATION_S <= result.duration_s < DURATION_S + 60

    kv = asyncio.run(load_test.wait_for_idle_full_kv(serve_url, timeout_s=30))
    assert kv["num_running"] == kv["num_waiting"] == 0, kv
    assert kv["num_free_blocks"] == kv["num_total_blocks"] > 0, kv

    # Greedy: one text per prompt however requests were batched, and it is the offline one.
    references = offline_llm.generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    )
    assert texts, "no completion recorded"
    for index, seen in texts.items():
        assert seen == {references[index].text}, (index, seen)


def test_percentile_is_nearest_rank():
    """The smallest value with at least q percent of the values at or below it."""
    percentile = _load_test_module().percentile
    ten = [float(v) for v in range(10, 0, -1)]  # unordered on purpose
    assert [percentile(ten, q) for q in (1, 10, 50, 51, 90, 99, 100)] == [1, 1, 5, 6, 9, 10, 10]
    assert percentile([float(v) for v in range(1, 23)], 50) == 11
    assert math.isnan(percentile([], 50))
