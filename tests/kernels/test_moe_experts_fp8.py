"""FP8 routed experts (e4m3 weights, a float32 scale per 128x128 block, one grid for the gate
rows and one for the up rows of w13): the twin against a hand-written closed form, the Triton
kernels against the twin under the interpreter, at shapes with partial edge blocks and several
blocks per dimension."""

from __future__ import annotations

import pytest
import torch

from kernels import ops
from kernels.fp8 import FP8_BLOCK, scale_grid, to_fp8
from kernels.moe_experts import (
    DECODE_CONFIG,
    EP_DECODE_CONFIG,
    PREFILL_CONFIG,
    GroupedGemmConfig,
    decode_config,
    grouped_moe_reference,
    grouped_moe_triton,
)
from tests.kernels.conftest import DEVICE, DTYPES, assert_close, needs_triton

# The gate grid's scales are ~1e-3, the up grid's ~1: a swap changes every output by ~1000x.
GATE_SCALE, UP_SCALE, DOWN_SCALE = 1e-3, 1.0, 3e-2


def fp8_experts(num_local: int, hidden: int, intermediate: int, seed: int = 0, device=DEVICE):
    """Random FP8 experts with scales that differ per block and per part:
    (w13 [E, 2I, H], w2 [E, H, I], w13_scale [E, 2, gi, gh], w2_scale [E, gh, gi])."""
    gen = torch.Generator().manual_seed(seed)
    # Clamped to e4m3's range: past it a cast gives 448 on some builds and NaN on others (CUDA).
    w13 = to_fp8(torch.randn(num_local, 2 * intermediate, hidden, generator=gen) * 100)
    w2 = to_fp8(torch.randn(num_local, hidden, intermediate, generator=gen) * 100)
    grid_13 = scale_grid(intermediate, hidden)
    # [E, 2, gi, gh]: per block a factor in [0.5, 2) times its part's magnitude
    w13_scale = torch.rand(num_local, 2, *grid_13, generator=gen) * 1.5 + 0.5
    w13_scale[:, 0] *= GATE_SCALE / 100
    w13_scale[:, 1] *= UP_SCALE / 100
    w2_scale = (torch.rand(num_local, *scale_grid(hidden, intermediate), generator=gen) + 0.5) * (
        DOWN_SCALE / 100
    )
    return tuple(t.to(device) for t in (w13, w2, w13_scale, w2_scale))


def routes(num_tokens: int, num_total: int, top_k: int, seed: int = 0):
    """Distinct experts per token out of num_total (some held by other ranks)."""
    gen = torch.Generator().manual_seed(seed + 1)
    ids = torch.stack([torch.randperm(num_total, generator=gen)[:top_k] for _ in range(num_tokens)])
    weights = torch.rand(num_tokens, top_k, generator=gen)
    return weights.to(DEVICE), ids.to(torch.int32).to(DEVICE)


