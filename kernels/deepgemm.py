"""Optional DeepGEMM backend for the grouped expert GEMMs, behind a wrapper we can test on CPU.

DeepGEMM is imported lazily, on the first call that needs it; each function is looked up when it
is first used, and a missing one raises an error that names it and the installed version.
`set_pdl` is applied only when our PDL gate allows it and the installed version has it. Whenever
DeepGEMM is absent the callers take the Triton path.

Its grouped GEMMs (bf16, "nt": b is [groups, n, k]) come in two layouts: contiguous (rows sorted
by group, each run padded to the M alignment, `m_indices[row]` = group or -1) for prefill, and
masked (a is [groups, max_m, k], `masked_m[g]` rows valid) for CUDA-graph decode.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from kernels.platform import force_reference, pdl_enabled

CONTIGUOUS_GEMM = "m_grouped_bf16_gemm_nt_contiguous"
MASKED_GEMM = "m_grouped_bf16_gemm_nt_masked"
ALIGNMENT = "get_mk_alignment_for_contiguous_layout"
SET_PDL = "set_pdl"
# DeepGEMM's documented M alignment of the contiguous layout, used when the query is absent.
DEFAULT_M_ALIGNMENT = 128


class DeepGemmSymbolError(RuntimeError):
    """The installed DeepGEMM lacks a function we need."""


def _import_deep_gemm() -> ModuleType:
    return importlib.import_module("deep_gemm")


class DeepGemmBackend:
    """Resolves DeepGEMM and its symbols on first use. `loader` returns the module or raises
    ImportError (tests pass one that returns a recording stand-in)."""

    def __init__(self, loader: Callable[[], Any] = _import_deep_gemm) -> None:
        self._loader = loader
        self._module: Any = None
        self._import_error: Exception | None = None
        self._loaded = False
        self._symbols: dict[str, Callable[..., Any]] = {}
        self._pdl_configured: set[torch.device] = set()

    def _load(self) -> Any:
        if not self._loaded:
            self._loaded = True
            try:
                self._module = self._loader()
            except ImportError as error:  # absent, or built against another torch
                self._import_error = error
        return self._module

    def available(self) -> bool:
        return self._load() is not None

    @property
    def version(self) -> str:
        return str(getattr(self._load(), "__version__", "unknown"))

    def symbol(self, name: str) -> Callable[..., Any]:
        if name not in self._symbols:
            module = self._load()
            if module is None:
                raise DeepGemmSymbolError(
                    f"DeepGEMM is not importable ({self._import_error}); cannot call `{name}`"
                )
            fn = getattr(module, name, None)
            if fn is None:
                raise DeepGemmSymbolError(
                    f"deep_gemm {self.version} has no `{name}`; mtpserve needs a DeepGEMM with "
                    f"`{name}` (or run without DeepGEMM: the Triton path is used when it is absent)"
                )
            self._symbols[name] = fn
        return self._symbols[name]

    def configure_pdl(self, device: torch.device) -> None:
        """Turn DeepGEMM's PDL on once per device when the gate allows and the version has it."""
        if device in self._pdl_configured:
            return
        self._pdl_configured.add(device)
        module = self._load()
        if module is not None and pdl_enabled(device) and hasattr(module, SET_PDL):
            self.symbol(SET_PDL)(True)

    def m_alignment(self) -> int:
        module = self._load()
        if module is not None and hasattr(module, ALIGNMENT):
            return int(self.symbol(ALIGNMENT)())
        return DEFAULT_M_ALIGNMENT

    def grouped_gemm_contiguous(
        self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, m_indices: torch.Tensor
    ) -> None:
        """out [M, N] = a [M, K] @ b[m_indices[row]].T; rows with m_indices -1 are skipped."""
        self.configure_pdl(a.device)
        self.symbol(CONTIGUOUS_GEMM)(a, b, out, m_indices)

    def grouped_gemm_masked(
        self,
        a: torch.Tensor,
        b: torch.Tensor,
        out: torch.Tensor,
        masked_m: torch.Tensor,
        expected_m: int,
    ) -> None:
        """out [G, max_m, N] = a [G, max_m, K] @ b[g].T for the first masked_m[g] rows of g."""
        self.configure_pdl(a.device)
        self.symbol(MASKED_GEMM)(a, b, out, masked_m, expected_m)


backend = DeepGemmBackend()


def use_deepgemm(x: torch.Tensor, active: DeepGemmBackend | None = None) -> bool:
    """DeepGEMM serves bf16 grouped GEMMs on CUDA when it is installed and not forced off."""
    active = backend if active is None else active
    return (
        x.device.type == "cuda"
        and x.dtype == torch.bfloat16
        and not force_reference()
        and active.available()
    )
