"""`kernels.ops` picks the Triton kernel where `use_triton` says so and the twin otherwise."""

from __future__ import annotations

import inspect

import pytest
import torch

from kernels import (
    activation,
    argmax,
    cache_write,
    fp8,
    fp8_gemm,
    fp8_mla_absorb,
    indexer,
    linear_fp32,
    moe_experts,
    moe_routing,
    ops,
    rmsnorm,
    rope,
    sparse_mla,
)
from kernels.settings import SettingsError, reload_settings

TWINS = {
    "rms_norm": rmsnorm.rms_norm_reference,
    "linear_fp32": linear_fp32.linear_fp32_reference,
    "fp8_linear": fp8.fp8_linear_reference,
    "add_rms_norm": rmsnorm.add_rms_norm_reference,
    "rope": rope.rope_reference,
    "rope_cos_sin": rope.rope_cos_sin,
    "mla_kv_cache_write": cache_write.mla_kv_cache_write_reference,
    "indexer_k_cache_write": cache_write.indexer_k_cache_write_reference,
    "indexer_topk": indexer.indexer_topk_reference,
    "sparse_mla_attention": sparse_mla.sparse_mla_attention_reference,
    "moe_route": moe_routing.moe_route_reference,
    "grouped_moe": moe_experts.grouped_moe_reference,
    "mla_absorb_q": fp8_mla_absorb.absorb_q_reference,
    "mla_absorb_out": fp8_mla_absorb.absorb_out_reference,
    "silu_and_mul": activation.silu_and_mul_reference,
    "argmax": argmax.argmax_reference,
}


@pytest.mark.parametrize("name", sorted(TWINS))
def test_ops_keep_the_twins_signatures(name: str) -> None:
    assert inspect.signature(getattr(ops, name)) == inspect.signature(TWINS[name])


@pytest.mark.parametrize(
    "force_reference,device,expect",
    [
        ("0", "cuda", "triton"),
        ("1", "cuda", "twin"),
        ("0", "cpu", "twin"),
    ],
)
def test_use_triton_policy(monkeypatch, force_reference, device, expect) -> None:
    from kernels.platform import use_triton

    monkeypatch.setenv("MTPSERVE_FORCE_REFERENCE", force_reference)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the interpreter never routes the model to Triton
    reload_settings()  # the code reads the environment once
    assert use_triton(torch.device(device)) == (expect == "triton")


@pytest.mark.parametrize("triton_on", [True, False])
def test_ops_dispatch_follows_use_triton(monkeypatch, triton_on) -> None:
    monkeypatch.setattr(ops, "use_triton", lambda device: triton_on)
    called: list[str] = []
    monkeypatch.setattr(ops, "silu_and_mul_triton", lambda x: called.append("triton") or x)
    monkeypatch.setattr(ops, "silu_and_mul_reference", lambda x: called.append("twin") or x)
    ops.silu_and_mul(torch.zeros(2, 4))
    assert called == ["triton" if triton_on else "twin"]


@pytest.mark.parametrize(
    "triton_on, dtype, num_rows, mode, in_prompt, expect",
    [
        (False, torch.bfloat16, 256, "1", True, "twin"),
        (True, torch.bfloat16, ops.W8A8_MIN_TOKENS, "1", False, "w8a8"),
        (True, torch.float16, 2048, "all", False, "w8a8"),
        (True, torch.bfloat16, ops.W8A8_MIN_TOKENS - 1, "1", True, "w8a16"),
        (True, torch.float32, 2048, "1", True, "w8a16"),  # fp32: the exact w8a16 math, always
        (True, torch.bfloat16, 2048, "0", True, "w8a16"),
        (True, torch.bfloat16, 2048, "off", True, "w8a16"),
        # the default (unset, or prefill): prompt steps only
        (True, torch.bfloat16, 2048, "", True, "w8a8"),
        (True, torch.bfloat16, ops.W8A8_MIN_TOKENS, "prefill", True, "w8a8"),
        (True, torch.bfloat16, 2048, "", False, "w8a16"),
        (True, torch.bfloat16, ops.W8A8_MIN_TOKENS - 1, "", True, "w8a16"),
        (True, torch.float32, 2048, "", True, "w8a16"),
    ],
)
def test_fp8_linear_dispatch(
    monkeypatch, triton_on, dtype, num_rows, mode, in_prompt, expect
) -> None:
    """Few rows or fp32 activations keep the w8a16 kernel; bf16 / fp16 with enough rows
    quantize the activations (w8a8) in prompt steps by default, in every step with `all`, in
    none with `off`."""
    monkeypatch.setenv("MTPSERVE_FP8_W8A8", mode)
    reload_settings()  # the code reads the environment once
    monkeypatch.setattr(ops, "use_triton", lambda device: triton_on)
    monkeypatch.setattr(ops, "fp8_tensor_cores", lambda device: True)
    called: list[str] = []
    for name, label in (
        ("fp8_linear_reference", "twin"),
        ("fp8_linear_triton", "w8a16"),
        ("fp8_linear_w8a8", "w8a8"),
    ):
        monkeypatch.setattr(ops, name, lambda *args, label=label, **kwargs: called.append(label))
    with ops.prompt_step(in_prompt):
        ops.fp8_linear(torch.zeros(num_rows, 8, dtype=dtype), torch.zeros(4, 8), torch.ones(1, 1))
    assert called == [expect]


