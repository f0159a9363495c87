"""The real Serve app, driven over HTTP by the official `openai` client.

References: greedy output must equal the offline `cluster.llm.LLM` on the same checkpoint and
prompt; seeded sampling must reproduce; n choices must equal n single requests with seed + i.
"""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from cluster.sampling_params import InvalidRequestError
from deploy.openai_protocol import ChatCompletionRequest, CompletionRequest
from deploy.openai_serving import plan_chat, plan_completion

pytestmark = pytest.mark.timeout(180)

PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name three colors."}]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _greedy(llm, prompt, max_tokens):
    from cluster.sampling_params import SamplingParams

    [out] = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=max_tokens))
    return out


def _error_body(exc: openai.APIStatusError) -> dict:
    body = exc.response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    return body["error"]


def test_models_lists_the_engine_model(client, model_server):
    info = model_server.model_info.remote().result()
    models = client.models.list().data
    assert [m.id for m in models] == [info.model_name]


def test_completion_greedy_equals_offline_llm(client, served_model, offline_llm):
    reference = _greedy(offline_llm, PROMPT, 12)
    response = client.completions.create(
        model=served_model["id"], prompt=PROMPT, max_tokens=12, temperature=0.0
    )
    assert response.choices[0].text == reference.text
    assert response.choices[0].finish_reason == reference.finish_reason
    assert response.usage.prompt_tokens == len(reference.prompt_token_ids)
    assert response.usage.completion_tokens == len(reference.token_ids)
    assert response.usage.total_tokens == len(reference.prompt_token_ids) + len(reference.token_ids)


def test_completion_accepts_token_id_prompt(client, served_model, offline_llm, tokenizer):
    prompt_ids = tokenizer.encode(PROMPT)
    reference = _greedy(offline_llm, prompt_ids, 8)
    response = client.completions.create(
        model=served_model["id"], prompt=prompt_ids, max_tokens=8, temperature=0.0
    )
    assert response.choices[0].text == reference.text


def test_chat_greedy_equals_offline_llm_on_templated_prompt(
    client, served_model, offline_llm, tokenizer
):
    text = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    prompt_ids = tokenizer.encode(text, add_special_tokens=False)
    reference = _greedy(offline_llm, prompt_ids, 10)
    response = client.chat.completions.create(
        model=served_model["id"], messages=CHAT, max_tokens=10, temperature=0.0
    )
    assert response.choices[0].message.role == "assistant"
    assert response.choices[0].message.content == reference.text
    assert response.usage.prompt_tokens == len(prompt_ids)
    assert response.usage.completion_tokens == len(reference.token_ids)


