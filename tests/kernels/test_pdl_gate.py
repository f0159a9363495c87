"""The PDL gate: where it is off, no launch carries `launch_pdl` and every USE_PDL is False.

Launches are intercepted where Triton receives them (`JITFunction.run`, or the interpreter's
`InterpretedFunction.run`), so these assertions are on what was really passed, not on what a
helper meant to pass. The platform is faked by monkeypatching torch's CUDA/ROCm/XPU queries and by
pretending the tensors live on cuda:0 (`kernels.launch.kernel_device`) and, except in the
interpreter case, that the gate is not under the interpreter; kernels still execute under the
interpreter, on CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

from kernels import launch as launch_module
from kernels import platform
from kernels.activation import silu_and_mul_reference, silu_and_mul_triton
from kernels.argmax import argmax_reference, argmax_triton
from kernels.cache_write import (
    cache_rows_write_reference,
    cache_rows_write_triton,
    indexer_k_cache_write_reference,
    indexer_k_cache_write_triton,
    mla_kv_cache_write_reference,
    mla_kv_cache_write_triton,
)
from kernels.fp8 import (
    FP8_DTYPE,
    fp8_linear_act_quant_reference,
    fp8_linear_reference,
    quantize_fp8_reference,
)
from kernels.fp8_gemm import fp8_linear_w8a8_triton
from kernels.fp8_linear import fp8_linear_triton
from kernels.indexer import (
    indexer_topk_reference,
    indexer_topk_triton,
    topk_select_reference,
    topk_select_triton,
)
from kernels.linear_fp32 import linear_fp32_reference, linear_fp32_triton
from kernels.moe_experts import (
    grouped_moe_reference,
    grouped_moe_triton,
    grouped_moe_w8a8_reference,
)
from kernels.moe_experts_w8a8 import grouped_moe_w8a8_triton
from kernels.moe_routing import moe_route_reference, moe_route_triton
from kernels.rmsnorm import (
    add_rms_norm_reference,
    add_rms_norm_triton,
    rms_norm_reference,
    rms_norm_triton,
)
from kernels.rope import rope_cos_sin, rope_cos_sin_triton, rope_reference, rope_triton
from kernels.settings import reload_settings, settings
from kernels.sparse_mla import sparse_mla_attention_reference, sparse_mla_attention_triton
from tests.kernels.conftest import INTERPRETER

pytestmark = pytest.mark.skipif(not INTERPRETER, reason="runs the kernels under TRITON_INTERPRET=1")

ALL_KERNELS = {
    "_rms_norm_kernel",
    "_rope_kernel",
    "_rope_cos_sin_kernel",
    "_silu_and_mul_kernel",
    "_argmax_chunk_kernel",
    "_argmax_pick_kernel",
    "_mla_kv_cache_write_kernel",
    "_indexer_k_cache_write_kernel",
    "_cache_rows_write_kernel",
    "_indexer_logits_kernel",
    "_topk_select_kernel",
    "_key_histogram_kernel",
    "_bucket_count_kernel",
    "_bucket_write_kernel",
    "_sparse_mla_split_kernel",
    "_sparse_mla_merge_kernel",
    "_moe_route_kernel",
    "_grouped_layout_kernel",
    "_moe_gate_up_kernel",
    "_moe_down_kernel",
    "_moe_sum_kernel",
    "_act_quant_kernel",
    "_moe_gate_up_w8a8_kernel",
    "_moe_down_w8a8_kernel",
    "_linear_fp32_kernel",
    "_fp8_linear_kernel",
    "_fp8_gemm_kernel",
}
# Kernels that also launch with FP8 weights (W_FP8=True), under the same gate.
FP8_WEIGHT_KERNELS = {"_moe_gate_up_kernel", "_moe_down_kernel"}


def _cases() -> list[tuple[str, Callable[..., Any], Callable[..., Any], tuple]]:
    """(name, triton op, twin, args) for every op, on tiny CPU inputs."""
    torch.manual_seed(0)
    f32 = torch.float32
    cos, sin = torch.randn(3, 2), torch.randn(3, 2)
    slots = torch.tensor([5, -1, 64])
    cache = torch.zeros(2, 64, 12)
    k_cache = torch.randn(2, 64, 16)
    block_tables = torch.tensor([[1, 0]], dtype=torch.int32)
    seq_idx = torch.zeros(3, dtype=torch.int32)
    positions = torch.tensor([0, 70, 127], dtype=torch.int32)
    topk = torch.tensor([[0, -1, -1], [3, 70, 1], [100, 2, 127]], dtype=torch.int32)
    ids = torch.tensor([[0, 2], [1, 3], [2, 0]], dtype=torch.int32)
    # FP8 experts with their block scales: both FP8 grouped-MoE paths take these.
    fp8_moe_inputs = (
        torch.randn(3, 6, dtype=f32),
        torch.randn(4, 10, 6).to(FP8_DTYPE),
        torch.randn(4, 6, 5).to(FP8_DTYPE),
        torch.rand(3, 2),
        ids,
        torch.rand(4, 2, 1, 1) + 0.5,
        torch.rand(4, 1, 1) + 0.5,
    )
    return [
        (
            "rms_norm",
            rms_norm_triton,
            rms_norm_reference,
            (torch.randn(3, 9), torch.randn(9), 1e-6),
        ),
        (
            "add_rms_norm",
            add_rms_norm_triton,
            add_rms_norm_reference,
            (torch.randn(3, 9), torch.randn(3, 9), torch.randn(9), 1e-6),
        ),
        ("silu_and_mul", silu_and_mul_triton, silu_and_mul_reference, (torch.randn(3, 10),)),
        ("argmax", argmax_triton, argmax_reference, (torch.randn(3, 5000),)),
        (
            "linear_fp32",
            linear_fp32_triton,
            linear_fp32_reference,
            (torch.randn(3, 70), torch.randn(9, 70), 0.5),
        ),
        (
            "fp8_linear",
            fp8_linear_triton,
            fp8_linear_reference,
            (torch.randn(3, 200), *quantize_fp8_reference(torch.randn(150, 200))),
        ),
        (  # activations quantized (the _act_quant_kernel), then the w8a8 GEMM, K split in two
            "fp8_linear_w8a8",
            fp8_linear_w8a8_triton,
            fp8_linear_act_quant_reference,
            (torch.randn(3, 200), *quantize_fp8_reference(torch.randn(150, 200))),
        ),
        ("rope", rope_triton, rope_reference, (torch.randn(3, 2, 6), cos, sin, True, 4)),
        (
            "rope_cos_sin",
            rope_cos_sin_triton,
            rope_cos_sin,
            (torch.tensor([0, 9, 70]), torch.rand(3), 1.3),
        ),
        (
            "mla_kv_cache_write",
            mla_kv_cache_write_triton,
            mla_kv_cache_write_reference,
            (torch.randn(3, 12), torch.randn(8), 1e-6, cos, sin, cache, slots),
        ),
        (
            "indexer_k_cache_write",
            indexer_k_cache_write_triton,
            indexer_k_cache_write_reference,
            (
                torch.randn(3, 16),
                torch.randn(16),
                torch.randn(16),
                1e-6,
                cos,
                sin,
                torch.zeros(2, 64, 16),
                slots,
            ),
        ),
        (
            "indexer_topk",
            indexer_topk_triton,
            indexer_topk_reference,
            (
                torch.randn(3, 2, 16),
                torch.rand(3, 2),
                k_cache,
                block_tables,
                seq_idx,
                positions,
                4,
                0.25,
            ),
        ),
        (  # returns the cache it wrote
            "cache_rows_write",
            lambda cache, *a: (cache_rows_write_triton(cache, *a), cache)[1],
            lambda cache, *a: (cache_rows_write_reference(cache, *a), cache)[1],
            (torch.zeros(2, 64, 12), slots, torch.randn(3, 12)),
        ),
        (  # standalone, the select counts its own histogram
            "topk_select",
            topk_select_triton,
            topk_select_reference,
            (torch.randn(3, 130), positions, 4),
        ),
        (
            "sparse_mla_attention",
            sparse_mla_attention_triton,
            sparse_mla_attention_reference,
            (torch.randn(3, 2, 16), k_cache, block_tables, seq_idx, topk, 0.25, 12),
        ),
        (  # a top-k wider than one split's keys: split programs, then the merge kernel
            "sparse_mla_attention",
            sparse_mla_attention_triton,
            sparse_mla_attention_reference,
            (
                torch.randn(3, 2, 16),
                k_cache,
                block_tables,
                seq_idx,
                torch.arange(128, dtype=torch.int32).repeat(3, 1),
                0.25,
                12,
            ),
        ),
        (
            "moe_route",
            moe_route_triton,
            moe_route_reference,
            (torch.randn(3, 8), torch.zeros(8), 2, 1, 2, True, 1.0),
        ),
        (
            "grouped_moe",
            grouped_moe_triton,
            grouped_moe_reference,
            (
                torch.randn(3, 6, dtype=f32),
                torch.randn(4, 10, 6),
                torch.randn(4, 6, 5),
                torch.rand(3, 2),
                ids,
            ),
        ),
        (
            "grouped_moe_fp8",
            lambda *a: grouped_moe_triton(*a[:5], w13_scale=a[5], w2_scale=a[6]),
            lambda *a: grouped_moe_reference(*a[:5], w13_scale=a[5], w2_scale=a[6]),
            fp8_moe_inputs,
        ),
        (
            "grouped_moe_w8a8",
            lambda *a: grouped_moe_w8a8_triton(*a[:5], 0, *a[5:]),
            lambda *a: grouped_moe_w8a8_reference(*a[:5], 0, *a[5:]),
            fp8_moe_inputs,
        ),
    ]


@pytest.fixture
def launches(monkeypatch) -> list[tuple[str, dict[str, Any]]]:
    """Every kernel launch as (kernel name, keyword arguments Triton received)."""
    recorded: list[tuple[str, dict[str, Any]]] = []
    for cls in (InterpretedFunction, JITFunction):
        original = cls.run

        def run(self, *args, _original=original, **kwargs):
            recorded.append((self.fn.__name__ if hasattr(self, "fn") else repr(self), kwargs))
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(cls, "run", run)
    return recorded


@pytest.fixture
def fake_platform(monkeypatch):
    """Make the host look like a GPU box; each test then turns one knob."""
    platform._cuda_capability.cache_clear()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=0: (9, 0))
    monkeypatch.setattr(torch.version, "hip", None)
    if getattr(torch, "xpu", None) is not None:
        monkeypatch.setattr(torch.xpu, "is_available", lambda: False)
    monkeypatch.setattr(launch_module, "kernel_device", lambda tensor: torch.device("cuda", 0))
    monkeypatch.delenv("MTPSERVE_DISABLE_PDL", raising=False)
    reload_settings()  # the code reads the environment once
    yield monkeypatch
    platform._cuda_capability.cache_clear()


def _not_interpreted(mp):
    # Our gate stops seeing the interpreter; Triton itself still interprets (it reads the
    # environment lazily, so the variable stays set).
    mp.setattr(platform, "triton_interpreter", lambda: False)


def _rocm(mp):
    mp.setattr(torch.version, "hip", "6.2.41133")
    _not_interpreted(mp)


def _xpu(mp):
    mp.setattr(torch.xpu, "is_available", lambda: True)
    _not_interpreted(mp)


def _interpreter(mp):
    mp.setenv("TRITON_INTERPRET", "1")
    reload_settings()  # the code reads the environment once


def _sm80(mp):
    mp.setattr(torch.cuda, "get_device_capability", lambda index=0: (8, 0))
    _not_interpreted(mp)


def _env_off(mp):
    mp.setenv("MTPSERVE_DISABLE_PDL", "1")
    reload_settings()  # the code reads the environment once
    _not_interpreted(mp)


@pytest.mark.parametrize(
    "make_platform",
    [_rocm, _xpu, _interpreter, _sm80, _env_off],
    ids=["rocm", "xpu", "interpreter", "sm80", "env-disabled"],
)
def test_no_pdl_launch_where_the_gate_is_off(fake_platform, launches, make_platform) -> None:
    make_platform(fake_platform)
    cuda0 = torch.device("cuda", 0)
    assert not platform.pdl_enabled(cuda0)
    for name, triton_op, twin, args in _cases():
        cloned = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
        actual, expected = triton_op(*args), twin(*cloned)
        for got, want in zip(
            actual if isinstance(actual, tuple) else (actual,),
            expected if isinstance(expected, tuple) else (expected,),
        ):
            if name in ("moe_route", "indexer_topk", "topk_select"):  # top-k: compare as sets
                got, want = got.sort(-1).values, want.sort(-1).values
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4, msg=name)
    assert {name for name, _ in launches} == ALL_KERNELS
    assert {name for name, kwargs in launches if kwargs.get("W_FP8")} == FP8_WEIGHT_KERNELS
    for name, kwargs in launches:
        assert "launch_pdl" not in kwargs, name
        assert kwargs["USE_PDL"] is False, name


def test_pdl_launch_where_the_gate_is_on(fake_platform, monkeypatch) -> None:
    """Positive control: on 'Hopper' the same launches carry launch_pdl=True and USE_PDL=True.

    The launches are recorded, not executed: the PDL intrinsics do not run in the interpreter.
    """
    _not_interpreted(fake_platform)
    assert platform.pdl_enabled(torch.device("cuda", 0))
    recorded: list[tuple[str, dict[str, Any]]] = []
    monkeypatch.setattr(
        InterpretedFunction, "run", lambda self, *a, **kw: recorded.append((self.fn.__name__, kw))
    )
    for _, triton_op, _, args in _cases():
        triton_op(*args)
    assert {name for name, _ in recorded} == ALL_KERNELS
    assert {name for name, kwargs in recorded if kwargs.get("W_FP8")} == FP8_WEIGHT_KERNELS
    for name, kwargs in recorded:
        assert kwargs.get("launch_pdl") is True and kwargs["USE_PDL"] is True, name


def test_kernels_named_off_launch_without_pdl(fake_platform, monkeypatch) -> None:
    """MTPSERVE_PDL_OFF_KERNELS takes PDL from the kernels it names, and from no other, where
    the gate is on (recorded launches, as in the positive control above)."""
    _not_interpreted(fake_platform)
    off = {"_rms_norm_kernel", "_linear_fp32_kernel"}
    monkeypatch.setenv("MTPSERVE_PDL_OFF_KERNELS", " _rms_norm_kernel, _linear_fp32_kernel,")
    reload_settings()  # the code reads the environment once
    assert settings().pdl_off_kernels == off
    recorded: list[tuple[str, dict[str, Any]]] = []
    monkeypatch.setattr(
        InterpretedFunction, "run", lambda self, *a, **kw: recorded.append((self.fn.__name__, kw))
    )
    for _, triton_op, _, args in _cases():
        triton_op(*args)
    assert off <= {name for name, _ in recorded}
    for name, kwargs in recorded:
        if name in off:
            assert "launch_pdl" not in kwargs and kwargs["USE_PDL"] is False, name
        else:
            assert kwargs.get("launch_pdl") is True and kwargs["USE_PDL"] is True, name
    monkeypatch.delenv("MTPSERVE_PDL_OFF_KERNELS")
    reload_settings()
