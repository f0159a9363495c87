"""The w8a8 block-scaled FP8 GEMM against its twin (under the interpreter its FP8 tiles are
converted to fp32 before the dot: the same products, see kernels/fp8_gemm.py)."""

from __future__ import annotations

import pytest
import torch

from kernels import fp8_linear
from kernels.fp8 import (
    FP8_BLOCK,
    fp8_gemm_reference,
    fp8_linear_act_quant_reference,
    fp8_linear_reference,
    quantize_activations_reference,
    quantize_fp8_reference,
)
from kernels.fp8_gemm import (
    W8A8_CONFIGS,
    fp8_gemm_triton,
    fp8_linear_w8a8_triton,
)
from kernels.fp8_linear import Fp8TileConfig, config_for_rows, fp8_linear_triton, split_k
from tests.kernels.conftest import DEVICE, INTERPRETER, assert_close, needs_triton


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


# Few programs to aim for, so small shapes split K into several 128-wide ranges (and one split per
# K range is what `UNSPLIT` computes).
SPLIT_CONFIG = Fp8TileConfig(block_m=16, block_n=32, num_warps=4, num_stages=3, split_target=64)
UNSPLIT = Fp8TileConfig(block_m=16, block_n=32, num_warps=4, num_stages=3, split_target=1)
# (rows, out_features, in_features) -> splits with SPLIT_CONFIG: 8; 2 (32 tiles, K 7168 in two
# ranges of 28 blocks); 8 (K 1000: a partial last block); 6 (N 200: a partial last tile).
SPLIT_SHAPES = [(1, 96, 1024), (16, 1024, 7168), (7, 64, 1000), (16, 200, 700)]


def _rounded_as_the_kernel_does(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 -> dtype as the kernel's cast rounds it: to nearest on a GPU; Triton 3.9's
    interpreter truncates fp32 -> bf16 (its `_convert_float` keeps the top 16 bits)."""
    if INTERPRETER and dtype == torch.bfloat16:
        return (t.view(torch.int32) & -(1 << 16)).view(torch.float32).to(dtype)
    return t.to(dtype)


def _num_splits(num_rows: int, out_features: int, in_features: int, config) -> tuple[int, int]:
    num_tiles = -(-num_rows // config.block_m) * -(-out_features // config.block_n)
    return split_k(num_tiles, in_features, config.split_target)


@needs_triton
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SPLIT_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_fp8_gemm_split_k_is_the_twin_and_the_fixed_order_sum_of_its_splits(
    out_dtype, shape
) -> None:
    """Several splits give the twin and, bit for bit, what the two-kernel path gave: each K
    range's fp32 partial (the kernel on that range alone, unsplit, fp32 out) added from zeros in
    order s = 0 .. S-1, then rounded to out_dtype."""
    num_rows, out_features, in_features = shape
    num_splits, k_per_split = _num_splits(*shape, SPLIT_CONFIG)
    assert num_splits > 1
    _, q, q_scale, weight, scale = _operands(*shape, seed=3)
    got = fp8_gemm_triton(*_to(DEVICE, q, q_scale, weight, scale), out_dtype, SPLIT_CONFIG)
    assert_close(got.cpu(), fp8_gemm_reference(q, q_scale, weight, scale, out_dtype))
    q, q_scale, weight, scale = _to(DEVICE, q, q_scale, weight, scale)
    want = torch.zeros(num_rows, out_features, device=DEVICE)
    for s in range(num_splits):
        k0, k1 = s * k_per_split, min((s + 1) * k_per_split, in_features)
        kb = slice(k0 // FP8_BLOCK, -(-k1 // FP8_BLOCK))
        want += fp8_gemm_triton(
            q[:, k0:k1], q_scale[:, kb], weight[:, k0:k1], scale[:, kb], torch.float32, UNSPLIT
        )
    assert torch.equal(got, _rounded_as_the_kernel_does(want, out_dtype))


@needs_triton
@pytest.mark.parametrize("min_counters", [1, 4096], ids=["grown", "up-front"])
def test_split_k_gemms_and_linears_share_the_tile_counters(min_counters, monkeypatch) -> None:
    """w8a8 and w8a16 launches of 3, 32 and 7 tiles back to back on the device's one counter
    buffer (grown as they come where it starts small): each gives its twin and the bits of its
    first call, and every counter is zero after them."""
    monkeypatch.setattr(fp8_linear, "_TILE_COUNTERS", {})
    monkeypatch.setattr(fp8_linear, "MIN_TILE_COUNTERS", min_counters)
    shapes = [(4, 96, 1024), (20, 500, 384), (16, 200, 700)]  # 8, 2 and 6 splits
    assert [_num_splits(*shape, SPLIT_CONFIG)[0] for shape in shapes] == [8, 2, 6]
    calls = []  # (the op on the device, its twin's output)
    for i, shape in enumerate(shapes):
        x, q, q_scale, weight, scale = _operands(*shape, seed=i)
        gemm_args = _to(DEVICE, q, q_scale, weight, scale)
        linear_args = _to(DEVICE, x, weight, scale)
        calls.append(
            (
                lambda a=gemm_args: fp8_gemm_triton(*a, torch.float32, SPLIT_CONFIG),
                fp8_gemm_reference(q, q_scale, weight, scale, torch.float32),
            )
        )
        calls.append(
            (
                lambda a=linear_args: fp8_linear_triton(*a, SPLIT_CONFIG),
                fp8_linear_reference(x, weight, scale),
            )
        )
    first = [op() for op, _ in calls]
    for _ in range(2):
        for (op, want), bits in zip(calls, first):
            got = op()
            assert torch.equal(got, bits)
            assert_close(got.cpu(), want)
    counters = fp8_linear._TILE_COUNTERS[first[0].device]
    assert counters.numel() == max(32, min_counters)
    assert int(counters.count_nonzero()) == 0


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
