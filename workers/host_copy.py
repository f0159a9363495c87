"""A device tensor's copy to the host, started now and waited for later.

The runner reads three things back each step (the argmax, the sampler's draws, the MTP proposal),
each while the device may still be running work queued behind it: the copy goes to pinned memory
without blocking, and an event recorded behind it says when it is done.

The event is recorded on the tensor's own device's current stream, named by its index.
`torch.cuda.Event.record()` with no stream resolves the current device through torch's
device-type discovery (`torch.cuda.is_available()`, an NVML query, environment reads) on every
call: ~6% of a one-request step's host time on the tiny model (BENCHMARKS.md, session 28).
"""

from __future__ import annotations

import torch


def start_copy_to_host(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """-> (the host copy, the event of the copy: `synchronize()` before reading it). A snapshot:
    device work queued after this call may overwrite `tensor` without changing the copy. A
    tensor not on CUDA is cloned at once, with no event."""
    if not tensor.is_cuda:
        return tensor.clone(), None
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record(torch.cuda.current_stream(tensor.device.index))
    return host, copied
