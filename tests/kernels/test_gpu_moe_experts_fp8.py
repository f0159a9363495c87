"""GPU: FP8 routed experts at DeepSeek-V3.2's real shapes against the twins (w8a16, and w8a8 with
FP8 activations), and PDL on vs off inside CUDA graphs over 1,000 replays. Run on the H200 with
`pytest -m gpu tests/kernels`."""

from __future__ import annotations

import pytest
import torch

from kernels import ops
from kernels.fp8 import FP8_DTYPE, scale_grid, scales_are_powers_of_two, to_fp8
from kernels.fp8_gemm import W8A8_MIN_TOKENS
from kernels.moe_experts import (
    SharedExpert,
    grouped_moe_reference,
    grouped_moe_triton,
    grouped_moe_w8a8_reference,
)
from kernels.moe_experts_w8a8 import grouped_moe_w8a8_triton
from kernels.moe_routing import moe_route_triton
from kernels.platform import pdl_enabled
from kernels.settings import reload_settings
from tests.kernels.conftest import (
    assert_close,
    assert_close_but_rare_rounding_flips,
    pdl_on_and_off_over_graph_replays,
)
from tests.kernels.test_fp8_pow2_scales import to_powers_of_two
from tests.kernels.test_moe_experts_w8a8 import W8A8_TOLERANCES

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# DeepSeek-V3.2
HIDDEN, NUM_EXPERTS, TOP_K, NUM_GROUPS, TOPK_GROUPS, MOE_INTER = 7168, 256, 8, 8, 4, 2048
BF16 = torch.bfloat16
CUDA = torch.device("cuda")

