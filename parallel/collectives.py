"""Collectives over the TP group; identity when TP=1."""

from __future__ import annotations

import torch
import torch.distributed as dist

from parallel.state import get_parallel_state


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    state = get_parallel_state()
    if state.tp_size == 1:
        return x
    dist.all_reduce(x, group=state.tp_group)
    return x


def tp_all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    state = get_parallel_state()
    if state.tp_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(state.tp_size)]
    dist.all_gather(parts, x.contiguous(), group=state.tp_group)
    return torch.cat(parts, dim=-1)


def tp_broadcast(x: torch.Tensor, src_tp_rank: int = 0) -> torch.Tensor:
    """In place: every TP rank ends with src's tensor (top-k indices, sampled tokens)."""
    state = get_parallel_state()
    if state.tp_size == 1:
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
    """
    state = get_parallel_state()
    if state.tp_size == 1:
        return compute()
    if state.tp_rank == src_tp_rank:
        out = compute()
        if tuple(out.shape) != tuple(shape) or out.dtype != dtype:
            raise ValueError(f"computed {tuple(out.shape)} {out.dtype}, declared {shape} {dtype}")
        out = out.contiguous()
    else:
        out = torch.empty(shape, dtype=dtype, device=device)
    return tp_broadcast(out, src_tp_rank)