def dequantize_by_blocks(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """[R, C] FP8 x [ceil(R/128), ceil(C/128)] -> fp32, one 128x128 block at a time."""
    out = torch.empty(weight.shape, dtype=torch.float32, device=weight.device)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            rows = slice(i * FP8_BLOCK, (i + 1) * FP8_BLOCK)
            cols = slice(j * FP8_BLOCK, (j + 1) * FP8_BLOCK)
            out[rows, cols] = weight[rows, cols].float() * scale[i, j]
    return out


@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_twin_is_the_bf16_twin_on_block_dequantized_weights(dtype) -> None:
    """Closed form: dequantize every 128x128 block of the gate, up and down weights by hand
    (gate grid for rows 0..I-1, up grid for rows I..2I-1), round to x's dtype, run the
    unquantized twin. Bit-equal: the two compute the same operations."""
    num_local, hidden, intermediate, first_expert = 4, 300, 160, 3
    w13, w2, w13_scale, w2_scale = fp8_experts(num_local, hidden, intermediate)
    weights, ids = routes(9, 10, 3)
    x = torch.randn(9, hidden, device=DEVICE).to(dtype)
    w13_deq = torch.stack(
        [
            torch.cat(
                [
                    dequantize_by_blocks(w13[e, :intermediate], w13_scale[e, 0]),
                    dequantize_by_blocks(w13[e, intermediate:], w13_scale[e, 1]),
                ]
            )
            for e in range(num_local)
        ]
    ).to(dtype)
    w2_deq = torch.stack([dequantize_by_blocks(w2[e], w2_scale[e]) for e in range(num_local)])
    expected = grouped_moe_reference(x, w13_deq, w2_deq.to(dtype), weights, ids, first_expert)
    actual = grouped_moe_reference(
        x, w13, w2, weights, ids, first_expert, w13_scale=w13_scale, w2_scale=w2_scale
    )
    assert torch.equal(actual, expected)
    # Swapping the gate and up grids moves the output far outside any kernel test's tolerance.
    swapped = grouped_moe_reference(
        x, w13, w2, weights, ids, first_expert, w13_scale=w13_scale.flip(1), w2_scale=w2_scale
    )
    assert (swapped.float() - expected.float()).abs().max() > 0.2 * expected.float().abs().max()


def test_fp8_twin_rejects_mismatched_scales() -> None:
    w13, w2, w13_scale, w2_scale = fp8_experts(2, 300, 160)
    weights, ids = routes(3, 2, 1)
    x = torch.randn(3, 300, device=DEVICE)
    with pytest.raises(ValueError, match="together"):
        grouped_moe_reference(x, w13, w2, weights, ids, w13_scale=w13_scale)
    with pytest.raises(ValueError, match="w13_scale"):  # one grid over [gate | up]: not ours
        grouped_moe_reference(
            x, w13, w2, weights, ids, w13_scale=w13_scale[:, 0], w2_scale=w2_scale
        )
    with pytest.raises(ValueError, match="w2_scale"):
        grouped_moe_reference(
            x, w13, w2, weights, ids, w13_scale=w13_scale, w2_scale=w2_scale.transpose(1, 2)
        )
    with pytest.raises(TypeError, match="w13"):
        grouped_moe_reference(
            x, w13.float(), w2, weights, ids, w13_scale=w13_scale, w2_scale=w2_scale
        )


# T in (1, 7, 33); H = 300 and I = 160: three and two 128-blocks, the last one partial.
FP8_CASES = [
    # num_tokens, num_local, num_total, first_expert, top_k
    (1, 3, 8, 2, 2),
    (7, 5, 9, 2, 3),
    (33, 4, 11, 5, 2),
]


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "config",
    [DECODE_CONFIG, EP_DECODE_CONFIG, PREFILL_CONFIG],
    ids=["decode", "ep-decode", "prefill"],
)
@pytest.mark.parametrize("num_tokens,num_local,num_total,first_expert,top_k", FP8_CASES)
def test_fp8_grouped_moe_matches_twin(
    dtype, config, num_tokens, num_local, num_total, first_expert, top_k
) -> None:
    hidden, intermediate = 300, 160
    w13, w2, w13_scale, w2_scale = fp8_experts(num_local, hidden, intermediate, seed=num_tokens)
    weights, ids = routes(num_tokens, num_total, top_k, seed=num_tokens)
    x = torch.randn(num_tokens, hidden, device=DEVICE).to(dtype)
    scales = dict(w13_scale=w13_scale, w2_scale=w2_scale)
    expected = grouped_moe_reference(x, w13, w2, weights, ids, first_expert, **scales)
    actual = grouped_moe_triton(x, w13, w2, weights, ids, first_expert, **scales, config=config)
    assert_close(actual, expected)
    assert expected.float().abs().max() > 0  # the rank holds some routed expert


