"""workers.host_copy: a copy to the host that device work queued after it cannot change."""

from __future__ import annotations

import pytest
import torch

from workers.host_copy import start_copy_to_host


def test_cpu_copy_is_a_snapshot():
    tensor = torch.arange(6).view(2, 3)
    host, copied = start_copy_to_host(tensor)
    assert copied is None
    tensor.fill_(-1)  # what work queued after the call may do to its input
    assert host.tolist() == [[0, 1, 2], [3, 4, 5]]


@pytest.mark.gpu
def test_cuda_copy_is_pinned_and_a_snapshot_once_synchronized():
    device = torch.device("cuda", torch.cuda.current_device())
    tensor = torch.arange(1 << 20, device=device)
    host, copied = start_copy_to_host(tensor)
    assert host.is_pinned() and host.device.type == "cpu"
    tensor.fill_(-1)  # queued behind the copy on the same stream
    copied.synchronize()
    assert torch.equal(host, torch.arange(1 << 20))
