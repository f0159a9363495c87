"""No request may hurt another (issue 16), over real HTTP against the session's Serve app.

Each group of bad or greedy requests runs while a bystander streams a greedy completion; after
each group the bystander's text must equal the offline engine's, the engine must be alive (a new
greedy request equals the offline one, /health is 200) and every KV block free again. The bad
requests must get OpenAI-shaped 4xx bodies naming the field, fast.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from cluster.sampling_params import SEED_MAX, SEED_MIN, SamplingParams

pytestmark = pytest.mark.timeout(240)

BYSTANDER_PROMPT = "Once upon a time"
BYSTANDER_TOKENS = 64
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name three colors."}]


@pytest.fixture(scope="module")
def bystander_text(offline_llm) -> str:
    params = SamplingParams(max_tokens=BYSTANDER_TOKENS, temperature=0.0, ignore_eos=True)
    return offline_llm.generate([BYSTANDER_PROMPT], params)[0].text


async def _stream_text(http: httpx.AsyncClient, url: str, body: dict, started: asyncio.Event):
    text = ""
    async with http.stream("POST", f"{url}/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            assert "error" not in event, event
            started.set()
            text += "".join(c["text"] for c in event["choices"])
    return text


def with_bystander(serve_url, served_model, offline_llm, bystander_text, attack):
    """Run `attack(http)` while a greedy stream runs; then check the stream and the engine."""
    model = served_model["id"]
    body = {
        "model": model,
        "prompt": BYSTANDER_PROMPT,
        "max_tokens": BYSTANDER_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }

    async def scenario():
        async with httpx.AsyncClient(timeout=120) as http:
            started = asyncio.Event()
            bystander = asyncio.create_task(_stream_text(http, serve_url, body, started))
            await asyncio.wait_for(started.wait(), 60)
            result = await attack(http)
            return result, await bystander

    result, text = asyncio.run(scenario())
    assert text == bystander_text
    _assert_engine_alive(serve_url, model, offline_llm)
    return result


def _assert_engine_alive(serve_url, model, offline_llm):
    response = httpx.post(
        f"{serve_url}/v1/completions",
        json={"model": model, "prompt": PROMPT, "max_tokens": 6, "temperature": 0.0},
        timeout=60,
    )
    assert response.status_code == 200, response.text
    [reference] = offline_llm.generate([PROMPT], SamplingParams(max_tokens=6, temperature=0.0))
    assert response.json()["choices"][0]["text"] == reference.text
    health = httpx.get(f"{serve_url}/health", timeout=30)
    assert health.status_code == 200 and health.json()["status"] == "ok"
    deadline = time.monotonic() + 30
    while True:
        engine = httpx.get(f"{serve_url}/health", timeout=30).json()["engine"]
        if engine["num_running"] == engine["num_waiting"] == 0:
            if engine["num_free_blocks"] == engine["num_total_blocks"]:
                return
        assert time.monotonic() < deadline, engine
        time.sleep(0.2)


def _error(response: httpx.Response, status: int = 400) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["message"]
    return body["error"]


# --- 1. seeds ------------------------------------------------------------------------------


def test_seeds_outside_int64_are_400_and_choice_seeds_wrap(
    serve_url, served_model, offline_llm, bystander_text
):
    model = served_model["id"]
    sampled = {"model": model, "prompt": PROMPT, "max_tokens": 6, "temperature": 1.0}

    async def attack(http):
        refused = [
            await http.post(f"{serve_url}/v1/completions", json={**sampled, "seed": seed})
            for seed in (2**64, -(2**64), 2**63)
        ]
        refused.append(
            await http.post(
                f"{serve_url}/v1/chat/completions",
                json={"model": model, "messages": CHAT, "max_tokens": 4, "seed": 2**64 - 1, "n": 2},
            )
        )
        # The last int64 seed with n = 2: choice 1 wraps to the first int64 seed.
        pair = await http.post(
            f"{serve_url}/v1/completions", json={**sampled, "seed": SEED_MAX, "n": 2}
        )
        singles = [
            await http.post(f"{serve_url}/v1/completions", json={**sampled, "seed": seed})
            for seed in (SEED_MAX, SEED_MIN)
        ]
        return refused, pair, singles

    refused, pair, singles = with_bystander(
        serve_url, served_model, offline_llm, bystander_text, attack
    )
    for response in refused:
        assert _error(response)["param"] == "seed"
    assert pair.status_code == 200, pair.text
    texts = {c["index"]: c["text"] for c in pair.json()["choices"]}
    assert [texts[0], texts[1]] == [s.json()["choices"][0]["text"] for s in singles]


# --- 6. every field honored or refused ------------------------------------------------------

IMAGE_PART = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
REFUSED = [
    ("completions", {"foo": 1}, "foo"),
    ("completions", {"best_of": 3}, "best_of"),
    ("completions", {"suffix": "done"}, "suffix"),
    ("completions", {"max_tokens": "10"}, "max_tokens"),
    ("completions", {"max_tokens": True}, "max_tokens"),
    ("completions", {"prompt": []}, "prompt"),
    ("completions", {"n": 0}, "n"),
    ("completions", {"logit_bias": {"abc": 1}}, "logit_bias"),
    ("completions", {"logit_bias": {"99999": 1}}, "logit_bias"),
    ("completions", {"presence_penalty": 3}, "presence_penalty"),
    ("completions", {"min_tokens": 9, "max_tokens": 4}, "min_tokens"),
    ("completions", {"stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    (  # forcing a call needs constrained decoding; "auto" and "none" are served
        "chat/completions",
        {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"},
        "tool_choice",
    ),
    ("chat/completions", {"tools": [{"type": "function"}]}, "tools.0.function"),
    (
        "chat/completions",
        {
            "messages": [
                {
                    "role": "user",
                    "content": "hi",
                    "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{}"}}],
                }
            ]
        },
        "messages.0.tool_calls",
    ),
    ("chat/completions", {"response_format": {"type": "json_object"}}, "response_format"),
    ("chat/completions", {"logprobs": "yes"}, "logprobs"),
    (
        "chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, IMAGE_PART]}]},
        "messages.0.content.1.type",
    ),
    ("chat/completions", {"messages": [{"role": "banana", "content": "hi"}]}, "messages.0.role"),
    (
        "chat/completions",
        {"messages": [{"role": "user", "content": "hi", "name": "bob"}]},
        "messages.0.name",
    ),
]
ACCEPTED = [
    ("completions", {"best_of": 1, "suffix": "", "user": "u-1"}),
    (
        "chat/completions",
        {
            "response_format": {"type": "text"},
            "store": False,
            "parallel_tool_calls": False,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
            "tool_choice": "auto",
            "messages": [
                {"role": "developer", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
                # An assistant reply echoed back by a client, null fields and all.
                {"role": "assistant", "content": "Hello", "refusal": None, "tool_calls": None},
                {"role": "user", "content": "Name a color."},
            ],
        },
    ),
]


def test_every_field_is_honored_or_refused(serve_url, served_model, offline_llm, bystander_text):
    model = served_model["id"]
    base = {
        "completions": {"model": model, "prompt": PROMPT, "max_tokens": 4},
        "chat/completions": {"model": model, "messages": CHAT, "max_tokens": 4},
    }

    async def attack(http):
        refused = [
            await http.post(f"{serve_url}/v1/{path}", json={**base[path], **extra})
            for path, extra, _ in REFUSED
        ]
        accepted = [
            await http.post(f"{serve_url}/v1/{path}", json={**base[path], **extra})
            for path, extra in ACCEPTED
        ]
        return refused, accepted

    refused, accepted = with_bystander(serve_url, served_model, offline_llm, bystander_text, attack)
    for (path, extra, param), response in zip(REFUSED, refused):
        error = _error(response)
        assert error["param"] == param, (path, extra, error)
    assert _error(refused[0])["code"] == "unknown_field"
    for (path, extra), response in zip(ACCEPTED, accepted):
        assert response.status_code == 200, (path, extra, response.text)


def test_penalties_and_logit_bias_over_http_equal_the_offline_engine(
    client, served_model, offline_llm
):
    processors = dict(
        presence_penalty=0.5, frequency_penalty=1.0, repetition_penalty=1.3, min_tokens=12
    )
    response = client.completions.create(
        model=served_model["id"],
        prompt=PROMPT,
        max_tokens=16,
        temperature=0.0,
        logit_bias={"17": 5.0, "42": -100.0},
        extra_body={"repetition_penalty": 1.3, "min_tokens": 12},
        presence_penalty=0.5,
        frequency_penalty=1.0,
    )
    params = SamplingParams(
        max_tokens=16, temperature=0.0, logit_bias={17: 5.0, 42: -100.0}, **processors
    )
    [reference] = offline_llm.generate([PROMPT], params)
    [plain] = offline_llm.generate([PROMPT], SamplingParams(max_tokens=16, temperature=0.0))
    assert reference.token_ids != plain.token_ids  # the processors changed something
    assert response.choices[0].text == reference.text
    assert response.usage.completion_tokens == len(reference.token_ids)


# --- 4. unencodable text ---------------------------------------------------------------------

SURROGATE = "\\ud800"  # a JSON escape: the body is valid JSON, the string is not valid Unicode


def test_lone_surrogates_are_400_everywhere(serve_url, served_model, offline_llm, bystander_text):
    model = json.dumps(served_model["id"])
    bodies = [
        ("completions", f'{{"model": {model}, "prompt": "a{SURROGATE}b"}}', "prompt"),
        ("completions", f'{{"model": {model}, "prompt": ["ok", "{SURROGATE}"]}}', "prompt.1"),
        ("completions", f'{{"model": "{SURROGATE}", "prompt": "hi"}}', "model"),
        (
            "chat/completions",
            f'{{"model": {model}, "messages": [{{"role": "user", "content": "{SURROGATE}"}}]}}',
            "messages.0.content",
        ),
        (
            "chat/completions",
            f'{{"model": {model}, "messages": [{{"role": "user", "content": '
            f'[{{"type": "text", "text": "x{SURROGATE}"}}]}}]}}',
            "messages.0.content.0.text",
        ),
        # A key cannot be named in a JSON answer: no param, the message still says why.
        ("completions", f'{{"model": {model}, "prompt": "hi", "{SURROGATE}": 1}}', None),
    ]

    async def attack(http):
        return [
            await http.post(
                f"{serve_url}/v1/{path}",
                content=body.encode(),
                headers={"content-type": "application/json"},
            )
            for path, body, _ in bodies
        ]

    responses = with_bystander(serve_url, served_model, offline_llm, bystander_text, attack)
    for (_, body, param), response in zip(bodies, responses):
        error = _error(response)
        assert error["param"] == param and "surrogate" in error["message"], (body, error)


# --- 3. huge bodies and prompts ---------------------------------------------------------------


def test_huge_bodies_are_413_and_huge_prompts_400_without_stalling_others(
    serve_url, served_model, offline_llm, bystander_text
):
    model = served_model["id"]
    small = {"model": model, "prompt": PROMPT, "max_tokens": 1}

    async def chunks(total: int):
        for _ in range(total // 2**16):
            yield b"x" * 2**16

    async def attack(http):
        huge = {"model": model, "prompt": "a " * 5_000_000, "max_tokens": 1}  # 10 MB
        sends = [
            http.post(f"{serve_url}/v1/completions", json=huge),
            http.post(
                f"{serve_url}/v1/completions",
                content=chunks(6 * 2**20),  # no Content-Length: chunked
                headers={"content-type": "application/json"},
            ),
            http.post(
                f"{serve_url}/v1/completions",
                json={"model": model, "prompt": "a " * 500_000, "max_tokens": 1},  # 1 MB
            ),
        ]
        started = time.monotonic()
        attacks = [asyncio.create_task(send) for send in sends]
        small_response = await http.post(f"{serve_url}/v1/completions", json=small)
        small_latency_s = time.monotonic() - started
        responses = await asyncio.gather(*attacks)
        return responses, time.monotonic() - started, small_response, small_latency_s

    responses, elapsed_s, small_response, small_latency_s = with_bystander(
        serve_url, served_model, offline_llm, bystander_text, attack
    )
    assert _error(responses[0], 413)["code"] == "request_too_large"
    assert _error(responses[1], 413)["code"] == "request_too_large"
    assert _error(responses[2])["param"] == "prompt"  # refused before tokenizing
    assert elapsed_s < 10 and small_latency_s < 5, (elapsed_s, small_latency_s)
    assert small_response.status_code == 200


# --- 2. fan-out ------------------------------------------------------------------------------


def test_fan_out_is_admitted_gradually_and_bounded(
    serve_url, served_model, offline_llm, bystander_text
):
    """16 prompts x n = 128 (2048 sequences) streams while a small request comes and goes in
    well under 10 s; one more prompt is a 400 naming n."""
    model = served_model["id"]
    big = {
        "model": model,
        "prompt": [f"{i} little pigs" for i in range(16)],
        "n": 128,
        "max_tokens": 16,
        "temperature": 1.0,
        "stream": True,
    }

    async def attack(http):
        big_started = asyncio.Event()
        num_big_chunks = 0

        async def run_big():
            nonlocal num_big_chunks
            async with http.stream("POST", f"{serve_url}/v1/completions", json=big) as response:
                assert response.status_code == 200
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        num_big_chunks += 1
                        big_started.set()

        big_task = asyncio.create_task(run_big())
        await asyncio.wait_for(big_started.wait(), 60)
        await asyncio.sleep(1.0)  # let it fill the engine as much as it may
        started = time.monotonic()
        small = await http.post(
            f"{serve_url}/v1/chat/completions",
            json={"model": model, "messages": CHAT, "max_tokens": 4, "temperature": 0.0},
        )
        small_latency_s = time.monotonic() - started
        too_many = await http.post(
            f"{serve_url}/v1/completions",
            json={**big, "prompt": big["prompt"] + ["one more"], "stream": False},
        )
        still_running = not big_task.done()
        big_task.cancel()  # the client goes away: its choices are aborted
        await asyncio.gather(big_task, return_exceptions=True)
        return small, small_latency_s, too_many, still_running, num_big_chunks

    small, small_latency_s, too_many, still_running, num_big_chunks = with_bystander(
        serve_url, served_model, offline_llm, bystander_text, attack
    )
    assert small.status_code == 200 and small_latency_s < 10, small_latency_s
    print(f"small request during a 16 x 128 fan-out: {small_latency_s:.2f} s")
    assert still_running and num_big_chunks > 0  # the fan-out was really running meanwhile
    error = _error(too_many)
    assert error["param"] == "n" and "2176" in error["message"]


def test_choices_past_the_live_cap_all_arrive(client, served_model, offline_llm):
    """n = 40 > max_live_sequences_per_request (32): the last 8 start as others finish, and
    every choice comes back, each the offline greedy completion."""
    from deploy.limits import IngressLimits

    n = IngressLimits.max_live_sequences_per_request + 8
    response = client.completions.create(
        model=served_model["id"], prompt=PROMPT, max_tokens=5, temperature=0.0, n=n
    )
    [reference] = offline_llm.generate([PROMPT], SamplingParams(max_tokens=5, temperature=0.0))
    assert sorted(c.index for c in response.choices) == list(range(n))
    assert {c.text for c in response.choices} == {reference.text}
    assert response.usage.completion_tokens == n * len(reference.token_ids)


# --- 7. /health --------------------------------------------------------------------------------


def test_health_carries_status_and_numbers_only(serve_url):
    body = httpx.get(f"{serve_url}/health", timeout=30).json()
    assert set(body) == {"status", "engine"} and body["status"] == "ok"
    for value in body["engine"].values():
        values = value if isinstance(value, list) else [value]
        assert all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)


def test_unhealthy_health_says_nothing_about_the_cluster():
    from types import SimpleNamespace

    from deploy.ingress import OpenAIIngress

    class FailingProbe:
        async def remote(self):
            raise RuntimeError(
                "\x1b[31mActorDiedError\x1b[0m actor 8f3a... on node 10.1.2.3 (ip 10.1.2.3) died"
            )

    fake_self = SimpleNamespace(_model_server=SimpleNamespace(probe=FailingProbe()))
    response = asyncio.run(OpenAIIngress.health(fake_self))
    assert response.status_code == 503
    assert json.loads(response.body) == {"status": "unhealthy"}


def test_replicas_run_this_checkout(ray_session, serve_url):
    """Ray workers import the code under test, not another checkout's."""
    import deploy

    @ray_session.remote(num_cpus=0)
    def where() -> str:
        import deploy

        return deploy.__file__

    assert ray_session.get(where.remote()) == deploy.__file__


