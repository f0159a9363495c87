"""The checkpoint's defaults, resolved once at startup (cluster/config.py): MTP on when config.json
has an MTP layer, the whole context unless the KV pool holds less (and then a line saying so),
generation_config.json's sampling knobs for what a request leaves out. Through the CLI where it
is a flag."""

from __future__ import annotations

import json
import logging
import os

import pytest

from cluster.config import (
    DEFAULT_NUM_DRAFT_TOKENS,
    ConfigError,
    EngineConfig,
    fit_context,
    lookahead_slots,
    read_checkpoint,
    resolve_config,
)
from cluster.llm import LLM
from cluster.sampling_params import SamplingParams
from deploy.cli import main as mtpserve
from workers.model_config import DEEPSEEK_V32

# DeepSeek-V3.2's context and YaRN parameters; its generation_config.json's sampling knobs, plus
# a top_k and a repetition penalty so every knob the engine takes is exercised.
LONG_CONTEXT = DEEPSEEK_V32["max_position_embeddings"]
YARN = dict(DEEPSEEK_V32["rope_parameters"])  # a copy: configs may be filled in place
GENERATION_CONFIG = {
    "bos_token_id": 0,
    "eos_token_id": 1,
    "do_sample": True,
    "temperature": 0.6,
    "top_p": 0.95,
    "top_k": 20,
    "repetition_penalty": 1.1,
}
SAMPLING_DEFAULTS = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.1}
# What the CPU worker allocates when memory sizes the pool (workers.worker.CPU_DEFAULT_KV_BLOCKS),
# less the null block.
CPU_POOL_TOKENS = (512 - 1) * 64


def _write_json(path: str, obj: dict) -> None:
    with open(path, "w") as f:
        json.dump(obj, f)


def _edit_config(model_dir: str, **changes) -> None:
    path = os.path.join(model_dir, "config.json")
    with open(path) as f:
        config = json.load(f)
    _write_json(path, {**config, **changes})


@pytest.fixture(scope="module")
def long_model_dir(tmp_path_factory) -> str:
    """The tiny model with DeepSeek-V3.2's context (YaRN) and sampling defaults."""
    from workers.tiny_model import make_tiny_model

    out = make_tiny_model(
        str(tmp_path_factory.mktemp("long")),
        seed=0,
        max_position_embeddings=LONG_CONTEXT,
        rope_parameters=YARN,
    )
    _write_json(os.path.join(out, "generation_config.json"), GENERATION_CONFIG)
    return out


@pytest.fixture(scope="module")
def no_mtp_dir(tmp_path_factory, tiny_model_dir) -> str:
    """config.json without an MTP layer (num_nextn_predict_layers 0)."""
    import shutil

    out = str(tmp_path_factory.mktemp("no-mtp") / "model")
    shutil.copytree(tiny_model_dir, out)
    _edit_config(out, num_nextn_predict_layers=0)
    return out


