"""One rank as a Ray actor: a Worker plus its place in the process group.

The executor drives the ranks through this lifecycle (each a remote call):
  open_store()          rank 0 only: the rendezvous store's "host:port"
  init_distributed(a)   every rank, all launched at once (see parallel.distributed)
  load()                build this rank's shard of the model and its KV cache
  warm_up(k, share)     every rank at once: capture the CUDA graphs before the engine is ready
  execute(step)         every step, SPMD on all ranks; only rank 0 returns the StepOutput
  answer(step)          the same, a failure returned as a StepFailure (the compiled step graph)
  serve_steps(address)  the socket transport's loop (cluster.step_sockets): read a step and
                        `answer` it, until the coordinator closes the socket; `warm_up` and
                        `ping` may come that way too (a workers.step_codec.RankCall)
  ping()                health

This module does not import Ray: the executor wraps the class with `ray.remote(...).options(...)`,
so the same class also runs in a plain process (tests, benchmarks).
"""

from __future__ import annotations

import logging
import os
import socket
import struct
from multiprocessing.connection import Connection

from parallel.distributed import destroy_distributed, init_distributed, open_store
from workers.batch import StepFailure, StepInput, StepOutput
from workers.long_lived import freeze_long_lived, thaw
from workers.step_codec import RankCall, StepDecoder, encode_answer
from workers.worker import WarmUp, Worker, WorkerSpec, resolve_device

logger = logging.getLogger(__name__)

RANK_HEADER = struct.Struct("!i")  # a rank's first message on its step socket: its rank
SOCKET_CALLS = frozenset({"warm_up", "ping"})  # what a RankCall on the step socket may name


class WorkerActor:
    def __init__(self, rank: int, spec: WorkerSpec):
        self.rank = rank
        self.spec = spec
        # Ray gives an actor with num_gpus=1 exactly one visible device: always local index 0.
        self.device = resolve_device(spec.device, 0)
        self.worker: Worker | None = None

    def open_store(self) -> str:
        return open_store(self.spec.tp_size, self.spec.collective_timeout_s)

    def init_distributed(self, store_address: str) -> int:
        s = self.spec
        init_distributed(
            self.rank,
            s.tp_size,
            s.tp_size,
            s.ep_size,
            store_address,
            self.device,
            s.collective_timeout_s,
        )
        return self.rank

    def load(self) -> tuple[int, bool]:
        """-> (num_kv_blocks this rank can hold, whether the checkpoint has an MTP layer)."""
        self.worker = Worker.from_spec(self.spec)
        return self.worker.num_kv_blocks, self.worker.has_mtp

    def warm_up(self, num_draft_tokens: int, share_topk: bool) -> WarmUp:
        warm = self.worker.warm_up(num_draft_tokens, share_topk)
        freeze_long_lived(f"rank {self.rank}")  # this process lives as long as the rank
        return warm

    def execute(self, step: StepInput) -> StepOutput | None:
        output = self.worker.execute(step)
        return output if self.rank == 0 else None

    def answer(self, step: StepInput) -> StepOutput | StepFailure | None:
        """`execute` for the transports where a rank must not raise (the compiled graph, the
        socket loop): a failure is an answer, and the coordinator decides."""
        try:
            return self.execute(step)
        except Exception as e:  # the driver decides (WorkerError with step_raised)
            logger.exception("step failed on rank %d", self.rank)
            return StepFailure(f"{type(e).__name__}: {e}")

    def serve_steps(self, address: str) -> None:
        """The socket step transport's loop, on one of the actor's threads for the engine's
        life: connect to the coordinator's Unix socket, say which rank this is, then answer
        each step it writes (blocking reads: an idle rank costs no CPU). Returns when the
        coordinator closes its end."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(address)
        decoder = StepDecoder()  # the requests' SamplingSpecs, sent once each
        with Connection(sock.detach()) as conn:
            conn.send_bytes(RANK_HEADER.pack(self.rank))
            while True:
                try:
                    message = decoder.decode(conn.recv_bytes())
                except EOFError:
                    return
                if isinstance(message, RankCall):
                    reply = self._socket_call(message)
                else:
                    reply = self.answer(message)
                conn.send_bytes(encode_answer(reply))

    def _socket_call(self, call: RankCall):
        """A RankCall's result, or its failure as a StepFailure (the coordinator raises it)."""
        if call.name not in SOCKET_CALLS:
            return StepFailure(f"no call {call.name!r} on the step socket")
        try:
            return getattr(self, call.name)(*call.args)
        except Exception as e:  # the coordinator decides
            logger.exception("%s failed on rank %d", call.name, self.rank)
            return StepFailure(f"{type(e).__name__}: {e}")

    def ping(self) -> int:
        return os.getpid()

    def run(self, fn, *args):
        """fn(self, *args) in this rank's process: lets tests and benchmarks look inside a rank."""
        return fn(self, *args)

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def shutdown(self) -> None:
        thaw()
        self.worker = None
        destroy_distributed()
