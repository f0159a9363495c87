"""An asyncio front for the engine: the step loop runs on its own thread, or in a process of
its own (`own_process`: cluster/engine_process.py says why); each request's outputs reach its
caller through an asyncio queue.

Pacing (`cluster.engine_loop.Pacer`): where the step loop runs, it decides when a request's
outputs cross to its caller (a stream's first text at once, then at most one per stream interval; a
request not streamed, one when it finishes), so a step costs the caller's event loop work only
for the requests that are due. Before, every request woke its caller's event loop every step,
and that Python work, sharing the GIL with the loop, cost more than the step itself at a few
dozen requests. When each token was produced still reaches the caller (`TokenTimings`), for
latency metrics.

Failure: a request that fails inside a step fails alone (`LLMEngine.step` isolates it; its
caller gets `RequestFailedError`). If the workers fail (a rank died or hung past the step
timeout), every request in flight ends with finish_reason "error", the engine marks itself dead,
and `restart()` builds a fresh executor (new workers) that serves the next request.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from cluster.config import EngineConfig
from cluster.engine import EngineStats, LLMEngine, load_tokenizer
from cluster.engine_loop import (
    Abort,
    Add,
    Delivery,
    EngineDeadError,
    EngineLoop,
    EngineOverloadedError,
    Refusal,
    RequestFailedError,
    stream_interval_s,
)
from cluster.engine_process import EngineInfo, EngineProcess, runs_in_own_process
from cluster.outputs import CumulativeOutput, RequestOutput, failure_delta, join_outputs
from cluster.sampling_params import SamplingParams

__all__ = [
    "AsyncEngine",
    "EngineDeadError",
    "EngineOverloadedError",
    "RequestFailedError",
    "TokenTimings",
    "stream_interval_s",
]

logger = logging.getLogger(__name__)

# How long a thread may hold the GIL while another waits for it (Python's default: 5 ms). The
# step loop gives the GIL up at every wait on the device and then needs it back at once; with
# the HTTP side busy in the same process, 5 ms per hand-back would outlast a whole decode step.
# With the engine in its own process, the threads that receive its outputs and send it requests
# wait on the HTTP side's event loop the same way.
GIL_SWITCH_INTERVAL_S = 0.0005


class TokenTimings(Protocol):
    """Told, on the caller's event loop, when each request's tokens were produced (perf_counter
    seconds, stamped by the step loop; tokens of one step share a stamp)."""

    def first_tokens(self, num_tokens: int, ttft_s: float) -> None: ...

    def later_tokens(self, num_tokens: int, since_previous_s: float) -> None: ...


@dataclass
class _Subscriber:
    """A request's caller, as the receiving side sees it."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    # The engine in its own process sends deltas: their cumulative fields are rebuilt here.
    cumulative: CumulativeOutput | None = None


@dataclass(frozen=True)
class _Delivery:
    output: RequestOutput
    token_stamps: list[tuple[int, float]]


def _resolve_soon(future: asyncio.Future, result: object = None) -> None:
    """Set `future`'s result from another thread (unless it is done or its loop closed)."""
    try:
        future.get_loop().call_soon_threadsafe(_resolve, future, result)
    except RuntimeError:  # the caller's loop is closed
        pass