def _generate_json(capsys, *argv: str) -> dict:
    assert mtpserve(["generate", "--device", "cpu", "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


# --- MTP on by default -----------------------------------------------------------------------


def test_mtp_is_on_by_default_and_off_with_zero(capsys, tiny_model_dir):
    prompt = ["--model", tiny_model_dir, "--prompt", "def f(x):", "--max-tokens", "8"]
    default = _generate_json(capsys, *prompt)
    assert len(default["acceptance_per_position"]) == DEFAULT_NUM_DRAFT_TOKENS
    off = _generate_json(
        capsys, *prompt, "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 0}'
    )
    assert off["acceptance_per_position"] == [] and off["mean_tokens_per_round"] == 1.0
    # MTP is lossless under greedy decoding (the generate default when the checkpoint has none).
    assert default["completion_token_ids"] == off["completion_token_ids"]


def test_a_checkpoint_without_an_mtp_layer(capsys, no_mtp_dir):
    checkpoint = read_checkpoint(no_mtp_dir)
    assert resolve_config(EngineConfig(no_mtp_dir), checkpoint).num_draft_tokens == 0
    with pytest.raises(ConfigError, match="has no MTP layer"):
        resolve_config(EngineConfig(no_mtp_dir, num_draft_tokens=2), checkpoint)
    with pytest.raises(SystemExit) as exited:
        mtpserve(["generate", "--model", no_mtp_dir, "--prompt", "x", "--num-draft-tokens", "2"])
    assert exited.value.code == 2
    assert "num_draft_tokens=2" in capsys.readouterr().err


# --- the whole context ----------------------------------------------------------------------


def test_fit_context_keeps_what_fits_and_lowers_what_does_not():
    asked = EngineConfig("m", num_draft_tokens=3)
    resolved = asked.replace(max_model_len=1000)
    room = 1000 + lookahead_slots(3)
    assert lookahead_slots(3) == 2 and lookahead_slots(0) == lookahead_slots(1) == 0
    assert fit_context(asked, resolved, room) == 1000
    assert fit_context(asked, resolved, room - 1) == 999
    with pytest.raises(ConfigError, match="too few"):
        fit_context(asked, resolved, 3)


def test_the_whole_context_unless_the_kv_pool_holds_less(long_model_dir, caplog):
    checkpoint = read_checkpoint(long_model_dir)
    assert checkpoint.context_len == LONG_CONTEXT == 40 * 4096  # YaRN's factor x original
    caplog.set_level(logging.INFO, logger="cluster.config")
    # The CPU pool's default size holds less than 163840 tokens: lowered, and said why.
    llm = LLM(long_model_dir, num_draft_tokens=0, dtype="float32")
    assert llm.engine.max_model_len == CPU_POOL_TOKENS
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("context:")]
    assert f"not the {LONG_CONTEXT} the checkpoint's whole context" in line
    assert f"the KV pool holds {CPU_POOL_TOKENS} tokens" in line
    # A pool that holds the whole context (and k = 2's one lookahead slot) serves all of it.
    caplog.clear()
    blocks = -(-(LONG_CONTEXT + 1) // 64) + 1
    llm = LLM(long_model_dir, num_draft_tokens=2, dtype="float32", num_kv_blocks=blocks)
    assert llm.engine.max_model_len == LONG_CONTEXT
    assert any("the checkpoint's whole context" in r.getMessage() for r in caplog.records)
    # One block less: one token of context less than fits.
    llm = LLM(long_model_dir, num_draft_tokens=2, dtype="float32", num_kv_blocks=blocks - 1)
    assert llm.engine.max_model_len == (blocks - 2) * 64 - 1


# --- sampling defaults from generation_config.json ------------------------------------------


def test_sampling_defaults_apply_where_a_request_is_silent(capsys, long_model_dir):
    assert read_checkpoint(long_model_dir).sampling_defaults == SAMPLING_DEFAULTS
    llm = LLM(long_model_dir, num_draft_tokens=0, dtype="float32", num_kv_blocks=64)
    prompt = [5, 9, 33, 71, 2, 100]
    want = SamplingParams(max_tokens=12, seed=7, ignore_eos=True, **SAMPLING_DEFAULTS)
    params = llm.engine.default_sampling_params(max_tokens=12, seed=7, ignore_eos=True)
    assert params == want
    with_defaults = llm.generate([prompt], params)[0].token_ids
    assert with_defaults == llm.generate([prompt], want)[0].token_ids
    # The engine's own defaults (temperature 1, no top-p/top-k) draw other tokens.
    plain = SamplingParams(max_tokens=12, seed=7, ignore_eos=True)
    assert llm.generate([prompt], plain)[0].token_ids != with_defaults
    # Explicit values win.
    greedy = llm.engine.default_sampling_params(max_tokens=12, temperature=0.0, ignore_eos=True)
    assert greedy.temperature == 0.0 and greedy.top_k == 20
    # `mtpserve generate` without --temperature samples with the checkpoint's defaults.
    argv = ["--model", long_model_dir, "--num-draft-tokens", "0", "--prompt", "def f(x):"]
    argv += ["--max-tokens", "12", "--seed", "7"]
    result = _generate_json(capsys, *argv)
    text_prompt = llm.tokenizer.encode("def f(x):")
    explicit = SamplingParams(max_tokens=12, seed=7, **SAMPLING_DEFAULTS)
    assert result["completion_token_ids"] == llm.generate([text_prompt], explicit)[0].token_ids
    # --temperature wins; the checkpoint's other knobs (its repetition penalty) still apply.
    greedy_result = _generate_json(capsys, *argv, "--temperature", "0")
    greedy = SamplingParams(max_tokens=12, seed=7, **{**SAMPLING_DEFAULTS, "temperature": 0.0})
    want_greedy = llm.generate([text_prompt], greedy)[0].token_ids
    assert greedy_result["completion_token_ids"] == want_greedy
    unpenalized = llm.generate([text_prompt], SamplingParams(max_tokens=12, temperature=0.0))
    assert unpenalized[0].token_ids != want_greedy  # so the penalty really was applied


def test_do_sample_false_means_greedy_and_bad_values_are_named(tmp_path):
    from cluster.config import sampling_defaults

    _write_json(tmp_path / "generation_config.json", {"do_sample": False, "temperature": 0.7})
    assert sampling_defaults(str(tmp_path)) == {"temperature": 0.0}
    _write_json(tmp_path / "generation_config.json", {"top_p": 0.0})
    with pytest.raises(ConfigError, match="generation_config.json: .*top_p"):
        sampling_defaults(str(tmp_path))
    os.remove(tmp_path / "generation_config.json")
    assert sampling_defaults(str(tmp_path)) == {}


# --- --kv-cache-dtype ------------------------------------------------------------------------


def test_kv_cache_dtype_through_the_cli(capsys, tiny_model_dir):
    """Both choices serve through `mtpserve generate`; MTP stays lossless on the FP8 latent
    cache (greedy k = 2 equals k = 0 on the same cache dtype); other values are refused."""
    assert EngineConfig("m").kv_cache_dtype == "auto"
    tokens = {}
    for dtype, k in (("auto", "0"), ("fp8", "0"), ("fp8", "2")):
        result = _generate_json(
            capsys, "--model", tiny_model_dir, "--prompt", "x", "--max-tokens", "6",
            "--num-draft-tokens", k, "--kv-cache-dtype", dtype,
        )  # fmt: skip
        tokens[dtype, k] = result["completion_token_ids"]
        assert len(tokens[dtype, k]) == 6
    assert tokens["fp8", "2"] == tokens["fp8", "0"]
    with pytest.raises(SystemExit) as exited:
        mtpserve(["generate", "--prompt", "x", "--model", tiny_model_dir, "--kv-cache-dtype", "e5"])
    assert exited.value.code == 2
    assert "invalid choice: 'e5'" in capsys.readouterr().err


# --- over HTTP --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def long_model_url(serve_url, long_model_dir):
    from ray import serve

    from deploy.app import build_app
    from tests.deploy.conftest import app_args

    app = "long-context"
    args = dict(app_args(long_model_dir), colocate=True)
    serve.run(build_app(args), name=app, route_prefix=f"/{app}")
    yield f"{serve_url}/{app}"
    serve.delete(app)


def test_http_serves_the_fitted_context_and_the_checkpoints_sampling(long_model_url):
    import openai

    client = openai.OpenAI(base_url=f"{long_model_url}/v1", api_key="x", max_retries=0, timeout=60)
    [card] = client.models.list().data
    assert card.model_extra["max_model_len"] == CPU_POOL_TOKENS

    def complete(**sampling) -> str:
        body = dict(model=card.id, prompt=[5, 9, 33, 71, 2, 100], max_tokens=12, seed=7)
        return client.completions.create(**body, **sampling).choices[0].text

    knobs = {k: v for k, v in SAMPLING_DEFAULTS.items() if k in ("temperature", "top_p")}
    extensions = {k: v for k, v in SAMPLING_DEFAULTS.items() if k not in knobs}
    silent = complete()
    assert silent == complete(**knobs, extra_body=extensions)
    # Explicit values win: the engine's own defaults draw other tokens.
    engine_defaults = {"top_k": 0, "repetition_penalty": 1.0}
    assert silent != complete(temperature=1.0, top_p=1.0, extra_body=engine_defaults)
