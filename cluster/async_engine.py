"""An asyncio front for the engine: the step loop runs on its own thread; each request's
outputs reach its caller through an asyncio queue.

Failure: a request that fails inside a step fails alone (`LLMEngine.step` isolates it; its
caller gets `RequestFailedError`). If the workers fail (a rank died or hung past the step
timeout), every request in flight ends with finish_reason "error", the engine marks itself dead,
and `restart()` builds a fresh executor (new workers) that serves the next request.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from collections.abc import AsyncIterator

from cluster.config import EngineConfig
from cluster.engine import EngineStats, LLMEngine
from cluster.outputs import RequestOutput
from cluster.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The workers failed; the engine must be restarted."""


class RequestFailedError(RuntimeError):
    """This request failed inside a step; the engine and every other request go on."""


class EngineOverloadedError(RuntimeError):
    """More requests are queued than max_queued_requests."""


class AsyncEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.engine = LLMEngine(config)
        self.tokenizer = self.engine.tokenizer
        self.model_name = config.model_name
        self.max_model_len = self.engine.max_model_len
        self._lock = threading.Lock()  # guards self.engine between the loop and callers
        self._wakeup = threading.Event()
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._dead: str | None = None
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
        self._thread.start()

    # --- the loop thread ------------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stopping:
            with self._lock:
                busy = self.engine.has_unfinished and self._dead is None
                if busy:
                    try:
                        outputs = self.engine.step()
                    except Exception as e:  # a failed rank: fail every request, stay up
                        logger.exception("engine step failed")
                        self._dead = f"{type(e).__name__}: {e}"
                        outputs = self.engine.fail_all(f"engine failure: {self._dead}")
            if busy:
                for out in outputs:
                    self._deliver(out)
            else:
                self._wakeup.wait(0.5)
                self._wakeup.clear()

    def _deliver(self, out: RequestOutput) -> None:
        entry = self._queues.get(out.request_id)
        if entry is None:
            return
        loop, queue = entry
        loop.call_soon_threadsafe(queue.put_nowait, out)

    # --- the caller's side ------------------------------------------------------------------------

    async def generate(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Yields one RequestOutput per engine step that changed the request; the last has
        finished=True. Raises InvalidRequestError, EngineOverloadedError, EngineDeadError."""
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        request_id = request_id or uuid.uuid4().hex
        queue: asyncio.Queue = asyncio.Queue()
        with self._lock:
            stats = self.engine.stats()
            if stats.num_waiting >= self.config.max_queued_requests:
                raise EngineOverloadedError(
                    f"{stats.num_waiting} requests queued (max_queued_requests="
                    f"{self.config.max_queued_requests})"
                )
            self._queues[request_id] = (asyncio.get_running_loop(), queue)
            try:
                self.engine.add_request(prompt_token_ids, params, request_id)
            except Exception:
                del self._queues[request_id]
                raise
        self._wakeup.set()
        finished = False
        try:
            while True:
                out: RequestOutput = await queue.get()
                yield out
                if out.finished:
                    finished = True
                    if out.finish_reason == "error":
                        failed = EngineDeadError if self._dead is not None else RequestFailedError
                        raise failed(out.error or "engine failure")
                    return
        finally:
            self._queues.pop(request_id, None)
            if not finished:  # the caller went away (disconnect, cancel): free its blocks
                await self.abort(request_id)

    async def abort(self, request_id: str) -> None:
        with self._lock:
            out = self.engine.abort(request_id)
        if out is not None:
            self._deliver(out)

    async def check_health(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        try:
            await asyncio.get_running_loop().run_in_executor(None, self._probe)
        except Exception as e:
            self._dead = f"health check failed: {e}"
            raise EngineDeadError(self._dead) from e

    def _probe(self) -> None:
        with self._lock:
            self.engine.check_health()

    @property
    def is_dead(self) -> bool:
        return self._dead is not None

    def restart(self) -> None:
        """Rebuild the workers (after a failure); requests in flight were already failed."""
        with self._lock:
            try:
                self.engine.shutdown()
            except Exception:
                logger.exception("shutting down the failed engine")
            self.engine = LLMEngine(self.config)
            self._dead = None

    def stats(self) -> EngineStats:
        return self.engine.stats()

    async def shutdown(self) -> None:
        self._stopping = True
        self._wakeup.set()
        self._thread.join(timeout=10)
        with self._lock:
            self.engine.shutdown()
