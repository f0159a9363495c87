"""The engine in a process of its own: its step loop never shares a GIL with its caller.

Why: in a Serve replica the engine's loop thread (scheduling, the model runner's host work,
detokenizing) and the replica's own threads (Ray's receiving and sending of calls, Serve's event
loops) took turns on one interpreter lock. On the H200 (tiny model, 128 requests not streamed)
a call from the ingress waited ~150 ms at p50 for the replica to take it, and the engine ran
each request a third slower than it does alone. This is the split every fast serving engine
makes: the front (HTTP, Serve, pacing of streams) in one process, the step loop in another, one
message per step between them.

    EngineProcess(config)           starts `python -m cluster.engine_process FD`, sends it the
                                    config, waits until its engine is loaded and warm
    .send(("add" | "abort", ...))   commands, applied between two steps
    .open_reader().read()           what arrived, never waiting: one message per step ("step",
                                    outputs, aborted ids, stats or None, dead reason or None);
                                    ("probe", token, error)

The two ends talk over a socketpair (pickled messages: `multiprocessing.connection`'s framing).
The caller reads them on its event loop (`FrameReader`, an `add_reader` callback), where they
are used: no thread between the socket and the loop. Outputs
cross as deltas (`cluster.outputs.make_request_delta`: tuples, without the fields that grow
with the request); the caller rebuilds the rest (`cluster.outputs.CumulativeOutput`). If this
process dies the other end reads EOF; if the caller dies this process exits within a second.

The Ray executor's ranks (TP > 1) are actors of the replica's placement group, which a process
outside Ray cannot place: the replica starts and loads them and hands their connected step
sockets to this process (`ranks`: cluster/step_sockets.py), which steps them. Ranks on other
nodes (no socket to them) keep the engine on a thread of the replica.
"""

from __future__ import annotations

import logging
import os
import queue
import select
import socket
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from typing import Any

from cluster.config import EngineConfig

logger = logging.getLogger(__name__)

# The engine process sends its stats this often while requests run (and whenever one ends).
STATS_PERIOD_S = 0.25
# How long an idle engine process waits for a command before it looks again.
IDLE_POLL_S = 0.5
# How often the engine process checks that its caller is still alive.
ORPHAN_CHECK_S = 1.0


def runs_in_own_process(config: EngineConfig) -> bool:
    """Whether `config`'s engine can run in an engine process (see the module doc): any but
    Ray ranks stepped by a transport other than their sockets (for "auto", known once they are
    placed: `RayExecutor.transport`)."""
    from cluster.executor import executor_kind

    if executor_kind(config.executor, config.tp_size) != "ray":
        return True
    return config.step_transport in ("auto", "socket")


@dataclass(frozen=True)
class EngineInfo:
    """What the caller needs of an engine it cannot reach into."""

    config: EngineConfig  # resolved: the context and draft length chosen
    warm_up: Any  # workers.worker.WarmUp
    max_model_len: int
    sampling_defaults: dict
    stats: Any  # cluster.engine.EngineStats when it was ready (None: not sent)