def _resolve(future: asyncio.Future, result: object = None) -> None:
    if not future.done():
        future.set_result(result)


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
    """The engine's step loop runs apart from the callers; callers never wait for a step.

    Callers post commands (add, abort) that the loop applies between steps, and the loop hands
    each step's outputs to each caller's event loop in one callback. So an asyncio caller never
    blocks on a step, and a step costs one cross-thread wake-up per event loop, not one per
    request.

    Where the loop runs: on a thread of this process (default), or, with `own_process`, in a
    process of its own (`cluster.engine_process`) where the executor allows it, so that the
    caller's threads (a Serve replica's) and the engine never wait for one interpreter lock;
    a thread of this process then receives the loop's messages and hands each output to its
    caller. `engine` (the `LLMEngine`) is reachable in the thread mode only.
    """

    def __init__(
        self, config: EngineConfig, stream_chunks_per_s: float = 0.0, own_process: bool = False
    ):
        self.config = config
        self.stream_chunks_per_s = stream_chunks_per_s
        self._subscribers: dict[str, _Subscriber] = {}
        self._dead: str | None = None
        self._stopping = False
        self._aborting: dict[str, list[asyncio.Future]] = {}  # done once the blocks are free
        self._aborting_lock = threading.Lock()
        self._process: EngineProcess | None = None
        self._retiring: EngineProcess | None = None  # being replaced by restart()
        self._own_process = own_process and runs_in_own_process(config)
        if sys.getswitchinterval() > GIL_SWITCH_INTERVAL_S:
            sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)  # process-wide: a serving process
        if self._own_process:
            self._start_process(config)
            self.engine = None
            self._tokenizer = None
        else:
            if own_process:
                logger.info("the %s executor runs the engine on a thread", config.executor)
            self.engine = LLMEngine(config)
            self._tokenizer = self.engine.tokenizer
            self._core = EngineLoop(self.engine, stream_chunks_per_s)
            self._info = EngineInfo(
                self.engine.config,
                self.engine.warm_up,
                self.engine.max_model_len,
                self.engine.sampling_defaults,
                None,
            )
            # Guards the engine between the loop and restart/shutdown/probe (never the event loop).
            self._lock = threading.Lock()
            self._wakeup = threading.Event()
            self._inbox: collections.deque[Add | Abort] = collections.deque()
            self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
            self._thread.start()
        self.model_name = config.model_name
        self.max_model_len = self._info.max_model_len
        self.sampling_defaults = self._info.sampling_defaults

    @property
    def own_process(self) -> bool:
        return self._own_process

    @property
    def pid(self) -> int:
        """The process the step loop runs in."""
        return self._process.pid if self._own_process else os.getpid()

    @property
    def resolved_config(self) -> EngineConfig:
        """The config as the engine resolved it (the draft length and the context chosen)."""
        return self._info.config

    @property
    def warm_up(self):
        """The engine's warm-up before it served (`workers.worker.WarmUp`)."""
        return self._info.warm_up

    @property
    def tokenizer(self):
        if self._tokenizer is None:  # the engine's own process has its own
            self._tokenizer = load_tokenizer(self.config.model)
        return self._tokenizer

    # --- the loop thread (engine on a thread of this process) ------------------------------------

    def _loop(self) -> None:
        while not self._stopping:
            commands = []
            while self._inbox:
                commands.append(self._inbox.popleft())
            with self._lock:
                due, aborted = self._core.turn(commands)
                busy = self._core.busy
                if self._core.dead is not None:
                    self._dead = self._core.dead
            self._after_turn(due, aborted)
            if not busy:
                self._wakeup.wait(0.5)
                self._wakeup.clear()

    # --- the receiving thread (engine in its own process) -----------------------------------------

    def _start_process(self, config: EngineConfig) -> None:
        self._process = EngineProcess(config, self.stream_chunks_per_s)
        self._info = self._process.info
        self._stats = self._info.stats
        self._probes: dict[str, asyncio.Future] = {}
        self._receiver = threading.Thread(
            target=self._receive, args=(self._process,), name="engine-receiver", daemon=True
        )
        self._receiver.start()

    def _receive(self, process: EngineProcess) -> None:
        while True:
            try:
                message = process.recv()
            except (EOFError, OSError):
                if not self._stopping and process is not self._retiring:
                    self._lost(process)
                return
            if message[0] == "step":
                _, due, aborted, stats, dead = message
                if stats is not None:
                    self._stats = stats
                if dead is not None:
                    self._dead = dead
                self._after_turn(due, aborted)
            elif message[0] == "probe":
                _, token, error = message
                future = self._probes.pop(token, None)
                if future is not None:
                    _resolve_soon(future, error)

    def _lost(self, process: EngineProcess) -> None:
        """The engine process died (killed, out of memory, a crash in native code): every
        request in flight ends with an error, as when a step fails."""
        self._dead = f"the engine process {process.exit_status()}"
        logger.error("%s", self._dead)
        error = f"engine failure: {self._dead}"
        failed = [
            (request_id, failure_delta(request_id, error), [])
            for request_id in list(self._subscribers)
        ]
        with self._aborting_lock:
            aborted = list(self._aborting)
        self._after_turn(failed, aborted)
        for token in list(self._probes):
            future = self._probes.pop(token, None)
            if future is not None:
                _resolve_soon(future, self._dead)

    # --- both -------------------------------------------------------------------------------------

    def _post(self, command: Add | Abort) -> None:
        if not self._own_process:
            self._inbox.append(command)
            self._wakeup.set()
            return
        try:
            self._process.send(("command", command))
        except OSError:  # the process is gone: its receiver fails what was in flight
            if isinstance(command, Add):
                raise EngineDeadError(self._dead or "the engine process is gone") from None

    def _after_turn(self, due: list[Delivery | Refusal], aborted: list[str]) -> None:
        for request_id in aborted:
            with self._aborting_lock:
                waiters = self._aborting.pop(request_id, [])
            for future in waiters:
                _resolve_soon(future)
        if due:
            self._deliver(due)

    def _deliver(self, due: list[Delivery | Refusal]) -> None:
        """Hand what the loop paced to the callers: one callback per caller event loop."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for item in due:
            if isinstance(item, Refusal):
                sub = self._subscribers.get(item.request_id)
                if sub is not None:
                    by_loop.setdefault(sub.loop, []).append((sub.queue, item))
                continue
            request_id, output, token_stamps = item
            sub = self._subscribers.get(request_id)
            if sub is None:
                continue
            if sub.cumulative is not None:  # a delta from the engine's own process
                output = sub.cumulative.complete(output)
            by_loop.setdefault(sub.loop, []).append((sub.queue, _Delivery(output, token_stamps)))
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
        cumulative = CumulativeOutput(list(prompt_token_ids)) if self._own_process else None
        self._subscribers[request_id] = _Subscriber(asyncio.get_running_loop(), queue, cumulative)
        arrived_s = time.perf_counter()
        last_stamp_s: float | None = None
        finished = False
        try:
            self._post(Add(request_id, prompt_token_ids, params, stream))
            while True:
                item: _Delivery | Refusal = await queue.get()
                if isinstance(item, Refusal):
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
                # Before the yield: a caller that stops reading after the last output (closing
                # this generator at the yield) must not abort a request the engine has already
                # ended (the abort's round trip to the loop held every such caller up a step).
                finished = out.finished
                yield out
                if finished:
                    if out.finish_reason == "error":
                        failed = EngineDeadError if self._dead is not None else RequestFailedError
                        raise failed(out.error or "engine failure")
                    return
        except EngineDeadError:
            finished = True
            raise
        finally:
            self._subscribers.pop(request_id, None)
            if not finished:  # the caller went away (disconnect, cancel): free its blocks
                await self.abort(request_id)

    async def abort(self, request_id: str) -> None:
        """Returns once the loop has aborted the request (between two steps) and freed its
        blocks; the event loop runs on meanwhile."""
        done = asyncio.get_running_loop().create_future()
        with self._aborting_lock:
            self._aborting.setdefault(request_id, []).append(done)
        try:
            self._post(Abort(request_id))
        except OSError:
            return  # the engine is gone, and the request with it
        if self._own_process and self._dead is not None:
            return  # nobody will answer
        if not self._stopping:
            await done

    async def check_health(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        try:
            if not self._own_process:
                await asyncio.get_running_loop().run_in_executor(None, self._probe)
                return
            future = asyncio.get_running_loop().create_future()
            token = uuid.uuid4().hex
            self._probes[token] = future
            self._process.send(("probe", token))
            error = await future
            if error is not None:
                raise RuntimeError(error)
        except Exception as e:
            self._dead = f"health check failed: {e}"
            if not self._own_process:
                self._core.dead = self._dead
            raise EngineDeadError(self._dead) from e

    def _probe(self) -> None:
        with self._lock:
            self.engine.check_health()

    @property
    def is_dead(self) -> bool:
        return self._dead is not None

    def restart(self) -> None:
        """Rebuild the workers (after a failure); requests in flight were already failed. The
        resolved config: the context and draft length the callers were told stay."""
        if self._own_process:
            self._retiring = self._process  # its receiver, reading EOF, fails nobody now
            self._retiring.stop()
            self._start_process(self._info.config)
            self._dead = None
            return
        with self._lock:
            try:
                self.engine.shutdown()
            except Exception:
                logger.exception("shutting down the failed engine")
            self.engine = LLMEngine(self.engine.config)
            self._core = EngineLoop(self.engine, self.stream_chunks_per_s)
            self._dead = None

    def stats(self) -> EngineStats:
        if self._own_process:
            return self._stats  # the engine process's, at most STATS_PERIOD_S old
        return self.engine.stats()

    async def shutdown(self) -> None:
        self._stopping = True
        with self._aborting_lock:
            waiters = [f for futures in self._aborting.values() for f in futures]
            self._aborting.clear()
        for future in waiters:  # nobody will abort these now: let their callers go
            _resolve_soon(future)
        if self._own_process:
            await asyncio.get_running_loop().run_in_executor(None, self._process.stop)
            return
        self._wakeup.set()
        self._thread.join(timeout=10)
        with self._lock:
            self.engine.shutdown()
