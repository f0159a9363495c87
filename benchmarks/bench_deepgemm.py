"""DeepGEMM's block-scaled FP8 GEMM against ours, where DeepGEMM loads: one projection of
DeepSeek-V3.2 at a time, activations quantized per token and 128 columns, weights in 128x128
blocks (the same FP8 operands for both), graph-replayed.

    PYTHONPATH=$PWD python benchmarks/bench_deepgemm.py [--tokens 1,64,2048]

DeepGEMM is not a dependency of mtpserve: it builds against the machine's CUDA and the CUTLASS its
own commit pins, then compiles its kernels at run time with NVCC. When `import deep_gemm` fails
the script prints why and stops (exit 2); when a call fails, the error for that shape. Each
result is checked against `kernels.fp8.fp8_gemm_reference` (both operands dequantized exactly,
the product in fp32) before it is timed.
"""

from __future__ import annotations

import argparse
import sys
from functools import partial

import torch

from benchmarks.bench_fp8_linear import SHAPES, graph_us
from kernels.fp8 import fp8_gemm_reference, quantize_activations_reference, quantize_fp8_reference
from kernels.fp8_gemm import fp8_gemm_triton

# |ours or DeepGEMM - twin| / max |twin|: both accumulate FP8 products in fp32 per 128-wide K
# block; bf16 output rounding is 2^-8 relative.
MAX_REL_ERROR = 1e-2


def _rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="1,64,2048", help="comma-separated row counts")
    args = ap.parse_args()
    try:
        import deep_gemm
    except Exception as e:  # absent, or built against another torch / CUDA
        print(f"deep_gemm does not import: {type(e).__name__}: {e}")
        return 2
    print(f"deep_gemm {getattr(deep_gemm, '__version__', '?')}, {torch.cuda.get_device_name()}")
    print()
    print("| projection | tokens | ours w8a8 us | DeepGEMM us | ours rel err | DeepGEMM rel err |")
    print("|---|---|---|---|---|---|")
    gen = torch.Generator("cuda").manual_seed(0)
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", generator=gen) * k**-0.5
        weight, w_scale = quantize_fp8_reference(w)
        for t in (int(v) for v in args.tokens.split(",")):
            x = torch.randn(t, k, device="cuda", generator=gen).to(torch.bfloat16)
            a, a_scale = quantize_activations_reference(x)
            want = fp8_gemm_reference(a, a_scale, weight, w_scale)
            ours = partial(fp8_gemm_triton, a, a_scale, weight, w_scale, torch.bfloat16)
            ours_err = _rel_error(ours(), want)
            out = torch.empty(t, n, dtype=torch.bfloat16, device="cuda")
            dg = partial(
                deep_gemm.fp8_gemm_nt,
                (a, a_scale),
                (weight, w_scale),
                out,
                disable_ue8m0_cast=True,
            )
            try:
                dg()
                torch.cuda.synchronize()
                dg_err = _rel_error(out, want)
                dg_us = f"{graph_us(dg):.1f}" if dg_err < MAX_REL_ERROR else "wrong"
            except Exception as e:  # this shape only
                dg_err, dg_us = float("nan"), f"failed: {type(e).__name__}: {str(e)[:80]}"
            print(
                f"| {name} | {t} | {graph_us(ours):.1f} | {dg_us} | {ours_err:.1e} | "
                f"{dg_err:.1e} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
