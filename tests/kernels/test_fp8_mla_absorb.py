"""MLA's absorbed products on an FP8 kv_b_proj (kernels/fp8_mla_absorb.py) against their twins,
and the twins against the per-head products they stand for."""

from __future__ import annotations

import pytest
import torch

from kernels.fp8 import FP8_BLOCK, dequantize_fp8_reference, quantize_fp8_reference
from kernels.fp8_mla_absorb import (
    FEW_ROWS,
    MANY_ROWS,
    ONE_ROW,
    AbsorbConfig,
    absorb_out_reference,
    absorb_out_triton,
    absorb_q_reference,
    absorb_q_triton,
    config_for,
)
from tests.kernels.conftest import DEVICE, DTYPES, assert_close, needs_triton

NOPE, V = 128, 128


def _kv_b(heads: int, kv_lora: int, pow2: bool, seed: int = 0):
    """An FP8 kv_b_proj [heads * (nope + v), kv_lora] whose blocks' scales are 10**-2 .. 10**2
    apart, so a scale read from another block (another head, part or column block) moves the
    result far past any tolerance."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(heads * (NOPE + V), kv_lora, generator=g) * kv_lora**-0.5
    rows = torch.arange(w.shape[0])[:, None] // FP8_BLOCK
    cols = torch.arange(kv_lora)[None, :] // FP8_BLOCK
    w = w * 10.0 ** ((rows * 3 + cols * 2) % 5 - 2)
    weight, scale = quantize_fp8_reference(w, pow2)
    return weight.to(DEVICE), scale.to(DEVICE)


def _inputs(num_rows: int, heads: int, kv_lora: int, dtype: torch.dtype, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    # q_nope as the model has it: a strided view beside the RoPE part of q_b's output
    q = torch.randn(num_rows, heads, NOPE + 64, generator=g).to(DEVICE, dtype)
    o_latent = torch.randn(num_rows, heads, kv_lora, generator=g).to(DEVICE, dtype)
    return q[..., :NOPE], o_latent


def test_twins_are_each_heads_product_with_its_dequantized_parts() -> None:
    heads, kv_lora = 3, 256
    weight, scale = _kv_b(heads, kv_lora, pow2=False)
    q_nope, o_latent = _inputs(5, heads, kv_lora, torch.float32)
    w = dequantize_fp8_reference(weight, scale).view(heads, NOPE + V, kv_lora)
    got_q = absorb_q_reference(q_nope, weight, scale, V)
    got_out = absorb_out_reference(o_latent, weight, scale, NOPE)
    for h in range(heads):
        assert_close(got_q[:, h], q_nope[:, h] @ w[h, :NOPE])
        assert_close(got_out[:, h], o_latent[:, h] @ w[h, NOPE:].t())


@needs_triton
@pytest.mark.parametrize("pow2", [False, True], ids=["amax", "ue8m0"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_rows", [1, 3, 16, 17, 70])
def test_absorbed_products_match_twins(num_rows, dtype, pow2) -> None:
    heads, kv_lora = 3, 320  # a partial last column block
    weight, scale = _kv_b(heads, kv_lora, pow2)
    q_nope, o_latent = _inputs(num_rows, heads, kv_lora, dtype)
    got = absorb_q_triton(q_nope, weight, scale, V, pow2_scales=pow2)
    assert got.is_contiguous()
    assert_close(got, absorb_q_reference(q_nope, weight, scale, V))
    got = absorb_out_triton(o_latent, weight, scale, NOPE, pow2_scales=pow2)
    assert got.is_contiguous()
    assert_close(got, absorb_out_reference(o_latent, weight, scale, NOPE))


@needs_triton
@pytest.mark.parametrize(
    "config",
    [
        ONE_ROW,
        AbsorbConfig(1, 32, 2, 1),
        FEW_ROWS,
        AbsorbConfig(16, 32, 4, 3),
        MANY_ROWS,
        AbsorbConfig(32, 64, 8, 2),
    ],
    ids=["one-row", "one-row-n32", "few", "few-n32", "many", "m32-n64"],
)
def test_every_tile_gives_the_twins_numbers(config) -> None:
    heads, kv_lora = 2, 256
    weight, scale = _kv_b(heads, kv_lora, pow2=True, seed=2)
    num_rows = 1 if config.block_m == 1 else 21
    q_nope, o_latent = _inputs(num_rows, heads, kv_lora, torch.float32, seed=3)
    got = absorb_q_triton(q_nope, weight, scale, V, True, config)
    assert_close(got, absorb_q_reference(q_nope, weight, scale, V))
    got = absorb_out_triton(o_latent, weight, scale, NOPE, True, config)
    assert_close(got, absorb_out_reference(o_latent, weight, scale, NOPE))


def test_config_narrows_output_tiles_to_fill_the_gpu() -> None:
    # DeepSeek-V3.2 at TP=1 (128 heads), one row: absorb_q's 512 latent columns fill 1024
    # programs at block_n 64; absorb_out's 128 v rows narrow to 32 for 512; at TP=8 (16 heads)
    # both narrow to the floor. The row count inside a tier never changes the tile.
    assert config_for(1, 128, 512, 128) == AbsorbConfig(1, 64, 2, 1, 512)  # a small tile: 2 warps
    assert config_for(1, 128, 128, 512) == AbsorbConfig(1, 32, 4, 1, 512)
    assert config_for(4, 128, 128, 512) == FEW_ROWS == config_for(16, 128, 128, 512)
    assert config_for(1, 16, 512, 128).block_n == 32
    assert config_for(32, 16, 512, 128) == config_for(2048, 16, 512, 128)
    assert config_for(32, 16, 512, 128).block_m == MANY_ROWS.block_m
    assert config_for(8, 16, 128, 512) == AbsorbConfig(
        16, 32, FEW_ROWS.num_warps, FEW_ROWS.num_stages
    )


@needs_triton
def test_zero_rows_and_bad_shapes() -> None:
    weight, scale = _kv_b(2, 128, pow2=False)
    q_nope, _ = _inputs(0, 2, 128, torch.float32)
    assert absorb_q_triton(q_nope, weight, scale, V).shape == (0, 2, 128)
    _, o_latent = _inputs(2, 2, 128, torch.float32)
    q_nope, _ = _inputs(2, 3, 128, torch.float32)
    with pytest.raises(ValueError, match="heads"):
        absorb_q_triton(q_nope, weight, scale, V)
    with pytest.raises(ValueError, match="whole 128-row"):
        absorb_q_triton(q_nope[..., :64], weight, scale, V)
    with pytest.raises(ValueError, match="one-row"):
        absorb_out_triton(o_latent, weight, scale, NOPE, config=ONE_ROW)