# --- 8. where prompts are tokenized --------------------------------------------------------------


def _fake_ingress(max_inline_chars: int):
    from concurrent.futures import ThreadPoolExecutor
    from types import SimpleNamespace

    from deploy.limits import IngressLimits

    return SimpleNamespace(
        _limits=IngressLimits(max_inline_tokenize_chars=max_inline_chars),
        _tokenizer="the loop's tokenizer",
        _thread_tokenizer="the thread's tokenizer",
        _tokenize_pool=ThreadPoolExecutor(1, thread_name_prefix="tokenize"),
    )


def test_short_texts_are_tokenized_on_the_loop_long_ones_on_the_thread():
    import threading

    from deploy.ingress import OpenAIIngress

    fake = _fake_ingress(max_inline_chars=100)

    def where(tokenizer):
        return tokenizer, threading.current_thread().name

    async def run():
        loop_thread = threading.current_thread().name
        seen = [await OpenAIIngress._tokenize(fake, n, where) for n in (0, 100, 101, 10**6)]
        return loop_thread, seen

    loop_thread, seen = asyncio.run(run())
    fake._tokenize_pool.shutdown()
    assert seen[0] == seen[1] == ("the loop's tokenizer", loop_thread)
    assert [s[0] for s in seen[2:]] == ["the thread's tokenizer"] * 2
    assert all(s[1].startswith("tokenize") and s[1] != loop_thread for s in seen[2:])


