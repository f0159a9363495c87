"""The streaming path under concurrency: streamed text is the non-streamed text is the offline
text, whatever the pacing joined into one chunk; the pacing rule and the chunk join in closed
form. Driven by the official `openai` client over real HTTP.
"""

from __future__ import annotations

import asyncio

import pytest

from cluster.async_engine import stream_interval_s
from cluster.outputs import JoinedOutputs, RequestOutput, join_outputs
from deploy.model_server import resolve_stream_chunks_per_s, to_chunk

pytestmark = pytest.mark.timeout(180)

NUM_STREAMS, MAX_TOKENS = 8, 24
PROMPTS = [f"def f{i}(x):" for i in range(NUM_STREAMS)]


def test_concurrent_streams_equal_non_streamed_and_offline(async_client, served_model, offline_llm):
    from cluster.sampling_params import SamplingParams

    model = served_model["id"]

    async def streamed(prompt: str) -> tuple[str, int, str | None, int]:
        stream = await async_client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
        )
        pieces, finish, tokens = [], None, 0
        async for chunk in stream:
            if chunk.choices:
                pieces.append(chunk.choices[0].text)
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage:
                tokens = chunk.usage.completion_tokens
        return "".join(pieces), len([p for p in pieces if p]), finish, tokens

    async def whole(prompt: str):
        return await async_client.completions.create(
            model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0
        )

    async def run():
        # All at once, so the replica paces 8 streams and steps batch them together.
        return await asyncio.gather(
            asyncio.gather(*(streamed(p) for p in PROMPTS)),
            asyncio.gather(*(whole(p) for p in PROMPTS)),
        )

    streams, wholes = asyncio.run(run())
    offline = offline_llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    for (text, num_chunks, finish, tokens), full, ref in zip(streams, wholes, offline):
        assert text == full.choices[0].text == ref.text
        assert finish == full.choices[0].finish_reason == ref.finish_reason
        assert tokens == full.usage.completion_tokens == len(ref.token_ids)
        assert 1 <= num_chunks <= tokens


def _output(new_tokens, new_text, tokens, text, finished=False, logprobs=None) -> RequestOutput:
    return RequestOutput(
        request_id="r",
        prompt_token_ids=[1, 2],
        token_ids=tokens,
        new_token_ids=new_tokens,
        text=text,
        new_text=new_text,
        finished=finished,
        finish_reason="length" if finished else None,
        new_logprobs=logprobs,
    )


def test_join_outputs_keeps_every_delta_once_in_order():
    a = _output([5], "a", [5], "a", logprobs=[{"token_id": 5}])
    b = _output([6, 7], "", [5, 6, 7], "a", logprobs=[{"token_id": 6}, {"token_id": 7}])
    c = _output([8], "bc", [5, 6, 7, 8], "abc", finished=True, logprobs=[{"token_id": 8}])
    joined = join_outputs([a, b, c])
    assert joined.new_token_ids == [5, 6, 7, 8] == joined.token_ids
    assert joined.new_text == "abc" == joined.text
    assert [e["token_id"] for e in joined.new_logprobs] == [5, 6, 7, 8]
    assert joined.finished and joined.finish_reason == "length"
    assert join_outputs([a]) is a
    chunk = to_chunk(joined)
    assert (chunk.new_token_ids, chunk.new_text, chunk.finished) == ([5, 6, 7, 8], "abc", True)


def test_outputs_joined_as_they_come_equal_join_outputs():
    a = _output([5], "a", [5], "a", logprobs=[{"token_id": 5}])
    b = _output([6, 7], "", [5, 6, 7], "a", logprobs=[{"token_id": 6}, {"token_id": 7}])
    c = _output([8], "bc", [5, 6, 7, 8], "abc", finished=True, logprobs=[{"token_id": 8}])
    plain = [_output([5], "a", [5], "a"), _output([6], "b", [5, 6], "ab", finished=True)]
    pending = JoinedOutputs()
    assert not pending
    for outputs in ([a, b, c], [b], plain, [a, b], [c]):  # takes in turn, then empty again
        for out in outputs:
            pending.add(out)
        assert pending
        assert pending.take() == join_outputs(outputs)
        assert not pending


def test_stream_interval_spreads_the_replica_budget_over_its_streams():
    assert stream_interval_s(1, 400.0) == pytest.approx(0.0025)
    assert stream_interval_s(16, 400.0) == pytest.approx(0.04)
    assert stream_interval_s(128, 400.0) == pytest.approx(0.32)
    assert stream_interval_s(16, 0.0) == 0.0  # no pacing: a chunk per step


@pytest.fixture(scope="module")
def colocated_url(serve_url, tiny_model_dir) -> str:
    """A second app beside the session's: ingress and engine in one deployment."""
    from ray import serve

    from deploy.app import build_app
    from tests.deploy.conftest import app_args

    serve.run(
        build_app({**app_args(tiny_model_dir), "colocate": True}),
        name="colocated",
        route_prefix="/colocated",
    )
    yield f"{serve_url}/colocated"
    serve.delete("colocated")


def test_colocated_app_serves_the_same_text_streamed_or_not(colocated_url, offline_llm):
    import openai

    from cluster.sampling_params import SamplingParams

    client = openai.OpenAI(base_url=f"{colocated_url}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    [ref] = offline_llm.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=16))
    full = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=16, temperature=0)
    stream = client.completions.create(
        model=model, prompt=PROMPTS[0], max_tokens=16, temperature=0, stream=True
    )
    text = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    assert text == full.choices[0].text == ref.text
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4, n=2, seed=1
    )
    assert [c.index for c in chat.choices] == [0, 1]
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=-1)