def test_prompt_step_is_scoped() -> None:
    """prompt_step holds inside its block only, nested blocks restore the outer value, and an
    exception leaves it as it was."""
    reload_settings()
    x = torch.zeros(ops.W8A8_MIN_TOKENS, 8, dtype=torch.bfloat16)
    seen = []
    with ops.prompt_step():
        seen.append(ops._in_prompt_step.get())
        with ops.prompt_step(False):
            seen.append(ops._in_prompt_step.get())
        seen.append(ops._in_prompt_step.get())
    with pytest.raises(RuntimeError), ops.prompt_step():
        raise RuntimeError
    seen.append(ops._in_prompt_step.get())
    assert seen == [True, False, True, False]
    assert not ops.use_fp8_w8a8(x)  # on this CPU: no FP8 tensor cores


@pytest.mark.parametrize(
    "value, mode",
    [("", "prefill"), ("prefill", "prefill"), ("1", "all"), ("ALL", "all"), ("on", "all")]
    + [("0", "off"), ("off", "off"), ("false", "off")],
)
def test_w8a8_modes(monkeypatch, value, mode) -> None:
    monkeypatch.setenv("MTPSERVE_FP8_W8A8", value)
    assert reload_settings().fp8_w8a8 == mode


@pytest.mark.parametrize(
    "value, mode, cpu, cuda, mps",
    [("", "auto", True, False, False), ("auto", "auto", True, False, False)]
    + [("1", "on", True, True, True), ("ON", "on", True, True, True)]
    + [("off", "off", False, False, False), ("0", "off", False, False, False)],
)
def test_dense_prompt_modes(monkeypatch, value, mode, cpu, cuda, mps) -> None:
    from workers.attention_metadata import dense_prompts_on

    monkeypatch.setenv("MTPSERVE_DENSE_PROMPTS", value)
    assert reload_settings().dense_prompts == mode
    assert dense_prompts_on(torch.device("cpu"), torch.float32) == cpu
    assert dense_prompts_on(torch.device("cpu"), torch.bfloat16) == (mode == "on")
    assert dense_prompts_on(torch.device("cuda"), torch.float32) == cuda
    assert dense_prompts_on(torch.device("cuda"), torch.bfloat16) == cuda
    assert dense_prompts_on(torch.device("mps"), torch.float32) == mps
    monkeypatch.setenv("MTPSERVE_DENSE_PROMPTS", "dense")
    with pytest.raises(SettingsError, match="MTPSERVE_DENSE_PROMPTS='dense'"):
        reload_settings()
    monkeypatch.delenv("MTPSERVE_DENSE_PROMPTS")
    reload_settings()


def test_a_w8a8_typo_is_an_error(monkeypatch) -> None:
    monkeypatch.setenv("MTPSERVE_FP8_W8A8", "prefil")
    with pytest.raises(SettingsError, match="MTPSERVE_FP8_W8A8='prefil'"):
        reload_settings()
    monkeypatch.delenv("MTPSERVE_FP8_W8A8")
    reload_settings()


@pytest.mark.parametrize(
    "mode, triton_on, fp8_cores, expect",
    [
        ("", True, True, ops.W8A8_MIN_TOKENS),
        ("1", True, True, None),  # every step's size decides: nothing for the runner to do
        ("0", True, True, None),
        ("", False, True, None),
        ("", True, False, None),
    ],
)
def test_w8a8_prompt_rows(monkeypatch, mode, triton_on, fp8_cores, expect) -> None:
    monkeypatch.setenv("MTPSERVE_FP8_W8A8", mode)
    reload_settings()
    monkeypatch.setattr(ops, "use_triton", lambda device: triton_on)
    monkeypatch.setattr(ops, "fp8_tensor_cores", lambda device: fp8_cores)
    assert ops.w8a8_prompt_rows(torch.device("cpu")) == expect


