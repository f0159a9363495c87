"""Shared pieces of the kernel tests: where Triton can run, the per-dtype tolerance table.

CPU runs need TRITON_INTERPRET=1 (set before `kernels` is imported, as `make test` does); GPU
tests are marked `gpu` and skipped without CUDA.
"""

from __future__ import annotations

import os

import pytest
import torch

INTERPRETER = os.environ.get("TRITON_INTERPRET", "") == "1"
HAS_CUDA = torch.cuda.is_available()

# Triton kernels run here: under the interpreter (CPU tensors) or on a CUDA device.
needs_triton = pytest.mark.skipif(
    not (INTERPRETER or HAS_CUDA), reason="needs TRITON_INTERPRET=1 or a CUDA GPU"
)
# Where the twin comparisons run: the interpreter's CPU tensors, else the GPU.
DEVICE = torch.device("cuda") if HAS_CUDA and not INTERPRETER else torch.device("cpu")

# (atol, rtol) against the twin; atol is relative to the largest |expected| of the tensor, since
# a one-ulp difference before a subtraction (RoPE, LayerNorm) survives as an absolute one.
# fp32: both sides accumulate in fp32 in different orders. bf16: one or two ulps (2**-8 relative)
# where the kernel keeps fp32 a step longer than the twin, e.g. attention probabilities rounded
# to bf16 for the tensor-core PV product.
TOLERANCES = {
    torch.float32: (2e-5, 2e-5),
    torch.bfloat16: (2e-2, 2e-2),
    torch.float16: (2e-3, 2e-3),
}
DTYPES = [torch.float32, torch.bfloat16]


def assert_close(actual: torch.Tensor, expected: torch.Tensor, scale: float = 1.0) -> None:
    """Compare in fp32 with the tolerance of `expected`'s dtype (times `scale`)."""
    atol, rtol = TOLERANCES[expected.dtype]
    atol *= max(1.0, expected.float().abs().max().item()) if expected.numel() else 1.0
    assert actual.dtype == expected.dtype
    assert actual.shape == expected.shape
    torch.testing.assert_close(
        actual.float(), expected.float(), atol=atol * scale, rtol=rtol * scale
    )


def overlap(actual: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """Per row, |actual ∩ expected| / |expected| over the non-negative entries (top-k sets)."""
    fractions = []
    for got, want in zip(actual.tolist(), expected.tolist()):
        want_set = {i for i in want if i >= 0}
        got_set = {i for i in got if i >= 0}
        fractions.append(len(want_set & got_set) / max(1, len(want_set)))
    return torch.tensor(fractions)


def pdl_on_and_off_over_graph_replays(step, monkeypatch, num_replays: int = 1000):
    """Run `step()` (-> a list of tensors) eagerly with PDL on and with it off, and replay a CUDA
    graph of it `num_replays` times each way: -> (outputs with PDL on, with it off, replays whose
    outputs differed from that way's eager ones). Callers assert the outputs equal and no replay
    differed."""
    from kernels.settings import reload_settings

    def run(disable: bool):
        if disable:
            monkeypatch.setenv("MTPSERVE_DISABLE_PDL", "1")
        else:
            monkeypatch.delenv("MTPSERVE_DISABLE_PDL", raising=False)
        reload_settings()  # the code reads the environment once
        eager = step()
        stream = torch.cuda.Stream()  # warm-up off the capturing stream, as CUDA graphs ask
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outputs = step()
        mismatches = 0
        for _ in range(num_replays):
            graph.replay()
            mismatches += sum(int((o != e).any()) for o, e in zip(outputs, eager))
        return eager, mismatches

    on, bad_on = run(False)
    off, bad_off = run(True)
    return on, off, bad_on + bad_off
