"""The fuzz tier: schemathesis generates bodies from the running server's own /openapi.json,
valid and invalid ones, with a fixed seed and a bounded number of examples per route, and no
response may be a 5xx. A 4xx must carry OpenAI's error body. Afterwards the engine is alive and
holds no request.

Generated valid bodies may ask for thousands of tokens times n = 128; the test caps `max_tokens`
and `n` before sending (what is fuzzed is the server's input handling, not CPU time).
"""

from __future__ import annotations

import time

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, seed, settings
from schemathesis import GenerationMode

POSITIVE = GenerationMode.POSITIVE

pytestmark = pytest.mark.timeout(300)

MAX_EXAMPLES = 30  # per route and mode; ~40 s for the four routes on the 2-core CPU box
FUZZ_SEED = 20261130


@pytest.fixture(scope="module")
def api_schema(serve_url):
    return schemathesis.openapi.from_url(f"{serve_url}/openapi.json", timeout=30)


def _bounded(body, model: str | None):
    """Keep generated work small: each bounded field keeps its type (so validation sees it).
    `model`: the served model's id, put in valid bodies so they reach the engine."""
    if not isinstance(body, dict):
        return body
    if model is not None and isinstance(body.get("model"), str):
        body["model"] = model
    for name, cap in (("max_tokens", 4), ("max_completion_tokens", 4), ("n", 2)):
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > cap:
            body[name] = cap
    for name in ("prompt", "messages"):
        value = body.get(name)
        if isinstance(value, list) and len(value) > 4:
            body[name] = value[:4]
    return body


def _fuzz(operation, mode: GenerationMode, model: str, seen: dict) -> None:
    # Schemathesis's pytest plugin does not run under pytest 9; Hypothesis drives it directly.
    @seed(FUZZ_SEED)
    @settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        database=None,
        derandomize=False,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case):
        case.body = _bounded(case.body, model if mode is POSITIVE else None)
        response = case.call(timeout=60)
        seen[response.status_code] = seen.get(response.status_code, 0) + 1
        assert response.status_code < 500, (case.method, case.path, case.body, response.text[:500])
        if 400 <= response.status_code < 500:
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["message"]

    run()


def test_no_5xx_from_generated_requests(api_schema, served_model):
    seen: dict[str, dict[int, int]] = {}
    for result in api_schema.get_all_operations():
        operation = result.ok()
        # A GET without parameters has no invalid form to generate.
        modes = list(GenerationMode) if operation.method.upper() == "POST" else [POSITIVE]
        for mode in modes:
            label = f"{operation.method.upper()} {operation.path} {mode.value}"
            _fuzz(operation, mode, served_model["id"], seen.setdefault(label, {}))
    print("status codes by route and mode:", seen)
    posts = [label for label in seen if label.startswith("POST")]
    # Completions, chat, /tokenize and /detokenize, valid and invalid bodies.
    assert len(posts) == 8
    for label in posts:
        assert sum(seen[label].values()) >= 5, seen
    # Valid bodies really reach the engine; invalid ones are refused.
    assert seen["POST /v1/completions positive"].get(200), seen
    assert seen["POST /v1/chat/completions positive"].get(200), seen
    assert all(code == 400 or code == 404 for code in seen["POST /v1/completions negative"]), seen


def test_engine_is_idle_and_alive_after_fuzzing(serve_url):
    deadline = time.monotonic() + 60
    while True:
        health = httpx.get(f"{serve_url}/health", timeout=30)
        engine = health.json()["engine"]
        idle = engine["num_running"] == engine["num_waiting"] == 0
        if health.status_code == 200 and idle:
            assert engine["num_free_blocks"] == engine["num_total_blocks"]
            return
        assert time.monotonic() < deadline, health.text
        time.sleep(0.5)
