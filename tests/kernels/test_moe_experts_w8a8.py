"""FP8 routed experts with FP8 activations (w8a8): the twin against DeepSeek's FP8 Linear composed
as its Expert, the Triton kernels against the twin under the interpreter (odd token counts, empty
experts, experts held by other ranks), a tolerance that tells w8a8 from w8a16, and the rule that
picks w8a8 only for opted-in prefill-sized steps."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import ops
from kernels.fp8 import fp8_linear_act_quant_reference
from kernels.fp8_gemm import W8A8_MIN_TOKENS
from kernels.moe_experts import (
    DECODE_MAX_PAIRS,
    GroupedGemmConfig,
    grouped_moe_reference,
    grouped_moe_w8a8_reference,
)
from kernels.moe_experts_w8a8 import W8A8_CONFIG, grouped_moe_w8a8_triton
from kernels.settings import reload_settings
from tests.kernels.conftest import DEVICE, INTERPRETER, assert_close, needs_triton
from tests.kernels.test_moe_experts_fp8 import fp8_experts, routes

# (atol relative to the largest |expected|, rtol) of the kernels against the w8a8 twin. Both
# quantize x to the same FP8 bytes (act_quant is exact), but their GEMMs add in different orders:
# where the last fp32 bits move the intermediate across an e4m3 rounding midpoint, that value
# moves a whole e4m3 step (1/16 to 1/8 of itself) before the down GEMM. bf16 adds a one-ulp
# (2**-8) rounding of the output. The w8a16 result lies outside every entry
# (test_tolerance_tells_w8a8_from_w8a16): activations not quantized are caught.
W8A8_TOLERANCES = {
    torch.float32: (3e-3, 3e-3),
    torch.bfloat16: (8e-3, 8e-3),
    torch.float16: (3e-3, 3e-3),
}
W8A8_DTYPES = list(W8A8_TOLERANCES)

# num_tokens, hidden, intermediate, num_local, num_total, first_expert, top_k. H and I multiples
# of 128 (one to three scale blocks), then one shape with partial edge blocks.
CASES = [
    (1, 256, 128, 4, 6, 1, 3),
    (7, 128, 384, 6, 20, 2, 3),
    (131, 256, 256, 6, 12, 3, 2),
    (33, 300, 160, 4, 11, 5, 2),
]
# The launcher's default (one 128-group per program row) and two groups per program row.
CONFIGS = {
    "default": W8A8_CONFIG,
    "m16-n256": GroupedGemmConfig(block_m=16, block_n=256, block_k=128, num_warps=4, num_stages=2),
}


def _inputs(num_tokens, hidden, intermediate, num_local, num_total, top_k, dtype, seed=0):
    experts = fp8_experts(num_local, hidden, intermediate, seed=seed + num_tokens)
    weights, ids = routes(num_tokens, num_total, top_k, seed=seed + num_tokens)
    # x64 (exact): outputs of ~1 to ~30, so assert_close's atol is relative to the largest one
    weights = weights * 64
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype).to(DEVICE)
    return x, experts, weights, ids


def _deepseek_expert(x_rows, w13, w2, w13_scale, w2_scale, e):
    """DeepSeek's Expert (w2(silu(w1(x)) * w3(x))) over its FP8 Linear (act_quant, then the FP8
    GEMM in fp32, out in x's dtype): kernels.fp8's dense activation twin, three times."""
    intermediate = w13.shape[1] // 2
    gate = fp8_linear_act_quant_reference(x_rows, w13[e, :intermediate], w13_scale[e, 0])
    up = fp8_linear_act_quant_reference(x_rows, w13[e, intermediate:], w13_scale[e, 1])
    return fp8_linear_act_quant_reference(F.silu(gate) * up, w2[e], w2_scale[e])


@pytest.mark.parametrize("dtype", W8A8_DTYPES)
def test_twin_is_deepseeks_expert_token_by_token(dtype) -> None:
    """Closed form: per token, the sum over its held slots of weight x DeepSeek's FP8 Expert."""
    num_tokens, hidden, intermediate, num_local, num_total, first_expert, top_k = CASES[1]
    x, experts, weights, ids = _inputs(
        num_tokens, hidden, intermediate, num_local, num_total, top_k, dtype
    )
    expected = torch.zeros(num_tokens, hidden, dtype=torch.float32, device=DEVICE)
    for t in range(num_tokens):
        for slot in range(top_k):
            e = int(ids[t, slot]) - first_expert
            if 0 <= e < num_local:
                y = _deepseek_expert(x[t : t + 1], *experts, e)[0]
                expected[t] += y.float() * weights[t, slot].float()
    actual = grouped_moe_w8a8_reference(x, *experts[:2], weights, ids, first_expert, *experts[2:])
    assert_close(actual, expected.to(dtype), tolerances=W8A8_TOLERANCES)