def test_max_completion_tokens_bounds_chat(client, served_model):
    response = client.chat.completions.create(
        model=served_model["id"],
        messages=CHAT,
        max_completion_tokens=5,
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    assert response.usage.completion_tokens == 5
    assert response.choices[0].finish_reason == "length"


def test_chat_stream_with_usage_equals_non_stream(client, served_model):
    kwargs = dict(model=served_model["id"], messages=CHAT, max_tokens=10, temperature=0.0)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(
        client.chat.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finish == [whole.choices[0].finish_reason]
    # Usage arrives once, in the last chunk, which has no choices.
    assert [c.usage is not None for c in chunks].count(True) == 1
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


def test_completion_stream_equals_non_stream(client, served_model):
    kwargs = dict(model=served_model["id"], prompt=PROMPT, max_tokens=10, temperature=0.0)
    whole = client.completions.create(**kwargs)
    chunks = list(
        client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].usage == whole.usage


def test_n_choices_equal_single_requests_with_seed_plus_i(client, served_model):
    common = dict(model=served_model["id"], prompt=PROMPT, max_tokens=8, temperature=1.0)
    merged = client.completions.create(**common, n=3, seed=7)
    assert sorted(c.index for c in merged.choices) == [0, 1, 2]
    by_index = {c.index: c.text for c in merged.choices}
    singles = [client.completions.create(**common, seed=7 + i).choices[0].text for i in range(3)]
    assert [by_index[i] for i in range(3)] == singles
    assert merged.usage.completion_tokens == sum(
        client.completions.create(**common, seed=7 + i).usage.completion_tokens for i in range(3)
    )


def test_n_choices_stream_reassembles_each_choice(client, served_model):
    common = dict(model=served_model["id"], messages=CHAT, max_tokens=6, temperature=1.0, seed=3)
    whole = client.chat.completions.create(**common, n=2)
    texts = {0: "", 1: ""}
    for chunk in client.chat.completions.create(**common, n=2, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == {c.index: c.message.content for c in whole.choices}


def test_seed_reproduces_and_differs_across_seeds(client, served_model):
    common = dict(model=served_model["id"], prompt=PROMPT, max_tokens=16, temperature=1.0)
    first = client.completions.create(**common, seed=1234).choices[0].text
    again = client.completions.create(**common, seed=1234).choices[0].text
    others = {client.completions.create(**common, seed=s).choices[0].text for s in (1, 2, 3)}
    assert first == again
    assert len(others | {first}) > 1


def test_stop_string_truncates_at_first_occurrence(client, served_model):
    common = dict(
        model=served_model["id"], prompt=PROMPT, temperature=0.0, extra_body={"ignore_eos": True}
    )
    full = client.completions.create(**common, max_tokens=24).choices[0].text
    stop = full[6:8]
    assert stop, f"reference completion too short: {full!r}"
    stopped = client.completions.create(**common, max_tokens=24, stop=[stop]).choices[0]
    assert stopped.text == full[: full.index(stop)]
    assert stopped.finish_reason == "stop"


def test_top_k_1_extension_equals_greedy(client, served_model):
    common = dict(model=served_model["id"], prompt=PROMPT, max_tokens=10)
    greedy = client.completions.create(**common, temperature=0.0).choices[0].text
    top1 = (
        client.completions.create(
            **common, temperature=1.0, seed=5, extra_body={"top_k": 1, "ignore_eos": False}
        )
        .choices[0]
        .text
    )
    assert top1 == greedy


def test_chat_logprobs_equal_offline_llm(client, served_model, offline_llm, tokenizer):
    from cluster.sampling_params import SamplingParams

    text = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    prompt_ids = tokenizer.encode(text, add_special_tokens=False)
    [reference] = offline_llm.generate(
        [prompt_ids], SamplingParams(temperature=0.0, max_tokens=6, logprobs=3)
    )
    response = client.chat.completions.create(
        model=served_model["id"],
        messages=CHAT,
        max_tokens=6,
        temperature=0.0,
        logprobs=True,
        top_logprobs=3,
    )
    content = response.choices[0].logprobs.content
    assert [t.token for t in content] == [tokenizer.decode([i]) for i in reference.token_ids]
    for token, entry in zip(content, reference.logprobs, strict=True):
        assert token.logprob == pytest.approx(entry["logprob"], abs=1e-4)
        assert [t.token for t in token.top_logprobs] == [
            tokenizer.decode([i]) for i, _ in entry["top"]
        ]
        assert [t.logprob for t in token.top_logprobs] == pytest.approx(
            [lp for _, lp in entry["top"]], abs=1e-4
        )
        # Greedy: the chosen token is the most likely one.
        assert token.logprob == pytest.approx(token.top_logprobs[0].logprob, abs=1e-5)


def test_completion_logprobs_follow_the_tokens(client, served_model, offline_llm, tokenizer):
    reference = _greedy(offline_llm, PROMPT, 5)
    logprobs = (
        client.completions.create(
            model=served_model["id"], prompt=PROMPT, max_tokens=5, temperature=0.0, logprobs=2
        )
        .choices[0]
        .logprobs
    )
    tokens = [tokenizer.decode([i]) for i in reference.token_ids]
    assert logprobs.tokens == tokens
    assert len(logprobs.token_logprobs) == len(tokens)
    # Greedy: the chosen token has the top logprob. (The legacy shape keys top_logprobs by
    # token text, so two byte tokens that both decode to U+FFFD share one key.)
    for chosen, top in zip(logprobs.token_logprobs, logprobs.top_logprobs, strict=True):
        assert 1 <= len(top) <= 2
        assert max(top.values()) == pytest.approx(chosen, abs=1e-5)
    # text_offset[i] = characters of the tokens before token i.
    assert logprobs.text_offset == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]


# -- client mistakes ------------------------------------------------------------------------


def test_malformed_json_is_400_with_openai_error(serve_url):
    response = httpx.post(
        f"{serve_url}/v1/chat/completions",
        content=b'{"model": "x", "messages": [',
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert response.status_code == 400
    body = response.json()
    assert body["error"]["type"] == "invalid_request_error"
    assert body["error"]["code"] == "json_invalid"


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="no-such-model", messages=CHAT, max_tokens=2)
    error = _error_body(caught.value)
    assert error["code"] == "model_not_found" and error["param"] == "model"


def test_negative_max_tokens_is_400(client, served_model):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=served_model["id"], prompt=PROMPT, max_tokens=-1)
    assert _error_body(caught.value)["param"] == "max_tokens"


def test_prompt_longer_than_context_is_400(client, served_model):
    too_long = [5] * (served_model["max_model_len"] + 8)
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=served_model["id"], prompt=too_long, max_tokens=4)
    assert _error_body(caught.value)["type"] == "invalid_request_error"


