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
the GIL released, so the Serve replica's event loop beside a TP > 1 engine keeps its thread.

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
from multiprocessing.connection import Connection

from cluster.executor import WorkerError
from workers.step_codec import StepEncoder
from workers.worker_actor import RANK_HEADER

MAX_FOLDER_CHARS = 90  # AF_UNIX paths end at 107 bytes on Linux (103 on macOS), "/steps" included


class StepSockets:
    def __init__(self, workers: list, timeout_s: float):
        self._conns: list[Connection] = []
        folder = tempfile.mkdtemp(prefix="mtpserve-steps-")
        if len(folder) > MAX_FOLDER_CHARS:  # a long TMPDIR: a socket's path has ~107 bytes
            os.rmdir(folder)
            folder = tempfile.mkdtemp(prefix="mtpserve-steps-", dir="/tmp")
        address = os.path.join(folder, "steps")
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            try:
                server.bind(address)
            except OSError as e:
                raise WorkerError(f"the step socket {address} could not be opened: {e}") from e
            server.listen(len(workers))
            server.settimeout(0.2)
            loops = [w.serve_steps.remote(address) for w in workers]
            by_rank = self._accept(server, loops, len(workers), timeout_s)
        except BaseException:
            for conn in self._conns:
                conn.close()
            raise
        finally:
            server.close()
            shutil.rmtree(folder, ignore_errors=True)  # connected sockets outlive their path
        self._conns = [by_rank[rank] for rank in range(len(workers))]
        self._encoder = StepEncoder()  # each request's SamplingSpec once (workers.step_codec)

    def _accept(self, server: socket.socket, loops: list, count: int, timeout_s: float) -> dict:
        """Every rank's connection, by rank; a loop that ends first (its actor died, or it
        could not connect) or the deadline passing is a WorkerError."""

        by_rank: dict[int, Connection] = {}
        deadline = time.monotonic() + timeout_s
        while len(by_rank) < count:
            try:
                sock, _ = server.accept()
            except TimeoutError:
                self._check_waiting(loops, deadline, count - len(by_rank), timeout_s)
                continue
            sock.settimeout(None)
            conn = Connection(sock.detach())
            self._conns.append(conn)  # closed on failure
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
        payload = self._encoder.encode(step)
        try:
            for conn in self._conns:
                conn.send_bytes(payload)
        except OSError as e:  # its end is closed: the rank's process is gone
            raise WorkerError(f"a worker actor died: sending the step failed ({e})") from e
        deadline = time.monotonic() + timeout_s
        answers = []
        for rank, conn in enumerate(self._conns):
            try:
                if not conn.poll(max(deadline - time.monotonic(), 0.0)):
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
