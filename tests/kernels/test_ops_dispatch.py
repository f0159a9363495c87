"""`kernels.ops` picks the Triton kernel where `use_triton` says so and the twin otherwise."""

from __future__ import annotations

import inspect

import pytest
import torch

from kernels import (
    activation,
    cache_write,
    indexer,
    linear_fp32,
    moe_experts,
    moe_routing,
    ops,
    rmsnorm,
    rope,
    sparse_mla,
)
from kernels.settings import reload_settings

TWINS = {
    "rms_norm": rmsnorm.rms_norm_reference,
    "linear_fp32": linear_fp32.linear_fp32_reference,
    "add_rms_norm": rmsnorm.add_rms_norm_reference,
    "rope": rope.rope_reference,
    "mla_kv_cache_write": cache_write.mla_kv_cache_write_reference,
    "indexer_k_cache_write": cache_write.indexer_k_cache_write_reference,
    "indexer_topk": indexer.indexer_topk_reference,
    "sparse_mla_attention": sparse_mla.sparse_mla_attention_reference,
    "moe_route": moe_routing.moe_route_reference,
    "grouped_moe": moe_experts.grouped_moe_reference,
    "silu_and_mul": activation.silu_and_mul_reference,
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
