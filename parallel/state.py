"""The tensor-parallel and expert-parallel groups of this process.

A single process (TP=1, EP=1) needs no torch.distributed at all; every collective is then a no-op.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist


@dataclass
class ParallelState:
    tp_rank: int = 0
    tp_size: int = 1
    ep_size: int = 1
    tp_group: dist.ProcessGroup | None = None

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


_STATE = ParallelState()


def get_parallel_state() -> ParallelState:
    return _STATE


def set_parallel_state(state: ParallelState) -> None:
    global _STATE
    _STATE = state
