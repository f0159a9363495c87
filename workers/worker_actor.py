"""One rank as a Ray actor: a Worker plus its place in the process group.

The executor drives the ranks through this lifecycle (each a remote call):
  open_store()          rank 0 only: the rendezvous store's "host:port"
  init_distributed(a)   every rank, all launched at once (see parallel.distributed)
  load()                build this rank's shard of the model and its KV cache
  execute(step)         every step, SPMD on all ranks; only rank 0 returns the StepOutput
  ping()                health

This module does not import Ray: the executor wraps the class with `ray.remote(...).options(...)`,
so the same class also runs in a plain process (tests, benchmarks).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from parallel.distributed import destroy_distributed, init_distributed, open_store
from workers.batch import StepInput, StepOutput
from workers.worker import Worker, resolve_device

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerSpec:
    """What a rank needs to start; built by the executor from the engine config."""

    model: str  # checkpoint directory
    tp_size: int
    ep_size: int
    device: str  # "auto" | "cpu" | "cuda"
    dtype: str
    num_kv_blocks: int | None
    block_size_tokens: int
    gpu_memory_utilization: float
    cpu_threads: int | None
    topk_src_rank: int | None  # see workers.model.Indexer.src_tp_rank
    collective_timeout_s: float  # every collective of the group; a hung peer becomes an error
    cuda_graph_max_batch: int = 0  # 0: eager decode steps
    max_model_len: int = 8192
    max_num_seqs: int = 64
    indexer_numerics: str = "exact"


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
        s = self.spec
        self.worker = Worker(
            s.model,
            self.device.type,
            s.dtype,
            s.num_kv_blocks,
            s.block_size_tokens,
            enable_mtp=True,
            gpu_memory_utilization=s.gpu_memory_utilization,
            cpu_threads=s.cpu_threads,
            topk_src_rank=s.topk_src_rank,
            cuda_graph_max_batch=s.cuda_graph_max_batch,
            max_model_len=s.max_model_len,
            max_num_seqs=s.max_num_seqs,
            indexer_numerics=s.indexer_numerics,
        )
        return self.worker.num_kv_blocks, self.worker.has_mtp

    def execute(self, step: StepInput) -> StepOutput | None:
        output = self.worker.execute(step)
        return output if self.rank == 0 else None

    def ping(self) -> int:
        return os.getpid()

    def run(self, fn, *args):
        """fn(self, *args) in this rank's process: lets tests and benchmarks look inside a rank."""
        return fn(self, *args)

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def shutdown(self) -> None:
        self.worker = None
        destroy_distributed()
