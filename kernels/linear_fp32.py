"""Small fp32-weight projections at decode sizes: the MoE router and the indexer's head weights.

DeepSeek keeps both in fp32 (the router's choice and the indexer's near-ties are discontinuous
in them), so their inputs are upcast. The kernel reads the bf16 activations directly and each
weight tile once for every token of the step; the twin upcasts and calls F.linear.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.launch import FLOAT_DTYPES, check_tensor, launch
from kernels.platform import tl, triton


def linear_fp32_reference(
    x: torch.Tensor, weight: torch.Tensor, scale: float = 1.0
) -> torch.Tensor:
    """(x @ weight.T) * scale in fp32: x [T, K] of any float dtype, weight [N, K] -> [T, N]."""
    out = F.linear(x.float(), weight.float())
    return out * scale if scale != 1.0 else out


# --- Triton ---------------------------------------------------------------------------------------

# Tokens up to which the kernel runs (decode and MTP verify steps); larger steps use the twin
# (a tensor-core GEMM reuses weight tiles better).
MAX_TOKENS = 32
_BLOCK_N = 1  # one weight row a program: 256 programs for the router, 64 for the indexer


# Batch-dependent sizes, strides and index-tensor offsets are not specialized on: a new batch
# shape must not compile a variant mid-serving (Worker.warm_up compiles the rest).
@triton.jit(
    do_not_specialize=["x_row_stride", "num_tokens"], do_not_specialize_on_alignment=["x_ptr"]
)
def _linear_fp32_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    x_row_stride,
    w_row_stride,
    num_tokens,
    n,
    k,
    scale,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    tokens = tl.arange(0, BLOCK_T)
    kk = tl.arange(0, BLOCK_K)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        k_mask = (k0 + kk) < k
        w = tl.load(
            w_ptr + cols[:, None] * w_row_stride + k0 + kk[None, :],
            mask=(cols[:, None] < n) & k_mask[None, :],
            other=0.0,
        ).to(tl.float32)  # [BLOCK_N, BLOCK_K]
        x = tl.load(
            x_ptr + tokens[:, None] * x_row_stride + k0 + kk[None, :],
            mask=(tokens[:, None] < num_tokens) & k_mask[None, :],
            other=0.0,
        ).to(tl.float32)  # [BLOCK_T, BLOCK_K]
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    tl.store(
        out_ptr + tokens[:, None] * n + cols[None, :],
        acc * scale,
        mask=(tokens[:, None] < num_tokens) & (cols[None, :] < n),
    )


def linear_fp32_triton(x: torch.Tensor, weight: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """Triton twin of `linear_fp32_reference` for at most MAX_TOKENS tokens (else the twin)."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor("weight", weight, ndim=2, dtypes=FLOAT_DTYPES, device=x.device)
    num_tokens, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"weight {tuple(weight.shape)} does not take rows of {k}")
    if num_tokens > MAX_TOKENS:
        return linear_fp32_reference(x, weight, scale)
    out = torch.empty(num_tokens, n, dtype=torch.float32, device=x.device)
    if num_tokens > 0:
        block_t = max(1, triton.next_power_of_2(num_tokens))
        launch(
            _linear_fp32_kernel,
            (triton.cdiv(n, _BLOCK_N),),
            x,
            x,
            weight,
            out,
            x.stride(0),
            weight.stride(0),
            num_tokens,
            n,
            k,
            scale,
            BLOCK_T=block_t,
            BLOCK_N=_BLOCK_N,
            BLOCK_K=max(64, 2048 // block_t),
            num_warps=4,
        )
    return out


def warm_up_linear_fp32(device: torch.device, x_dtype: torch.dtype) -> None:
    """Compile the kernel's variants (BLOCK_T and BLOCK_K follow the row count) for every row
    count it takes, for activations of `x_dtype` against fp32 weights (the router's and the
    indexer's, as the model keeps them); sizes and strides are not specialized on, so a small
    dummy weight does."""
    weight = torch.zeros(16, 128, dtype=torch.float32, device=device)
    for num_tokens in range(1, MAX_TOKENS + 1):
        linear_fp32_triton(torch.zeros(num_tokens, 128, dtype=x_dtype, device=device), weight)
