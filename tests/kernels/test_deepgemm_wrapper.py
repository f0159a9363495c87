"""Our DeepGEMM wrapper, driven by a recording stand-in module on CPU.

These test *our* dispatch (lazy import, symbol lookup, set_pdl gating, layouts handed over, the
result assembled from the GEMM outputs), not DeepGEMM: the stand-in computes the grouped GEMMs
with torch.
"""

from __future__ import annotations

import types

import pytest
import torch

from kernels import deepgemm, platform
from kernels.deepgemm import DeepGemmBackend, DeepGemmSymbolError
from kernels.moe_experts import grouped_moe_deepgemm, grouped_moe_reference
from tests.kernels.conftest import INTERPRETER, assert_close


class RecordingDeepGemm(types.ModuleType):
    """Stands in for `deep_gemm`: records every call, computes the grouped GEMMs with torch."""

    def __init__(self, with_set_pdl: bool = True, alignment: int = 4) -> None:
        super().__init__("deep_gemm")
        self.__version__ = "0.0-recording"
        self.calls: list[tuple[str, tuple]] = []
        self._alignment = alignment
        if with_set_pdl:
            self.set_pdl = lambda enabled: self.calls.append(("set_pdl", (enabled,)))

    def get_mk_alignment_for_contiguous_layout(self) -> int:
        self.calls.append(("get_mk_alignment_for_contiguous_layout", ()))
        return self._alignment

    def m_grouped_bf16_gemm_nt_contiguous(self, a, b, d, m_indices) -> None:
        self.calls.append(("m_grouped_bf16_gemm_nt_contiguous", (a.shape, b.shape, d.shape)))
        assert a.shape[0] % self._alignment == 0 and m_indices.shape == (a.shape[0],)
        for row, group in enumerate(m_indices.tolist()):
            d[row] = (a[row] @ b[group].t()).to(d.dtype) if group >= 0 else 0

    def m_grouped_bf16_gemm_nt_masked(self, a, b, d, masked_m, expected_m) -> None:
        self.calls.append(("m_grouped_bf16_gemm_nt_masked", (a.shape, b.shape, d.shape)))
        for group, rows in enumerate(masked_m.tolist()):
            d[group, :rows] = (a[group, :rows] @ b[group].t()).to(d.dtype)


def _problem(dtype=torch.float32):
    torch.manual_seed(0)
    x = torch.randn(7, 12, dtype=dtype)
    w13 = torch.randn(5, 2 * 6, 12, dtype=dtype) * 0.3
    w2 = torch.randn(5, 12, 6, dtype=dtype) * 0.3
    ids = torch.stack([torch.randperm(8)[:3] for _ in range(7)]).to(torch.int32)
    return x, w13, w2, torch.rand(7, 3), ids


def test_wrapper_imports_lazily_and_resolves_each_symbol_once() -> None:
    loads: list[int] = []
    fake = RecordingDeepGemm()
    backend = DeepGemmBackend(loader=lambda: loads.append(1) or fake)
    assert loads == []  # constructing imports nothing
    fn = backend.symbol(deepgemm.CONTIGUOUS_GEMM)
    assert backend.symbol(deepgemm.CONTIGUOUS_GEMM) is fn and loads == [1]


def test_wrapper_reports_absent_deepgemm_and_the_missing_symbol() -> None:
    def missing():
        raise ImportError("No module named 'deep_gemm'")

    absent = DeepGemmBackend(loader=missing)
    assert not absent.available()
    assert not deepgemm.use_deepgemm(torch.zeros(1, dtype=torch.bfloat16), absent)
    with pytest.raises(DeepGemmSymbolError, match="m_grouped_bf16_gemm_nt_masked"):
        absent.symbol(deepgemm.MASKED_GEMM)

    old = types.ModuleType("deep_gemm")
    old.__version__ = "1.0"
    with pytest.raises(
        DeepGemmSymbolError, match=r"1\.0 has no `m_grouped_bf16_gemm_nt_contiguous`"
    ):
        DeepGemmBackend(loader=lambda: old).symbol(deepgemm.CONTIGUOUS_GEMM)


@pytest.mark.parametrize(
    "gate_on,with_set_pdl,expect_set_pdl",
    [
        (True, True, True),
        (True, False, False),
        (False, True, False),
    ],
)
def test_wrapper_calls_set_pdl_only_when_gate_and_version_allow(
    monkeypatch, gate_on: bool, with_set_pdl: bool, expect_set_pdl: bool
) -> None:
    monkeypatch.setattr(deepgemm, "pdl_enabled", lambda device: gate_on)
    fake = RecordingDeepGemm(with_set_pdl=with_set_pdl)
    backend = DeepGemmBackend(loader=lambda: fake)
    a, b = torch.randn(4, 3), torch.randn(2, 5, 3)
    for _ in range(2):
        backend.grouped_gemm_contiguous(a, b, torch.empty(4, 5), torch.tensor([0, 0, 1, -1]))
    set_pdl_calls = [args for name, args in fake.calls if name == "set_pdl"]
    assert set_pdl_calls == ([(True,)] if expect_set_pdl else [])  # once per device


def test_platform_gate_is_what_deepgemm_asks() -> None:
    assert deepgemm.pdl_enabled is platform.pdl_enabled


@pytest.mark.skipif(not INTERPRETER, reason="SiLU-and-mul between the GEMMs runs in Triton")
@pytest.mark.parametrize("masked", [False, True], ids=["contiguous", "masked"])
def test_wrapper_dispatch_with_recording_deepgemm_matches_twin(masked: bool) -> None:
    x, w13, w2, weights, ids = _problem()
    fake = RecordingDeepGemm()
    backend = DeepGemmBackend(loader=lambda: fake)
    actual = grouped_moe_deepgemm(x, w13, w2, weights, ids, 2, backend, masked=masked)
    assert_close(actual, grouped_moe_reference(x, w13, w2, weights, ids, first_expert=2))
    gemm = deepgemm.MASKED_GEMM if masked else deepgemm.CONTIGUOUS_GEMM
    assert [name for name, _ in fake.calls if name == gemm] == [gemm, gemm]  # gate/up, down
    assert not any(name == "set_pdl" for name, _ in fake.calls)  # CPU: gate off
