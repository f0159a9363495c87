"""The FP8 linear kernel against its twin, and the twins against closed forms."""

from __future__ import annotations

import pytest
import torch

from kernels.fp8 import (
    FP8_BLOCK,
    dequantize_fp8_reference,
    fp8_linear_act_quant_reference,
    fp8_linear_reference,
    quantize_activations_reference,
    quantize_fp8_reference,
)
from kernels.fp8_linear import DECODE_CONFIG, PREFILL_CONFIG, fp8_linear_triton
from tests.kernels.conftest import DEVICE, DTYPES, assert_close, needs_triton


def _weight(out_features: int, in_features: int, seed: int = 0):
    """An FP8 weight whose blocks have scales 10**-2 .. 10**2 apart, so a scale read from the
    wrong block moves the result far past any tolerance."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=g)
    rows = torch.arange(out_features)[:, None] // FP8_BLOCK
    cols = torch.arange(in_features)[None, :] // FP8_BLOCK
    w = w * 10.0 ** ((rows * 3 + cols * 5) % 5 - 2)
    return quantize_fp8_reference(w)


def test_dequantization_is_each_block_times_its_scale() -> None:
    weight, scale = _weight(300, 200)
    got = dequantize_fp8_reference(weight, scale)
    for r in range(300):
        for c in (0, 127, 128, 199):
            assert got[r, c] == weight[r, c].float() * scale[r // 128, c // 128]


def test_quantization_round_trips_within_e4m3() -> None:
    w = torch.randn(300, 200)
    weight, scale = quantize_fp8_reference(w)
    assert scale.shape == (3, 2)
    # e4m3 keeps 3 mantissa bits: a relative step of 2**-3, so half of that after rounding.
    err = (dequantize_fp8_reference(weight, scale) - w).abs()
    assert (err <= w.abs() * 2**-4 + scale.repeat_interleave(128, 0)[:300, :1] * 2**-9).all()


def test_activation_quantization_per_token_groups() -> None:
    x = torch.randn(5, 300) * torch.tensor([1.0, 10.0, 100.0, 0.1, 1.0])[:, None]
    q, scale = quantize_activations_reference(x)
    assert scale.shape == (5, 3)
    for t in range(5):
        for g in range(3):
            group = x[t, g * 128 : (g + 1) * 128]
            assert scale[t, g] == group.abs().max() / 448
    deq = q.float() * scale.repeat_interleave(128, 1)[:, :300]
    assert (
        (deq - x).abs() <= x.abs() * 2**-4 + scale.repeat_interleave(128, 1)[:, :300] * 2**-9
    ).all()
    weight, wscale = _weight(64, 300)
    closed = deq @ dequantize_fp8_reference(weight, wscale).t()
    assert torch.allclose(fp8_linear_act_quant_reference(x, weight, wscale), closed)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "num_tokens, out_features, in_features",
    [(1, 200, 300), (7, 128, 256), (33, 64, 1000), (131, 150, 130)],
)
def test_fp8_linear_matches_twin(dtype, num_tokens, out_features, in_features) -> None:
    weight, scale = _weight(out_features, in_features)
    x = torch.randn(num_tokens, in_features, dtype=dtype)
    want = fp8_linear_reference(x, weight, scale)
    got = fp8_linear_triton(x.to(DEVICE), weight.to(DEVICE), scale.to(DEVICE)).cpu()
    assert got.dtype == dtype
    assert_close(got, want)


@needs_triton
@pytest.mark.parametrize("config", [DECODE_CONFIG, PREFILL_CONFIG], ids=["decode", "prefill"])
def test_fp8_linear_either_config_on_any_rows(config) -> None:
    """Split K (decode: few tiles, so K spreads over programs) and whole K give the twin."""
    weight, scale = _weight(96, 520, seed=1)
    x = torch.randn(19, 520)
    got = fp8_linear_triton(x.to(DEVICE), weight.to(DEVICE), scale.to(DEVICE), config).cpu()
    assert_close(got, fp8_linear_reference(x, weight, scale))


def test_fp8_linear_refuses_a_wrong_scale_grid() -> None:
    weight, scale = _weight(200, 300)
    with pytest.raises(ValueError, match="scale_inv"):
        fp8_linear_triton(torch.randn(2, 300), weight, scale[:1])
