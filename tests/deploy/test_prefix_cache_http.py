"""Prefix caching over HTTP, with the official `openai` client against an app of this test's own
(MTP k = 2, 16-token blocks): `usage.prompt_tokens_details.cached_tokens` is exactly what the
block keys predict (completions and chat, streamed usage too), the engine's hit counter sums
them, and the text equals the offline engine's with prefix caching and MTP off.
"""

from __future__ import annotations

import pytest
import torch
from conftest import app_args

from deploy.openai_protocol import ChatCompletionRequest
from deploy.openai_serving import chat_prompt_token_ids

pytestmark = pytest.mark.timeout(240)

APP = "prefixapp"
BLOCK = 16
NUM_DRAFTS = 2
MAX_TOKENS = 8
SYSTEM = "You are a terse assistant who answers in lists. " * 6


@pytest.fixture(scope="module")
def prefix_app(serve_url, tiny_model_dir):
    """(openai client, model name, model-server handle) of an app only this module uses."""
    import openai
    from ray import serve

    from deploy.app import MODEL_SERVER_NAME, build_app

    args = {**app_args(tiny_model_dir, block_size_tokens=BLOCK), "num_draft_tokens": NUM_DRAFTS}
    serve.run(build_app(args), name=APP, route_prefix=f"/{APP}")
    client = openai.OpenAI(
        base_url=f"{serve_url}/{APP}/v1", api_key="unused", max_retries=0, timeout=120
    )
    model = client.models.list().data[0].id
    yield client, model, serve.get_deployment_handle(MODEL_SERVER_NAME, app_name=APP)
    serve.delete(APP)


@pytest.fixture(scope="module")
def reference_llm(tiny_model_dir):
    from cluster.llm import LLM

    return LLM(tiny_model_dir, num_draft_tokens=0, dtype="float32", enable_prefix_caching=False)


def _reference(llm, prompt_ids: list[int]):
    from cluster.sampling_params import SamplingParams

    [out] = llm.generate([prompt_ids], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    return out


def expected_cached_tokens(
    previous: list[int], num_computed: int, prompt: list[int], mtp: bool = True
) -> int:
    """What the cache holds for `prompt` after one earlier request whose tokens were `previous`
    (`num_computed` of them in the cache): its leading full blocks whose key (the block plus,
    with MTP, the next token) matches, that the earlier request finished (every row final:
    with MTP, computed through the next token), leaving the prompt's last token to compute."""
    extra = 1 if mtp else 0
    num = 0
    while (
        (num + 1) * BLOCK <= (len(prompt) - 1)
        and (num + 1) * BLOCK + extra <= num_computed
        and prompt[: (num + 1) * BLOCK + extra] == previous[: (num + 1) * BLOCK + extra]
    ):
        num += 1
    return num * BLOCK


def test_completion_reports_cached_tokens_and_keeps_output(prefix_app, reference_llm):
    client, model, handle = prefix_app
    g = torch.Generator().manual_seed(11)
    prompt = torch.randint(3, 512, (70,), generator=g).tolist()
    reference = _reference(reference_llm, prompt)
    kwargs = dict(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0)
    hits_before = handle.engine_stats.remote().result()["prefix_cache_hit_tokens"]

    first = client.completions.create(**kwargs)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    second = client.completions.create(**kwargs)
    sequence = prompt + list(reference.token_ids)
    num_computed = len(sequence) - 1  # a finished request's last token has no KV
    cached = expected_cached_tokens(sequence, num_computed, prompt)
    assert cached == 64  # (70 - 1) // 16 = 4 blocks
    assert second.usage.prompt_tokens_details.cached_tokens == cached
    chunks = list(
        client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    )
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == cached
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert first.choices[0].text == second.choices[0].text == streamed == reference.text
    hits = handle.engine_stats.remote().result()["prefix_cache_hit_tokens"] - hits_before
    assert hits == 2 * cached


def test_chat_turns_report_cached_tokens_and_keep_output(prefix_app, reference_llm, tiny_model_dir):
    from transformers import AutoTokenizer

    client, model, _ = prefix_app
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Name three colors."},
    ]
    previous: list[int] = []
    num_computed = 0
    for turn, question in enumerate(["Name three animals.", "And three rivers."]):
        prompt = chat_prompt_token_ids(
            ChatCompletionRequest(model=model, messages=messages), tokenizer
        )
        reference = _reference(reference_llm, prompt)
        response = client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=MAX_TOKENS,
            temperature=0.0,
            stream=turn == 1,
            **({"stream_options": {"include_usage": True}} if turn == 1 else {}),
        )
        if turn == 1:
            chunks = list(response)
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            usage = chunks[-1].usage
        else:
            text, usage = response.choices[0].message.content, response.usage
        assert text == reference.text
        assert usage.prompt_tokens == len(prompt)
        cached = expected_cached_tokens(previous, num_computed, prompt) if previous else 0
        assert usage.prompt_tokens_details.cached_tokens == cached
        if turn == 1:
            assert cached >= len(tokenizer.encode(SYSTEM)) // BLOCK * BLOCK - BLOCK
        previous = prompt + list(reference.token_ids)
        num_computed = len(previous) - 1
        messages += [
            {"role": "assistant", "content": text},
            {"role": "user", "content": question},
        ]


