"""FP8 weights whose block scales are powers of two (UE8M0, as DeepSeek-V3.1 and later ship
them): the detector, the quantizer's option, and the w8a16 kernels' POW2_SCALES path (the e4m3
tile multiplied unscaled, the scale applied to each k step's partial product) against the same
twins as the per-element path."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kernels import fp8_linear, moe_experts
from kernels.fp8 import (
    FP8_DTYPE,
    dequantize_fp8_reference,
    fp8_linear_reference,
    quantize_fp8_reference,
    scales_are_powers_of_two,
)
from kernels.fp8_linear import DECODE_CONFIG as DECODE_LINEAR
from kernels.fp8_linear import PREFILL_CONFIG as PREFILL_LINEAR
from kernels.fp8_linear import (
    W8A16_GEMV_CONFIG,
    Fp8GemvConfig,
    Fp8TileConfig,
    fp8_linear_triton,
    split_k,
)
from kernels.moe_experts import (
    DECODE_CONFIG,
    ONE_TOKEN_CONFIG,
    PREFILL_CONFIG,
    MoeGemvConfig,
    SharedExpert,
    grouped_moe_reference,
    grouped_moe_triton,
    one_token_takes_shared,
)
from tests.kernels.conftest import DEVICE, DTYPES, assert_close, needs_triton
from tests.kernels.test_moe_experts_fp8 import FP8_CASES, fp8_experts, routes


def to_powers_of_two(scale: torch.Tensor) -> torch.Tensor:
    """Each scale to the nearest power of two (its block's values keep their e4m3 codes)."""
    return torch.exp2(torch.round(torch.log2(scale)))


def test_the_detector_takes_only_positive_finite_normal_powers_of_two() -> None:
    assert scales_are_powers_of_two(torch.tensor([1.0, 0.5, 2.0**-20, 2.0**100]))
    for bad in (3.0, 0.75, 1.0 + 2**-23, 0.0, -2.0, float("inf"), float("nan"), 2.0**-140):
        assert not scales_are_powers_of_two(torch.tensor([1.0, bad])), bad
    # A single non-power anywhere in a large grid is found.
    grid = torch.full((64, 57), 2.0**-7)
    assert scales_are_powers_of_two(grid)
    grid[63, 56] = 2.0**-7 * 1.5
    assert not scales_are_powers_of_two(grid)


def test_ue8m0_quantization_rounds_each_scale_up_to_a_power_of_two() -> None:
    w = torch.randn(300, 260, generator=torch.Generator().manual_seed(0)) * 3
    q, scale = quantize_fp8_reference(w, pow2_scales=True)
    exact_q, exact = quantize_fp8_reference(w)
    assert scales_are_powers_of_two(scale) and not scales_are_powers_of_two(exact)
    # Rounded up (never down, so no block overflows e4m3), by less than a factor of two.
    assert ((scale >= exact) & (scale < 2 * exact)).all()
    assert q.dtype == FP8_DTYPE and torch.isfinite(q.float()).all()
    # Each element within e4m3's relative step of its block's largest value.
    err = (dequantize_fp8_reference(q, scale) - w).abs()
    assert (
        err
        <= w.abs() / 16
        + scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:300, :260] * 2.0**-9
    ).all()


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config", [DECODE_CONFIG, PREFILL_CONFIG], ids=["decode", "prefill"])
@pytest.mark.parametrize("num_tokens,num_local,num_total,first_expert,top_k", FP8_CASES)
def test_pow2_grouped_moe_matches_the_twin(
    dtype, config, num_tokens, num_local, num_total, first_expert, top_k
) -> None:
    """Scales that differ per block, per part (gate ~1e-3, up ~1) and per expert, all powers of
    two: the POW2_SCALES kernels equal the twin, and so the per-element kernels."""
    hidden, intermediate = 300, 160
    w13, w2, w13_scale, w2_scale = fp8_experts(num_local, hidden, intermediate, seed=num_tokens)
    w13_scale, w2_scale = to_powers_of_two(w13_scale), to_powers_of_two(w2_scale)
    assert scales_are_powers_of_two(w13_scale) and scales_are_powers_of_two(w2_scale)
    assert len(w13_scale.unique()) > 4  # not one scale everywhere
    weights, ids = routes(num_tokens, num_total, top_k, seed=num_tokens)
    x = torch.randn(num_tokens, hidden, device=DEVICE).to(dtype)
    scales = dict(w13_scale=w13_scale, w2_scale=w2_scale)
    expected = grouped_moe_reference(x, w13, w2, weights, ids, first_expert, **scales)
    fast = grouped_moe_triton(
        x, w13, w2, weights, ids, first_expert, **scales, config=config, pow2_scales=True
    )
    assert_close(fast, expected)
    per_element = grouped_moe_triton(
        x, w13, w2, weights, ids, first_expert, **scales, config=config
    )
    assert_close(fast, per_element)
    assert expected.float().abs().max() > 0
    # The path reads the scales: the up grid's scales halved, the output moves.
    halved = grouped_moe_triton(
        x,
        w13,
        w2,
        weights,
        ids,
        first_expert,
        w13_scale=torch.stack([w13_scale[:, 0], w13_scale[:, 1] / 2], 1),
        w2_scale=w2_scale,
        config=config,
        pow2_scales=True,
    )
    assert (halved.float() - fast.float()).abs().max() > 0.1 * fast.float().abs().max()


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "num_rows,out_features,in_features,config",
    [
        (1, 300, 1000, DECODE_LINEAR),  # split K, partial edge blocks both ways
        (5, 130, 7168, DECODE_LINEAR),  # many splits
        (3, 256, 384, Fp8TileConfig(16, 64, 4, 2, split_target=1)),  # one split
        (70, 200, 260, PREFILL_LINEAR),  # a tall tile: the per-element path
        # 32-row tiles, the scale forced onto the products and onto the elements
        (32, 200, 1000, Fp8TileConfig(32, 64, 4, 3, split_target=16, scale_products=True)),
        (29, 200, 1000, Fp8TileConfig(32, 64, 4, 3, split_target=16, scale_products=False)),
    ],
)
def test_pow2_fp8_linear_matches_the_twin(
    dtype, num_rows, out_features, in_features, config
) -> None:
    gen = torch.Generator().manual_seed(num_rows)
    w = torch.randn(out_features, in_features, generator=gen) * in_features**-0.5
    weight, scale = quantize_fp8_reference(w, pow2_scales=True)
    scale = scale * torch.exp2(torch.randint(-3, 4, scale.shape, generator=gen).float())
    assert scales_are_powers_of_two(scale) and len(scale.unique()) > 2
    weight, scale = weight.to(DEVICE), scale.to(DEVICE)
    x = torch.randn(num_rows, in_features, generator=gen).to(dtype).to(DEVICE)
    expected = fp8_linear_reference(x, weight, scale)
    fast = fp8_linear_triton(x, weight, scale, config=config, pow2_scales=True)
    assert_close(fast, expected)
    assert_close(fast, fp8_linear_triton(x, weight, scale, config=config))
    # The path reads the scales: one block's scale doubled moves that block's outputs only.
    doubled = scale.clone()
    doubled[0, 0] *= 2
    moved = fp8_linear_triton(x, weight, doubled, config=config, pow2_scales=True)
    diff = (moved.float() - fast.float()).abs().amax(0)
    assert diff[:128].max() > 0 and diff[128:].max() == 0


