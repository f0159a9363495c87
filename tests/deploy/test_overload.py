"""A full engine queue answers 503 with an OpenAI error body, and nothing leaks afterwards.

A second app with room for one running and one waiting request: the third concurrent request
must be refused by the engine (`max_queued_requests`), not queued forever.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from conftest import app_args

pytestmark = pytest.mark.timeout(240)

APP = "overload"


@pytest.fixture(scope="module")
def overload_app(serve_url, tiny_model_dir):
    from ray import serve

    from deploy.app import MODEL_SERVER_NAME, build_app

    args = app_args(tiny_model_dir, max_num_seqs=1, max_queued_requests=1, num_kv_blocks=64)
    serve.run(build_app(args), name=APP, route_prefix=f"/{APP}")
    handle = serve.get_deployment_handle(MODEL_SERVER_NAME, app_name=APP)
    model_name = handle.model_info.remote().result().model_name
    yield f"{serve_url}/{APP}", handle, model_name
    serve.delete(APP)


def _stats(handle) -> dict:
    return handle.engine_stats.remote().result()


async def _wait_until(handle, predicate, timeout_s=60.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while not predicate(stats := await handle.engine_stats.remote()):
        assert time.monotonic() < deadline, f"timed out; engine stats {stats}"
        await asyncio.sleep(0.1)
    return stats


def test_full_queue_is_503_and_engine_recovers(overload_app):
    url, handle, model_name = overload_app
    body = {
        "model": model_name,
        "prompt": "hello",
        "max_tokens": 3000,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }

    async def first_event(http: httpx.AsyncClient) -> None:
        async with http.stream("POST", f"{url}/v1/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    await asyncio.sleep(3600)  # hold the stream open until cancelled

    async def scenario() -> httpx.Response:
        async with httpx.AsyncClient(timeout=120) as http:
            running = asyncio.create_task(first_event(http))
            await _wait_until(handle, lambda s: s["num_running"] == 1)
            waiting = asyncio.create_task(first_event(http))
            await _wait_until(handle, lambda s: s["num_waiting"] == 1)
            refused = await http.post(f"{url}/v1/completions", json={**body, "stream": False})
            for task in (running, waiting):
                task.cancel()
            await asyncio.gather(running, waiting, return_exceptions=True)
            return refused

    refused = asyncio.run(scenario())
    assert refused.status_code == 503
    error = refused.json()["error"]
    assert error["type"] == "overloaded_error" and "max_queued_requests" in error["message"]
    # Both cancelled streams are aborted: the pool is whole again and new requests run.
    stats = asyncio.run(
        _wait_until(
            handle,
            lambda s: (
                s["num_running"] == s["num_waiting"] == 0
                and s["num_free_blocks"] == s["num_total_blocks"]
            ),
        )
    )
    assert stats["kv_usage"] == 0
    ok = httpx.post(
        f"{url}/v1/completions", json={**body, "stream": False, "max_tokens": 3}, timeout=60
    )
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
