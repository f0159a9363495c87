"""Collectives over the TP group; identity when TP=1.

On a simulated rank (ParallelState.simulated) nothing is sent: each call is recorded, and its
result has the shape and dtype the real collective's has, so what follows costs what it would.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from parallel.state import ParallelState, get_parallel_state


def _simulated(state: ParallelState, op: str, x: torch.Tensor) -> bool:
    if state.simulated:
        state.simulated_collectives.append((op, tuple(x.shape), x.dtype))
    return state.simulated


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """In place: the sum over the TP ranks (a simulated rank: its own partial)."""
    state = get_parallel_state()
    if state.tp_size == 1 or _simulated(state, "all_reduce", x):
        return x
    dist.all_reduce(x, group=state.tp_group)
    return x


def tp_all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Every rank's x side by side (a simulated rank: its own x, tp_size times)."""
    state = get_parallel_state()
    if state.tp_size == 1:
        return x
    if _simulated(state, "all_gather", x):
        return torch.cat([x] * state.tp_size, dim=-1)
    parts = [torch.empty_like(x) for _ in range(state.tp_size)]
    dist.all_gather(parts, x.contiguous(), group=state.tp_group)
    return torch.cat(parts, dim=-1)


def tp_broadcast(x: torch.Tensor, src_tp_rank: int = 0) -> torch.Tensor:
    """In place: every TP rank ends with src's tensor (top-k indices, sampled tokens); a
    simulated rank keeps its own."""
    state = get_parallel_state()
    if state.tp_size == 1 or _simulated(state, "broadcast", x):
        return x
    src = dist.get_global_rank(state.tp_group, src_tp_rank) if state.tp_group else src_tp_rank
    dist.broadcast(x, src=src, group=state.tp_group)
    return x


def tp_compute_on_one_rank(
    compute,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
    src_tp_rank: int = 0,
) -> torch.Tensor:
    """`compute()` on TP rank src only; the other ranks skip it and receive its result.

    Every rank must know the result's shape and dtype beforehand (top-k: [T, index_topk] int32).
    A simulated rank must be the source: it has no one to receive from.
    """
    state = get_parallel_state()
    if state.tp_size == 1:
        return compute()
    if state.tp_rank == src_tp_rank:
        out = compute()
        if tuple(out.shape) != tuple(shape) or out.dtype != dtype:
            raise ValueError(f"computed {tuple(out.shape)} {out.dtype}, declared {shape} {dtype}")
        out = out.contiguous()
    elif state.simulated:
        raise ValueError(
            f"simulated TP rank {state.tp_rank} would receive from rank {src_tp_rank}: "
            "simulate the source rank"
        )
    else:
        out = torch.empty(shape, dtype=dtype, device=device)
    return tp_broadcast(out, src_tp_rank)
