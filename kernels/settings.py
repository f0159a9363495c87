"""Every environment variable mtpserve reads, read in one place into one typed, frozen object.

- `MTPSERVE_DISABLE_PDL=1` (`disable_pdl`): no programmatic dependent launch anywhere;
- `MTPSERVE_PDL_OFF_KERNELS=name,name` (`pdl_off_kernels`): these Triton kernels (by function
  name, e.g. `_rms_norm_kernel`) launch without PDL where the gate would allow it (finding a
  kernel whose early launch costs more than it gains: `benchmarks/bench_decode.py
  --pdl-per-kernel`);
- `MTPSERVE_FORCE_REFERENCE=1` (`force_reference`): every op runs its pure-torch twin;
- `MTPSERVE_FP8_W8A8` (`fp8_w8a8`, one of `W8A8_MODES`): where FP8 linears and FP8 routed
  experts quantize bf16 / fp16 activations to FP8 per token and 128 columns (w8a8, on FP8 tensor
  cores) instead of dequantizing the weights (w8a16). Both only in steps of `W8A8_MIN_TOKENS`
  tokens or more (kernels/fp8_gemm.py). `prefill` (unset: the default) in steps that carry
  prompt tokens only (`kernels.ops.prompt_step`), so decodes and verifies keep one kernel
  whatever the batch; `all` (or 1 / true / yes / on) in every such step; `off` (or 0 / false /
  no) never;
- `MTPSERVE_DENSE_PROMPTS` (`dense_prompts`, one of `DENSE_PROMPT_MODES`): whether an eager
  step's prompt tokens before the indexer's top-k size attend densely (unabsorbed causal
  attention, no indexer scoring; `workers.model_runner.ModelRunner._dense_rows`). `auto` (unset:
  the default) for the CPU in fp32 only (in 16 bits greedy output would then depend on the
  schedule: `workers.attention_metadata.dense_prompts_on`); on (1 / true / yes / on)
  everywhere; off (0 / false / no) nowhere;
- `TRITON_INTERPRET=1` (`triton_interpret`): Triton's interpreter runs the kernels (no PDL);
- `TRITON_CACHE_DIR` (`triton_cache_dir`): where compiled kernels go (unset: under
  `cache_home`, `kernels.platform.ensure_triton_cache_dir`);
- `XDG_CACHE_HOME` (`cache_home` = `$XDG_CACHE_HOME/mtpserve`, else `~/.cache/mtpserve`):
  mtpserve's caches (the tiny model, compiled kernels).

Flags are on for 1 / true / yes / on (any case). `settings()` reads the environment once per
process; `reload_settings()` reads it again, for tests and benchmarks that change it at run
time. It lives in `kernels/`, the bottom of the import order, so every package can ask it.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass

_ON = ("1", "true", "yes", "on")
_OFF = ("0", "false", "no", "off")


def _flag(env: Mapping[str, str], name: str) -> bool:
    return env.get(name, "").strip().lower() in _ON


W8A8_MODES = ("prefill", "all", "off")


class SettingsError(ValueError):
    """An environment variable mtpserve reads holds a value it does not take."""


DENSE_PROMPT_MODES = ("auto", "on", "off")


def _dense_prompts_mode(env: Mapping[str, str]) -> str:
    value = env.get("MTPSERVE_DENSE_PROMPTS", "").strip().lower()
    if value in ("", "auto"):
        return "auto"
    if value in _ON:
        return "on"
    if value in _OFF:
        return "off"
    raise SettingsError(
        f"MTPSERVE_DENSE_PROMPTS={value!r}: expected auto (the default), on (or 1) or off (or 0)"
    )


def _w8a8_mode(env: Mapping[str, str]) -> str:
    """MTPSERVE_FP8_W8A8 -> one of W8A8_MODES; SettingsError for anything else (a typo must not
    silently pick a kernel)."""
    value = env.get("MTPSERVE_FP8_W8A8", "").strip().lower()
    if value in ("", "prefill"):
        return "prefill"
    if value in _ON or value == "all":
        return "all"
    if value in _OFF:
        return "off"
    raise SettingsError(
        f"MTPSERVE_FP8_W8A8={value!r}: expected prefill (the default), all (or 1) or off (or 0)"
    )


@dataclass(frozen=True)
class Settings:
    disable_pdl: bool
    pdl_off_kernels: frozenset[str]
    force_reference: bool
    fp8_w8a8: str  # one of W8A8_MODES
    dense_prompts: str  # one of DENSE_PROMPT_MODES
    triton_interpret: bool
    triton_cache_dir: str | None  # as the user set it; None: unset
    cache_home: str  # mtpserve's cache directory (the tiny model, compiled kernels)

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Settings:
        base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        return cls(
            disable_pdl=_flag(env, "MTPSERVE_DISABLE_PDL"),
            pdl_off_kernels=frozenset(
                name.strip() for name in env.get("MTPSERVE_PDL_OFF_KERNELS", "").split(",")
            )
            - {""},
            force_reference=_flag(env, "MTPSERVE_FORCE_REFERENCE"),
            fp8_w8a8=_w8a8_mode(env),
            dense_prompts=_dense_prompts_mode(env),
            triton_interpret=_flag(env, "TRITON_INTERPRET"),
            triton_cache_dir=env.get("TRITON_CACHE_DIR") or None,
            cache_home=os.path.join(base, "mtpserve"),
        )


@functools.cache
def settings() -> Settings:
    return Settings.from_env(os.environ)


def reload_settings() -> Settings:
    settings.cache_clear()
    return settings()