def test_max_tokens_past_the_context_is_400(client, served_model):
    """As OpenAI's API: an explicit max_tokens the context cannot hold after the prompt is a 400
    naming max_tokens, for both endpoints, not a silently shorter answer."""
    room = served_model["max_model_len"] - 3
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=served_model["id"], prompt=[5, 6, 7], max_tokens=room + 1)
    error = _error_body(caught.value)
    assert error["param"] == "max_tokens" and f"at most {room}" in error["message"]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=served_model["id"], messages=CHAT, max_tokens=served_model["max_model_len"]
        )
    assert _error_body(caught.value)["param"] == "max_tokens"


def test_missing_field_is_400_naming_the_param(client, served_model):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=served_model["id"], messages=[])
    assert _error_body(caught.value)["param"] == "messages"


# -- lifecycle --------------------------------------------------------------------------------


def _wait_for_idle_engine(model_server, timeout_s: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        stats = model_server.engine_stats.remote().result()
        idle = stats["num_running"] == 0 and stats["num_waiting"] == 0
        if idle and stats["num_free_blocks"] == stats["num_total_blocks"]:
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"engine not idle after {timeout_s} s: {stats}")
        time.sleep(0.2)


def _wait_for_busy_engine(model_server, timeout_s: float = 30.0) -> dict:
    """The engine's stats once they show one request running and holding KV blocks. They are
    a snapshot the engine process sends every `STATS_PERIOD_S`, so a request that has already
    streamed tokens may not be in them yet."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = model_server.engine_stats.remote().result()
        busy = stats["num_running"] + stats["num_waiting"] == 1
        if busy and stats["num_free_blocks"] < stats["num_total_blocks"]:
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"the request not seen running after {timeout_s} s: {stats}")
        time.sleep(0.05)


def test_disconnect_mid_stream_frees_blocks(serve_url, served_model, model_server):
    """A client that closes the stream aborts its request: the engine frees its blocks and
    counts it aborted, not finished at its length."""
    stats = _wait_for_idle_engine(model_server)
    aborted = stats["num_finished"].get("abort", 0)
    finished_by_length = stats["num_finished"].get("length", 0)
    body = {
        "model": served_model["id"],
        "messages": CHAT,  # no max_tokens: the rest of the context
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{serve_url}/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            data_lines = 0
            for line in lines:
                data_lines += line.startswith("data: ")
                if data_lines == 4:
                    break
            # The reply is the rest of the context (4096 tokens): seconds of decoding at least.
            _wait_for_busy_engine(model_server)
        # Leaving the `with` closes the connection mid-stream.
    stats = _wait_for_idle_engine(model_server)
    assert stats["kv_usage"] == 0
    assert stats["num_finished"].get("abort", 0) == aborted + 1
    assert stats["num_finished"].get("length", 0) == finished_by_length


def test_disconnect_before_a_whole_answer_aborts_it(serve_url, served_model, model_server):
    """A request not streamed is one plain call to the model server: a client that gives up
    before the answer cancels it, and the engine aborts the request (not runs it to the end)."""
    _wait_for_idle_engine(model_server)
    aborted = model_server.engine_stats.remote().result()["num_finished"].get("abort", 0)
    body = {
        "model": served_model["id"],
        "messages": CHAT,  # no max_tokens: the rest of the context
        "temperature": 0.0,
        "ignore_eos": True,
    }
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{serve_url}/v1/chat/completions", json=body, timeout=1.5)
    stats = _wait_for_idle_engine(model_server)
    assert stats["kv_usage"] == 0
    assert stats["num_finished"].get("abort", 0) == aborted + 1


def test_health_probes_engine(serve_url, model_server):
    model_server.check_health.remote().result()
    response = httpx.get(f"{serve_url}/health", timeout=30)
    assert response.status_code == 200
    engine = response.json()["engine"]
    assert engine["num_total_blocks"] > 0
    assert 0.0 <= engine["kv_usage"] <= 1.0


def test_max_tokens_that_fill_the_context_exactly_are_accepted():
    """The boundary of the rule above, and the default left alone: an unset max_tokens is
    whatever room is left (chat) or 16 (completions), never an error of its own."""
    prompt = [5, 6, 7]
    for max_tokens, fits in ((13, True), (14, False)):
        request = CompletionRequest(model="m", prompt=prompt, max_tokens=max_tokens)
        if fits:
            plans = plan_completion(request, [prompt], max_model_len=16)
            assert plans[0].params.max_tokens == 13
        else:
            with pytest.raises(InvalidRequestError, match="at most 13"):
                plan_completion(request, [prompt], max_model_len=16)
    for unset in (CompletionRequest(model="m", prompt=prompt), _null_max_tokens(prompt)):
        assert plan_completion(unset, [prompt], 8)[0].params.max_tokens == 16
    chat = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}])
    assert plan_chat(chat, prompt, 16)[0].params.max_tokens == 13


def _null_max_tokens(prompt: list[int]) -> CompletionRequest:
    """A request whose JSON carries "max_tokens": null, as clients may send."""
    return CompletionRequest.model_validate({"model": "m", "prompt": prompt, "max_tokens": None})


def _post_json(serve_url: str, path: str, body: dict, content_type: str) -> httpx.Response:
    import json

    return httpx.post(
        f"{serve_url}{path}",
        content=json.dumps(body),
        headers={"content-type": content_type},
        timeout=60,
    )


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "temperature": 0.0, "n": 2}),
        ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 8, "logprobs": True}),
        ("/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "stream": True}),
        ("/v1/completions", {"prompt": PROMPT, "max_tokens": 0}),  # the route's own 400
    ],
)
def test_the_direct_route_answers_as_fastapis_route(serve_url, served_model, path, body):
    """`application/json` takes DirectRoutes; `application/vnd.test+json`, which FastAPI also
    reads as JSON, takes FastAPI's route: the same request answers the same (ids aside)."""
    import json

    body = {"model": served_model["id"], "temperature": 0.0, **body}
    direct = _post_json(serve_url, path, body, "application/json")
    routed = _post_json(serve_url, path, body, "application/vnd.test+json")
    assert direct.status_code == routed.status_code
    assert direct.headers["content-type"] == routed.headers["content-type"]

    def without_ids(text: str):
        events = [e for e in text.split("\n\n") if e] if body.get("stream") else [text]
        out = []
        for event in events:
            payload = event.removeprefix("data: ")
            if payload == "[DONE]":
                out.append(payload)
                continue
            data = json.loads(payload)
            if isinstance(data, dict):
                data.pop("id", None)
                data.pop("created", None)
            out.append(data)
        return out

    def merged(events: list):
        """A stream's events as what a client reads: per choice the joined text and its last
        finish_reason. How tokens group into events depends on timing (a lagging reader gets
        several in one), not on the route."""
        if not body.get("stream") or direct.status_code != 200:
            return events
        texts: dict = {}
        finish: dict = {}
        for event in events:
            if event == "[DONE]":
                continue
            for choice in event.get("choices", []):
                delta = choice.get("delta", {}).get("content") if "delta" in choice else None
                text = choice.get("text") if "text" in choice else delta
                texts[choice["index"]] = texts.get(choice["index"], "") + (text or "")
                if choice.get("finish_reason"):
                    finish[choice["index"]] = choice["finish_reason"]
        return texts, finish, events[-1]

    assert merged(without_ids(direct.text)) == merged(without_ids(routed.text))
    if direct.status_code == 200 and not body.get("stream"):
        assert direct.json()["choices"]