def _pow2_linear(out_features: int, in_features: int, seed: int):
    """An FP8 weight with UE8M0 scales spread over 2^-3 .. 2^3 of amax's."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=gen) * in_features**-0.5
    weight, scale = quantize_fp8_reference(w, pow2_scales=True)
    scale = scale * torch.exp2(torch.randint(-3, 4, scale.shape, generator=gen).float())
    assert scales_are_powers_of_two(scale) and len(scale.unique()) > 2
    return weight.to(DEVICE), scale.to(DEVICE), gen


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "out_features,in_features,config",
    [
        (300, 1000, Fp8GemvConfig(32, 256, 4, split_target=40)),  # split, edges both ways
        (130, 7168, Fp8GemvConfig(64, 512, 4, split_target=64)),  # many splits of 4 blocks
        (256, 384, Fp8GemvConfig(32, 128, 4, split_target=1)),  # one split
        (576, 7168, W8A16_GEMV_CONFIG),  # kv_a's rows: a partial last scale block
    ],
)
def test_one_row_kernel_matches_the_twin(dtype, out_features, in_features, config) -> None:
    weight, scale, gen = _pow2_linear(out_features, in_features, seed=out_features)
    x = torch.randn(1, in_features, generator=gen).to(dtype).to(DEVICE)
    got = fp8_linear_triton(x, weight, scale, config=config, pow2_scales=True)
    assert_close(got, fp8_linear_reference(x, weight, scale))
    assert torch.equal(fp8_linear_triton(x, weight, scale, config=config, pow2_scales=True), got)
    # The kernel reads each block's scale: one doubled moves that block's outputs only.
    doubled = scale.clone()
    doubled[0, -1] *= 2
    moved = fp8_linear_triton(x, weight, doubled, config=config, pow2_scales=True)
    diff = (moved.float() - got.float()).abs()[0]
    assert diff[:128].max() > 0 and diff[128:].max() == 0
    counters = fp8_linear._TILE_COUNTERS.get(x.device)
    assert counters is None or int(counters.count_nonzero()) == 0


@needs_triton
def test_one_row_with_pow2_scales_takes_the_cuda_core_kernel_and_no_other(monkeypatch) -> None:
    """The launcher's choice: one row with pow2_scales goes to the one-row kernel; more rows, or
    per-element scales, go to the tensor-core kernel; a GEMV config elsewhere is refused."""
    weight, scale, gen = _pow2_linear(200, 700, seed=1)
    calls = []
    real = fp8_linear._fp8_gemv
    monkeypatch.setattr(
        fp8_linear, "_fp8_gemv", lambda *args: calls.append(args[-1]) or real(*args)
    )
    one, two = (torch.randn(rows, 700, generator=gen).to(DEVICE) for rows in (1, 2))
    assert_close(
        fp8_linear_triton(one, weight, scale, pow2_scales=True),
        fp8_linear_reference(one, weight, scale),
    )
    assert calls == [W8A16_GEMV_CONFIG]
    fp8_linear_triton(two, weight, scale, pow2_scales=True)
    fp8_linear_triton(one, weight, scale)
    assert calls == [W8A16_GEMV_CONFIG]
    for x, pow2 in ((two, True), (one, False)):
        with pytest.raises(ValueError, match="one-row kernel"):
            fp8_linear_triton(x, weight, scale, config=W8A16_GEMV_CONFIG, pow2_scales=pow2)


def test_the_one_row_kernels_splits_are_whole_steps() -> None:
    """Its K splits are in block_k steps: 7168 is 28 steps of 256; 66 tiles for 528 programs
    want 8 splits, so 4 steps each, which 7 splits cover."""
    assert split_k(66, 7168, 528, 256) == (7, 1024)
    assert split_k(66, 7168, 528) == (8, 896)  # 128-wide, the tensor-core kernel's
    assert split_k(4, 7168, 1, 256) == (1, 7168)


def _pow2_experts(num_local: int, hidden: int, intermediate: int, seed: int):
    w13, w2, w13_scale, w2_scale = fp8_experts(num_local, hidden, intermediate, seed=seed)
    return w13, w2, to_powers_of_two(w13_scale), to_powers_of_two(w2_scale)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "num_local,first_expert,ids,hidden,intermediate,config",
    [
        # pairs 0 and 2 held here, 1 elsewhere; partial edge tiles and scale blocks both ways
        (3, 2, [3, 7, 4], 300, 160, MoeGemvConfig(32, 256, 4)),
        (6, 0, [5, 0, 2, 3], 300, 160, MoeGemvConfig(64, 128, 4, 16)),  # every pair held here
        (4, 5, [6], 384, 256, ONE_TOKEN_CONFIG),  # top-1: one pair, nothing to sum
    ],
)
def test_one_token_expert_kernels_match_the_twin(
    dtype, num_local, first_expert, ids, hidden, intermediate, config
) -> None:
    """One token's FP8 experts on CUDA cores (no grouped layout, the pairs summed in the down
    kernel's launch) equal the twin and the tensor-core tiles; pairs routed to experts held
    elsewhere add nothing; the same bits on a second run, the tile counters left at zero."""
    w13, w2, w13_scale, w2_scale = _pow2_experts(num_local, hidden, intermediate, len(ids))
    gen = torch.Generator().manual_seed(len(ids))
    topk_ids = torch.tensor([ids], dtype=torch.int32, device=DEVICE)
    weights = (torch.rand(1, len(ids), generator=gen) + 0.5).to(DEVICE)
    x = torch.randn(1, hidden, generator=gen).to(dtype).to(DEVICE)
    scales = dict(w13_scale=w13_scale, w2_scale=w2_scale)
    args = (x, w13, w2, weights, topk_ids, first_expert)
    expected = grouped_moe_reference(*args, **scales)
    got = grouped_moe_triton(*args, **scales, config=config, pow2_scales=True)
    assert_close(got, expected)
    assert expected.float().abs().max() > 0
    assert torch.equal(grouped_moe_triton(*args, **scales, config=config, pow2_scales=True), got)
    tiles = grouped_moe_triton(*args, **scales, config=DECODE_CONFIG, pow2_scales=True)
    assert_close(got, tiles)
    counters = fp8_linear._TILE_COUNTERS.get(x.device)
    assert counters is None or int(counters.count_nonzero()) == 0
    # Each held pair counts with its routing weight; a pair held elsewhere with none.
    for slot, expert in enumerate(ids):
        zeroed = weights.clone()
        zeroed[0, slot] = 0.0
        moved = grouped_moe_triton(
            x, w13, w2, zeroed, topk_ids, first_expert, **scales, config=config, pow2_scales=True
        )
        held = first_expert <= expert < first_expert + num_local
        if held:
            assert (moved.float() - got.float()).abs().max() > 0
            assert_close(
                moved, grouped_moe_reference(x, w13, w2, zeroed, topk_ids, first_expert, **scales)
            )
        else:
            assert torch.equal(moved, got)


def _shared_from(w13, w2, w13_scale, w2_scale, expert: int) -> SharedExpert:
    """Expert `expert` of a routed set as a shared expert, in the merged linears' layout."""
    blocks_i, blocks_h = w13_scale.shape[2:]
    return SharedExpert(
        w13[expert],
        w2[expert],
        w13_scale[expert].reshape(2 * blocks_i, blocks_h),
        w2_scale[expert],
        pow2_scales=True,
    )


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "num_local,first_expert,ids,config",
    [
        (3, 2, [3, 7, 4], MoeGemvConfig(32, 256, 4)),  # a pair held elsewhere
        (4, 0, [2], ONE_TOKEN_CONFIG),  # top-1: the shared expert makes it a sum of two
    ],
)
def test_one_token_kernels_run_the_shared_expert_as_one_more_pair(
    dtype, num_local, first_expert, ids, config
) -> None:
    """The shared expert in the routed launches is exactly one more routed pair of weight 1 in
    the last slot (the same bits as that expert appended to the routed ones), equals the twin
    (routed and shared in one fp32 sum), and counts: without it the output is the routed one."""
    hidden, intermediate = 300, 256  # whole gate and up scale blocks; partial edge blocks in H
    w13, w2, w13_scale, w2_scale = _pow2_experts(num_local + 1, hidden, intermediate, len(ids))
    shared = _shared_from(w13, w2, w13_scale, w2_scale, num_local)
    routed = (w13[:num_local], w2[:num_local], w13_scale[:num_local], w2_scale[:num_local])
    gen = torch.Generator().manual_seed(7)
    topk_ids = torch.tensor([ids], dtype=torch.int32, device=DEVICE)
    weights = (torch.rand(1, len(ids), generator=gen) + 0.5).to(DEVICE)
    x = torch.randn(1, hidden, generator=gen).to(dtype).to(DEVICE)

    def run(experts, weights, ids, shared=None):
        w13_, w2_, s13, s2 = experts
        return grouped_moe_triton(
            x,
            w13_,
            w2_,
            weights,
            ids,
            first_expert,
            s13,
            s2,
            config=config,
            pow2_scales=True,
            shared=shared,
        )

    got = run(routed, weights, topk_ids, shared)
    # The shared expert appended as routed expert `num_local` (local id), weight 1, last slot.
    appended_ids = torch.cat(
        [topk_ids, torch.tensor([[first_expert + num_local]], dtype=torch.int32, device=DEVICE)], 1
    )
    appended_weights = torch.cat([weights, torch.ones(1, 1, device=DEVICE)], 1)
    assert torch.equal(got, run((w13, w2, w13_scale, w2_scale), appended_weights, appended_ids))
    expected = grouped_moe_reference(
        x, *routed[:2], weights, topk_ids, first_expert, *routed[2:], shared=shared
    )
    assert_close(got, expected)
    without = run(routed, weights, topk_ids)
    assert (without.float() - got.float()).abs().max() > 0
    # The twin's shared expert: the routed sum's fp32 plus the shared expert's output.
    shared_alone = grouped_moe_reference(
        x,
        *shared.as_routed()[:2],
        torch.ones(1, 1, device=DEVICE),
        torch.zeros(1, 1, dtype=torch.int32, device=DEVICE),
        0,
        *shared.as_routed()[2:],
    )
    assert_close(expected, (without.float() + shared_alone.float()).to(dtype), scale=2.0)
    assert torch.equal(run(routed, weights, topk_ids, shared), got)


