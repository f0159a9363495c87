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
from cluster.engine import EngineStats, LLMEngine, checked_config, load_tokenizer
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
from cluster.engine_process import EngineInfo, EngineProcess, FrameReader, runs_in_own_process
from cluster.executor import executor_kind
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
# With the engine in its own process, this process's other threads (Serve's, the writer of
# commands the socket did not take at once) wait on the HTTP side's event loop the same way.
GIL_SWITCH_INTERVAL_S = 0.0005


# How often a caller waiting on a loop that does not read the engine process's messages looks
# whether the loop that reads them still runs (it may end first, its callers done): if not, the
# reading moves to the caller's loop. Callers on the reading loop itself wait without looking.
READER_CHECK_S = 0.2


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


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def _resolve_soon(future: asyncio.Future, result: object = None) -> None:
    """Set `future`'s result: at once on its own loop, else through that loop (unless it is
    done or its loop closed)."""
    loop = future.get_loop()
    if loop is _running_loop():
        _resolve(future, result)
        return
    try:
        loop.call_soon_threadsafe(_resolve, future, result)
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


class _LoopReader:
    """The engine process's messages, read by one event loop's reader callback as they arrive
    (`frames`, a `cluster.engine_process.FrameReader`): handled on the loop where the callers
    wait, with no thread between the socket and them. `on_message(message)` for each;
    `on_eof(process)` once the process is gone. The frames outlive a reader that moves to
    another loop (what it holds of a message not yet whole stays with them)."""

    def __init__(self, loop, frames: FrameReader, process: EngineProcess, on_message, on_eof):
        self.loop, self.frames, self.process = loop, frames, process
        self._on_message, self._on_eof = on_message, on_eof
        self._fd = frames.fileno()
        self.attached = True
        self.ended = False  # it read the process's end
        loop.add_reader(self._fd, self._readable)

    def serves(self, loop: asyncio.AbstractEventLoop, process: EngineProcess) -> bool:
        """Whether it reads `process` where `loop`'s callers get what it reads: on `loop`
        itself, or on a loop that runs (in another thread, passing their outputs on)."""
        return (
            process is self.process
            and self.attached
            and not self.loop.is_closed()
            and (self.loop is loop or self.loop.is_running())
        )

    def _readable(self) -> None:
        try:
            messages = self.frames.read()
        except (EOFError, OSError):
            self.ended = True
            self._detach(close=True)
            self._on_eof(self.process)
            return
        for message in messages:
            try:
                self._on_message(message)
            except Exception:  # a bug here must not cost the messages behind it
                logger.exception("handling the engine process's %r message", message[0])

    def _detach(self, close: bool) -> None:
        """On the loop's thread, or with the loop not running. The reader goes before the
        descriptor is closed: its number, once closed, may be another's."""
        if self.attached:
            self.attached = False
            if not self.loop.is_closed():
                self.loop.remove_reader(self._fd)
        if close:
            self.frames.close()

    def detach(self, close: bool) -> None:
        """Stop reading on this loop (from any thread); `close`: the frames too, for good."""
        if self.loop.is_running() and self.loop is not _running_loop():
            try:
                self.loop.call_soon_threadsafe(self._detach, close)
                return
            except RuntimeError:  # closed meanwhile
                pass
        self._detach(close)


def _start_ranks(config: EngineConfig):
    """The Ray executor's ranks, started and loaded in this process (their actors are this
    process's: in a Serve replica, in its placement group) for `config` as resolved."""
    from cluster.ray_executor import RayExecutor

    return RayExecutor(config)