def test_w8a8_warm_up_rows_meet_every_row_bucket() -> None:
    """Every w8a8 tile bucket from W8A8_MIN_TOKENS on is met at its top and below it."""
    rows = ops.w8a8_warm_up_rows()
    assert min(rows) == ops.W8A8_MIN_TOKENS
    tops = [t for t in sorted(fp8_gemm.W8A8_CONFIGS) if t >= ops.W8A8_MIN_TOKENS]
    for low, top in zip([ops.W8A8_MIN_TOKENS - 1] + tops, tops):
        inside = [n for n in rows if low < n <= top]
        assert top in inside
        assert top == ops.W8A8_MIN_TOKENS or any(n % 16 for n in inside)


def test_fp8_linear_needs_fp8_tensor_cores(monkeypatch) -> None:
    monkeypatch.setattr(ops, "use_triton", lambda device: True)
    monkeypatch.setattr(ops, "fp8_tensor_cores", lambda device: False)
    assert not ops.use_fp8_w8a8(torch.zeros(4096, 8, dtype=torch.bfloat16))


@pytest.mark.parametrize(
    "device, capability, hip, expect",
    [
        ("cpu", (9, 0), None, False),
        ("cuda:0", (9, 0), None, True),
        ("cuda:0", (8, 9), None, True),
        ("cuda:0", (8, 0), None, False),  # A100: no FP8 tensor cores
        ("cuda:0", (9, 4), "6.2", False),  # ROCm
    ],
)
def test_fp8_tensor_cores(monkeypatch, device, capability, hip, expect) -> None:
    from kernels import platform

    monkeypatch.setattr(platform, "_cuda_capability", lambda index: capability)
    monkeypatch.setattr(torch.version, "hip", hip)
    assert platform.fp8_tensor_cores(torch.device(device)) == expect


@pytest.mark.parametrize(
    "num_rows, out_features, in_features, available, contiguous, expect",
    [
        (fp8_gemm.CUBLASLT_MIN_ROWS, 256, 512, True, True, "cublaslt"),
        (1000, 256, 512, True, True, "cublaslt"),  # rows padded to 1008
        (fp8_gemm.CUBLASLT_MIN_ROWS - 1, 256, 512, True, True, "triton"),
        (2048, 256, 512, False, True, "triton"),  # this PyTorch / device does not take it
        (2048, 576, 512, True, True, "triton"),  # kv_a's 576 rows: a partial 128-block
        (2048, 256, 384, True, True, "triton"),  # K of 3 blocks: not a multiple of 4
        (2048, 256, 512, True, False, "triton"),  # a strided weight view
    ],
)
def test_fp8_linear_w8a8_takes_cublaslt_where_it_holds(
    monkeypatch, num_rows, out_features, in_features, available, contiguous, expect
) -> None:
    called: list[str] = []
    monkeypatch.setattr(fp8_gemm, "cublaslt_block_scaled", lambda device: available)
    monkeypatch.setattr(
        fp8_gemm,
        "quantize_activations_triton",
        lambda x, **kw: (torch.zeros(-(-x.shape[0] // 16) * 16, 1), kw),
    )
    monkeypatch.setattr(
        fp8_gemm,
        "fp8_gemm_cublaslt",
        lambda q, kw, *args: called.append(("cublaslt", q.shape[0], kw)) or q,
    )
    monkeypatch.setattr(
        fp8_gemm, "fp8_linear_w8a8_triton", lambda *args: called.append(("triton",)) or args[0]
    )
    weight = torch.zeros(out_features, in_features * (1 if contiguous else 2))
    weight = weight if contiguous else weight[:, ::2]
    out = fp8_gemm.fp8_linear_w8a8(
        torch.zeros(num_rows, in_features, dtype=torch.bfloat16), weight, torch.ones(1, 1)
    )
    assert called[0][0] == expect and len(called) == 1
    assert out.shape[0] == num_rows  # padded rows sliced off
    if expect == "cublaslt":
        assert called[0][1] % 16 == 0
        assert called[0][2] == {"scales_token_major": True, "rows_multiple": 16}


@pytest.mark.parametrize("has_libdevice", [True, False])
def test_rope_cos_sin_needs_the_device_math_library(monkeypatch, has_libdevice) -> None:
    """The cos/sin kernel calls libdevice's cos and sin: where Triton has no libdevice module,
    the twin runs instead, never a kernel that cannot compile."""
    from kernels import platform

    monkeypatch.setattr(ops, "use_triton", lambda device: True)
    monkeypatch.setattr(platform, "libdevice", object() if has_libdevice else None)
    called: list[str] = []
    monkeypatch.setattr(ops, "rope_cos_sin_triton", lambda *a: called.append("triton"))
    monkeypatch.setattr(ops, "rope_cos_sin_reference", lambda *a: called.append("twin"))
    ops.rope_cos_sin(torch.zeros(2, dtype=torch.int64), torch.ones(4), 1.0)
    assert called == ["triton" if has_libdevice else "twin"]