def test_only_well_formed_json_objects_take_the_direct_route():
    """DirectRoutes calls the ingress's method for a valid body with `application/json` and
    leaves everything else to FastAPI (which words the errors)."""
    import asyncio
    import json

    from deploy.ingress import DirectRoutes
    from deploy.openai_protocol import CompletionResponse

    class Ingress:
        def __init__(self):
            self.calls = []

        async def completions(self, request):
            self.calls.append(request)
            return CompletionResponse(id="cmpl-1", model=request.model, choices=[])

    class App:
        def __init__(self):
            self.state = type("State", (), {"ingress": Ingress()})()
            self.fell_through = []

        async def __call__(self, scope, receive, send):
            self.fell_through.append((await receive())["body"])
            await send({"type": "http.response.start", "status": 400, "headers": []})
            await send({"type": "http.response.body", "body": b"fastapi"})

    def call(body: bytes, content_type: bytes = b"application/json", path="/v1/completions"):
        app = App()
        scope = {
            "type": "http",
            "method": "POST",
            "path": path,
            "root_path": "",
            "headers": [(b"content-type", content_type)],
            "app": app,
        }
        sent = []

        async def receive():
            return {"type": "http.request", "body": body, "more_body": False}

        async def send(message):
            sent.append(message)

        asyncio.run(DirectRoutes(app)(scope, receive, send))
        return app, sent

    # In the served app it runs after the key and size checks, before FastAPI's routing.
    from deploy.auth import ApiKeyCheck
    from deploy.ingress import app as served_app
    from deploy.limits import BodySizeLimit

    order = [m.cls for m in served_app.user_middleware]
    assert order == [ApiKeyCheck, BodySizeLimit, DirectRoutes]

    good = json.dumps({"model": "m", "prompt": "hi", "max_tokens": 3}).encode()
    app, sent = call(good)
    assert [r.max_tokens for r in app.state.ingress.calls] == [3] and not app.fell_through
    assert sent[0]["status"] == 200
    assert json.loads(sent[1]["body"])["model"] == "m"
    app, _ = call(good, b"Application/JSON; charset=utf-8")
    assert len(app.state.ingress.calls) == 1 and not app.fell_through
    for body, content_type, path in [
        (b"{not json", b"application/json", "/v1/completions"),
        (b"[1, 2]", b"application/json", "/v1/completions"),
        (
            json.dumps({"model": "m", "prompt": "hi", "max_tokens": -1}).encode(),
            b"application/json",
            "/v1/completions",
        ),
        (good, b"text/plain", "/v1/completions"),
        (good, b"application/jsonx", "/v1/completions"),
        (b"[" * 100_000 + b"]" * 100_000, b"application/json", "/v1/completions"),
        (good, b"application/json", "/v1/embeddings"),
    ]:
        app, sent = call(body, content_type, path)
        assert not app.state.ingress.calls
        assert app.fell_through == [body] and sent[-1]["body"] == b"fastapi"
