"""Process-group setup for one engine's ranks.

Rendezvous, in two calls the executor makes on the ranks:
  1. rank 0 `open_store()`: a TCP store on a free port of its own host; returns "host:port";
  2. every rank `init_distributed(rank, ..., store_address)`, all launched before any is awaited
     (init_process_group blocks until world_size ranks have joined: awaiting them one by one
     deadlocks).

Every collective of the group carries the group's timeout, so a rank that dies or hangs turns
into an error on the others instead of a hang.
"""

from __future__ import annotations

import logging
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from parallel.state import ParallelState, set_parallel_state

logger = logging.getLogger(__name__)

_STORE: dist.TCPStore | None = None  # rank 0 keeps the store it serves alive


def node_ip() -> str:
    """This host's address as the other ranks (possibly on other nodes) see it."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))  # no packet is sent; picks the outward interface
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def open_store(world_size: int, timeout_s: float) -> str:
    """On rank 0: serve the rendezvous store on a free port; returns its "host:port"."""
    global _STORE
    host = node_ip()
    # Port 0: the OS picks a free port and the store reports it, so no probe-then-bind race.
    _STORE = dist.TCPStore(
        host,
        0,
        world_size,
        is_master=True,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )
    return f"{host}:{_STORE.port}"


def default_backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def init_distributed(
    rank: int,
    world_size: int,
    tp_size: int,
    ep_size: int,
    store_address: str,
    device: torch.device,
    timeout_s: float,
) -> ParallelState:
    """Join the group and make it this process's parallel state (before the model is built).

    Today the world is one TP group (ranks 0..tp_size-1); EP lives inside it (see ParallelState).
    """
    if world_size != tp_size:
        raise ValueError(f"world_size={world_size} must equal tp_size={tp_size}")
    timeout = timedelta(seconds=timeout_s)
    host, port = store_address.rsplit(":", 1)
    if rank == 0 and _STORE is not None:
        store = _STORE
    else:
        store = dist.TCPStore(host, int(port), world_size, is_master=False, timeout=timeout)
    backend = default_backend(device)
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world_size, timeout=timeout, **kwargs
    )
    state = ParallelState(tp_rank=rank, tp_size=tp_size, ep_size=ep_size, tp_group=dist.group.WORLD)
    set_parallel_state(state)
    logger.info(
        "rank %d/%d joined %s group (tp=%d ep=%d) via %s",
        rank,
        world_size,
        backend,
        tp_size,
        ep_size,
        store_address,
    )
    return state


def destroy_distributed() -> None:
    global _STORE
    if dist.is_initialized():
        dist.destroy_process_group()
    _STORE = None
    set_parallel_state(ParallelState())