def test_colocated_disconnect_frees_blocks(colocated_url):
    import time

    import httpx

    model = httpx.get(f"{colocated_url}/v1/models", timeout=30).json()["data"][0]["id"]
    body = {"model": model, "prompt": PROMPTS[1], "max_tokens": 2000, "stream": True}
    body |= {"ignore_eos": True, "temperature": 0.0}
    with httpx.stream("POST", f"{colocated_url}/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break  # one chunk, then hang up mid-stream
    deadline = time.monotonic() + 30
    while True:
        engine = httpx.get(f"{colocated_url}/health", timeout=30).json()["engine"]
        if engine["num_running"] == 0 and engine["num_free_blocks"] == engine["num_total_blocks"]:
            break
        assert time.monotonic() < deadline, engine
        time.sleep(0.2)


def test_colocated_disconnect_before_a_whole_answer_aborts_it(colocated_url):
    """Colocated, a request not streamed is a task of the replica: a client that gives up
    before the answer cancels it, and the engine aborts the request (not runs it to the end),
    as /metrics counts (pushed about once a second, so polled)."""
    import time

    import httpx

    def aborted() -> float:
        text = httpx.get(f"{colocated_url}/metrics", timeout=30).text
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("mtpserve:request_success_total{")
            and 'finished_reason="abort"' in line
        )

    def settled() -> float:
        # The test before this one aborts a request too, and its count can reach /metrics after
        # this one starts (CI once read 0 here and 2 after this abort): take the count once it
        # has stayed the same over more than two pushes.
        value, since = aborted(), time.monotonic()
        deadline = since + 30
        while time.monotonic() - since < 2.5:
            assert time.monotonic() < deadline, value
            time.sleep(0.3)
            now = aborted()
            if now != value:
                value, since = now, time.monotonic()
        return value

    model = httpx.get(f"{colocated_url}/v1/models", timeout=30).json()["data"][0]["id"]
    before = settled()
    body = {"model": model, "prompt": PROMPTS[1], "max_tokens": 3000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{colocated_url}/v1/completions", json=body | {"temperature": 0.0}, timeout=1.5)
    deadline = time.monotonic() + 30
    while aborted() != before + 1:
        assert time.monotonic() < deadline, (before, aborted())
        time.sleep(0.3)
    engine = httpx.get(f"{colocated_url}/health", timeout=30).json()["engine"]
    assert engine["num_running"] == 0 and engine["num_free_blocks"] == engine["num_total_blocks"]


def test_auto_chunk_budget_follows_the_cores(monkeypatch):
    import os

    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert resolve_stream_chunks_per_s(None) == 100.0
    monkeypatch.setattr(os, "cpu_count", lambda: 128)
    assert resolve_stream_chunks_per_s(None) == 800.0
    assert resolve_stream_chunks_per_s(0.0) == 0.0
    assert resolve_stream_chunks_per_s(250.0) == 250.0


# --- one choice, read without the merge's task (deploy.ingress.OpenAIIngress._merge) ----------


class _RecordingStream:
    """A model server's stream of `items` (an Exception item is raised) that counts cancels."""

    def __init__(self, items):
        self._items = list(items)
        self.cancels = 0

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self._items:
            raise StopAsyncIteration
        item = self._items.pop(0)
        if isinstance(item, Exception):
            raise item
        return item

    def cancel(self) -> None:
        self.cancels += 1


def _chunk(text: str, finished: bool = False):
    from deploy.messages import GenerateChunk

    return GenerateChunk([1], text, finished, "length" if finished else None)


def _merged_one(stream, first, take: int | None = None):
    """(what `_merge` yields for one choice, the stream's cancels): read whole, or `take` items
    and then closed, as a reader that stops early (a disconnect, a failure) closes it."""
    from types import SimpleNamespace

    from deploy.ingress import OpenAIIngress

    ingress = SimpleNamespace(_one=OpenAIIngress._one)

    async def run():
        merged = OpenAIIngress._merge(ingress, "cmpl-1", [stream], [first], [])
        items = []
        async for item in merged:
            items.append(item)
            if take is not None and len(items) == take:
                await merged.aclose()
                break
        return items, stream.cancels  # the cancel, if any, came with the close

    return asyncio.run(run())


def test_one_choice_yields_each_item_in_order_and_needs_no_cancel_at_its_end():
    chunks = [_chunk("a"), _chunk("b"), _chunk("c", finished=True)]
    stream = _RecordingStream(chunks[1:])
    assert _merged_one(stream, chunks[0]) == ([(0, c) for c in chunks], 0)
    # A reader that stops at the last item (it has all it needs) cancels nothing either.
    stream = _RecordingStream(chunks[1:])
    assert _merged_one(stream, chunks[0], take=3) == ([(0, c) for c in chunks], 0)


def test_one_choice_closed_early_cancels_its_stream_at_once():
    chunks = [_chunk("a"), _chunk("b"), _chunk("c", finished=True)]
    stream = _RecordingStream(chunks[1:])
    assert _merged_one(stream, chunks[0], take=2) == ([(0, c) for c in chunks[:2]], 1)


def test_one_choice_whose_stream_fails_ends_with_a_failure_and_a_cancel():
    from deploy.messages import GenerateFailure

    stream = _RecordingStream([RuntimeError("the replica died")])
    items, cancels = _merged_one(stream, _chunk("a"))
    assert [i for i, _ in items] == [0, 0] and items[0][1] == _chunk("a")
    assert isinstance(items[1][1], GenerateFailure) and cancels == 1