class _Writer:
    """Writes pickled messages to `sock` as `multiprocessing.connection.Connection.recv` reads
    them, in order, without ever blocking the caller. A message goes out on the caller's thread
    when nothing is queued and the socket takes it whole (a command is a few hundred bytes); what
    the socket does not take, and everything after it until that is written, goes to a thread of
    its own. Why not always the thread: handing each command over cost ~1 ms on a busy event
    loop's process (the thread waits for the GIL), on the path of every request to the engine."""

    _MAX_FRAME = 0x7FFFFFFF  # Connection's 4-byte length (a 128k-token prompt is ~0.6 MB)

    def __init__(self, sock: socket.socket):
        self._sock = sock
        self._lock = threading.Lock()
        self._queued = 0  # frames the thread has yet to write
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.broken = False  # a write failed: the peer is gone
        self._thread = threading.Thread(
            target=self._write_queued, name="engine-sender", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def send(self, message) -> None:
        """Raises BrokenPipeError once a write found the peer gone."""
        if self.broken:
            raise BrokenPipeError("the engine process is gone")
        payload = ForkingPickler.dumps(message)  # as Connection.send pickles (a memoryview)
        if payload.nbytes > self._MAX_FRAME:
            raise ValueError(f"a {payload.nbytes}-byte message to the engine process")
        frame = struct.pack("!i", payload.nbytes) + payload  # Connection's framing, one copy
        with self._lock:
            if not self._queued:
                try:
                    sent = self._sock.send(frame, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    sent = 0
                except OSError as e:
                    self.broken = True
                    raise BrokenPipeError("the engine process is gone") from e
                if sent == len(frame):
                    return
                frame = frame[sent:]
            self._queued += 1
            self._outbox.put(frame)

    def stop(self) -> None:
        """The thread ends (after what it holds is written, or a write failed)."""
        self._outbox.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def close(self) -> None:
        self._sock.close()

    def _write_queued(self) -> None:
        while (frame := self._outbox.get()) is not None:
            try:
                self._sock.sendall(frame)
            except OSError:
                self.broken = True
                return
            with self._lock:
                self._queued -= 1


class FrameReader:
    """Reads messages framed as `Connection.send` frames them (a 4-byte big-endian length, or -1
    and an 8-byte one, then the pickle) without ever waiting: `read()` takes what the socket
    holds and returns the whole messages in it; a message not yet whole waits in the buffer for
    the next read. For an event loop's reader callback: a large message arrives over several
    callbacks while the loop goes on with other work."""

    _CHUNK = 1 << 18

    def __init__(self, fd: int):
        self._sock = socket.socket(fileno=os.dup(fd))  # its own descriptor: it closes alone
        self._buffer = bytearray()
        self._eof = False

    def fileno(self) -> int:
        return self._sock.fileno()

    def read(self) -> list:
        """The messages that arrived whole; EOFError once the peer is gone and every whole
        message before that was returned."""
        while not self._eof:
            try:  # MSG_DONTWAIT: the descriptor stays blocking for the writer's thread
                chunk = self._sock.recv(self._CHUNK, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:  # reset: gone as well
                chunk = b""
            if not chunk:
                self._eof = True
                break
            self._buffer += chunk
            if len(chunk) < self._CHUNK:
                break  # most likely all there was; the loop calls again if not
        messages = self._take()
        if self._eof and not messages:
            raise EOFError("the engine process closed its end")
        return messages

    def _take(self) -> list:
        buffer, pos, messages = self._buffer, 0, []
        while len(buffer) - pos >= 4:
            (size,) = struct.unpack_from("!i", buffer, pos)
            header = 4
            if size == -1:  # Connection's frame for a message over 2 GiB
                if len(buffer) - pos < 12:
                    break
                (size,) = struct.unpack_from("!Q", buffer, pos + 4)
                header = 12
            end = pos + header + size
            if len(buffer) < end:
                break
            messages.append(ForkingPickler.loads(buffer[pos + header : end]))
            pos = end
        del buffer[:pos]
        return messages

    def close(self) -> None:
        self._sock.close()


class EngineStartError(RuntimeError):
    """The engine process failed before it was ready (its traceback is in the message)."""


class EngineProcess:
    """The caller's end: starts the engine process and talks to it. `send` may be called from
    any thread and never blocks (`_Writer`): an event loop posting a long prompt (a 128k-token
    prompt pickles to ~0.6 MB, more than a socket buffer) does not wait for the engine to finish
    a step and read it. Its messages are read through `open_reader()`, never waiting either."""

    def __init__(self, config: EngineConfig, stream_chunks_per_s: float = 0.0, ranks=None):
        """`ranks`: a cluster.step_sockets.LoadedRanks whose sockets go to the engine process
        (its executor), closed here once it has them."""
        mine, theirs = socket.socketpair()
        env = dict(os.environ)
        # The engine process imports what this one can (a Ray worker's sys.path is not only
        # PYTHONPATH: runtime environments and working directories add to it).
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        started = time.perf_counter()
        try:
            self._process = subprocess.Popen(
                [sys.executable, "-m", "cluster.engine_process", str(theirs.fileno())],
                pass_fds=(theirs.fileno(), *(ranks.fds if ranks else ())),
                env=env,
            )
        finally:
            theirs.close()
            if ranks is not None:
                ranks.close()  # the engine process's now: a rank reads EOF when it exits
        self._conn = Connection(os.dup(mine.fileno()))  # reads
        self._writer = _Writer(mine)
        self._writer.start()
        self.send(("config", config, stream_chunks_per_s, ranks))
        try:
            message = self._conn.recv()
        except (EOFError, OSError):
            message = ("failed", f"the engine process exited with code {self._process.wait()}")
        if message[0] != "ready":
            self.kill()
            raise EngineStartError(message[1])
        self.info: EngineInfo = message[1]
        logger.info(
            "engine process %d ready in %.1f s", self._process.pid, time.perf_counter() - started
        )

    @property
    def pid(self) -> int:
        return self._process.pid

    def send(self, message: tuple) -> None:
        """Send `message` without blocking (see `_Writer`); raises BrokenPipeError once a write
        found the engine process gone (before that, its loss shows as EOF to a reader)."""
        self._writer.send(message)

    def open_reader(self) -> FrameReader:
        """A reader of this process's messages (one at a time: a message read by one reader is
        gone for any other). The caller closes it; it outlives `kill()`, which closes only this
        object's own ends, so an event loop that watches it removes it before it is closed."""
        return FrameReader(self._conn.fileno())

    def exit_status(self) -> str:
        code = self._process.poll()
        return "still running" if code is None else f"exited with code {code}"

    def stop(self, timeout_s: float = 10.0) -> None:
        """Ask the engine to shut down (its workers, its memory), then make sure it is gone."""
        try:
            self.send(("shutdown",))
            self._process.wait(timeout=timeout_s)
        except (OSError, subprocess.TimeoutExpired):
            pass
        self.kill()

    def kill(self) -> None:
        if self._process.poll() is None:
            self._process.kill()
            self._process.wait()
        self._writer.stop()
        self._writer.close()
        self._conn.close()


# --- the engine process's side -------------------------------------------------------------------


def _exit_when_orphaned(parent_pid: int) -> None:
    """End this process once the one that started it is gone (it was reparented), whatever the
    step loop is doing. (PR_SET_PDEATHSIG would fire when the starting *thread* ends, and a
    replica may start its engine from a pool thread.)"""
    while os.getppid() == parent_pid:
        time.sleep(ORPHAN_CHECK_S)
    os._exit(1)


class Readable:
    """Whether `conn` has a message to read: one poll(2) on its socket, registered once.
    `Connection.poll` builds, registers and drops a selector on every call, which costs the
    step loop a few microseconds a turn, twice (poll.poll is where the platform has it)."""

    def __init__(self, conn: Connection):
        self._conn = conn
        self._poller = select.poll() if hasattr(select, "poll") else None
        if self._poller is not None:
            self._poller.register(conn.fileno(), select.POLLIN)

    def __call__(self, timeout_s: float) -> bool:
        if self._poller is None:
            return self._conn.poll(timeout_s)
        # A closed peer reads as ready (POLLHUP): recv then raises EOFError, as it should.
        return bool(self._poller.poll(timeout_s * 1000.0))


def _serve(conn: Connection, loop) -> None:
    """Turn after turn: read the commands that came, run a turn, send what it gave."""
    from cluster.engine_loop import Refusal, portable
    from cluster.outputs import Delta

    readable = Readable(conn)
    last_stats_s = 0.0
    while True:
        commands, probes = [], []
        timeout = 0.0 if loop.busy else IDLE_POLL_S
        while readable(timeout):
            message = conn.recv()
            timeout = 0.0
            kind = message[0]
            if kind == "shutdown":
                return
            if kind == "probe":
                probes.append(message[1])
            else:  # "command": an Add or an Abort
                commands.append(message[1])
        due, aborted = loop.turn(commands)
        for token in probes:
            try:
                loop.engine.check_health()
                conn.send(("probe", token, None))
            except Exception as e:  # noqa: BLE001 - the caller's probe fails with it
                conn.send(("probe", token, f"{type(e).__name__}: {e}"))
        now_s = time.monotonic()
        stats = None
        # Also whenever a request ends, so that the caller's figures agree with its outputs.
        ended = aborted or any(  # a delivery: (request id, delta, stamps)
            not isinstance(d, Refusal) and d[1][Delta.FINISHED] for d in due
        )
        if ended or now_s - last_stats_s >= STATS_PERIOD_S:
            stats, last_stats_s = loop.engine.stats(), now_s
        if due or aborted or stats is not None:
            sent = [
                Refusal(d.request_id, portable(d.error)) if isinstance(d, Refusal) else d
                for d in due
            ]
            conn.send(("step", sent, aborted, stats, loop.dead))


def main(argv: list[str]) -> int:
    threading.Thread(
        target=_exit_when_orphaned, args=(os.getppid(),), name="orphan-check", daemon=True
    ).start()
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    conn = Connection(int(argv[1]))
    _, config, stream_chunks_per_s, ranks = conn.recv()
    try:
        from cluster.engine import LLMEngine
        from cluster.engine_loop import EngineLoop
        from workers.long_lived import freeze_long_lived, thaw

        executor = None
        if ranks is not None:  # loaded by the caller; stepped from here over their sockets
            from cluster.step_sockets import SocketExecutor

            executor = SocketExecutor(ranks, config.step_timeout_s)
        # deltas_only: the caller keeps the cumulative fields
        engine = LLMEngine(config, deltas_only=True, executor=executor)
    except BaseException as e:  # noqa: BLE001 - the caller raises it
        import traceback

        logger.exception("the engine failed to start")
        conn.send(("failed", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        return 1
    freeze_long_lived("engine process")
    info = EngineInfo(
        engine.config,
        engine.warm_up,
        engine.max_model_len,
        engine.sampling_defaults,
        engine.stats(),
    )
    conn.send(("ready", info))
    try:
        _serve(conn, EngineLoop(engine, stream_chunks_per_s))
    except (EOFError, OSError):  # the caller is gone
        pass
    finally:
        engine.shutdown()
        thaw()
    return 0


if __name__ == "__main__":
    # Through the module's own name, so that what it sends (EngineInfo) unpickles as
    # cluster.engine_process's, not as this __main__'s.
    from cluster.engine_process import main as _main

    sys.exit(_main(sys.argv))
