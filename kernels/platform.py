"""Where kernels run: the one PDL gate, whether Triton kernels are used at all, and the one
place Triton is imported.

Environment variables come from `kernels.settings`, read once.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import torch

from kernels.settings import settings

logger = logging.getLogger(__name__)


class _Unlaunchable:
    """A kernel defined where Triton is not installed: the ops run its twin instead."""

    def __init__(self, fn: Callable) -> None:
        self.__name__ = getattr(fn, "__name__", "kernel")

    def __getitem__(self, grid: Any):
        raise RuntimeError(f"{self.__name__}: Triton is not installed (the ops use the twins)")


class _NoTriton:
    """Stands in for `triton` where it cannot be imported (no macOS or Windows builds), so the
    kernel modules still import and define their twins. Only what runs at import is here."""

    @staticmethod
    def jit(fn: Callable | None = None, **options: Any):
        return _Unlaunchable(fn) if fn is not None else _Unlaunchable

    @staticmethod
    def cdiv(a: int, b: int) -> int:
        return -(-a // b)

    @staticmethod
    def next_power_of_2(n: int) -> int:
        return 1 << max(n - 1, 0).bit_length()


class _NoTritonLanguage:
    """Stands in for `triton.language`: module-level constexprs are their plain values."""

    @staticmethod
    def constexpr(value: Any = None) -> Any:
        return value


try:
    import triton
    import triton.language as tl
except ImportError:
    triton, tl, libdevice = _NoTriton(), _NoTritonLanguage(), None
    HAS_TRITON = False
    logger.warning("Triton is not installed: every op runs its pure-torch twin")
else:
    HAS_TRITON = True
    try:  # the device math library's functions (CUDA's libdevice, ROCm's ocml), exact
        from triton.language.extra import libdevice
    except ImportError:  # not where Triton keeps it: the kernels that need it run their twins
        libdevice = None


def triton_interpreter() -> bool:
    return settings().triton_interpret


def force_reference() -> bool:
    """MTPSERVE_FORCE_REFERENCE=1 makes every op run its pure-torch twin."""
    return settings().force_reference


@functools.cache
def _cuda_capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


def pdl_enabled(device: torch.device | None = None) -> bool:
    """The single decision on programmatic dependent launch.

    True only on CUDA (not ROCm, not XPU) with compute capability >= 9.0, outside Triton's
    interpreter, and unless MTPSERVE_DISABLE_PDL=1. Every USE_PDL constexpr, every `launch_pdl=`
    keyword, every warm-up enumeration and DeepGEMM's set_pdl asks this function.
    """
    if settings().disable_pdl or triton_interpreter():
        return False
    if device is not None and device.type != "cuda":
        return False
    if not torch.cuda.is_available() or torch.version.hip is not None:
        return False
    if getattr(torch, "xpu", None) is not None and torch.xpu.is_available():
        return False
    index = device.index if device is not None and device.index is not None else 0
    return _cuda_capability(index)[0] >= 9


def fp8_tensor_cores(device: torch.device) -> bool:
    """Whether tl.dot takes FP8 operands here: CUDA (not ROCm) with compute capability >= 8.9."""
    if device.type != "cuda" or torch.version.hip is not None:
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _cuda_capability(index) >= (8, 9)


def ensure_triton_cache_dir() -> str:
    """Triton's compiled kernels go to TRITON_CACHE_DIR when it is set, else to
    `$XDG_CACHE_HOME/mtpserve/triton` (`~/.cache/...`), which this sets for the process (and the
    processes it starts) before anything compiles: kernels compiled once load from there after a
    restart instead of compiling again. Returns the directory."""
    path = settings().triton_cache_dir
    if not path:
        path = os.path.join(settings().cache_home, "triton")
        os.environ["TRITON_CACHE_DIR"] = path  # for Triton, in this process and its children
    os.makedirs(path, exist_ok=True)
    return path


def use_triton(device: torch.device) -> bool:
    """Triton kernels on CUDA devices (where Triton is installed) unless forced off; the twins
    everywhere else.

    Under TRITON_INTERPRET=1 on CPU the model still runs the twins: the interpreter is how the
    kernel tests run each kernel against its twin, far too slow to serve a model through.
    """
    return HAS_TRITON and device.type == "cuda" and not force_reference()


class LateCompileLog:
    """After warm-up, every Triton kernel variant that still has to be compiled (or loaded from
    the disk cache) is one log line naming the kernel and its specialization, with the time it
    took: the step it lands in stalls for that long, so warm-up missed a shape it should cover.
    `count` says how many there were. Installed by `watch_late_compiles`; hooks are per process."""

    def __init__(self) -> None:
        self.count = 0
        self.seconds = 0.0
        self._started: dict[str, float] = {}

    def before(self, *, key: Any, repr: str, fn: Any, **_: Any) -> bool:
        self._started[str(key)] = time.perf_counter()
        return False  # False: go on and compile

    def after(self, *, key: Any, repr: str, fn: Any, compile: dict, **_: Any) -> None:
        started = self._started.pop(str(key), None)
        seconds = time.perf_counter() - started if started is not None else 0.0
        self.count += 1
        self.seconds += seconds
        # The specialization: constexpr values and the integer/pointer arguments Triton assumed
        # divisible by 16 or equal to 1 (argument positions), which is what differs per variant.
        signature = list(compile.get("signature", {}))
        constants = {
            signature[path[0]] if path and path[0] < len(signature) else str(path): value
            for path, value in compile.get("constants", {}).items()
            if not str(value).startswith("<")  # constexpr functions and dtypes: not per variant
        }
        logger.warning(
            "Triton kernel %s compiled after warm-up in %.0f ms (the step waited); "
            "constants %s, argument attributes %s",
            getattr(fn, "name", fn),
            seconds * 1e3,
            constants,
            compile.get("configs"),
        )


def stop_watching_late_compiles() -> None:
    """Remove the hooks a `watch_late_compiles` installed; hooks of anyone else stay. A warm-up
    calls this first: the hooks are per process, so another engine's watch in the same process
    would log this warm-up's compiles as its own late ones."""
    if not HAS_TRITON:
        return
    from triton import knobs

    runtime = knobs.runtime
    for name in ("jit_cache_hook", "jit_post_compile_hook"):
        if isinstance(getattr(getattr(runtime, name), "__self__", None), LateCompileLog):
            setattr(runtime, name, None)


def watch_late_compiles() -> LateCompileLog | None:
    """Log every Triton compile from now on in this process (`LateCompileLog`); None where
    Triton compiles nothing (not installed, or its interpreter)."""
    if not HAS_TRITON or triton_interpreter():
        return None
    from triton import knobs

    log = LateCompileLog()
    knobs.runtime.jit_cache_hook = log.before
    knobs.runtime.jit_post_compile_hook = log.after
    return log