@needs_triton
@pytest.mark.parametrize("dtype", W8A8_DTYPES)
@pytest.mark.parametrize("config", list(CONFIGS.values()), ids=list(CONFIGS))
@pytest.mark.parametrize(
    "num_tokens,hidden,intermediate,num_local,num_total,first_expert,top_k", CASES
)
def test_w8a8_grouped_moe_matches_twin(
    dtype, config, num_tokens, hidden, intermediate, num_local, num_total, first_expert, top_k
) -> None:
    x, experts, weights, ids = _inputs(
        num_tokens, hidden, intermediate, num_local, num_total, top_k, dtype
    )
    w13, w2, w13_scale, w2_scale = experts
    expected = grouped_moe_w8a8_reference(
        x, w13, w2, weights, ids, first_expert, w13_scale, w2_scale
    )
    actual = grouped_moe_w8a8_triton(
        x, w13, w2, weights, ids, first_expert, w13_scale, w2_scale, config=config
    )
    assert_close(actual, expected, tolerances=W8A8_TOLERANCES)
    local = ids.long() - first_expert
    held = local[(local >= 0) & (local < num_local)].unique()
    assert held.numel() > 0 and expected.float().abs().max() > 0
    assert (local >= num_local).any() or (local < 0).any()  # some routes go to other ranks
    if num_tokens < 10:  # the small steps leave some local experts without a token
        assert held.numel() < num_local


@needs_triton
@pytest.mark.parametrize("block_n,warps", [(64, 4), (256, 8)])
def test_the_down_gemms_own_tile_gives_the_same_bits(block_n, warps) -> None:
    """`down_config` (W8A8_DOWN_CONFIG): another N tile and warp count for the down GEMM alone
    change no product's rounding (each K step is still one 128-column scale block, in order),
    so on the GPU the output is the default's, bit for bit, and the twin's within its tolerance.
    Under Triton's interpreter (3.9) a tile's dot is a host matmul whose summation order within
    the 128-column block follows the tile's shape: there the two agree to fp32's last bits."""
    num_tokens, hidden, intermediate, num_local, num_total, first_expert, top_k = CASES[2]
    x, experts, weights, ids = _inputs(
        num_tokens, hidden, intermediate, num_local, num_total, top_k, torch.float32
    )
    w13, w2, w13_scale, w2_scale = experts
    args = (x, w13, w2, weights, ids, first_expert, w13_scale, w2_scale)
    down = GroupedGemmConfig(W8A8_CONFIG.block_m, block_n, 128, warps, 2)
    actual = grouped_moe_w8a8_triton(*args, config=W8A8_CONFIG, down_config=down)
    default = grouped_moe_w8a8_triton(*args, config=W8A8_CONFIG)
    if INTERPRETER:
        assert_close(actual, default)  # fp32: to 2e-5 of the largest
    else:
        assert torch.equal(actual, default)
    assert_close(actual, grouped_moe_w8a8_reference(*args), tolerances=W8A8_TOLERANCES)


@pytest.mark.parametrize("dtype", W8A8_DTYPES)
def test_tolerance_tells_w8a8_from_w8a16(dtype) -> None:
    """The same experts with activations left in x's dtype (the w8a16 twin) fail the w8a8
    tolerance at every test shape: the kernel test would catch a skipped quantization."""
    for num_tokens, hidden, intermediate, num_local, num_total, first_expert, top_k in CASES:
        x, experts, weights, ids = _inputs(
            num_tokens, hidden, intermediate, num_local, num_total, top_k, dtype
        )
        w13, w2, w13_scale, w2_scale = experts
        w8a8 = grouped_moe_w8a8_reference(
            x, w13, w2, weights, ids, first_expert, w13_scale, w2_scale
        )
        w8a16 = grouped_moe_reference(x, w13, w2, weights, ids, first_expert, w13_scale, w2_scale)
        with pytest.raises(AssertionError):
            assert_close(w8a16, w8a8, tolerances=W8A8_TOLERANCES)


