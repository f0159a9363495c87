"""MLA's q_a and kv_a as one replicated matmul: loaded part by part from the checkpoint's two
tensors (FP8 with their block scales, or not), it computes what the two layers compute."""

from __future__ import annotations

import torch

from kernels.fp8 import FP8_DTYPE, fp8_linear_reference, quantize_fp8_reference
from parallel.linear import MergedReplicatedLinear

TOL = dict(rtol=1e-6, atol=1e-6)  # fp32: one matmul over both parts may block its sums differently


def _load(layer: MergedReplicatedLinear, parts) -> None:
    for shard, (weight, scale) in enumerate(parts):
        layer.weight.weight_loader(layer.weight, weight, shard)
        if scale is not None:
            layer.weight_scale_inv.weight_loader(layer.weight_scale_inv, scale, shard)


def test_fp8_parts_stack_their_scale_grids() -> None:
    """A 256-row part then a 72-row one (a partial last block, as kv_a's 576): one FP8 weight
    whose scale grid is the two grids stacked; each output slice is its part's FP8 linear."""
    g = torch.Generator().manual_seed(0)
    parts = [quantize_fp8_reference(torch.randn(rows, 200, generator=g)) for rows in (256, 72)]
    layer = MergedReplicatedLinear(200, [256, 72], torch.float32)
    assert layer.use_fp8()
    _load(layer, parts)
    assert layer.weight.dtype == FP8_DTYPE and layer.weight_scale_inv.shape == (3, 2)
    assert torch.equal(layer.weight_scale_inv, torch.cat([parts[0][1], parts[1][1]]))
    x = torch.randn(5, 200, generator=g)
    q, kv = layer.split(layer(x))
    torch.testing.assert_close(q, fp8_linear_reference(x, *parts[0]), **TOL)
    torch.testing.assert_close(kv, fp8_linear_reference(x, *parts[1]), **TOL)


def test_parts_that_cut_a_block_stay_in_the_model_dtype() -> None:
    g = torch.Generator().manual_seed(1)
    layer = MergedReplicatedLinear(64, [48, 40], torch.float32)
    assert not layer.use_fp8()  # a 48-row first part would share a scale block with kv_a
    weights = [torch.randn(48, 64, generator=g), torch.randn(40, 64, generator=g)]
    _load(layer, [(w, None) for w in weights])
    x = torch.randn(3, 64, generator=g)
    q, kv = layer.split(layer(x))
    torch.testing.assert_close(q, x @ weights[0].t(), **TOL)
    torch.testing.assert_close(kv, x @ weights[1].t(), **TOL)
