"""Small fp32-weight projections at decode sizes: the MoE router and the indexer's head weights.

DeepSeek keeps both in fp32 (the router's choice and the indexer's near-ties are discontinuous
in them), so their inputs are upcast. The kernel reads the bf16 activations directly and each
weight element once for all the tokens of the step; the twin upcasts and calls F.linear.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.fp8_linear import config_for_rows, split_k_workspace, store_split_k
from kernels.launch import FLOAT_DTYPES, check_tensor, launch
from kernels.platform import tl, triton, triton_interpreter


def linear_fp32_reference(
    x: torch.Tensor, weight: torch.Tensor, scale: float = 1.0
) -> torch.Tensor:
    """(x @ weight.T) * scale in fp32: x [T, K] of any float dtype, weight [N, K] -> [T, N]."""
    out = F.linear(x.float(), weight.float())
    return out * scale if scale != 1.0 else out


# --- Triton ---------------------------------------------------------------------------------------
#
# One program per (BLOCK_N output features, split of K); every program holds all the step's
# tokens (at most MAX_TOKENS), so each weight element is read once whatever the batch. Two tile
# products, by the step's token count (LINEAR_FP32_CONFIGS):
# - few tokens, on CUDA cores: one feature a program, K unsplit, a [BLOCK_T, BLOCK_K] broadcast
#   product summed (a decode step of a few sequences: each program streams one weight row);
# - more, on tensor cores: a tl.dot of the tokens (padded to 16 rows) with tf32x3 precision (bf16
#   activations are exact in tf32 and the weight's two tf32 parts carry its 24 bits: the products
#   are fp32's to ~2^-22), K split in fixed pieces and reduced in the same launch in a fixed order
#   (`store_split_k`, as the FP8 linears do), since 1.8-7.3 MB of weights in 64 or 256 programs
#   do not fill the GPU. The CUDA-core product at 32 tokens (what the kernel did before) cost
#   122 us a router launch on the H200 against a ~2 us floor (BENCHMARKS.md, session 20).


@dataclass(frozen=True)
class LinearFp32Config:
    block_n: int
    block_k: int  # on CUDA cores: the product's elements per token (BLOCK_K = block_k / BLOCK_T)
    k_per_split: int  # a multiple of block_k; 0: K unsplit
    num_warps: int
    num_stages: int
    use_dot: bool = True  # tensor cores (tf32x3); False: CUDA cores


# Tokens up to which the kernel runs (decode and MTP verify steps); larger steps use the twin
# (a tensor-core GEMM reuses weight tiles better).
MAX_TOKENS = 32
_MIN_DOT_TOKENS = 16  # tl.dot's smallest tile: fewer tokens are padded to it
# By tokens, the first key >= the step's (`config_for_rows`). `benchmarks/bench_linear_fp32.py
# --sweep` on the H200 (2026-12-03, BENCHMARKS.md session 20).
LINEAR_FP32_CONFIGS: dict[int, LinearFp32Config] = {
    2: LinearFp32Config(
        block_n=1, block_k=4096, k_per_split=0, num_warps=8, num_stages=1, use_dot=False
    ),
    4: LinearFp32Config(
        block_n=1, block_k=4096, k_per_split=0, num_warps=4, num_stages=1, use_dot=False
    ),
    8: LinearFp32Config(block_n=32, block_k=128, k_per_split=256, num_warps=4, num_stages=3),
    MAX_TOKENS: LinearFp32Config(
        block_n=64, block_k=128, k_per_split=256, num_warps=8, num_stages=3
    ),
}


# Batch-dependent sizes and strides (the partials' [T, N] stride too) are not specialized on: a
# new batch shape must not compile a variant mid-serving (Worker.warm_up compiles the rest, on
# the model's own weight shapes).
@triton.jit(
    do_not_specialize=["x_row_stride", "num_tokens", "partial_split_stride"],
    do_not_specialize_on_alignment=["x_ptr"],
)
def _linear_fp32_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    partial_ptr,
    counter_ptr,
    x_row_stride,
    w_row_stride,
    num_tokens,
    n,
    k,
    scale,
    num_splits,
    k_per_split,
    partial_split_stride,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    USE_DOT: tl.constexpr,
    PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(1)
    tokens = tl.arange(0, BLOCK_T)
    kk = tl.arange(0, BLOCK_K)
    token_mask = tokens < num_tokens
    col_mask = cols < n
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, k)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        k_mask = (k0 + kk) < k_end
        x = tl.load(
            x_ptr + tokens[:, None] * x_row_stride + k0 + kk[None, :],
            mask=token_mask[:, None] & k_mask[None, :],
            other=0.0,
        ).to(tl.float32)  # [BLOCK_T, BLOCK_K]
        w = tl.load(
            w_ptr + cols[:, None] * w_row_stride + k0 + kk[None, :],
            mask=col_mask[:, None] & k_mask[None, :],
            other=0.0,
        ).to(tl.float32)  # [BLOCK_N, BLOCK_K]
        if USE_DOT:
            acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
        else:
            acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    store_split_k(
        acc * scale,
        out_ptr,
        partial_ptr,
        counter_ptr,
        tokens[:, None] * n + cols[None, :],  # out and partials: [T, N]
        token_mask[:, None] & col_mask[None, :],
        tl.program_id(0),
        split,
        num_splits,
        partial_split_stride,
        SPLIT_K,
    )


def linear_fp32_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: float = 1.0,
    config: LinearFp32Config | None = None,
) -> torch.Tensor:
    """Triton twin of `linear_fp32_reference` for at most MAX_TOKENS tokens (else the twin);
    `config`: LINEAR_FP32_CONFIGS' for the token count unless given (benchmarks sweep it)."""
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
        c = config or config_for_rows(num_tokens, LINEAR_FP32_CONFIGS)
        block_t = triton.next_power_of_2(num_tokens)
        if c.use_dot:
            block_t, block_k = max(_MIN_DOT_TOKENS, block_t), c.block_k
        else:  # the broadcast product's elements per token
            block_k = max(16, c.block_k // block_t)
        k_per_split = c.k_per_split or k
        tiles, num_splits = triton.cdiv(n, c.block_n), triton.cdiv(k, k_per_split)
        partial, counters = split_k_workspace(out, num_splits, tiles)
        launch(
            _linear_fp32_kernel,
            (tiles, num_splits),
            x,
            x,
            weight,
            out,
            partial,
            counters,
            x.stride(0),
            weight.stride(0),
            num_tokens,
            n,
            k,
            scale,
            num_splits,
            k_per_split,
            out.numel(),
            BLOCK_T=block_t,
            BLOCK_N=c.block_n,
            BLOCK_K=block_k,
            SPLIT_K=num_splits > 1,
            USE_DOT=c.use_dot,
            # the interpreter computes a dot in fp32 whatever the precision named
            PRECISION="ieee" if triton_interpreter() else "tf32x3",
            num_warps=c.num_warps,
            num_stages=c.num_stages,
        )
    return out


def warm_up_linear_fp32(
    device: torch.device, x_dtype: torch.dtype, weight_shapes: list[tuple[int, int]]
) -> None:
    """Compile the kernel's variants (the tiles follow the row count) for every row count it
    takes, for activations of `x_dtype` against fp32 weights of each of `weight_shapes` (the
    model's router and indexer head weights: the variants specialize on their sizes)."""
    for n, k in weight_shapes:
        weight = torch.zeros(n, k, dtype=torch.float32, device=device)
        for num_tokens in range(1, MAX_TOKENS + 1):
            linear_fp32_triton(torch.zeros(num_tokens, k, dtype=x_dtype, device=device), weight)