@needs_triton
def test_w8a8_launcher_rejects_what_it_cannot_run() -> None:
    x, (w13, w2, w13_scale, w2_scale), weights, ids = _inputs(3, 256, 128, 2, 2, 1, torch.float32)
    with pytest.raises(ValueError, match="block_k"):  # a K step must be one scale block
        grouped_moe_w8a8_triton(
            x,
            *(w13, w2, weights, ids, 0, w13_scale, w2_scale),
            config=GroupedGemmConfig(
                block_m=16, block_n=128, block_k=64, num_warps=4, num_stages=2
            ),
        )
    with pytest.raises(ValueError, match="block_n"):  # the epilogue quantizes whole groups
        grouped_moe_w8a8_triton(
            x,
            *(w13, w2, weights, ids, 0, w13_scale, w2_scale),
            config=GroupedGemmConfig(
                block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=2
            ),
        )
    with pytest.raises(ValueError, match="layout's block_m"):  # one layout for both GEMMs
        grouped_moe_w8a8_triton(
            x,
            *(w13, w2, weights, ids, 0, w13_scale, w2_scale),
            config=W8A8_CONFIG,
            down_config=GroupedGemmConfig(
                block_m=2 * W8A8_CONFIG.block_m, block_n=128, block_k=128, num_warps=4, num_stages=2
            ),
        )
    with pytest.raises(ValueError, match="together"):
        grouped_moe_w8a8_triton(x, w13, w2, weights, ids, 0, w13_scale, None)
    with pytest.raises(TypeError, match="w13"):
        grouped_moe_w8a8_triton(x, w13.float(), w2, weights, ids, 0, w13_scale, w2_scale)


def test_w8a8_steps_are_past_decode_size_with_top8() -> None:
    """The one threshold (in tokens) puts DeepSeek's top-8 w8a8 steps past the grouped MoE's
    decode-sized steps (in routed pairs)."""
    assert W8A8_MIN_TOKENS * 8 > DECODE_MAX_PAIRS


BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


@pytest.mark.parametrize(
    "triton_on, dtype, num_tokens, enable, fp8, expect",
    [
        (True, BF16, W8A8_MIN_TOKENS, "1", True, "w8a8"),
        (True, FP16, 2048, "1", True, "w8a8"),
        (True, BF16, W8A8_MIN_TOKENS - 1, "1", True, "w8a16"),
        (True, BF16, 1, "1", True, "w8a16"),  # decode steps
        (True, BF16, 32, "1", True, "w8a16"),
        (True, BF16, 2048, "0", True, "w8a16"),
        (True, BF16, 2048, "", True, "w8a8"),  # the default: prompt steps (the test's are)
        (True, FP32, 2048, "1", True, "w8a16"),  # fp32: the exact w8a16 math, always
        (True, BF16, 2048, "1", False, "bf16"),  # unquantized experts
        (False, BF16, 2048, "1", True, "twin"),
    ],
)
def test_grouped_moe_picks_w8a8_as_the_linears_do(
    monkeypatch, triton_on, dtype, num_tokens, enable, fp8, expect
) -> None:
    monkeypatch.setenv("MTPSERVE_FP8_W8A8", enable)
    reload_settings()  # the code reads the environment once
    monkeypatch.setattr(ops, "use_triton", lambda device: triton_on)
    monkeypatch.setattr(ops, "fp8_tensor_cores", lambda device: True)
    monkeypatch.setattr(ops.deepgemm, "use_deepgemm", lambda x, active=None: False)
    called: list[str] = []

    def spy(label):
        return lambda *args, **kwargs: called.append(label)

    monkeypatch.setattr(ops, "grouped_moe_reference", spy("twin"))
    monkeypatch.setattr(ops, "grouped_moe_triton", spy("w8a16" if fp8 else "bf16"))
    monkeypatch.setattr(ops, "grouped_moe_w8a8_triton", spy("w8a8"))
    x = torch.zeros(num_tokens, 8, dtype=dtype)
    scales = (torch.ones(1, 2, 1, 1), torch.ones(1, 1, 1)) if fp8 else (None, None)
    with ops.prompt_step():
        ops.grouped_moe(
            x, torch.zeros(1, 8, 8), torch.zeros(1, 8, 4), x[:, :1], x[:, :1], 0, *scales
        )
        if fp8 and triton_on:  # the FP8 linears of the same step take the same side
            assert ops.use_fp8_w8a8(x) == (expect == "w8a8")
    assert called == [expect]
