"""The tensor-parallel and expert-parallel groups of this process.

A single process (TP=1, EP=1) needs no torch.distributed at all; every collective is then a no-op.
So does a simulated rank: one process standing in for rank tp_rank of tp_size ranks (a benchmark
of one rank's shard, benchmarks/bench_rank_shard.py), whose collectives move nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class ParallelState:
    tp_rank: int = 0
    tp_size: int = 1
    ep_size: int = 1
    tp_group: dist.ProcessGroup | None = None
    # True: no group at all; modules take rank tp_rank's shapes of tp_size ranks and every
    # collective moves nothing (parallel/collectives.py says what each returns), appending
    # (op, shape of this rank's tensor, dtype) to `simulated_collectives` as it is called (so
    # once per eager call or capture; a CUDA graph's replays append nothing). The serving path
    # never sets it.
    simulated: bool = False
    simulated_collectives: list[tuple[str, tuple[int, ...], torch.dtype]] = field(
        default_factory=list
    )

    # Expert parallelism lives inside the TP group: the EP group splits the routed experts, and
    # the tp_size // ep_size ranks that share an expert split its intermediate dimension. One
    # all-reduce over the TP group then sums shared-expert and routed-expert partials together.
    @property
    def expert_tp_size(self) -> int:
        return self.tp_size // self.ep_size

    @property
    def expert_tp_rank(self) -> int:
        return self.tp_rank % self.expert_tp_size

    def __post_init__(self) -> None:
        if self.tp_size % self.ep_size:
            raise ValueError(f"ep_size={self.ep_size} must divide tp_size={self.tp_size}")
        self.ep_rank = self.tp_rank // self.expert_tp_size
        if self.simulated and self.tp_group is not None:
            raise ValueError("a simulated rank has no process group")


_STATE = ParallelState()


def get_parallel_state() -> ParallelState:
    return _STATE


def set_parallel_state(state: ParallelState) -> None:
    global _STATE
    _STATE = state
