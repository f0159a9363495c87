"""An asyncio front for the engine: the step loop runs on its own thread; each request's
outputs reach its caller through an asyncio queue.

Pacing: the loop thread decides when a request's outputs cross to its caller, so a step costs the
caller's event loop work only for the requests that are due. A streamed request gets its first
output at once, then at most one output (every step since the last one, joined) per stream
interval: `stream_chunks_per_s` spread over the streams in flight (0: one per step); a request
that is not streamed gets one output, when it finishes. Before, every request woke its caller's
event loop every step, and that Python work, sharing the GIL with this loop, cost more than the
step itself at a few dozen requests. When each token was produced still reaches the caller
(`TokenTimings`), for latency metrics.

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
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

from cluster.config import EngineConfig
from cluster.engine import EngineStats, LLMEngine
from cluster.outputs import JoinedOutputs, RequestOutput, join_outputs
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


class TokenTimings(Protocol):
    """Told, on the caller's event loop, when each request's tokens were produced (perf_counter
    seconds, stamped by the step loop; tokens of one step share a stamp)."""

    def first_tokens(self, num_tokens: int, ttft_s: float) -> None: ...

    def later_tokens(self, num_tokens: int, since_previous_s: float) -> None: ...


def stream_interval_s(num_streams: int, chunks_per_s: float) -> float:
    """The least time between two outputs of one stream when `num_streams` stream at once and
    the engine sends at most `chunks_per_s` stream outputs in all (0: no pacing, one per step)."""
    return num_streams / chunks_per_s if chunks_per_s > 0 else 0.0


@dataclass
class _Subscriber:
    """A request's caller, as the loop thread sees it."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    stream: bool
    pending: JoinedOutputs = field(default_factory=JoinedOutputs)  # not yet sent
    token_stamps: list[tuple[int, float]] = field(default_factory=list)  # (tokens, when)
    next_send_s: float = 0.0  # time.perf_counter(); 0: the next output goes at once


@dataclass(frozen=True)
class _Delivery:
    output: RequestOutput
    token_stamps: list[tuple[int, float]]


def _resolve_soon(future: asyncio.Future) -> None:
    try:
        future.get_loop().call_soon_threadsafe(_resolve, future)
    except RuntimeError:  # the caller's loop is closed
        pass


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


def _tell_timings(
    timings: TokenTimings,
    token_stamps: list[tuple[int, float]],
    arrived_s: float,
    last_stamp_s: float | None,
) -> float | None:
    """TTFT at the first tokens, then each later step's tokens with the time since the step
    before; -> the last stamp."""
    for num_tokens, stamp_s in token_stamps:
        if last_stamp_s is None:
            timings.first_tokens(num_tokens, stamp_s - arrived_s)
        else:
            timings.later_tokens(num_tokens, stamp_s - last_stamp_s)
        last_stamp_s = stamp_s
    return last_stamp_s


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

    def __init__(self, config: EngineConfig, stream_chunks_per_s: float = 0.0):
        self.config = config
        self.stream_chunks_per_s = stream_chunks_per_s
        self.engine = LLMEngine(config)
        self.tokenizer = self.engine.tokenizer
        self.model_name = config.model_name
        self.max_model_len = self.engine.max_model_len
        self.sampling_defaults = self.engine.sampling_defaults
        # Guards self.engine between the loop and restart/shutdown/probe (never the event loop).
        self._lock = threading.Lock()
        self._wakeup = threading.Event()
        self._inbox: collections.deque[_Add | _Abort] = collections.deque()
        self._subscribers: dict[str, _Subscriber] = {}
        self._num_streams = 0  # streamed requests in flight (written by callers' loops only)
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
        """Hand what is due to the callers: one callback per caller event loop for the step."""
        now_s = time.perf_counter()
        interval_s = stream_interval_s(self._num_streams, self.stream_chunks_per_s)
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outputs:
            sub = self._subscribers.get(out.request_id)
            if sub is None:
                continue
            if isinstance(out, _Refusal):
                by_loop.setdefault(sub.loop, []).append((sub.queue, out))
                continue
            sub.pending.add(out)
            if out.new_token_ids:
                sub.token_stamps.append((len(out.new_token_ids), now_s))
            if not (out.finished or (sub.stream and now_s >= sub.next_send_s)):
                continue  # joins a later output
            delivery = _Delivery(sub.pending.take(), sub.token_stamps)
            sub.token_stamps = []
            sub.next_send_s = now_s + interval_s
            by_loop.setdefault(sub.loop, []).append((sub.queue, delivery))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # that caller's loop is closed: nobody is listening
                pass

    # --- the caller's side ------------------------------------------------------------------------

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        *,
        stream: bool = True,
        timings: TokenTimings | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Streamed: yields the request's outputs as the engine paces them (see the module
        docstring), several joined when the caller fell behind; not streamed: one output, the
        whole completion. The last has finished=True. Raises InvalidRequestError,
        EngineOverloadedError, EngineDeadError."""
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        request_id = request_id or uuid.uuid4().hex
        queue: asyncio.Queue = asyncio.Queue()
        self._subscribers[request_id] = _Subscriber(asyncio.get_running_loop(), queue, stream)
        self._num_streams += stream
        arrived_s = time.perf_counter()
        last_stamp_s: float | None = None
        self._inbox.append(_Add(request_id, prompt_token_ids, params))
        self._wakeup.set()
        finished = False
        try:
            while True:
                item: _Delivery | _Refusal = await queue.get()
                if isinstance(item, _Refusal):
                    finished = True
                    raise item.error
                ready = [item]
                while not queue.empty():  # behind the engine: one output for all that is ready
                    ready.append(queue.get_nowait())
                if timings is not None:
                    for delivery in ready:
                        last_stamp_s = _tell_timings(
                            timings, delivery.token_stamps, arrived_s, last_stamp_s
                        )
                out = join_outputs([delivery.output for delivery in ready])
                yield out
                if out.finished:
                    finished = True
                    if out.finish_reason == "error":
                        failed = EngineDeadError if self._dead is not None else RequestFailedError
                        raise failed(out.error or "engine failure")
                    return
        finally:
            self._subscribers.pop(request_id, None)
            self._num_streams -= stream
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