@needs_triton
def test_the_shared_expert_goes_only_where_the_one_token_kernels_run() -> None:
    w13, w2, w13_scale, w2_scale = _pow2_experts(4, 300, 256, seed=5)
    shared = _shared_from(w13, w2, w13_scale, w2_scale, 3)
    routed = (w13[:3], w2[:3], w13_scale[:3], w2_scale[:3])
    scales = dict(w13_scale=routed[2], w2_scale=routed[3])
    one, two = (torch.randn(rows, 300).to(DEVICE) for rows in (1, 2))
    ids1 = torch.tensor([[1, 2]], dtype=torch.int32, device=DEVICE)
    ids2 = torch.tensor([[1, 2], [0, 1]], dtype=torch.int32, device=DEVICE)
    w1, w2_ = torch.ones(1, 2, device=DEVICE), torch.ones(2, 2, device=DEVICE)
    assert one_token_takes_shared(one, routed[0], routed[1], True, shared)
    assert not one_token_takes_shared(two, routed[0], routed[1], True, shared)
    assert not one_token_takes_shared(one, routed[0], routed[1], False, shared)
    not_pow2 = dataclasses.replace(shared, pow2_scales=False)
    assert not one_token_takes_shared(one, routed[0], routed[1], True, not_pow2)
    with pytest.raises(ValueError, match="shared expert goes only"):
        grouped_moe_triton(
            two, *routed[:2], w2_, ids2, 0, **scales, pow2_scales=True, shared=shared
        )
    with pytest.raises(ValueError, match="shared expert goes only"):
        grouped_moe_triton(
            one, *routed[:2], w1, ids1, 0, **scales, pow2_scales=True, shared=not_pow2
        )
    narrow = _shared_from(*_pow2_experts(1, 300, 128, seed=6), 0)
    with pytest.raises(ValueError, match="is not a routed expert"):
        grouped_moe_triton(one, *routed[:2], w1, ids1, 0, **scales, pow2_scales=True, shared=narrow)


