"""Batch rows fail alone: bad rows (seeds past int64, unknown fields, loosely typed values,
unencodable text) are recorded as errors, and every valid row of the same run, running
concurrently with them, gets exactly the offline engine's output."""

from __future__ import annotations

import asyncio
import json

import pytest

from cluster.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(180)

PROMPTS = [f"Row {i}: the quick brown fox" for i in range(6)]
BAD_ROWS = {
    "seed-2**64": {"seed": 2**64, "temperature": 1.0},
    "seed--2**64": {"seed": -(2**64), "temperature": 1.0},
    "seed-2**63": {"seed": 2**63, "temperature": 1.0},
    "max-tokens-string": {"max_tokens": "10"},
    "max-tokens-true": {"max_tokens": True},
    "unknown-field": {"best_of": 3},
    "bias-outside-vocab": {"logit_bias": {"100000": 1.0}},
}


def test_bad_rows_fail_alone(tiny_model_dir, tmp_path, offline_llm):
    from cluster.async_engine import AsyncEngine
    from cluster.config import EngineConfig
    from deploy.batch import run_batch

    rows = []
    for i, prompt in enumerate(PROMPTS):
        rows.append(
            json.dumps({"id": f"ok-{i}", "prompt": prompt, "max_tokens": 8, "temperature": 0})
        )
        if i < len(BAD_ROWS):
            name, fields = list(BAD_ROWS.items())[i]
            rows.append(json.dumps({"id": name, "prompt": prompt, **fields}))
    rows.append('{"id": "surrogate", "prompt": "\\ud800 lone"}')  # json.dumps would escape it too
    for name, fields in list(BAD_ROWS.items())[len(PROMPTS) :]:
        rows.append(json.dumps({"id": name, "prompt": "x", **fields}))
    input_path, output_path = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    input_path.write_text("\n".join(rows) + "\n")

    async def run():
        engine = AsyncEngine(EngineConfig(tiny_model_dir, num_draft_tokens=0, device="cpu"))
        try:
            runner = await run_batch(str(input_path), str(output_path), engine, 16, False)
            return runner, engine.is_dead
        finally:
            await engine.shutdown()

    runner, dead = asyncio.run(run())
    assert not dead
    results = {row["id"]: row for row in map(json.loads, output_path.read_text().splitlines())}
    assert set(results) == {f"ok-{i}" for i in range(len(PROMPTS))} | set(BAD_ROWS) | {"surrogate"}
    for name in [*BAD_ROWS, "surrogate"]:
        assert results[name]["error"], name
    assert (
        "seed" in results["seed-2**64"]["error"] and "best_of" in results["unknown-field"]["error"]
    )
    references = offline_llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0.0))
    for i, reference in enumerate(references):
        row = results[f"ok-{i}"]
        assert row["error"] is None
        assert row["completion_token_ids"] == list(reference.token_ids)
    assert (runner.num_succeeded, runner.num_failed) == (len(PROMPTS), len(BAD_ROWS) + 1)