def test_a_short_prompt_does_not_wait_behind_a_long_one_on_the_tokenizing_thread():
    import threading

    from deploy.ingress import OpenAIIngress

    fake = _fake_ingress(max_inline_chars=100)
    release = threading.Event()

    def long_tokenize(tokenizer):
        assert release.wait(30)  # a huge prompt, still being tokenized
        return "long"

    async def run():
        long = asyncio.ensure_future(OpenAIIngress._tokenize(fake, 10**6, long_tokenize))
        await asyncio.sleep(0.05)  # the thread has taken it
        short = await asyncio.wait_for(OpenAIIngress._tokenize(fake, 10, lambda t: "short"), 5)
        still_running = not long.done()
        release.set()
        return short, still_running, await long

    assert asyncio.run(run()) == ("short", True, "long")
    fake._tokenize_pool.shutdown()


def test_tokenize_and_detokenize_agree_with_the_tokenizer_on_both_sides_of_the_inline_bound(
    serve_url, served_model, tiny_model_dir
):
    from transformers import AutoTokenizer

    from deploy.limits import IngressLimits

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    bound = IngressLimits.max_inline_tokenize_chars
    base = "Hello, world! Prompts of every length tokenize alike. "
    for length in (bound - 1, bound, bound + 1, 3 * bound):  # the loop's tokenizer, the thread's
        prompt = (base * (length // len(base) + 1))[:length]
        body = {"model": served_model["id"], "prompt": prompt}
        response = httpx.post(f"{serve_url}/tokenize", json=body, timeout=30)
        assert response.status_code == 200, response.text
        tokens = response.json()["tokens"]
        assert tokens == tokenizer.encode(prompt), length
        # Back to text: under the bound on the loop, past it (3 x bound) on the thread.
        body = {"model": served_model["id"], "tokens": tokens}
        response = httpx.post(f"{serve_url}/detokenize", json=body, timeout=30)
        assert response.status_code == 200, response.text
        assert response.json()["prompt"] == tokenizer.decode(tokens), length
    for tokens in ([3, len(tokenizer)], [-1, 3]):
        body = {"model": served_model["id"], "tokens": tokens}
        response = httpx.post(f"{serve_url}/detokenize", json=body, timeout=30)
        assert _error(response)["param"] == "tokens", tokens