@needs_triton
def test_one_token_with_pow2_scales_takes_the_one_token_kernels_and_no_other(monkeypatch) -> None:
    """The launcher's choice: one token of FP8 experts with pow2_scales goes to the one-token
    kernels; more tokens, per-element scales or bf16 experts go to the tiles; the one-token
    config elsewhere is refused."""
    w13, w2, w13_scale, w2_scale = _pow2_experts(4, 300, 160, seed=3)
    scales = dict(w13_scale=w13_scale, w2_scale=w2_scale)
    calls = []
    real = moe_experts._grouped_moe_one_token
    monkeypatch.setattr(
        moe_experts,
        "_grouped_moe_one_token",
        lambda *args: calls.append(args[8]) or real(*args),  # the config
    )
    one, two = (torch.randn(rows, 300).to(DEVICE) for rows in (1, 2))
    ids1 = torch.tensor([[1, 2]], dtype=torch.int32, device=DEVICE)
    ids2 = torch.tensor([[1, 2], [0, 3]], dtype=torch.int32, device=DEVICE)
    w1, w2_ = torch.ones(1, 2, device=DEVICE), torch.ones(2, 2, device=DEVICE)
    assert_close(
        grouped_moe_triton(one, w13, w2, w1, ids1, 0, **scales, pow2_scales=True),
        grouped_moe_reference(one, w13, w2, w1, ids1, 0, **scales),
    )
    assert calls == [ONE_TOKEN_CONFIG]
    grouped_moe_triton(two, w13, w2, w2_, ids2, 0, **scales, pow2_scales=True)
    grouped_moe_triton(one, w13, w2, w1, ids1, 0, **scales)
    assert calls == [ONE_TOKEN_CONFIG]
    with pytest.raises(ValueError, match="one-token expert kernels"):
        grouped_moe_triton(
            two, w13, w2, w2_, ids2, 0, **scales, config=ONE_TOKEN_CONFIG, pow2_scales=True
        )
    with pytest.raises(ValueError, match="one-token expert kernels"):
        grouped_moe_triton(one, w13, w2, w1, ids1, 0, **scales, config=ONE_TOKEN_CONFIG)
