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


def assert_close(
    actual: torch.Tensor,
    expected: torch.Tensor,
    scale: float = 1.0,
    tolerances: dict[torch.dtype, tuple[float, float]] = TOLERANCES,
) -> None:
    """Compare in fp32 with the tolerance of `expected`'s dtype in `tolerances` (times `scale`)."""
    atol, rtol = tolerances[expected.dtype]
    atol *= max(1.0, expected.float().abs().max().item()) if expected.numel() else 1.0
    assert actual.dtype == expected.dtype
    assert actual.shape == expected.shape
    torch.testing.assert_close(
        actual.float(), expected.float(), atol=atol * scale, rtol=rtol * scale
    )


def assert_close_but_rare_rounding_flips(
    actual: torch.Tensor,
    expected: torch.Tensor,
    tolerances: dict[torch.dtype, tuple[float, float]],
    max_fraction: float = 1e-4,
    flip_factor: float = 2.0,
) -> None:
    """`assert_close`, except that at most `max_fraction` of the elements (at least one) may miss
    the tolerance, and those by at most `flip_factor` times it. For kernels that round an
    intermediate to FP8 (w8a8): an fp32 sum in another order than the twin's lands on the other
    side of an FP8 rounding boundary now and then, a one-step difference in that intermediate
    element, which moves every output of its token a little. Seen on the H200 at DeepSeek-V3.2's
    shapes: 1 of 3.67M and 2 of 459k outputs at 1.1x the tolerance (one run), 10 of 459k and
    302 of 14.7M (2.2e-5 and 2.1e-5) at 1.26x and 1.61x (another)."""
    atol, rtol = tolerances[expected.dtype]
    atol *= max(1.0, expected.float().abs().max().item()) if expected.numel() else 1.0
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    allowed = atol + rtol * expected.float().abs()
    excess = (actual.float() - expected.float()).abs() / allowed
    num_missed = int((excess > 1).sum())
    worst = excess.max().item()
    account = (
        f"{num_missed} of {expected.numel()} elements outside the tolerance, the worst "
        f"{worst:.2f}x it"
    )
    assert num_missed <= max(1, int(max_fraction * expected.numel())), account
    assert worst <= flip_factor, account


def overlap(actual: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """Per row, |actual ∩ expected| / |expected| over the non-negative entries (top-k sets)."""
    fractions = []
    for got, want in zip(actual.tolist(), expected.tolist()):
        want_set = {i for i in want if i >= 0}
        got_set = {i for i in got if i >= 0}
        fractions.append(len(want_set & got_set) / max(1, len(want_set)))
    return torch.tensor(fractions)


def graph_replays(step, num_replays: int) -> tuple[tuple[torch.Tensor, ...], int]:
    """Capture `step` (-> tensors) in a CUDA graph; replay it; count replays whose outputs
    differ from the eager run's (bitwise, counted on the device: no sync per replay)."""
    eager = tuple(t.clone() for t in step())  # also compiles every kernel before capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step()
    mismatches = torch.zeros((), dtype=torch.int64, device=outputs[0].device)
    for _ in range(num_replays):
        graph.replay()
        for got, want in zip(outputs, eager):
            mismatches += (got != want).any()
    return eager, int(mismatches)


def pdl_on_and_off_over_graph_replays(make_step, monkeypatch, num_replays: int = 1000):
    """`graph_replays` of `make_step()` with PDL on, then with it off (the step is made after
    each switch): -> (outputs with PDL on, with it off, replays that differed from their eager
    run, both ways). Callers assert the outputs equal and no replay differed."""
    from kernels.platform import pdl_enabled
    from kernels.settings import reload_settings

    monkeypatch.delenv("MTPSERVE_DISABLE_PDL", raising=False)
    reload_settings()  # the code reads the environment once
    on, bad_on = graph_replays(make_step(), num_replays)
    monkeypatch.setenv("MTPSERVE_DISABLE_PDL", "1")
    reload_settings()
    assert not pdl_enabled(torch.device("cuda"))
    off, bad_off = graph_replays(make_step(), num_replays)
    return on, off, bad_on + bad_off