# (E_local, I, first_expert): one GPU with every expert; EP=8's rank 2; TP=8's shard of I.
LAYOUTS = {
    "ep1": (NUM_EXPERTS, MOE_INTER, 0),
    "ep8-rank2": (NUM_EXPERTS // 8, MOE_INTER, 64),
    "tp8": (NUM_EXPERTS, MOE_INTER // 8, 0),
}


def _fp8_experts(num_local: int, intermediate: int, seed: int = 0):
    """Random FP8 experts as a checkpoint holds them, built an expert at a time (no fp32 copy of
    all of them): values spread over e4m3's range, scales making weights of ~0.02 that vary per
    128x128 block. The ep1 layout is 11.3 GB."""
    gen = torch.Generator(device=CUDA).manual_seed(seed)
    w13 = torch.empty(num_local, 2 * intermediate, HIDDEN, dtype=FP8_DTYPE, device=CUDA)
    w2 = torch.empty(num_local, HIDDEN, intermediate, dtype=FP8_DTYPE, device=CUDA)
    for e in range(num_local):
        w13[e] = to_fp8(torch.randn(w13.shape[1:], generator=gen, device=CUDA) * 64)
        w2[e] = to_fp8(torch.randn(w2.shape[1:], generator=gen, device=CUDA) * 64)
    grid_13 = scale_grid(intermediate, HIDDEN)
    w13_scale = (torch.rand(num_local, 2, *grid_13, generator=gen, device=CUDA) + 0.5) * 0.02 / 64
    w13_scale[:, 1] *= 4  # the up grid differs from the gate grid
    grid_2 = scale_grid(HIDDEN, intermediate)
    w2_scale = (torch.rand(num_local, *grid_2, generator=gen, device=CUDA) + 0.5) * 0.02 / 64
    return w13, w2, w13_scale, w2_scale


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def fp8_experts(request):
    num_local, intermediate, first_expert = LAYOUTS[request.param]
    return (*_fp8_experts(num_local, intermediate), first_expert)


def _choice_bias(first_expert: int, num_local: int) -> torch.Tensor:
    """Where this rank holds only some experts, two of them get a choice bias above any score,
    so every token routes to the rank (never an all-zero output) and to other ranks too."""
    bias = torch.zeros(NUM_EXPERTS, device=CUDA)
    if num_local < NUM_EXPERTS:
        bias[first_expert : first_expert + 2] = 1.0
    return bias


def _routes(
    num_tokens: int, first_expert: int, num_local: int, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    return moe_route_triton(
        torch.randn(num_tokens, NUM_EXPERTS, device=CUDA),
        _choice_bias(first_expert, num_local),
        NUM_GROUPS,
        TOPK_GROUPS,
        TOP_K,
        True,
        2.5,
    )


@pytest.mark.parametrize("num_tokens", [1, 8, 128, 2048])
def test_fp8_grouped_moe_real_shapes(fp8_experts, num_tokens: int) -> None:
    """Decode (<= 256 pairs) and prefill configs, bf16 activations, against the FP8 twin."""
    w13, w2, w13_scale, w2_scale, first_expert = fp8_experts
    x = torch.randn(num_tokens, HIDDEN, dtype=BF16, device=CUDA)
    weights, ids = _routes(num_tokens, first_expert, w13.shape[0], seed=num_tokens)
    held = (ids >= first_expert) & (ids < first_expert + w13.shape[0])
    assert held.any(1).all() and not (w13.shape[0] < NUM_EXPERTS and held.all())
    scales = dict(w13_scale=w13_scale, w2_scale=w2_scale)
    expected = grouped_moe_reference(x, w13, w2, weights, ids, first_expert, **scales)
    actual = grouped_moe_triton(x, w13, w2, weights, ids, first_expert, **scales)
    assert_close(actual, expected)
    assert_close(ops.grouped_moe(x, w13, w2, weights, ids, first_expert, **scales), expected)


@pytest.mark.parametrize("num_tokens", [1, 8, 32, 2048])
def test_pow2_scales_grouped_moe_real_shapes(fp8_experts, num_tokens: int) -> None:
    """The same experts with every scale rounded to a power of two (UE8M0, as DeepSeek-V3.1 and
    later ship them): the POW2_SCALES kernels (e4m3 tiles to bf16 by way of fp16, the scale on
    each k step's product) against the twin, and against the per-element kernels."""
    w13, w2, w13_scale, w2_scale, first_expert = fp8_experts
    w13_scale, w2_scale = to_powers_of_two(w13_scale), to_powers_of_two(w2_scale)
    assert scales_are_powers_of_two(w13_scale) and scales_are_powers_of_two(w2_scale)
    x = torch.randn(num_tokens, HIDDEN, dtype=BF16, device=CUDA)
    weights, ids = _routes(num_tokens, first_expert, w13.shape[0], seed=num_tokens)
    scales = dict(w13_scale=w13_scale, w2_scale=w2_scale)
    expected = grouped_moe_reference(x, w13, w2, weights, ids, first_expert, **scales)
    fast = grouped_moe_triton(x, w13, w2, weights, ids, first_expert, **scales, pow2_scales=True)
    assert_close(fast, expected)
    assert_close(fast, grouped_moe_triton(x, w13, w2, weights, ids, first_expert, **scales))
    via_ops = ops.grouped_moe(x, w13, w2, weights, ids, first_expert, **scales, pow2_scales=True)
    assert_close(via_ops, expected)


def test_one_token_shared_expert_real_shapes(fp8_experts) -> None:
    """The shared expert inside the one-token launches at DeepSeek-V3.2's shapes: the same bits
    as that expert appended to the routed ones (weight 1, last slot), close to the twin."""
    w13, w2, w13_scale, w2_scale, first_expert = fp8_experts
    w13_scale, w2_scale = to_powers_of_two(w13_scale), to_powers_of_two(w2_scale)
    num_local, intermediate = w13.shape[0], w13.shape[1] // 2
    if intermediate % 128:
        pytest.skip("the shared expert's gate and up need whole scale blocks")
    s13, s2, s13_scale, s2_scale = _fp8_experts(1, intermediate, seed=11)
    s13_scale, s2_scale = to_powers_of_two(s13_scale), to_powers_of_two(s2_scale)
    shared = SharedExpert(
        s13[0], s2[0], s13_scale[0].reshape(-1, s13_scale.shape[-1]), s2_scale[0], True
    )
    x = torch.randn(1, HIDDEN, dtype=BF16, device=CUDA)
    weights, ids = _routes(1, first_expert, num_local, seed=5)
    scales = dict(w13_scale=w13_scale, w2_scale=w2_scale)
    assert ops.moe_takes_shared(x, w13, w2, True, shared)
    got = ops.grouped_moe(
        x, w13, w2, weights, ids, first_expert, **scales, pow2_scales=True, shared=shared
    )
    assert_close(
        got, grouped_moe_reference(x, w13, w2, weights, ids, first_expert, **scales, shared=shared)
    )
    appended = grouped_moe_triton(
        x,
        torch.cat([w13, s13]),
        torch.cat([w2, s2]),
        torch.cat([weights, torch.ones(1, 1, device=CUDA)], 1),
        torch.cat([ids, torch.full((1, 1), first_expert + num_local, device=CUDA)], 1).int(),
        first_expert,
        torch.cat([w13_scale, s13_scale]),
        torch.cat([w2_scale, s2_scale]),
        pow2_scales=True,
    )
    assert torch.equal(got, appended)


def test_fp8_grouped_moe_fp32_activations() -> None:
    """fp32 activations (UPCAST_DOT, ieee): exact dequantization then an fp32 GEMM."""
    w13, w2, w13_scale, w2_scale = _fp8_experts(NUM_EXPERTS // 8, MOE_INTER // 8)
    x = torch.randn(8, HIDDEN, device=CUDA)
    weights, ids = _routes(8, 0, NUM_EXPERTS // 8)
    scales = dict(w13_scale=w13_scale, w2_scale=w2_scale)
    expected = grouped_moe_reference(x, w13, w2, weights, ids, 0, **scales)
    assert_close(grouped_moe_triton(x, w13, w2, weights, ids, 0, **scales), expected)


@pytest.mark.parametrize("num_tokens", [W8A8_MIN_TOKENS, 512, 2048])
def test_w8a8_grouped_moe_real_shapes(fp8_experts, monkeypatch, num_tokens: int) -> None:
    """FP8 activations (prefill sizes) against the w8a8 twin; the op takes this kernel when
    MTPSERVE_FP8_W8A8=1 and gives its bits."""
    w13, w2, w13_scale, w2_scale, first_expert = fp8_experts
    x = torch.randn(num_tokens, HIDDEN, dtype=BF16, device=CUDA)
    weights, ids = _routes(num_tokens, first_expert, w13.shape[0], seed=num_tokens)
    args = (x, w13, w2, weights, ids, first_expert, w13_scale, w2_scale)
    expected = grouped_moe_w8a8_reference(*args)
    actual = grouped_moe_w8a8_triton(*args)
    assert_close_but_rare_rounding_flips(actual, expected, W8A8_TOLERANCES)
    monkeypatch.setenv("MTPSERVE_FP8_W8A8", "1")
    reload_settings()  # the code reads the environment once
    assert torch.equal(ops.grouped_moe(*args), actual)


def _fp8_moe_chain(experts, num_tokens: int, pow2: bool = False):
    """Routing then the FP8 experts, as a decode (8 tokens) or prefill (128) step runs them;
    `pow2`: every scale rounded to a power of two (one token then takes the one-token kernels)."""
    w13, w2, w13_scale, w2_scale, first_expert = experts
    if pow2:
        w13_scale, w2_scale = to_powers_of_two(w13_scale), to_powers_of_two(w2_scale)
    torch.manual_seed(0)
    x = torch.randn(num_tokens, HIDDEN, dtype=BF16, device=CUDA)
    router = torch.randn(num_tokens, NUM_EXPERTS, device=CUDA)
    bias = _choice_bias(first_expert, w13.shape[0])

    def step() -> tuple[torch.Tensor, ...]:
        weights, ids = ops.moe_route(router, bias, NUM_GROUPS, TOPK_GROUPS, TOP_K, True, 2.5)
        moe = ops.grouped_moe(
            x,
            w13,
            w2,
            weights,
            ids,
            first_expert,
            w13_scale=w13_scale,
            w2_scale=w2_scale,
            pow2_scales=pow2,
        )
        return weights, ids, moe

    return step


@pytest.mark.parametrize("num_tokens", [8, 128])
def test_fp8_pdl_on_and_off_identical_over_graph_replays(
    fp8_experts, monkeypatch, num_tokens: int
) -> None:
    assert pdl_enabled(CUDA), "this test is meant for Hopper or newer"
    with_pdl, without_pdl, mismatches = pdl_on_and_off_over_graph_replays(
        lambda: _fp8_moe_chain(fp8_experts, num_tokens), monkeypatch
    )
    assert mismatches == 0
    for on, off in zip(with_pdl, without_pdl):
        assert torch.equal(on, off)


def test_one_token_pdl_on_and_off_identical_over_graph_replays(fp8_experts, monkeypatch) -> None:
    """One token with power-of-two scales: the one-token kernels (the down kernel sums the
    pairs with the split-K tile counters) give the same bits with PDL on and off, replay after
    replay."""
    assert pdl_enabled(CUDA), "this test is meant for Hopper or newer"
    with_pdl, without_pdl, mismatches = pdl_on_and_off_over_graph_replays(
        lambda: _fp8_moe_chain(fp8_experts, 1, pow2=True), monkeypatch
    )
    assert mismatches == 0
    for on, off in zip(with_pdl, without_pdl):
        assert torch.equal(on, off)


@pytest.mark.parametrize("num_tokens", [128, 2048])
def test_w8a8_pdl_on_and_off_identical_over_graph_replays(
    fp8_experts, monkeypatch, num_tokens: int
) -> None:
    """The same chain with MTPSERVE_FP8_W8A8=1 at prefill sizes: the w8a8 kernels (act_quant,
    gate/up, down, sum) under PDL on and off."""
    assert pdl_enabled(CUDA), "this test is meant for Hopper or newer"
    monkeypatch.setenv("MTPSERVE_FP8_W8A8", "1")  # kept by the helper's reload_settings()
    reload_settings()
    assert ops.use_fp8_w8a8(torch.empty(num_tokens, HIDDEN, dtype=BF16, device=CUDA))
    with_pdl, without_pdl, mismatches = pdl_on_and_off_over_graph_replays(
        lambda: _fp8_moe_chain(fp8_experts, num_tokens), monkeypatch
    )
    assert mismatches == 0
    for on, off in zip(with_pdl, without_pdl):
        assert torch.equal(on, off)
