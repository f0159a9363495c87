"""The Ray executor's socket step transport: each step to every rank over a Unix socket.

The ranks are Ray actors on this process's node. At the first step each starts a loop
(`WorkerActor.serve_steps`, one of its two actor threads) that connects to a socket this
process listens on, then reads a step, runs it and answers it until the socket closes. A step
is encoded once (pickled, each request's SamplingSpec only with its first step:
workers.step_codec) and written to every rank's connection; the answer is every rank's (rank 0's
StepOutput, None from the others, or a StepFailure), read once every rank has finished the step,
as through the compiled graph.

Why not only the compiled graph: its round trip cost 0.24 ms (TP=1) and 0.28 ms (TP=2) on the
H200 host with an empty step, and 0.07 / 0.18 ms on the 2-core CPU box, against 0.035 / 0.058
ms for the same messages over a Unix socket between two processes there (BENCHMARKS.md). A
socket also needs no polling: an idle rank and a waiting coordinator block in the kernel, with
the GIL released.

In a Serve replica the step loop runs in the engine process (cluster/engine_process.py), a
process outside Ray: the replica starts and loads the ranks and connects their sockets
(`StepSockets.connect`, Ray calls), then hands the connected sockets over (`LoadedRanks`, passed
as descriptors) to the engine process, which steps, warms up and checks the ranks over them
(`SocketExecutor`) while the replica keeps the actors. So at TP > 1, as at TP = 1, the replica's
event loop and the engine's step loop never wait for one interpreter lock.

A rank that dies closes its end: the coordinator reads the end of file at once and raises a
WorkerError. A rank that hangs is a WorkerError after `step_timeout_s`. The socket's directory
is made for this executor alone, readable by this user only (mode 0700): no other user's
process can connect to it, and nothing listens beyond this machine.
"""

from __future__ import annotations

import os
import pickle
import shutil
import socket
import tempfile
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection

from cluster.engine_process import Readable
from cluster.executor import Executor, WorkerError, first_answer
from cluster.ray_executor import HEALTH_TIMEOUT_S, STARTUP_TIMEOUT_S
from workers.batch import StepInput, StepOutput
from workers.step_codec import RankCall, StepEncoder
from workers.worker_actor import RANK_HEADER

MAX_FOLDER_CHARS = 90  # AF_UNIX paths end at 107 bytes on Linux (103 on macOS), "/steps" included


