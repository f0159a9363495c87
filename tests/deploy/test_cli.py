"""`mtpserve` console script: make-tiny-model and generate --json, checked against `LLM`."""

from __future__ import annotations

import json
import subprocess

import pytest
from conftest import MTPSERVE

pytestmark = pytest.mark.timeout(180)


def test_make_tiny_model_is_deterministic(tmp_path):
    for name in ("a", "b"):
        subprocess.run(
            [MTPSERVE, "make-tiny-model", str(tmp_path / name), "--seed", "3"],
            check=True,
            capture_output=True,
            timeout=120,
        )
    a = (tmp_path / "a" / "model.safetensors").read_bytes()
    assert a == (tmp_path / "b" / "model.safetensors").read_bytes()


@pytest.mark.no_triton
def test_generate_json_with_mtp_equals_greedy_without(tiny_model_dir, offline_llm):
    from cluster.sampling_params import SamplingParams

    prompt = "Once upon a time"
    done = subprocess.run(
        [
            MTPSERVE,
            "generate",
            "--model",
            tiny_model_dir,
            "--prompt",
            prompt,
            "--max-tokens",
            "12",
            "--temperature",
            "0",
            "--num-draft-tokens",
            "2",
            "--device",
            "cpu",
            "--json",
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=150,
    )
    result = json.loads(done.stdout.strip().splitlines()[-1])
    [reference] = offline_llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12))
    # MTP is lossless under greedy decoding: same tokens as plain decoding.
    assert result["prompt_token_ids"] == reference.prompt_token_ids
    assert result["completion_token_ids"] == reference.token_ids
    assert result["text"] == reference.text
    assert 1.0 <= result["mean_tokens_per_round"] <= 3.0
    assert len(result["acceptance_per_position"]) == 2
    assert all(0.0 <= a <= 1.0 for a in result["acceptance_per_position"])


def test_help_says_what_it_does_and_the_commands_to_run():
    done = subprocess.run(
        [MTPSERVE, "--help"], check=True, capture_output=True, text=True, timeout=60
    )
    described = done.stdout.split("positional arguments:")[0]
    assert "OpenAI-compatible HTTP API" in described
    for command in ("mtpserve serve  ", "mtpserve serve --model DIR", "mtpserve generate"):
        assert command in described, described
    assert "argument parsing" not in done.stdout  # the module's docstring is for developers


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_a_checkpoint_cut_short_is_an_error_naming_the_file(tiny_model_dir, tmp_path, command):
    """A download cut short (a shard truncated) is `mtpserve: error:` naming the shard, exit 2,
    before Ray or a replica starts: not a replica that Serve retries, traceback after
    traceback, until the deployment fails."""
    import shutil
    import time

    model = tmp_path / "cut"
    shutil.copytree(tiny_model_dir, model)
    [shard, *_] = sorted(model.glob("*.safetensors"), key=lambda p: -p.stat().st_size)
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    args = ["--prompt", "x"] if command == "generate" else ["--port", "8013"]
    started = time.monotonic()
    done = subprocess.run(
        [MTPSERVE, command, "--model", str(model), "--device", "cpu", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr[-3000:]
    assert f"mtpserve: error: {shard} is not a whole safetensors file" in done.stderr
    assert "Traceback" not in done.stderr
    assert "starting a local Ray" not in done.stdout
    assert time.monotonic() - started < 60


def test_a_switch_off_its_list_is_an_error_before_anything_starts(tiny_model_dir):
    """An environment variable mtpserve reads, set to a value it does not take, is `mtpserve:
    error:` naming it, exit 2, before a model loads or Ray starts."""
    import os

    done = subprocess.run(
        [MTPSERVE, "generate", "--model", tiny_model_dir, "--device", "cpu", "--prompt", "x"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "MTPSERVE_FP8_W8A8": "prefil"},
    )
    assert done.returncode == 2, done.stderr[-3000:]
    assert "mtpserve: error: MTPSERVE_FP8_W8A8='prefil': expected prefill" in done.stderr
    assert "Traceback" not in done.stderr
