"""GPU: the FP8 linear at DeepSeek-V3.2's real projection shapes against its twin, and PDL on
vs off identical over CUDA-graph replays. Run on the H200 with `pytest -m gpu tests/kernels`."""

from __future__ import annotations

import pytest
import torch

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


def test_fp8_linear_pdl_on_and_off_identical_over_graph_replays(monkeypatch) -> None:
    assert pdl_enabled(CUDA), "this test is meant for Hopper or newer"
    weights = [_weight(o, i) for o, i in SHAPES[:2]]
    x = torch.randn(4, 7168, dtype=torch.bfloat16, device=CUDA)

    on, off, mismatches = pdl_on_and_off_over_graph_replays(
        lambda: lambda: [fp8_linear_triton(x, w, s) for w, s in weights], monkeypatch
    )
    assert mismatches == 0
    assert all(torch.equal(a, b) for a, b in zip(on, off))