class StepSockets:
    """A connected socket to every rank, in rank order: steps and RankCalls out, answers in.
    Needs no Ray once connected, so the ranks' sockets can go to the engine process (a process
    outside Ray: cluster/engine_process.py) while the replica keeps the actors."""

    def __init__(self, conns: list[Connection]):
        self._conns = conns
        # One poll(2) per connection, registered once (Connection.poll builds a selector a call).
        self._readable = [Readable(conn) for conn in conns]
        self._encoder = StepEncoder()  # each request's SamplingSpec once (workers.step_codec)

    @classmethod
    def connect(cls, workers: list, timeout_s: float) -> StepSockets:
        """Start every rank's step loop (`WorkerActor.serve_steps`, a Ray call) and accept their
        connections: a rank whose loop ends first, or the deadline passing, is a WorkerError."""
        folder = tempfile.mkdtemp(prefix="mtpserve-steps-")
        if len(folder) > MAX_FOLDER_CHARS:  # a long TMPDIR: a socket's path has ~107 bytes
            os.rmdir(folder)
            folder = tempfile.mkdtemp(prefix="mtpserve-steps-", dir="/tmp")
        address = os.path.join(folder, "steps")
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        accepted: list[Connection] = []
        try:
            try:
                server.bind(address)
            except OSError as e:
                raise WorkerError(f"the step socket {address} could not be opened: {e}") from e
            server.listen(len(workers))
            server.settimeout(0.2)
            loops = [w.serve_steps.remote(address) for w in workers]
            by_rank = cls._accept(server, loops, len(workers), timeout_s, accepted)
        except BaseException:
            for conn in accepted:
                conn.close()
            raise
        finally:
            server.close()
            shutil.rmtree(folder, ignore_errors=True)  # connected sockets outlive their path
        return cls([by_rank[rank] for rank in range(len(workers))])

    @classmethod
    def _accept(
        cls, server: socket.socket, loops: list, count: int, timeout_s: float, accepted: list
    ) -> dict:
        """Every rank's connection, by rank (each also put in `accepted`, which the caller
        closes on failure); a loop that ends first (its actor died, or it could not connect) or
        the deadline passing is a WorkerError."""

        by_rank: dict[int, Connection] = {}
        deadline = time.monotonic() + timeout_s
        while len(by_rank) < count:
            try:
                sock, _ = server.accept()
            except TimeoutError:
                cls._check_waiting(loops, deadline, count - len(by_rank), timeout_s)
                continue
            sock.settimeout(None)
            conn = Connection(sock.detach())
            accepted.append(conn)
            if not conn.poll(max(deadline - time.monotonic(), 0.0)):
                raise WorkerError("a rank connected and did not say which it is")
            (rank,) = RANK_HEADER.unpack(conn.recv_bytes())
            by_rank[rank] = conn
        return by_rank

    @staticmethod
    def _check_waiting(loops: list, deadline: float, missing: int, timeout_s: float) -> None:
        import ray

        ended, _ = ray.wait(loops, num_returns=1, timeout=0)
        if ended:
            try:
                ray.get(ended[0])
            except Exception as e:
                raise WorkerError(f"a rank's step loop failed to start: {e}") from e
            raise WorkerError("a rank's step loop ended before it connected")
        if time.monotonic() > deadline:
            raise WorkerError(f"{missing} rank(s) did not connect within {timeout_s:.0f}s")

    def execute(self, step, timeout_s: float) -> list:
        """Every rank's answer to `step`, in rank order."""
        return self._round_trip(self._encoder.encode(step), timeout_s)

    def call(self, name: str, *args, timeout_s: float) -> list:
        """Every rank's result of its method `name` (a RankCall), in rank order."""
        return self._round_trip(RankCall(name, args).encode(), timeout_s)

    def detach(self) -> list[int]:
        """The sockets' descriptors in rank order, now the caller's to pass on and close; this
        object holds none after."""
        fds = [os.dup(conn.fileno()) for conn in self._conns]
        self.close()
        return fds

    def _round_trip(self, payload: bytes, timeout_s: float) -> list:
        if not self._conns:
            raise WorkerError("the step sockets are closed")
        try:
            for conn in self._conns:
                conn.send_bytes(payload)
        except OSError as e:  # its end is closed: the rank's process is gone
            raise WorkerError(f"a worker actor died: sending the step failed ({e})") from e
        deadline = time.monotonic() + timeout_s
        answers = []
        for rank, (conn, readable) in enumerate(zip(self._conns, self._readable)):
            try:
                if not readable(max(deadline - time.monotonic(), 0.0)):
                    raise WorkerError(f"rank {rank} did not answer within {timeout_s:.0f}s")
                answers.append(pickle.loads(conn.recv_bytes()))
            except (EOFError, OSError) as e:
                raise WorkerError(f"a worker actor died: rank {rank} closed its socket") from e
        return answers

    def close(self) -> None:
        """The ranks' loops read the end of file and return."""
        for conn in self._conns:
            try:
                conn.close()
            except OSError:
                pass
        self._conns = []
        self._readable = []


@dataclass(frozen=True)
class LoadedRanks:
    """Ranks that the Serve replica started and loaded (`RayExecutor.hand_off`), for the engine
    process to step: their step sockets' descriptors in rank order (passed to that process,
    same numbers there) and what loading them told."""

    fds: tuple[int, ...]
    num_kv_blocks: int
    has_mtp: bool
    overlaps_steps: bool

    def close(self) -> None:
        """This process's copies: once the engine process holds them (or failed to start)."""
        for fd in self.fds:
            os.close(fd)


class SocketExecutor(Executor):
    """The engine process's executor for ranks it cannot reach through Ray: steps, the warm-up
    and health checks all over their step sockets. The replica that holds the actors kills them
    (`RayExecutor.shutdown`); closing the sockets here ends their step loops."""

    def __init__(self, ranks: LoadedRanks, step_timeout_s: float):
        self._sockets = StepSockets([Connection(fd) for fd in ranks.fds])
        self._step_timeout_s = step_timeout_s
        self.num_kv_blocks = ranks.num_kv_blocks
        self.has_mtp = ranks.has_mtp
        self.overlaps_steps = ranks.overlaps_steps

    def execute(self, step: StepInput) -> StepOutput:
        return first_answer(self._sockets.execute(step, self._step_timeout_s))

    def warm_up(self, num_draft_tokens: int, share_topk: bool):
        answers = self._sockets.call(
            "warm_up", num_draft_tokens, share_topk, timeout_s=STARTUP_TIMEOUT_S
        )
        return first_answer(answers)

    def check_health(self) -> None:
        first_answer(self._sockets.call("ping", timeout_s=HEALTH_TIMEOUT_S))

    def shutdown(self) -> None:
        self._sockets.close()
