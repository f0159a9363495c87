"""An asyncio front for the engine: the step loop runs on its own thread; each request's
outputs reach its caller through an asyncio queue.

Failure: a request that fails inside a step fails alone (`LLMEngine.step` isolates it; its
caller gets `RequestFailedError`). If the workers fail (a rank died or hung past the step
timeout), every request in flight ends with finish_reason "error", the engine marks itself dead,
and `restart()` builds a fresh executor (new workers) that serves the next request.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import sys
import threading
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from cluster.config import EngineConfig
from cluster.engine import EngineStats, LLMEngine
from cluster.outputs import RequestOutput, join_outputs
from cluster.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# How long a thread may hold the GIL while another waits for it (Python's default: 5 ms). The
# step loop gives the GIL up at every wait on the device and then needs it back at once; with
# the HTTP side busy in the same process, 5 ms per hand-back would outlast a whole decode step.
GIL_SWITCH_INTERVAL_S = 0.0005


class EngineDeadError(RuntimeError):
    """The workers failed; the engine must be restarted."""


class RequestFailedError(RuntimeError):
    """This request failed inside a step; the engine and every other request go on."""


class EngineOverloadedError(RuntimeError):
    """More requests are queued than max_queued_requests."""


@dataclass(frozen=True)
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


@dataclass(frozen=True)
class _Abort:
    request_id: str
    done: asyncio.Future | None = None  # set once the blocks are free


@dataclass(frozen=True)
class _Refusal:
    """The loop refused a request at admission; its stream raises `error`."""

    request_id: str
    error: Exception


def _resolve_soon(future: asyncio.Future) -> None:
    try:
        future.get_loop().call_soon_threadsafe(_resolve, future)
    except RuntimeError:  # the caller's loop is closed
        pass


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


def _put_all(items: list[tuple[asyncio.Queue, object]]) -> None:
    for queue, out in items:
        queue.put_nowait(out)


class AsyncEngine:
    """The engine loop thread owns `self.engine`; callers never wait for a step.

    Callers post commands (add, abort) to an inbox that the loop drains between steps, and the
    loop hands each step's outputs to each caller's event loop in one callback. So an asyncio
    caller never blocks on the lock a step holds (before, `generate` and `abort` took it on the
    event loop thread and stalled every stream of the replica for up to a step), and a step costs
    one cross-thread wake-up per event loop, not one per request.
    """

    def __init__(self, config: EngineConfig):
        self.config = config
        self.engine = LLMEngine(config)
        self.tokenizer = self.engine.tokenizer
        self.model_name = config.model_name
        self.max_model_len = self.engine.max_model_len
        self.sampling_defaults = self.engine.sampling_defaults
        # Guards self.engine between the loop and restart/shutdown/probe (never the event loop).
        self._lock = threading.Lock()
        self._wakeup = threading.Event()
        self._inbox: collections.deque[_Add | _Abort] = collections.deque()
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._dead: str | None = None
        self._stopping = False
        if sys.getswitchinterval() > GIL_SWITCH_INTERVAL_S:
            sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)  # process-wide: a serving process
        self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
        self._thread.start()

    # --- the loop thread ------------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stopping:
            with self._lock:
                outputs = self._drain_inbox()
                busy = self.engine.has_unfinished and self._dead is None
                if busy:
                    try:
                        outputs += self.engine.step()
                    except Exception as e:  # a failed rank: fail every request, stay up
                        logger.exception("engine step failed")
                        self._dead = f"{type(e).__name__}: {e}"
                        outputs += self.engine.fail_all(f"engine failure: {self._dead}")
            if outputs:
                self._deliver(outputs)
            if not busy:
                self._wakeup.wait(0.5)
                self._wakeup.clear()

    def _drain_inbox(self) -> list[RequestOutput | _Refusal]:
        """Admit or abort what callers posted since the last step (called under the lock)."""
        outputs: list[RequestOutput | _Refusal] = []
        while self._inbox:
            command = self._inbox.popleft()
            if isinstance(command, _Abort):
                out = self.engine.abort(command.request_id)
                if out is not None:
                    outputs.append(out)
                if command.done is not None:
                    _resolve_soon(command.done)
                continue
            try:
                if self._dead is not None:
                    raise EngineDeadError(self._dead)
                num_waiting = self.engine.scheduler.num_waiting
                if num_waiting >= self.config.max_queued_requests:
                    raise EngineOverloadedError(
                        f"{num_waiting} requests queued (max_queued_requests="
                        f"{self.config.max_queued_requests})"
                    )
                self.engine.add_request(
                    command.prompt_token_ids, command.params, command.request_id
                )
            except Exception as e:  # InvalidRequestError and the two above reach the caller
                outputs.append(_Refusal(command.request_id, e))
        return outputs

    def _deliver(self, outputs: list[RequestOutput | _Refusal]) -> None:
        """One callback per caller event loop for the whole step."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outputs:
            entry = self._queues.get(out.request_id)
            if entry is not None:
                by_loop.setdefault(entry[0], []).append((entry[1], out))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # that caller's loop is closed: nobody is listening
                pass

    # --- the caller's side ------------------------------------------------------------------------

    async def generate(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Yields a RequestOutput per engine step that changed the request, or one for several
        steps when the caller fell behind (their deltas joined); the last has finished=True.
        Raises InvalidRequestError, EngineOverloadedError, EngineDeadError."""
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        request_id = request_id or uuid.uuid4().hex
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = (asyncio.get_running_loop(), queue)
        self._inbox.append(_Add(request_id, prompt_token_ids, params))
        self._wakeup.set()
        finished = False
        try:
            while True:
                out: RequestOutput | _Refusal = await queue.get()
                if isinstance(out, _Refusal):
                    finished = True
                    raise out.error
                if not queue.empty():  # behind the engine: one output for every ready step
                    ready = [out]
                    while not queue.empty():
                        ready.append(queue.get_nowait())
                    out = join_outputs(ready)
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
        """Returns once the loop has aborted the request (between two steps) and freed its
        blocks; the event loop runs on meanwhile."""
        done = asyncio.get_running_loop().create_future()
        self._inbox.append(_Abort(request_id, done))
        self._wakeup.set()
        if not self._stopping:
            await done

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
            # The resolved config: the context and draft length the callers were told stay.
            self.engine = LLMEngine(self.engine.config)
            self._dead = None

    def stats(self) -> EngineStats:
        return self.engine.stats()

    async def shutdown(self) -> None:
        self._stopping = True
        self._wakeup.set()
        self._thread.join(timeout=10)
        for command in self._inbox:  # nobody will abort these now: let their callers go
            if isinstance(command, _Abort) and command.done is not None:
                _resolve_soon(command.done)
        with self._lock:
            self.engine.shutdown()