@needs_triton
def test_fp8_grouped_moe_small_tiles_tiny_intermediate_strided() -> None:
    """I = 32 (tiny test models): one partial block per part; BLOCK_K 32 and BLOCK_N 16, so
    several k steps share one scale block. Weights are views with padded rows and the scales
    are non-contiguous: the kernels follow every stride."""
    hidden, intermediate, num_local = 136, 32, 3
    w13, w2, w13_scale, w2_scale = fp8_experts(num_local, hidden + 8, intermediate + 8, seed=5)
    w13 = torch.cat([w13[:, :intermediate], w13[:, -intermediate:]], 1)[..., :hidden]
    w2 = w2[:, :hidden, :intermediate]  # [E, H, I] with row stride I + 8
    w13_scale = w13_scale.transpose(1, 3).contiguous().transpose(1, 3)  # strides (.., 1, .., ..)
    w2_scale = torch.cat([w2_scale, torch.zeros_like(w2_scale)], 2)[..., :1]  # [E, 2, 1]
    for strided in (w13, w2, w13_scale, w2_scale):
        assert strided.stride() != strided.contiguous().stride()
    weights, ids = routes(5, 4, 2, seed=5)
    x = torch.randn(5, hidden, device=DEVICE)
    config = GroupedGemmConfig(block_m=16, block_n=16, block_k=32, num_warps=4, num_stages=2)
    scales = dict(w13_scale=w13_scale, w2_scale=w2_scale)
    expected = grouped_moe_reference(x, w13, w2, weights, ids, 1, **scales)
    assert_close(grouped_moe_triton(x, w13, w2, weights, ids, 1, **scales, config=config), expected)


@needs_triton
def test_fp8_grouped_moe_rejects_block_k_straddling_scale_blocks() -> None:
    w13, w2, w13_scale, w2_scale = fp8_experts(2, 300, 160)
    weights, ids = routes(3, 2, 1)
    config = GroupedGemmConfig(block_m=16, block_n=64, block_k=256, num_warps=4, num_stages=2)
    with pytest.raises(ValueError, match="block_k"):
        grouped_moe_triton(
            torch.randn(3, 300, device=DEVICE),
            w13,
            w2,
            weights,
            ids,
            w13_scale=w13_scale,
            w2_scale=w2_scale,
            config=config,
        )


@needs_triton
@pytest.mark.parametrize("triton_on", [True, False])
def test_ops_grouped_moe_fp8_runs_triton_never_deepgemm(monkeypatch, triton_on) -> None:
    """With scales the op is the FP8 Triton kernel where Triton runs (even with DeepGEMM
    present: its FP8 grouped GEMMs take another scale layout) and the FP8 twin elsewhere."""
    monkeypatch.setattr(ops, "use_triton", lambda device: triton_on)
    monkeypatch.setattr(ops.deepgemm, "use_deepgemm", lambda x, active=None: True)
    called: list[str] = []

    def spy(name, fn):
        return lambda *args, **kwargs: called.append(name) or fn(*args, **kwargs)

    monkeypatch.setattr(ops, "grouped_moe_triton", spy("triton", grouped_moe_triton))
    monkeypatch.setattr(ops, "grouped_moe_reference", spy("twin", grouped_moe_reference))
    monkeypatch.setattr(ops, "grouped_moe_deepgemm", spy("deepgemm", None))
    hidden, intermediate = 300, 160
    w13, w2, w13_scale, w2_scale = fp8_experts(3, hidden, intermediate, seed=7)
    weights, ids = routes(4, 5, 2, seed=7)
    x = torch.randn(4, hidden, device=DEVICE)
    scales = dict(w13_scale=w13_scale, w2_scale=w2_scale)
    actual = ops.grouped_moe(x, w13, w2, weights, ids, 1, **scales)
    assert called == ["triton" if triton_on else "twin"]
    assert_close(actual, grouped_moe_reference(x, w13, w2, weights, ids, 1, **scales))


def test_decode_tile_follows_the_ranks_share_of_the_experts() -> None:
    """n32 tiles where a rank holds an eighth of the routed experts or less (a token sends it
    about one expert: more programs over its weights), the n64 tile otherwise or when unknown."""
    assert decode_config(32, 256) == EP_DECODE_CONFIG  # DeepSeek-V3.2 at EP=8
    assert decode_config(16, 256) == EP_DECODE_CONFIG
    assert decode_config(64, 256) == DECODE_CONFIG  # EP=4
    assert decode_config(8, 8) == DECODE_CONFIG == decode_config(32, None)
    assert EP_DECODE_CONFIG.block_m == DECODE_CONFIG.block_m  # one grouped layout for both
