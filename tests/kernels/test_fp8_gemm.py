"""The w8a8 block-scaled FP8 GEMM against its twin (under the interpreter its FP8 tiles are
converted to fp32 before the dot: the same products, see kernels/fp8_gemm.py)."""

from __future__ import annotations

import pytest
import torch

from kernels.fp8 import (
    FP8_BLOCK,
    fp8_gemm_reference,
    fp8_linear_act_quant_reference,
    quantize_activations_reference,
    quantize_fp8_reference,
)
from kernels.fp8_gemm import (
    W8A8_CONFIGS,
    fp8_gemm_triton,
    fp8_linear_w8a8_triton,
)
from kernels.fp8_linear import Fp8TileConfig, config_for_rows
from tests.kernels.conftest import DEVICE, assert_close, needs_triton


def _operands(num_rows: int, out_features: int, in_features: int, seed: int = 0):
    """FP8 activations and weight whose groups / blocks have scales 10**-2 .. 10**2 apart, so a
    scale read from the wrong group or block moves the result far past any tolerance."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=g)
    rows = torch.arange(out_features)[:, None] // FP8_BLOCK
    cols = torch.arange(in_features)[None, :] // FP8_BLOCK
    w = w * 10.0 ** ((rows * 3 + cols * 5) % 5 - 2)
    x = torch.randn(num_rows, in_features, generator=g)
    x = x * 10.0 ** ((torch.arange(num_rows)[:, None] + cols * 2) % 5 - 2)
    return x, *quantize_activations_reference(x), *quantize_fp8_reference(w)


def _to(device, *tensors):
    return [t.to(device) for t in tensors]


@needs_triton
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "num_rows, out_features, in_features",
    [(1, 200, 300), (7, 128, 256), (33, 64, 1000), (131, 150, 130), (20, 576, 384)],
)
def test_fp8_gemm_matches_twin(out_dtype, num_rows, out_features, in_features) -> None:
    _, q, q_scale, weight, scale = _operands(num_rows, out_features, in_features)
    want = fp8_gemm_reference(q, q_scale, weight, scale, out_dtype)
    got = fp8_gemm_triton(*_to(DEVICE, q, q_scale, weight, scale), out_dtype).cpu()
    assert_close(got, want)


@needs_triton
@pytest.mark.parametrize(
    "config",
    [
        *W8A8_CONFIGS.values(),
        Fp8TileConfig(block_m=16, block_n=32, num_warps=4, num_stages=3, split_target=10_000),
    ],
    ids=lambda c: f"m{c.block_m}n{c.block_n}s{c.split_target}",
)
def test_fp8_gemm_any_config_on_any_rows(config) -> None:
    """Split K (a fixed-order sum over splits) and whole K, tiles wider than the output, several
    tile rows walked in grouped order: all give the twin."""
    _, q, q_scale, weight, scale = _operands(70, 96, 520, seed=1)
    got = fp8_gemm_triton(*_to(DEVICE, q, q_scale, weight, scale), torch.float32, config).cpu()
    assert_close(got, fp8_gemm_reference(q, q_scale, weight, scale, torch.float32))


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp8_linear_w8a8_is_the_activation_twin(dtype) -> None:
    x, *_, weight, scale = _operands(9, 200, 300, seed=2)
    x = x.to(dtype)
    got = fp8_linear_w8a8_triton(*_to(DEVICE, x, weight, scale)).cpu()
    assert_close(got, fp8_linear_act_quant_reference(x, weight, scale))


def test_config_for_rows_takes_the_first_bucket_that_holds_them() -> None:
    bounds = sorted(W8A8_CONFIGS)
    assert config_for_rows(1, W8A8_CONFIGS) is W8A8_CONFIGS[bounds[0]]
    assert config_for_rows(bounds[0], W8A8_CONFIGS) is W8A8_CONFIGS[bounds[0]]
    assert config_for_rows(bounds[0] + 1, W8A8_CONFIGS) is W8A8_CONFIGS[bounds[1]]
    assert config_for_rows(10**6, W8A8_CONFIGS) is W8A8_CONFIGS[bounds[-1]]


def test_fp8_gemm_refuses_wrong_scale_grids() -> None:
    _, q, q_scale, weight, scale = _operands(3, 200, 300)
    with pytest.raises(ValueError, match="a_scale"):
        fp8_gemm_triton(q, q_scale[:, :2], weight, scale)
    with pytest.raises(ValueError, match="scale_inv"):
        fp8_gemm_triton(q, q_scale, weight, scale[:1])