def test_usage_counts_a_prompts_cached_tokens_once_as_its_fewest():
    """n choices of one prompt run side by side; later ones may hit what the first computed.
    Prompt tokens count once per prompt, and so do its cached tokens: the fewest of its
    choices' (what the prompt cost at least once)."""
    from cluster.sampling_params import SamplingParams
    from deploy.openai_serving import ChoicePlan, ChoiceResult, usage

    plans = [
        ChoicePlan(0, 0, list(range(100)), SamplingParams()),
        ChoicePlan(1, 0, list(range(100)), SamplingParams()),
        ChoicePlan(2, 1, list(range(70)), SamplingParams()),
    ]
    results = [
        ChoiceResult(0, num_cached_tokens=64, completion_token_ids=[1, 2]),
        ChoiceResult(1, num_cached_tokens=0, completion_token_ids=[3]),
        ChoiceResult(2, num_cached_tokens=64, completion_token_ids=[4, 5, 6]),
    ]
    info = usage(results, plans)
    assert (info.prompt_tokens, info.completion_tokens, info.total_tokens) == (170, 6, 176)
    assert info.prompt_tokens_details.cached_tokens == 0 + 64


def test_prefix_cache_counters_on_metrics_move_by_the_cached_tokens(prefix_app):
    """`GET /metrics` (vLLM's `prefix_cache_queries` / `prefix_cache_hits`, in tokens): a prompt
    sent twice adds its length to the queries twice and its cached tokens to the hits."""
    import time

    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    client, model, handle = prefix_app
    url = str(client.base_url).rstrip("/").removesuffix("/v1")

    def counters() -> tuple[float, float]:
        text = httpx.get(f"{url}/metrics", timeout=30).text
        values = {
            s.name: s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }
        return values["mtpserve:prefix_cache_queries_total"], values[
            "mtpserve:prefix_cache_hits_total"
        ]

    prompt = torch.randint(3, 512, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    engine = handle.engine_stats.remote().result()  # the truth; /metrics may lag it by 1 s
    queries_before = engine["prefix_cache_queried_tokens"]
    hits_before = engine["prefix_cache_hit_tokens"]
    usages = [
        client.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0.0).usage
        for _ in range(2)
    ]
    cached = sum(u.prompt_tokens_details.cached_tokens for u in usages)
    assert cached == 32  # the second time: (40 - 1) // 16 = 2 blocks
    expected = (queries_before + 2 * len(prompt), hits_before + cached)
    deadline = time.monotonic() + 30
    while (now := counters()) != expected:  # replicas report about once a second
        assert time.monotonic() < deadline, (now, expected)
        time.sleep(0.5)


def test_cli_flag_turns_prefix_caching_off():
    from cluster.config import EngineConfig
    from deploy.cli import build_parser
    from deploy.engine_args import engine_options

    parser = build_parser()
    # Unset, the option is left to EngineConfig, whose default is on.
    assert "enable_prefix_caching" not in engine_options(parser.parse_args(["serve"]))
    assert EngineConfig(model="m").enable_prefix_caching is True
    for command in (["serve"], ["generate", "--prompt", "x"]):
        args = parser.parse_args([*command, "--no-enable-prefix-caching"])
        assert engine_options(args)["enable_prefix_caching"] is False
