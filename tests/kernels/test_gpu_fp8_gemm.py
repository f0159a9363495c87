"""GPU: the activation quantizer (bit for bit) and the w8a8 FP8 GEMM on the real FP8 tensor
cores against their twins at DeepSeek-V3.2's projection shapes, and PDL on vs off identical over
CUDA-graph replays. Run on the H200 with
`pytest -m gpu tests/kernels/test_gpu_fp8_gemm.py`."""

from __future__ import annotations

import pytest
import torch

from kernels.fp8 import (
    fp8_gemm_reference,
    fp8_linear_act_quant_reference,
    quantize_activations_reference,
    quantize_fp8_reference,
)
from kernels.fp8_act_quant import quantize_activations_triton
from kernels.fp8_cublaslt import (
    CUBLASLT_MIN_ROWS,
    cublaslt_block_scaled,
    cublaslt_shape_ok,
    fp8_gemm_cublaslt,
)
from kernels.fp8_gemm import (
    W8A8_CONFIGS,
    fp8_gemm_triton,
    fp8_linear_w8a8,
    fp8_linear_w8a8_triton,
)
from kernels.fp8_linear import _TILE_COUNTERS
from kernels.platform import pdl_enabled
from tests.kernels.conftest import assert_close, pdl_on_and_off_over_graph_replays

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
CUDA = torch.device("cuda")
# (out, in): q_a, kv_a (576: a partial last block), q_b, o_proj, the dense MLP's gate+up and
# down, q_a and kv_a fused (2112).
SHAPES = [
    (1536, 7168),
    (576, 7168),
    (24576, 1536),
    (7168, 16384),
    (36864, 7168),
    (7168, 18432),
    (2112, 7168),
]
ROWS = [1, 16, 64, 2048, 7, 131]


def _weight(out_features: int, in_features: int):
    w = torch.randn(out_features, in_features, device=CUDA) * in_features**-0.5
    return quantize_fp8_reference(w)


@pytest.mark.parametrize("num_tokens", [1, 7, 64, 2048])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("width", [7168, 16384, 1536, 300])
def test_act_quant_identical_to_twin(width, dtype, num_tokens) -> None:
    x = (
        torch.randn(num_tokens, width, device=CUDA)
        * torch.logspace(-3, 3, num_tokens, device=CUDA)[:, None]
    )
    x[0, :128] = 0.0
    x = x.to(dtype)
    want_q, want_scale = quantize_activations_reference(x)
    got_q, got_scale = quantize_activations_triton(x)
    assert torch.equal(got_scale, want_scale)
    assert torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8))


@pytest.mark.parametrize("num_tokens", ROWS)
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{o}x{i}" for o, i in SHAPES])
def test_fp8_gemm_real_shapes(shape, num_tokens) -> None:
    weight, scale = _weight(*shape)
    x = torch.randn(num_tokens, shape[1], dtype=torch.bfloat16, device=CUDA)
    q, q_scale = quantize_activations_reference(x)
    want = fp8_gemm_reference(q, q_scale, weight, scale, torch.bfloat16)
    assert_close(fp8_gemm_triton(q, q_scale, weight, scale, torch.bfloat16), want)
    # The whole linear (quantize, then GEMM) is the activation twin.
    assert_close(
        fp8_linear_w8a8_triton(x, weight, scale), fp8_linear_act_quant_reference(x, weight, scale)
    )


@pytest.mark.parametrize(
    "config",
    list(W8A8_CONFIGS.values()),
    ids=lambda c: f"m{c.block_m}n{c.block_n}s{c.split_target}",
)
def test_fp8_gemm_every_config_fp32_out(config) -> None:
    """Every tile config on one shape, fp32 out. The FP8 tensor cores accumulate a 128-product
    block with fewer bits than fp32 (why the kernel promotes every block), so fp32 out gets 20x
    the fp32 tolerance of an fp32 reduction."""
    weight, scale = _weight(1536, 7168)
    x = torch.randn(100, 7168, device=CUDA)
    q, q_scale = quantize_activations_reference(x)
    got = fp8_gemm_triton(q, q_scale, weight, scale, torch.float32, config)
    assert_close(got, fp8_gemm_reference(q, q_scale, weight, scale, torch.float32), scale=20.0)


