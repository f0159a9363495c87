"""GPU: the FP8 linear at DeepSeek-V3.2's real projection shapes against its twin, and PDL on
vs off identical over CUDA-graph replays. Run on the H200 with `pytest -m gpu tests/kernels`."""

from __future__ import annotations

import pytest
import torch

from kernels import fp8_linear
from kernels.fp8 import fp8_linear_reference, quantize_fp8_reference
from kernels.fp8_linear import fp8_linear_triton
from kernels.platform import pdl_enabled
from tests.kernels.conftest import assert_close, pdl_on_and_off_over_graph_replays

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
CUDA = torch.device("cuda")
# (out, in): q_a, kv_a (576: a partial last block), the indexer's wq_b, q_b, o_proj, the dense
# MLP's gate+up and down, a routed expert's gate+up at TP=8.
SHAPES = [
    (1536, 7168),
    (576, 7168),
    (8192, 1536),
    (24576, 1536),
    (7168, 16384),
    (36864, 7168),
    (7168, 18432),
    (512, 7168),
]


def _weight(out_features: int, in_features: int):
    w = torch.randn(out_features, in_features, device=CUDA) * in_features**-0.5
    return quantize_fp8_reference(w)


@pytest.mark.parametrize("num_tokens", [1, 8, 128, 2048])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{o}x{i}" for o, i in SHAPES])
def test_fp8_linear_real_shapes(shape, num_tokens) -> None:
    weight, scale = _weight(*shape)
    x = torch.randn(num_tokens, shape[1], dtype=torch.bfloat16, device=CUDA)
    assert_close(fp8_linear_triton(x, weight, scale), fp8_linear_reference(x, weight, scale))


@pytest.mark.parametrize("num_tokens", [1, 4, 16, 64, 2048])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{o}x{i}" for o, i in SHAPES])
def test_pow2_scales_fp8_linear_real_shapes(shape, num_tokens) -> None:
    """UE8M0 scales (powers of two, as DeepSeek-V3.1 and later ship them): the POW2_SCALES path
    (e4m3 to bf16 by way of fp16, the scale on each k step's product) against the twin and the
    per-element path, split K or not; PDL on and off bit-identical in graph replays."""
    w = torch.randn(*shape, device=CUDA) * shape[1] ** -0.5
    weight, scale = quantize_fp8_reference(w, pow2_scales=True)
    x = torch.randn(num_tokens, shape[1], dtype=torch.bfloat16, device=CUDA)
    fast = fp8_linear_triton(x, weight, scale, pow2_scales=True)
    assert_close(fast, fp8_linear_reference(x, weight, scale))
    assert_close(fast, fp8_linear_triton(x, weight, scale))


def test_pow2_scales_pdl_on_and_off_identical_over_graph_replays(monkeypatch) -> None:
    weights = [
        quantize_fp8_reference(torch.randn(o, i, device=CUDA) * i**-0.5, pow2_scales=True)
        for o, i in SHAPES[:3]
    ]
    x = torch.randn(1, 7168, dtype=torch.bfloat16, device=CUDA)
    x2 = torch.randn(1, 1536, dtype=torch.bfloat16, device=CUDA)
    inputs = [x, x, x2]
    on, off, mismatches = pdl_on_and_off_over_graph_replays(
        lambda: (
            lambda: [
                fp8_linear_triton(a, w, s, pow2_scales=True) for a, (w, s) in zip(inputs, weights)
            ]
        ),
        monkeypatch,
    )
    assert mismatches == 0
    assert all(torch.equal(a, b) for a, b in zip(on, off))


def test_fp8_linear_pdl_on_and_off_identical_over_graph_replays(monkeypatch) -> None:
    assert pdl_enabled(CUDA), "this test is meant for Hopper or newer"
    weights = [_weight(o, i) for o, i in SHAPES[:2]]
    x = torch.randn(4, 7168, dtype=torch.bfloat16, device=CUDA)

    on, off, mismatches = pdl_on_and_off_over_graph_replays(
        lambda: lambda: [fp8_linear_triton(x, w, s) for w, s in weights], monkeypatch
    )
    assert mismatches == 0
    assert all(torch.equal(a, b) for a, b in zip(on, off))


def test_fp8_linear_split_k_graph_replays_give_the_eager_bits() -> None:
    """Split K at decode sizes (q_a and kv_a at 1 and 4 rows: 10, 28, 6 and 14 splits), all on
    the device's one counter buffer: calls repeat their bits; a CUDA graph captured after one
    eager call, replayed with new inputs copied in, gives the eager call's bits on them; every
    counter is back at zero after."""
    weights = [_weight(o, i) for o, i in SHAPES[:2]]
    inputs = [torch.randn(rows, 7168, dtype=torch.bfloat16, device=CUDA) for rows in (1, 4)]

    def step() -> list[torch.Tensor]:
        return [fp8_linear_triton(x, w, s) for x in inputs for w, s in weights]

    eager = step()  # compiles every variant and allocates the counters before the capture
    assert all(torch.equal(a, b) for a, b in zip(step(), eager))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = step()
    for _ in range(5):
        for x in inputs:
            x.copy_(torch.randn_like(x))
        graph.replay()
        got = [t.clone() for t in replayed]
        want = step()
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert_close(want[0], fp8_linear_reference(inputs[0], *weights[0]))
    torch.cuda.synchronize()
    assert int(fp8_linear._TILE_COUNTERS[inputs[0].device].count_nonzero()) == 0
