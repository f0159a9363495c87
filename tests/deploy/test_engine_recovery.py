"""A model-server replica whose engine process died: requests get a 503 that says so, the health
probe rebuilds the engine without freezing the replica's event loop, and the replica serves
again. (The replica class itself, on this test's event loop: Serve calls the same methods.)"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from cluster.sampling_params import SamplingParams
from deploy.messages import GenerateChunk, GenerateFailure, GenerateRequest
from deploy.model_server import ModelServer

pytestmark = pytest.mark.timeout(120)


def _request(request_id: str) -> GenerateRequest:
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    return GenerateRequest(request_id, [5, 6, 7], params, stream=False)


async def _until(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


def test_a_killed_engine_is_a_503_then_the_health_probe_rebuilds_it(tiny_model_dir):
    async def run():
        config = {"model": tiny_model_dir, "device": "cpu", "num_draft_tokens": 0}
        server = await asyncio.to_thread(ModelServer, config, None, None, True)
        engine = server._engine
        try:
            assert engine.own_process
            ok = await server.generate_whole(_request("before"))
            assert isinstance(ok, GenerateChunk) and len(ok.new_token_ids) == 4

            os.kill(engine.pid, signal.SIGKILL)
            await _until(lambda: engine.is_dead)
            failed = await server.generate_whole(_request("while-dead"))
            assert isinstance(failed, GenerateFailure)
            assert (failed.status_code, failed.error_type) == (503, "engine_dead_error")

            old_pid = engine.pid
            probe = asyncio.create_task(server.check_health())
            second = asyncio.create_task(server.check_health())  # waits, rebuilds nothing
            # The event loop runs on during the rebuild: a request is answered (503) at once.
            started = time.monotonic()
            during = await server.generate_whole(_request("during"))
            assert isinstance(during, GenerateFailure) and during.status_code == 503
            assert time.monotonic() - started < 0.5
            assert not probe.done()
            await asyncio.gather(probe, second)
            assert engine.pid != old_pid and not engine.is_dead

            after = await server.generate_whole(_request("after"))
            assert isinstance(after, GenerateChunk) and after.new_token_ids == ok.new_token_ids
        finally:
            await server.__del__()

    asyncio.run(run())