def test_fp8_linear_w8a8_pdl_on_and_off_identical_over_graph_replays(monkeypatch) -> None:
    assert pdl_enabled(CUDA), "this test is meant for Hopper or newer"
    weights = [_weight(o, i) for o, i in SHAPES[:2]]
    x = torch.randn(80, 7168, dtype=torch.bfloat16, device=CUDA)

    on, off, mismatches = pdl_on_and_off_over_graph_replays(
        lambda: lambda: [fp8_linear_w8a8_triton(x, w, s) for w, s in weights], monkeypatch
    )
    assert mismatches == 0
    assert all(torch.equal(a, b) for a, b in zip(on, off))


def test_fp8_gemm_split_k_graph_replays_give_the_eager_bits() -> None:
    """Split K at decode sizes (q_a and kv_a at 1 and 16 rows: 19, 28, 19 and 28 splits), the
    activations quantized in the same step: calls repeat their bits; a CUDA graph captured after
    one eager call, replayed with new inputs copied in, gives the eager call's bits on them;
    every counter is back at zero after."""
    weights = [_weight(o, i) for o, i in SHAPES[:2]]
    inputs = [torch.randn(rows, 7168, dtype=torch.bfloat16, device=CUDA) for rows in (1, 16)]

    def step() -> list[torch.Tensor]:
        return [fp8_linear_w8a8_triton(x, w, s) for x in inputs for w, s in weights]

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
    assert_close(want[0], fp8_linear_act_quant_reference(inputs[0], *weights[0]))
    torch.cuda.synchronize()
    assert int(_TILE_COUNTERS[inputs[0].device].count_nonzero()) == 0


needs_cublaslt = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
    reason="cuBLASLt's block-scaled FP8 GEMM is taken on compute capability 9.0",
)


@needs_cublaslt
def test_cublaslt_block_scaled_runs_here() -> None:
    """On an H100 / H200 with this PyTorch the probe must find it (else prefill silently keeps
    the slower Triton kernel)."""
    assert cublaslt_block_scaled(CUDA)


@needs_cublaslt
@pytest.mark.parametrize("num_tokens", [16, 256, 1000, 2048])
@pytest.mark.parametrize(
    "shape", [s for s in SHAPES if cublaslt_shape_ok(*s)], ids=lambda s: f"{s[0]}x{s[1]}"
)
def test_cublaslt_gemm_real_shapes(shape, num_tokens) -> None:
    """cuBLASLt's block-scaled GEMM is the w8a8 twin at DeepSeek-V3.2's shapes; the linear
    takes it from CUBLASLT_MIN_ROWS rows (1000: padded to 1008) and is the activation twin."""
    weight, scale = _weight(*shape)
    x = torch.randn(num_tokens, shape[1], dtype=torch.bfloat16, device=CUDA)
    x *= torch.logspace(-2, 2, shape[1] // 128, device=CUDA).repeat_interleave(128)
    q, q_scale = quantize_activations_triton(x, scales_token_major=True, rows_multiple=16)
    got = fp8_gemm_cublaslt(q, q_scale, weight, scale, torch.bfloat16)[:num_tokens]
    want = fp8_gemm_reference(q[:num_tokens], q_scale[:num_tokens], weight, scale, torch.bfloat16)
    assert_close(got, want)
    linear = fp8_linear_w8a8(x, weight, scale)
    assert linear.shape == (num_tokens, shape[0])
    assert_close(linear, fp8_linear_act_quant_reference(x, weight, scale))
    if num_tokens >= CUBLASLT_MIN_ROWS:  # the linear took cuBLASLt: the same bits as above
        assert torch.equal(linear, got)
