"""y = x @ W^T with W in DeepSeek's block-scaled FP8, dequantized in registers.

The weights stay FP8 in HBM (half the bytes of bf16: a decode step reads every weight once, so
this halves the step's floor); activations stay in their dtype. The twins are in kernels/fp8.py:
`fp8_linear_reference` (exact dequantization, then the matmul) is this kernel's spec.

Split K (both FP8 GEMMs, this one and kernels/fp8_gemm.py's) is reduced in the same launch, with
one int32 counter per output tile (`tile_counters`): every launch leaves its counters at zero, so
one buffer per device serves every launch. That assumes one stream at a time per device: two
split-K launches running concurrently on two streams would share counters. A side stream is fine
when it is ordered against the others (the graph warm-up's `wait_stream`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

import torch

from kernels.fp8 import FP8_BLOCK, FP8_DTYPE, POW2_SCALES_MAX_BLOCK_M, scale_grid
from kernels.launch import FLOAT_DTYPES, check_tensor, dot_in_fp32, launch
from kernels.platform import tl, triton

# --- Triton ---------------------------------------------------------------------------------------
#
# One program per (BLOCK_M rows, BLOCK_N output features, split of K). Each K step is one 128-wide
# scale block: the FP8 tile is converted to fp32, multiplied by its rows' scales for that block,
# rounded to the activations' dtype (as the twin rounds the dequantized weight) and fed to
# tl.dot. Decode has few rows and, for a narrow projection, few output tiles (q_a: 1536 outputs
# = 24 tiles of 64 for 132 SMs), so K is split across programs. Serial split-K (CUTLASS's
# semaphore): each split writes its fp32 partial tile to a workspace and counts itself in on its
# tile's counter; the last of a tile's splits to arrive adds all the tile's partials in a fixed
# order (s = 0 .. S-1, from zeros), stores the output and puts the counter back to 0. Which
# program adds does not change the sum: the same bits as a second kernel adding the splits
# (what this replaced: 28 launches of ~2.75 us in an H200 decode step), deterministic over graph
# replays and PDL on/off, unlike atomic adds of the partials.


@dataclass(frozen=True)
class Fp8TileConfig:
    """A launch config of both FP8 GEMMs (this w8a16 one and kernels/fp8_gemm.py's w8a8)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    # Programs to aim for: K is split (in 128-wide blocks; a tile's last split to finish sums
    # them in a fixed order, `store_split_k`) until tiles x splits reaches this; 1 never splits.
    split_target: int = 264
    # With power-of-two scales, scale each k step's product rather than each weight element:
    # None leaves it to the tile's rows (at most POW2_SCALES_MAX_BLOCK_M).
    scale_products: bool | None = None


# The first configs (tests use them as a decode-sized and a prefill-sized tile): decode (M <= 16)
# spreads K over enough programs to fill the H200's 132 SMs twice; prefill uses tensor-core-sized
# tiles. W8A16_CONFIGS below is what the launcher picks from.
DECODE_CONFIG = Fp8TileConfig(block_m=16, block_n=64, num_warps=4, num_stages=4)
PREFILL_CONFIG = Fp8TileConfig(block_m=64, block_n=128, num_warps=8, num_stages=3)
# By rows: the first entry whose key is >= M, the last for any larger M (`config_for_rows`).
# Tuned on the H200 (2026-11-30): `benchmarks/bench_fp8_linear.py --sweep`, the config nearest
# every DeepSeek-V3.2 projection's best per row count. 2-16 rows retuned (2026-12-02) after split
# K moved into the GEMM's launch and UE8M0 scales: splitting to 528 programs took o_proj from
# 49.4 to 37.2 us and the dense down projection from 55.3 to 41.7 at 8 rows (q_b, 384 tiles
# unsplit before, 11.6 to 12.8); BENCHMARKS.md, session 15.
W8A16_CONFIGS: dict[int, Fp8TileConfig] = {
    1: Fp8TileConfig(block_m=16, block_n=64, num_warps=4, num_stages=3, split_target=264),
    16: Fp8TileConfig(block_m=16, block_n=64, num_warps=4, num_stages=3, split_target=528),
    # 17-32 rows (b=32 decode, MTP verify of 8 sequences at k=3) retuned (2026-12-03) with
    # 32-row tiles: the smallest sum over the seven projections, 302.5 us (BENCHMARKS.md,
    # session 20).
    32: Fp8TileConfig(block_m=32, block_n=64, num_warps=4, num_stages=3, split_target=1056),
    64: Fp8TileConfig(block_m=64, block_n=128, num_warps=4, num_stages=3, split_target=132),
    128: Fp8TileConfig(block_m=64, block_n=128, num_warps=4, num_stages=3, split_target=132),
    256: Fp8TileConfig(block_m=64, block_n=128, num_warps=4, num_stages=3, split_target=132),
    2048: Fp8TileConfig(block_m=64, block_n=128, num_warps=4, num_stages=3, split_target=132),
}

Config = TypeVar("Config")


def config_for_rows(num_rows: int, configs: dict[int, Config]) -> Config:
    """The config of the smallest key >= num_rows; the largest key's beyond them all."""
    for max_rows in sorted(configs):
        if num_rows <= max_rows:
            return configs[max_rows]
    return configs[max(configs)]


# Counters of a split-K launch's output tiles, per device: zero between launches (each tile's
# last split puts its counter back), so every launch on the device shares them (one stream at a
# time, see the module docstring). Allocated on a device's first split-K launch, never during a
# CUDA-graph capture (the zeroing would become a graph node); a buffer outgrown is kept, not
# freed, since a captured graph may still point at it.
MIN_TILE_COUNTERS = 4096  # tiles of a split launch < split_target (<= 1056 in the sweeps)
_TILE_COUNTERS: dict[torch.device, torch.Tensor] = {}
_OUTGROWN_TILE_COUNTERS: list[torch.Tensor] = []


def tile_counters(device: torch.device, num_tiles: int) -> torch.Tensor:
    """The device's zeroed int32 tile counters, at least num_tiles of them (grown outside a
    CUDA-graph capture only: growing during one raises RuntimeError)."""
    counters = _TILE_COUNTERS.get(device)
    if counters is not None and counters.numel() >= num_tiles:
        return counters
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        have = 0 if counters is None else counters.numel()
        raise RuntimeError(
            f"split-K needs {num_tiles} tile counters on {device} and has {have}: they cannot be "
            "allocated during a CUDA-graph capture; run this launch eagerly once before capturing"
        )
    if counters is not None:
        _OUTGROWN_TILE_COUNTERS.append(counters)
    counters = torch.zeros(max(num_tiles, MIN_TILE_COUNTERS), dtype=torch.int32, device=device)
    _TILE_COUNTERS[device] = counters
    return counters


def split_k_workspace(
    out: torch.Tensor, num_splits: int, num_tiles: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(partials [S, *out.shape] fp32, the device's tile counters) for `store_split_k`; one
    split stores the output as it is and needs neither (out stands in for both)."""
    if num_splits == 1:
        return out, out
    partial = torch.empty(num_splits, *out.shape, dtype=torch.float32, device=out.device)
    return partial, tile_counters(out.device, num_tiles)


@triton.jit
def store_split_k(
    acc,
    out_ptr,
    partial_ptr,
    counter_ptr,
    offsets,
    mask,
    tile,
    split,
    num_splits,
    partial_split_stride,
    SPLIT_K: tl.constexpr,
):
    """Store a program's fp32 tile `acc` [BLOCK_M, BLOCK_N] at out_ptr + offsets (in out's
    dtype). Split K: the partial goes to the workspace; the tile's last split to arrive sums the
    splits' partials in order s = 0 .. S-1 from zeros, stores that, and zeroes the counter."""
    if not SPLIT_K:
        tl.store(out_ptr + offsets, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(partial_ptr + split * partial_split_stride + offsets, acc, mask=mask)
        # The scalar atomic is one thread's: the barrier puts every thread's partial stores
        # before its release (acq_rel, gpu scope); Triton broadcasts the result after a barrier
        # too, so the reads below come after the acquire in every thread.
        tl.debug_barrier()
        arrived = tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == num_splits - 1:
            total = tl.zeros_like(acc)
            for s in range(num_splits):  # a fixed order
                total += tl.load(
                    partial_ptr + s * partial_split_stride + offsets,
                    mask=mask,
                    other=0.0,
                    cache_modifier=".cg",  # other SMs wrote them: not from L1
                )
            tl.store(out_ptr + offsets, total.to(out_ptr.dtype.element_ty), mask=mask)
            # Every split of this tile has counted itself: the next launch finds a zero.
            tl.atomic_xchg(counter_ptr + tile, 0, sem="relaxed", scope="gpu")


@triton.jit
def _fp8_linear_kernel(
    x_ptr,
    w_ptr,
    scale_ptr,
    out_ptr,
    partial_ptr,
    counter_ptr,
    num_rows,
    out_features,
    in_features,
    x_row_stride,
    w_row_stride,
    scale_row_stride,
    partial_split_stride,
    k_per_split,
    num_splits,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    POW2_SCALES: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # output features
    split = tl.program_id(2)
    kk = tl.arange(0, BLOCK_K)
    row_mask = rows < num_rows
    col_mask = cols < out_features
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, in_features)
    w_rows = w_ptr + cols[:, None].to(tl.int64) * w_row_stride
    scale_rows = scale_ptr + (cols // BLOCK_K) * scale_row_stride
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    for k0 in range(k_start, k_end, BLOCK_K):
        k_mask = (k0 + kk) < k_end
        a = tl.load(
            x_ptr + rows[:, None].to(tl.int64) * x_row_stride + k0 + kk[None, :],
            mask=row_mask[:, None] & k_mask[None, :],
            other=0.0,
        )  # [BLOCK_M, BLOCK_K]
        w = tl.load(w_rows + k0 + kk[None, :], mask=col_mask[:, None] & k_mask[None, :], other=0.0)
        scale = tl.load(scale_rows + k0 // BLOCK_K, mask=col_mask, other=0.0)  # [BLOCK_N]
        if POW2_SCALES:  # the scale on the step's product (exact for a power of two)
            if UPCAST_DOT:
                part = tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
            else:  # e4m3 -> fp16 -> the activations' dtype: exact, and the fast conversion
                part = tl.dot(a, tl.trans(w.to(tl.float16).to(a.dtype)))
            acc += part * scale[None, :]
        else:
            w = w.to(tl.float32) * scale[:, None]  # [BLOCK_N, BLOCK_K], exactly dequantized
            if UPCAST_DOT:
                acc = tl.dot(a.to(tl.float32), tl.trans(w), acc, input_precision="ieee")
            else:
                acc = tl.dot(a, tl.trans(w.to(a.dtype)), acc)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    store_split_k(
        acc,
        out_ptr,
        partial_ptr,
        counter_ptr,
        rows[:, None].to(tl.int64) * out_features + cols[None, :],  # out and partials: [M, N]
        row_mask[:, None] & col_mask[None, :],
        tl.program_id(0) * tl.num_programs(1) + tl.program_id(1),
        split,
        num_splits,
        partial_split_stride,
        SPLIT_K,
    )


@dataclass(frozen=True)
class Fp8GemvConfig:
    """A launch config of the one-row kernel (`_fp8_gemv_kernel`)."""

    block_n: int
    block_k: int  # a multiple of 128: block_k // 128 scale blocks per step
    num_warps: int
    split_target: int  # as Fp8TileConfig's


# One row with UE8M0 scales (a decode step of one sequence without MTP) on CUDA cores instead of
# tensor cores: a [BLOCK_N, BLOCK_K] FP8 tile times the row, summed per 128-block, each block's
# sum times its scale. The tensor-core kernel pads the row to a 16-row tile and converts every
# weight for it; this one reads the same bytes with nothing to pad. Picked by
# `benchmarks/bench_fp8_linear.py --sweep --tokens 1` on the H200 (2026-12-01): 160.4 us over
# DeepSeek-V3.2's projections against 204.0 for the tensor-core kernel's best (BENCHMARKS.md,
# session 14). From two rows the tensor cores win (o_proj 49.1 / 52.8 us at 2 rows, 49.2 / 90.7
# at 4), and with per-element (amax) scales the rounding of each dequantized weight costs what
# it saves.
W8A16_GEMV_CONFIG = Fp8GemvConfig(block_n=32, block_k=512, num_warps=4, split_target=528)


@triton.jit
def gemv_weights(
    w_rows, scale_rows, k0, k_end, col_mask, BLOCK_K: tl.constexpr, SCALE_BLOCK: tl.constexpr
):
    """One K step's FP8 tile [BLOCK_N, BLOCK_K] and its scales [BLOCK_N, BLOCK_K // 128] (scale
    rows read with stride 1). Shared with kernels/moe_experts.py's one-token expert kernels."""
    kk = k0 + tl.arange(0, BLOCK_K)
    w = tl.load(w_rows + kk[None, :], mask=col_mask[:, None] & (kk < k_end)[None, :], other=0.0)
    blocks = k0 // SCALE_BLOCK + tl.arange(0, BLOCK_K // SCALE_BLOCK)
    scale = tl.load(
        scale_rows + blocks[None, :],
        mask=col_mask[:, None] & (blocks * SCALE_BLOCK < k_end)[None, :],
        other=0.0,
    )
    return w, scale


@triton.jit
def gemv_step(
    w,
    scale,
    x_ptr,
    k0,
    k_end,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
):
    """A K step's fp32 partial sums [BLOCK_N]: the row times the tile, per 128-block, each
    block's sum times its scale (a power of two times a sum: exact)."""
    kk = k0 + tl.arange(0, BLOCK_K)
    x = tl.load(x_ptr + kk, mask=kk < k_end, other=0.0).to(tl.float32)
    product = w.to(tl.float32) * x[None, :]  # [BLOCK_N, BLOCK_K]
    sums = tl.sum(tl.reshape(product, [BLOCK_N, BLOCK_K // SCALE_BLOCK, SCALE_BLOCK]), axis=2)
    return tl.sum(sums * scale, axis=1)


@triton.jit
def _fp8_gemv_kernel(
    x_ptr,
    w_ptr,
    scale_ptr,
    out_ptr,
    partial_ptr,
    counter_ptr,
    out_features,
    in_features,
    w_row_stride,
    scale_row_stride,
    k_per_split,
    num_splits,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
    SPLIT_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # output features
    split = tl.program_id(1)
    col_mask = cols < out_features
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, in_features)
    w_rows = w_ptr + cols[:, None].to(tl.int64) * w_row_stride
    scale_rows = scale_ptr + (cols // SCALE_BLOCK)[:, None] * scale_row_stride
    # The weights do not depend on the kernel before this one: the first K step's tile is read
    # before the PDL wait, so its bytes come in while that kernel ends (every split has a step).
    w, scale = gemv_weights(w_rows, scale_rows, k_start, k_end, col_mask, BLOCK_K, SCALE_BLOCK)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    acc = gemv_step(w, scale, x_ptr, k_start, k_end, BLOCK_N, BLOCK_K, SCALE_BLOCK)
    for k0 in range(k_start + BLOCK_K, k_end, BLOCK_K):
        w, scale = gemv_weights(w_rows, scale_rows, k0, k_end, col_mask, BLOCK_K, SCALE_BLOCK)
        acc += gemv_step(w, scale, x_ptr, k0, k_end, BLOCK_N, BLOCK_K, SCALE_BLOCK)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    store_split_k(
        acc,
        out_ptr,
        partial_ptr,
        counter_ptr,
        cols,  # out and partials: [1, N]
        col_mask,
        tl.program_id(0),
        split,
        num_splits,
        out_features,
        SPLIT_K,
    )


def _fp8_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    out: torch.Tensor,
    config: Fp8GemvConfig,
) -> torch.Tensor:
    out_features, in_features = weight.shape
    if config.block_k % FP8_BLOCK:
        raise ValueError(f"block_k {config.block_k} is not a multiple of {FP8_BLOCK}")
    num_tiles = triton.cdiv(out_features, config.block_n)
    num_splits, k_per_split = split_k(num_tiles, in_features, config.split_target, config.block_k)
    partial, counters = split_k_workspace(out, num_splits, num_tiles)
    launch(
        _fp8_gemv_kernel,
        (num_tiles, num_splits),
        x,
        x,
        weight,
        scale_inv,
        out,
        partial,
        counters,
        out_features,
        in_features,
        weight.stride(0),
        scale_inv.stride(0),
        k_per_split,
        num_splits,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        SCALE_BLOCK=FP8_BLOCK,
        SPLIT_K=num_splits > 1,
        num_warps=config.num_warps,
        num_stages=1,
    )
    return out


def split_k(
    num_tiles: int, in_features: int, split_target: int, block_k: int = FP8_BLOCK
) -> tuple[int, int]:
    """(splits, K per split, a multiple of block_k) so that num_tiles x splits is about
    split_target programs; every split has at least one block_k-wide step."""
    k_blocks = -(-in_features // block_k)
    num_splits = max(1, min(k_blocks, -(-split_target // num_tiles)))
    k_per_split = -(-k_blocks // num_splits) * block_k
    return -(-in_features // k_per_split), k_per_split


def scale_on_products(config: Fp8TileConfig) -> bool:
    """Whether a tile with power-of-two scales scales its k steps' products (else each weight
    element)."""
    if config.scale_products is not None:
        return config.scale_products
    return config.block_m <= POW2_SCALES_MAX_BLOCK_M


def fp8_linear_triton(
    x: torch.Tensor,  # [T, in_features]
    weight: torch.Tensor,  # [out_features, in_features] float8_e4m3fn
    scale_inv: torch.Tensor,  # [ceil(out/128), ceil(in/128)] float32
    config: Fp8TileConfig | Fp8GemvConfig | None = None,
    pow2_scales: bool = False,
) -> torch.Tensor:
    """Triton twin of `kernels.fp8.fp8_linear_reference`: [T, out_features] in x's dtype.
    `pow2_scales`: the caller's promise that every scale is a power of two (UE8M0, as
    DeepSeek-V3.1 and later ship them): the scale then multiplies each k step's fp32 product
    instead of every weight element, the same numbers (a power of two times a value is exact)
    up to the fp32 summation order, with fewer instructions per weight element. One row with
    such scales takes the CUDA-core kernel (`W8A16_GEMV_CONFIG`) unless `config` says otherwise;
    an `Fp8GemvConfig` takes one row with power-of-two scales only."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    device = x.device
    check_tensor("weight", weight, ndim=2, dtypes=(FP8_DTYPE,), device=device)
    check_tensor("scale_inv", scale_inv, ndim=2, dtypes=(torch.float32,), device=device)
    num_rows, in_features = x.shape
    out_features = weight.shape[0]
    if weight.shape[1] != in_features:
        raise ValueError(f"weight {tuple(weight.shape)} does not take {in_features} features")
    if tuple(scale_inv.shape) != scale_grid(out_features, in_features):
        raise ValueError(
            f"scale_inv {tuple(scale_inv.shape)}, expected "
            f"{scale_grid(out_features, in_features)} for a {tuple(weight.shape)} weight"
        )
    out = torch.empty(num_rows, out_features, dtype=x.dtype, device=device)
    if num_rows == 0:
        return out
    if config is None and num_rows == 1 and pow2_scales:
        config = W8A16_GEMV_CONFIG
    if isinstance(config, Fp8GemvConfig):
        if num_rows != 1 or not pow2_scales:
            raise ValueError(
                f"the one-row kernel takes 1 row with power-of-two scales, not {num_rows} rows"
                f"{'' if pow2_scales else ' without pow2_scales'}"
            )
        return _fp8_gemv(x, weight, scale_inv, out, config)
    if config is None:
        config = config_for_rows(num_rows, W8A16_CONFIGS)
    tiles_m = triton.cdiv(num_rows, config.block_m)
    tiles_n = triton.cdiv(out_features, config.block_n)
    num_tiles = tiles_m * tiles_n
    num_splits, k_per_split = split_k(num_tiles, in_features, config.split_target)
    partial, counters = split_k_workspace(out, num_splits, num_tiles)
    launch(
        _fp8_linear_kernel,
        (tiles_m, tiles_n, num_splits),
        x,
        x,
        weight,
        scale_inv,
        out,
        partial,
        counters,
        num_rows,
        out_features,
        in_features,
        x.stride(0),
        weight.stride(0),
        scale_inv.stride(0),
        num_rows * out_features,
        k_per_split,
        num_splits,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=FP8_BLOCK,
        SPLIT_K=num_splits > 1,
        UPCAST_DOT=dot_in_fp32(x.dtype),
        POW2_SCALES=pow2_scales and scale_on_products(config),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out