class AsyncEngine:
    """The engine's step loop runs apart from the callers; callers never wait for a step.

    Callers post commands (add, abort) that the loop applies between steps, and the loop hands
    each step's outputs to each caller's event loop in one callback. So an asyncio caller never
    blocks on a step, and a step costs one cross-thread wake-up per event loop, not one per
    request.

    Where the loop runs: on a thread of this process (default), or, with `own_process`, in a
    process of its own (`cluster.engine_process`) where the executor allows it, so that the
    caller's threads (a Serve replica's) and the engine never wait for one interpreter lock.
    The callers' event loop then reads the engine process's messages itself (`_LoopReader`,
    attached by the first call on a loop) and puts each output in its caller's queue; callers on
    another running loop get theirs through that loop. `engine` (the `LLMEngine`) is reachable
    in the thread mode only.
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
        self._reader: _LoopReader | None = None  # reads self._process on a callers' loop
        self._reader_lock = threading.Lock()
        self._ranks = None  # TP > 1 in a process of its own: the Ray ranks it steps (ours)
        self._process_steps_ranks = False  # ... and so every engine process it starts
        self._own_process = own_process and runs_in_own_process(config)
        if sys.getswitchinterval() > GIL_SWITCH_INTERVAL_S:
            sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)  # process-wide: a serving process
        ranks = None
        if self._own_process and executor_kind(config.executor, config.tp_size) == "ray":
            ranks = _start_ranks(checked_config(config)[1])
            if ranks.transport != "socket":
                logger.info(
                    "ranks on other nodes (steps by %s): the engine runs on a thread",
                    ranks.transport,
                )
                self._own_process = False
        if self._own_process:
            self._process_steps_ranks = ranks is not None
            self._start_process(config, ranks)
            self.engine = None
            self._tokenizer = None
        else:
            if own_process and ranks is None:
                logger.info("the %s executor runs the engine on a thread", config.executor)
            try:
                self.engine = LLMEngine(config, executor=ranks)
            except BaseException:
                if ranks is not None:
                    ranks.shutdown()
                raise
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
    def rank_actors(self) -> list:
        """The Ray actors of the engine's ranks (none for an executor without)."""
        if self._ranks is not None:
            return list(self._ranks.workers)
        return list(getattr(self.engine.executor, "workers", [])) if self.engine else []

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

    # --- the receiving side (engine in its own process) ------------------------------------------

    def _start_process(self, config: EngineConfig, ranks=None) -> None:
        """`ranks`: a RayExecutor whose loaded ranks the engine process is to step (TP > 1);
        they are then this object's, killed with the engine."""
        self._ranks = ranks
        try:
            loaded = ranks.hand_off() if ranks is not None else None
            self._process = EngineProcess(config, self.stream_chunks_per_s, loaded)
        except BaseException:
            self._stop_ranks()
            raise
        self._frames = self._process.open_reader()
        self._info = self._process.info
        self._stats = self._info.stats
        self._probes: dict[str, asyncio.Future] = {}

    def _read_here(self) -> None:
        """Make sure the engine process's messages are read where this caller (on the running
        loop) gets them: a reader is attached to this loop unless one reads on it, or on another
        loop that runs, already (one that ended gives its place up). Called before any command
        goes: a message only ever answers one."""
        loop = asyncio.get_running_loop()
        with self._reader_lock:  # two loops' callers at once must not both attach one
            reader = self._reader
            if reader is not None:
                if reader.serves(loop, self._process):
                    return
                if reader.process is self._process:
                    if reader.ended:
                        return  # nothing more will come (the callers were failed then)
                    reader.detach(close=False)  # its loop ended or stopped: the frames move on
                else:  # a process restart() replaced
                    reader.detach(close=True)
            self._reader = _LoopReader(
                loop, self._frames, self._process, self._on_message, self._on_eof
            )

    def _reads_on(self, loop: asyncio.AbstractEventLoop) -> bool:
        """Whether a caller on `loop` can wait for the engine's messages without looking
        (`_wait`): the engine runs on a thread, or `loop` reads its process's messages."""
        reader = self._reader
        return not self._own_process or (reader is not None and reader.loop is loop)

    async def _wait(self, make):
        """`await make()` (a fresh awaitable per call) for a caller of the engine process. Off
        the reading loop it looks every READER_CHECK_S whether that loop still reads; if not,
        the reading moves here (`_read_here`)."""
        while True:
            if self._reads_on(asyncio.get_running_loop()):
                return await make()
            try:
                return await asyncio.wait_for(make(), READER_CHECK_S)
            except asyncio.TimeoutError:
                self._read_here()

    def _on_message(self, message: tuple) -> None:
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

    def _on_eof(self, process: EngineProcess) -> None:
        if not self._stopping and process is not self._retiring:
            self._lost(process)

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
        self._read_here()
        try:
            self._process.send(("command", command))
        except OSError:  # the process is gone: its reader fails what was in flight
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
        here = _running_loop()  # the reading loop's own callers get theirs at once
        for loop, items in by_loop.items():
            if loop is here:
                _put_all(items)
                continue
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
        loop = asyncio.get_running_loop()
        self._subscribers[request_id] = _Subscriber(loop, queue, cumulative)
        arrived_s = time.perf_counter()
        last_stamp_s: float | None = None
        finished = False
        try:
            self._post(Add(request_id, prompt_token_ids, params, stream))
            while True:
                if self._reads_on(loop):
                    item: _Delivery | Refusal = await queue.get()
                else:
                    item = await self._wait(queue.get)
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
            await self._wait(lambda: asyncio.shield(done))

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
            self._read_here()
            self._process.send(("probe", token))
            error = await self._wait(lambda: asyncio.shield(future))
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
            self._retiring = self._process  # its reader, reading EOF, fails nobody now
            if self._reader is None:  # never read: nobody else will close its frames
                self._frames.close()
            self._retiring.stop()
            ranks = None
            if self._process_steps_ranks:  # new ranks, once the old ones are gone
                self._stop_ranks()
                ranks = _start_ranks(self._info.config)
            self._start_process(self._info.config, ranks)
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

    def _stop_process(self) -> None:
        self._process.stop()
        self._stop_ranks()

    def _stop_ranks(self) -> None:
        ranks, self._ranks = self._ranks, None
        if ranks is not None:
            ranks.shutdown()

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
            await asyncio.get_running_loop().run_in_executor(None, self._stop_process)
            reader = self._reader
            if reader is not None:
                reader.detach(close=True)
            if reader is None or reader.frames is not self._frames:
                self._frames.close()
            return
        self._wakeup.set()
        self._thread.join(timeout=10)
        with self._lock:
            self.engine.shutdown()
