"""Routed experts as one grouped matmul over the tokens each expert received."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels.activation import silu_and_mul_reference, silu_and_mul_triton
from kernels.deepgemm import DeepGemmBackend
from kernels.fp8 import (
    FP8_BLOCK,
    FP8_DTYPE,
    POW2_SCALES_MAX_BLOCK_M,
    dequantize_activations_reference,
    dequantize_fp8_reference,
    quantize_activations_reference,
    scale_grid,
)
from kernels.fp8_linear import gemv_step, gemv_weights, split_k_workspace, store_split_k
from kernels.launch import FLOAT_DTYPES, INDEX_DTYPES, check_tensor, dot_in_fp32, launch
from kernels.platform import tl, triton


def check_fp8_scales(
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale: torch.Tensor | None,
    w2_scale: torch.Tensor | None,
) -> bool:
    """Whether the experts are FP8 (both scales given), with every shape and dtype checked:
    w13 [E, 2 * I, H] and w2 [E, H, I] float8_e4m3fn, w13_scale [E, 2, ceil(I/128),
    ceil(H/128)] (one grid for the gate rows, one for the up rows: I need not be a multiple of
    128) and w2_scale [E, ceil(H/128), ceil(I/128)], float32."""
    if w13_scale is None and w2_scale is None:
        return False
    if w13_scale is None or w2_scale is None:
        raise ValueError("w13_scale and w2_scale come together (FP8 experts) or not at all")
    for name, weight in (("w13", w13), ("w2", w2)):
        if weight.dtype != FP8_DTYPE:
            raise TypeError(f"{name}: scales given, so expected {FP8_DTYPE}, got {weight.dtype}")
    for name, scale in (("w13_scale", w13_scale), ("w2_scale", w2_scale)):
        if scale.dtype != torch.float32:
            raise TypeError(f"{name}: expected float32, got {scale.dtype}")
    num_local_experts, two_i, hidden = w13.shape
    intermediate = two_i // 2
    want_13 = (num_local_experts, 2, *scale_grid(intermediate, hidden))
    want_2 = (num_local_experts, *scale_grid(hidden, intermediate))
    if tuple(w13_scale.shape) != want_13:
        raise ValueError(f"w13_scale {tuple(w13_scale.shape)}, expected {want_13}")
    if tuple(w2_scale.shape) != want_2:
        raise ValueError(f"w2_scale {tuple(w2_scale.shape)}, expected {want_2}")
    return True


def dequantize_expert_reference(
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale: torch.Tensor,
    w2_scale: torch.Tensor,
    expert: int,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One FP8 expert exactly dequantized (fp32) and rounded to `dtype`: (w13 [2 * I, H],
    w2 [H, I]). The gate and up halves of w13 each have their own 128x128 scale grid."""
    intermediate = w13.shape[1] // 2
    gate = dequantize_fp8_reference(w13[expert, :intermediate], w13_scale[expert, 0])
    up = dequantize_fp8_reference(w13[expert, intermediate:], w13_scale[expert, 1])
    down = dequantize_fp8_reference(w2[expert], w2_scale[expert])
    return torch.cat([gate, up]).to(dtype), down.to(dtype)


@dataclass(frozen=True)
class SharedExpert:
    """An expert every token takes with weight 1 (DeepSeek's shared expert), laid out as one of
    the routed experts: w13 [2 * I, H] ([gate | up]), w2 [H, I]; FP8 with the linears' scale
    grids, w13_scale [2 * I / 128, H / 128] (gate's block rows, then up's: I a multiple of 128)
    and w2_scale [H / 128, I / 128]."""

    w13: torch.Tensor
    w2: torch.Tensor
    w13_scale: torch.Tensor | None = None
    w2_scale: torch.Tensor | None = None
    pow2_scales: bool = False  # every scale a power of two (see POW2_SCALES)

    def as_routed(self) -> tuple[torch.Tensor, ...]:
        """(w13 [1, 2I, H], w2 [1, H, I], w13_scale [1, 2, I/128, H/128] or None, w2_scale
        [1, H/128, I/128] or None): the same memory in the routed experts' layout."""
        w13, w2 = self.w13.unsqueeze(0), self.w2.unsqueeze(0)
        if self.w13_scale is None or self.w2_scale is None:
            return w13, w2, None, None
        blocks_i2, blocks_h = self.w13_scale.shape
        w13_scale = self.w13_scale.view(1, 2, blocks_i2 // 2, blocks_h)
        return w13, w2, w13_scale, self.w2_scale.unsqueeze(0)


def check_shared_expert(shared: SharedExpert, w13: torch.Tensor, w2: torch.Tensor) -> None:
    """The shared expert has the routed experts' shapes and dtype (and, FP8, whole gate and up
    scale blocks)."""
    if shared.w13.shape != w13.shape[1:] or shared.w2.shape != w2.shape[1:]:
        raise ValueError(
            f"shared expert {tuple(shared.w13.shape)} / {tuple(shared.w2.shape)} is not a routed "
            f"expert's {tuple(w13.shape[1:])} / {tuple(w2.shape[1:])}"
        )
    if shared.w13.dtype != w13.dtype or shared.w2.dtype != w2.dtype:
        raise TypeError(f"shared expert {shared.w13.dtype}, routed experts {w13.dtype}")
    if (shared.w13_scale is None) != (shared.w2_scale is None):
        raise ValueError("the shared expert needs both scales or neither")
    if shared.w13_scale is not None:
        if (shared.w13.shape[0] // 2) % FP8_BLOCK:
            raise ValueError(
                f"the shared expert's intermediate {shared.w13.shape[0] // 2} cuts its "
                f"[gate | up] scale blocks"
            )
        check_fp8_scales(*shared.as_routed())


def _sum_over_experts(
    x: torch.Tensor,
    num_local_experts: int,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    first_expert: int,
    expert_forward: Callable[[int, torch.Tensor], torch.Tensor],
    shared_forward: Callable[[], torch.Tensor] | None = None,
) -> torch.Tensor:
    """sum_k topk_weights[t, k] * expert_forward(ids[t, k], token rows) over the experts held
    here, plus shared_forward() (every token's, weight 1) when given, in fp32, rounded once to
    x's dtype. expert_forward(e, token [n]) -> [n, hidden] in x's dtype (the expert's output as
    its GEMM rounds it); shared_forward() -> [T, hidden] likewise."""
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    local_ids = topk_ids.long() - first_expert
    for e in local_ids.unique().tolist():
        if e < 0 or e >= num_local_experts:
            continue
        token, slot = (local_ids == e).nonzero(as_tuple=True)
        y = expert_forward(e, token).float() * topk_weights[token, slot, None].float()
        out.index_add_(0, token, y)
    if shared_forward is not None:
        out += shared_forward().float()
    return out.to(x.dtype)


def grouped_moe_reference(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    first_expert: int = 0,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    pow2_scales: bool = False,
    num_experts: int | None = None,
    shared: SharedExpert | None = None,
) -> torch.Tensor:
    """sum_k topk_weights[t, k] * expert_{ids[t, k]}(x[t]) over the experts held here, plus the
    shared expert's output (weight 1) in the same fp32 sum when `shared` is given.
    (`pow2_scales` and `num_experts`, the kernels' hints, change nothing here.)

    x [T, hidden], w13 [E_local, 2 * I, hidden] ([gate | up]), w2 [E_local, hidden, I].
    This rank holds experts first_expert .. first_expert + E_local - 1; routes to others
    contribute nothing (expert parallelism sums the ranks' partial outputs).

    With w13_scale and w2_scale (see `check_fp8_scales`) the weights are FP8: each expert is
    dequantized exactly and rounded to x's dtype, then the same math as without scales.
    """
    fp8 = check_fp8_scales(w13, w2, w13_scale, w2_scale)

    def expert_forward(e: int, token: torch.Tensor) -> torch.Tensor:
        if fp8:
            w13_e, w2_e = dequantize_expert_reference(w13, w2, w13_scale, w2_scale, e, x.dtype)
        else:
            w13_e, w2_e = w13[e], w2[e]
        return silu_and_mul_reference(x[token] @ w13_e.t()) @ w2_e.t()

    shared_forward = None
    if shared is not None:
        check_shared_expert(shared, w13, w2)
        shared_w13, shared_w2, shared_w13_scale, shared_w2_scale = shared.as_routed()

        def shared_forward() -> torch.Tensor:
            return grouped_moe_reference(
                x,
                shared_w13,
                shared_w2,
                torch.ones(x.shape[0], 1, device=x.device),
                torch.zeros(x.shape[0], 1, dtype=torch.int32, device=x.device),
                0,
                shared_w13_scale,
                shared_w2_scale,
            )

    return _sum_over_experts(
        x, w13.shape[0], topk_weights, topk_ids, first_expert, expert_forward, shared_forward
    )


def grouped_moe_w8a8_reference(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    first_expert: int,
    w13_scale: torch.Tensor,
    w2_scale: torch.Tensor,
) -> torch.Tensor:
    """FP8 experts as DeepSeek's reference inference runs them (w8a8), the twin of
    kernels/moe_experts_w8a8.py: x quantized per token in 1x128 groups (act_quant); per expert,
    the dequantized x times the exactly dequantized [gate | up] in fp32, rounded to x's dtype;
    silu(gate) * up in x's dtype; that quantized per token in 1x128 groups; dequantized, times
    the dequantized w2 in fp32, rounded to x's dtype; then the routing weights as
    `grouped_moe_reference`. Shapes and scales as there (the scales are required)."""
    if not check_fp8_scales(w13, w2, w13_scale, w2_scale):
        raise ValueError("w8a8 experts need w13_scale and w2_scale")
    x_fp8 = dequantize_activations_reference(*quantize_activations_reference(x))  # [T, H] fp32

    def expert_forward(e: int, token: torch.Tensor) -> torch.Tensor:
        w13_e, w2_e = dequantize_expert_reference(w13, w2, w13_scale, w2_scale, e, torch.float32)
        h = silu_and_mul_reference((x_fp8[token] @ w13_e.t()).to(x.dtype))  # [n, I]
        h_fp8 = dequantize_activations_reference(*quantize_activations_reference(h))
        return (h_fp8 @ w2_e.t()).to(x.dtype)

    return _sum_over_experts(x, w13.shape[0], topk_weights, topk_ids, first_expert, expert_forward)


# --- Triton ---------------------------------------------------------------------------------------
#
# Contiguous grouped layout: the (token, slot) pairs routed to local experts are sorted by expert,
# each expert's run padded to a multiple of block_m rows, so every block of rows belongs to one
# expert (DeepGEMM's contiguous layout when block_m = 128). Built with torch ops that never sync
# with the host, so the whole op is CUDA-graph capturable. Two kernels: gate/up GEMM with
# SiLU-and-mul fused into its epilogue, then the down GEMM times the routing weight into one fp32
# row per pair; the top-k rows of a token are summed in a fixed order (deterministic, unlike
# atomics, so PDL on/off and graph replays are bit-identical).


@dataclass(frozen=True)
class GroupedLayout:
    """Pairs sorted by local expert: `sorted_pairs[row]` is a pair index (token * top_k + slot)
    or -1 for padding; `block_expert[b]` is the local expert of rows b*block_m.. or -1."""

    sorted_pairs: torch.Tensor  # [num_rows] int32
    block_expert: torch.Tensor  # [num_rows // block_m] int32
    block_m: int


def _layout_rows(num_pairs: int, num_local_experts: int, block_m: int) -> int:
    """An upper bound on the padded rows that needs no host sync."""
    return triton.cdiv(num_pairs + min(num_local_experts, num_pairs) * (block_m - 1), block_m) * (
        block_m
    )


# Routed pairs at or below which a step is decode (e.g. batch 32 x top-8): the decode tile config
# below, and the grouped layout as one Triton program.
DECODE_MAX_PAIRS = 256


def grouped_layout(
    topk_ids: torch.Tensor, num_local_experts: int, first_expert: int, block_m: int
) -> GroupedLayout:
    num_pairs = topk_ids.numel()
    device = topk_ids.device
    local = topk_ids.reshape(-1).long() - first_expert
    # Experts held elsewhere go to a sentinel bucket that sorts last and owns no rows.
    local = torch.where((local >= 0) & (local < num_local_experts), local, num_local_experts)
    counts = torch.zeros(num_local_experts + 1, dtype=torch.long, device=device)
    counts.scatter_add_(0, local, torch.ones_like(local))
    padded = (counts[:num_local_experts] + block_m - 1) // block_m * block_m  # [E]
    padded_end = padded.cumsum(0)
    padded_start = padded_end - padded
    order = torch.argsort(local, stable=True)  # [num_pairs] pair indices by expert
    sorted_local = local[order]
    rank = torch.arange(num_pairs, device=device) - (counts.cumsum(0) - counts)[sorted_local]
    num_rows = _layout_rows(num_pairs, num_local_experts, block_m)
    held = sorted_local < num_local_experts
    start = padded_start[sorted_local.clamp(max=num_local_experts - 1)]
    dest = torch.where(held, start + rank, num_rows)
    sorted_pairs = torch.full((num_rows + 1,), -1, dtype=torch.int32, device=device)
    sorted_pairs.scatter_(0, dest, order.to(torch.int32))
    block_starts = torch.arange(0, num_rows, block_m, device=device)
    block_expert = torch.searchsorted(padded_end[:num_local_experts], block_starts, right=True)
    block_expert = torch.where(block_expert < num_local_experts, block_expert, -1)
    return GroupedLayout(sorted_pairs[:num_rows], block_expert.to(torch.int32), block_m)


# Batch-dependent sizes, strides and index-tensor offsets are not specialized on: a new batch
# shape must not compile a variant mid-serving (Worker.warm_up compiles the rest).
@triton.jit(
    do_not_specialize=["num_pairs", "num_local_experts", "first_expert", "num_rows", "num_blocks"],
    do_not_specialize_on_alignment=["ids_ptr"],
)
def _grouped_layout_kernel(
    ids_ptr,
    sorted_pairs_ptr,
    block_expert_ptr,
    num_pairs,
    num_local_experts,
    first_expert,
    num_rows,
    num_blocks,
    BLOCK_M: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_NB: tl.constexpr,
    CHUNK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """`grouped_layout` in one program (decode sizes): every pair's rank among the earlier pairs
    of its expert, and each expert's padded start, by chunked comparisons in registers."""
    pairs = tl.arange(0, BLOCK_P)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    local = tl.load(ids_ptr + pairs, mask=pairs < num_pairs, other=-1).to(tl.int32) - first_expert
    held = (pairs < num_pairs) & (local >= 0) & (local < num_local_experts)
    local = tl.where(held, local, -1)  # -1 matches no expert
    rank = tl.zeros([BLOCK_P], dtype=tl.int32)
    for q0 in tl.static_range(0, BLOCK_P, CHUNK):
        q = q0 + tl.arange(0, CHUNK)
        other = tl.load(ids_ptr + q, mask=q < num_pairs, other=-1).to(tl.int32) - first_expert
        other = tl.where((q < num_pairs) & (other >= 0) & (other < num_local_experts), other, -2)
        earlier = (other[None, :] == local[:, None]) & (q[None, :] < pairs[:, None])
        rank += tl.sum(earlier.to(tl.int32), 1)
    start = tl.zeros([BLOCK_P], dtype=tl.int32)  # padded start of each pair's expert
    block_first_row = tl.arange(0, BLOCK_NB) * BLOCK_M
    block_expert = tl.zeros([BLOCK_NB], dtype=tl.int32)  # expert + 1, 0 for none
    base = num_pairs * 0
    for e0 in range(0, num_local_experts, CHUNK):
        experts = e0 + tl.arange(0, CHUNK)
        mine = local[:, None] == experts[None, :]  # [BLOCK_P, CHUNK]
        padded = (tl.sum(mine.to(tl.int32), 0) + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        ends = base + tl.cumsum(padded, 0)
        starts = ends - padded
        start += tl.sum(tl.where(mine, starts[None, :], 0), 1)
        inside = (starts[None, :] <= block_first_row[:, None]) & (
            block_first_row[:, None] < ends[None, :]
        )
        block_expert += tl.sum(tl.where(inside, experts[None, :] + 1, 0), 1)
        base += tl.sum(padded)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    for r0 in range(0, num_rows, BLOCK_P):
        r = r0 + tl.arange(0, BLOCK_P)
        tl.store(sorted_pairs_ptr + r, -1, mask=r < num_rows)
    tl.debug_barrier()  # the padding is written before the pairs land on it
    tl.store(sorted_pairs_ptr + start + rank, pairs, mask=held)
    blocks = tl.arange(0, BLOCK_NB)
    tl.store(block_expert_ptr + blocks, block_expert - 1, mask=blocks < num_blocks)


def warm_up_grouped_layout(num_local_experts: int, block_m: int, device: torch.device) -> None:
    """Compile every variant of the layout kernel (its BLOCK_P and BLOCK_NB follow the pair count)
    with a dummy launch per pair count up to DECODE_MAX_PAIRS: eager steps of any size then find
    them compiled (CUDA-graph capture meets only the graphed batches' counts)."""
    for num_pairs in range(1, DECODE_MAX_PAIRS + 1):
        ids = torch.randint(0, num_local_experts, (num_pairs,), device=device, dtype=torch.int32)
        grouped_layout_triton(ids, num_local_experts, 0, block_m)


def grouped_layout_triton(
    topk_ids: torch.Tensor, num_local_experts: int, first_expert: int, block_m: int
) -> GroupedLayout:
    """Triton twin of `grouped_layout`: one launch instead of a dozen torch ops at decode sizes
    (1 to DECODE_MAX_PAIRS pairs), the twin itself otherwise."""
    num_pairs = topk_ids.numel()
    if not 0 < num_pairs <= DECODE_MAX_PAIRS:
        return grouped_layout(topk_ids, num_local_experts, first_expert, block_m)
    ids = topk_ids.reshape(-1)
    num_rows = _layout_rows(num_pairs, num_local_experts, block_m)
    num_blocks = num_rows // block_m
    sorted_pairs = torch.empty(num_rows, dtype=torch.int32, device=ids.device)
    block_expert = torch.empty(num_blocks, dtype=torch.int32, device=ids.device)
    launch(
        _grouped_layout_kernel,
        (1,),
        ids,
        ids,
        sorted_pairs,
        block_expert,
        num_pairs,
        num_local_experts,
        first_expert,
        num_rows,
        num_blocks,
        BLOCK_M=block_m,
        BLOCK_P=max(32, triton.next_power_of_2(num_pairs)),
        BLOCK_NB=max(32, triton.next_power_of_2(num_blocks)),
        CHUNK=32,
        num_warps=4,
    )
    return GroupedLayout(sorted_pairs, block_expert, block_m)


# FP8 experts (W_FP8): the weight tiles come from HBM as e4m3 and are dequantized in registers,
# each element times the scale of its 128x128 block, rounded to the activations' dtype (as the
# twin rounds its dequantized weights), then the same tl.dot as bf16 weights. BLOCK_K divides 128,
# so a tile's columns share one scale block: the scales are a [BLOCK_N] vector per k step.
# POW2_SCALES (every scale a power of two, as DeepSeek-V3.1 and later ship them, UE8M0): the
# e4m3 tile goes to the activations' dtype as it is (exact, by way of fp16: Triton's direct e4m3
# -> bf16 conversion is the slow one) and the scale multiplies the k step's fp32 partial product
# instead of every weight element. A power of two times a value is exact, so this gives the
# twin's numbers (up to the fp32 summation order) with a third of the per-element instructions.
_SCALE_BLOCK = tl.constexpr(FP8_BLOCK)


@triton.jit
def _fp8_tile_dot(a, w, UPCAST_DOT: tl.constexpr):
    """a [M, K] times the e4m3 tile w [N, K] transposed, unscaled, in fp32 (POW2_SCALES)."""
    if UPCAST_DOT:
        return tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
    return tl.dot(a, tl.trans(w.to(tl.float16).to(a.dtype)))


@triton.jit
def _moe_gate_up_kernel(
    x_ptr,
    w13_ptr,
    w13_scale_ptr,
    h_ptr,
    sorted_pairs_ptr,
    block_expert_ptr,
    x_row_stride,
    w13_expert_stride,
    w13_row_stride,
    scale_expert_stride,
    scale_part_stride,
    scale_row_stride,
    scale_col_stride,
    h_row_stride,
    hidden,
    intermediate,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    W_FP8: tl.constexpr,
    POW2_SCALES: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    block = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] of intermediate
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    kk = tl.arange(0, BLOCK_K)
    col_mask = cols < intermediate
    dtype = h_ptr.dtype.element_ty  # the activations' dtype
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    if expert >= 0:
        pairs = tl.load(sorted_pairs_ptr + rows)
        valid = pairs >= 0
        tokens = tl.where(valid, pairs // TOP_K, 0).to(tl.int64)
        w_gate = w13_ptr + expert * w13_expert_stride + cols[:, None].to(tl.int64) * w13_row_stride
        w_up = w_gate + intermediate * w13_row_stride
        # [BLOCK_N] scale rows of the gate grid; the up grid is the next part.
        scale_rows = (cols // _SCALE_BLOCK) * scale_row_stride  # [BLOCK_N]
        s_gate = w13_scale_ptr + expert * scale_expert_stride + scale_rows
        s_up = s_gate + scale_part_stride
        acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            k_mask = (k0 + kk) < hidden
            a = tl.load(
                x_ptr + tokens[:, None] * x_row_stride + k0 + kk[None, :],
                mask=valid[:, None] & k_mask[None, :],
                other=0.0,
            )  # [BLOCK_M, BLOCK_K]
            bg = tl.load(
                w_gate + k0 + kk[None, :], mask=col_mask[:, None] & k_mask[None, :], other=0.0
            )  # [BLOCK_N, BLOCK_K]
            bu = tl.load(
                w_up + k0 + kk[None, :], mask=col_mask[:, None] & k_mask[None, :], other=0.0
            )
            if W_FP8:
                k_block = (k0 // _SCALE_BLOCK) * scale_col_stride
                sg = tl.load(s_gate + k_block, mask=col_mask, other=0.0)  # [BLOCK_N] fp32
                su = tl.load(s_up + k_block, mask=col_mask, other=0.0)
            if W_FP8 and POW2_SCALES:
                acc_gate += _fp8_tile_dot(a, bg, UPCAST_DOT) * sg[None, :]
                acc_up += _fp8_tile_dot(a, bu, UPCAST_DOT) * su[None, :]
            else:
                if W_FP8:
                    bg = (bg.to(tl.float32) * sg[:, None]).to(dtype)
                    bu = (bu.to(tl.float32) * su[:, None]).to(dtype)
                if UPCAST_DOT:
                    a = a.to(tl.float32)
                    acc_gate = tl.dot(
                        a, tl.trans(bg.to(tl.float32)), acc_gate, input_precision="ieee"
                    )
                    acc_up = tl.dot(a, tl.trans(bu.to(tl.float32)), acc_up, input_precision="ieee")
                else:
                    acc_gate = tl.dot(a, tl.trans(bg), acc_gate)
                    acc_up = tl.dot(a, tl.trans(bu), acc_up)
        if USE_PDL:
            tl.extra.cuda.gdc_launch_dependents()
        # Round where the twin rounds: the GEMM output, silu, the product.
        gate = acc_gate.to(dtype).to(tl.float32)
        up = acc_up.to(dtype).to(tl.float32)
        silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        tl.store(
            h_ptr + rows[:, None].to(tl.int64) * h_row_stride + cols[None, :],
            (silu * up).to(dtype),
            mask=valid[:, None] & col_mask[None, :],
        )


@triton.jit
def _moe_down_kernel(
    h_ptr,
    w2_ptr,
    w2_scale_ptr,
    topk_weights_ptr,
    y_ptr,
    sorted_pairs_ptr,
    block_expert_ptr,
    h_row_stride,
    w2_expert_stride,
    w2_row_stride,
    scale_expert_stride,
    scale_row_stride,
    scale_col_stride,
    y_row_stride,
    hidden,
    intermediate,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    W_FP8: tl.constexpr,
    POW2_SCALES: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    block = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] of hidden
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    kk = tl.arange(0, BLOCK_K)
    col_mask = cols < hidden
    dtype = h_ptr.dtype.element_ty
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    if expert >= 0:
        pairs = tl.load(sorted_pairs_ptr + rows)
        valid = pairs >= 0
        w_rows = w2_ptr + expert * w2_expert_stride + cols[:, None].to(tl.int64) * w2_row_stride
        scale_rows = (cols // _SCALE_BLOCK) * scale_row_stride  # [BLOCK_N]
        s_rows = w2_scale_ptr + expert * scale_expert_stride + scale_rows
        h_rows = h_ptr + rows[:, None].to(tl.int64) * h_row_stride
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, intermediate, BLOCK_K):
            k_mask = (k0 + kk) < intermediate
            a = tl.load(h_rows + k0 + kk[None, :], mask=valid[:, None] & k_mask[None, :], other=0.0)
            b = tl.load(
                w_rows + k0 + kk[None, :], mask=col_mask[:, None] & k_mask[None, :], other=0.0
            )
            if W_FP8:
                scale = tl.load(
                    s_rows + (k0 // _SCALE_BLOCK) * scale_col_stride, mask=col_mask, other=0.0
                )
            if W_FP8 and POW2_SCALES:
                acc += _fp8_tile_dot(a, b, UPCAST_DOT) * scale[None, :]
            else:
                if W_FP8:
                    b = (b.to(tl.float32) * scale[:, None]).to(dtype)
                if UPCAST_DOT:
                    acc = tl.dot(
                        a.to(tl.float32), tl.trans(b.to(tl.float32)), acc, input_precision="ieee"
                    )
                else:
                    acc = tl.dot(a, tl.trans(b), acc)
        if USE_PDL:
            tl.extra.cuda.gdc_launch_dependents()
        weight = tl.load(topk_weights_ptr + pairs, mask=valid, other=0.0).to(tl.float32)
        y = acc.to(dtype).to(tl.float32) * weight[:, None]
        tl.store(
            y_ptr + pairs[:, None].to(tl.int64) * y_row_stride + cols[None, :],
            y,
            mask=valid[:, None] & col_mask[None, :],
        )


@triton.jit
def _moe_sum_kernel(
    y_ptr,
    ids_ptr,
    out_ptr,
    hidden,
    num_local_experts,
    first_expert,
    TOP_K: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """out[t] = sum over t's held pairs of y[pair], in slot order, rounded once to out's dtype
    (pairs routed to experts held elsewhere were never written and are skipped)."""
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < hidden
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for slot in tl.static_range(TOP_K):
        pair = token * TOP_K + slot
        local = tl.load(ids_ptr + pair).to(tl.int32) - first_expert
        if (local >= 0) & (local < num_local_experts):
            acc += tl.load(y_ptr + pair * hidden + cols, mask=mask, other=0.0)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    tl.store(out_ptr + token * hidden + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


@dataclass(frozen=True)
class GroupedGemmConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# Decode: a few tokens per expert, so the smallest MMA M (16) and narrow N tiles to spread each
# expert's weights over many programs (memory-bound). Prefill: tall tiles reuse weight tiles.
DECODE_CONFIG = GroupedGemmConfig(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=4)
PREFILL_CONFIG = GroupedGemmConfig(block_m=64, block_n=128, block_k=64, num_warps=8, num_stages=3)
# Decode on a rank that holds an eighth of the experts or less (EP >= 8): a token sends it about
# one expert, whose weights n64 tiles spread over too few programs. `python3
# benchmarks/bench_moe_decode_configs.py --local-experts 32 --block-k 128` on the H200
# (2026-12-04, BENCHMARKS.md session 25): 24.6 -> 21.4 us at 1 token, 115.2 -> 105.6 at 8 (n32
# the best of 16 tiles at both); with all 256 experts local the two tie (109.3 / 109.7 at 1).
EP_DECODE_CONFIG = GroupedGemmConfig(block_m=16, block_n=32, block_k=128, num_warps=4, num_stages=4)
EP_DECODE_MAX_SHARE = 1 / 8  # of the routed experts held by the rank


def decode_config(num_local_experts: int, num_experts: int | None) -> GroupedGemmConfig:
    """The decode tile for a rank holding `num_local_experts` of `num_experts` routed experts
    (None: unknown, as if all)."""
    if num_experts and num_local_experts <= num_experts * EP_DECODE_MAX_SHARE:
        return EP_DECODE_CONFIG
    return DECODE_CONFIG


def check_moe_args(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    weight_dtypes: tuple[torch.dtype, ...],
) -> tuple[int, int, int, int, int]:
    """The grouped MoE kernels' arguments checked -> (num_tokens, hidden, num_local_experts,
    intermediate, top_k): x [T, H], w13 [E, 2 * I, H], w2 [E, H, I], routes [T, top_k]."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    device = x.device
    check_tensor("w13", w13, ndim=3, dtypes=weight_dtypes, device=device)
    check_tensor("w2", w2, ndim=3, dtypes=weight_dtypes, device=device)
    check_tensor(
        "topk_weights", topk_weights, ndim=2, dtypes=FLOAT_DTYPES, contiguous=True, device=device
    )
    # The pair sum reads ids and weights by token * top_k + slot.
    check_tensor("topk_ids", topk_ids, ndim=2, dtypes=INDEX_DTYPES, contiguous=True, device=device)
    num_tokens, hidden = x.shape
    num_local_experts, two_i, _ = w13.shape
    intermediate = two_i // 2
    if w13.shape != (num_local_experts, 2 * intermediate, hidden):
        raise ValueError(f"w13 {tuple(w13.shape)} is not [E, 2 * I, {hidden}]")
    if w2.shape != (num_local_experts, hidden, intermediate):
        raise ValueError(
            f"w2 {tuple(w2.shape)}, expected {(num_local_experts, hidden, intermediate)}"
        )
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != num_tokens:
        raise ValueError(
            f"topk_ids {tuple(topk_ids.shape)} / weights "
            f"{tuple(topk_weights.shape)} vs {num_tokens} tokens"
        )
    return num_tokens, hidden, num_local_experts, intermediate, topk_ids.shape[1]


def launch_pair_sum(
    y: torch.Tensor,  # [T * top_k, H] fp32, one weighted expert output per routed pair
    topk_ids: torch.Tensor,  # [T, top_k]
    out: torch.Tensor,  # [T, H] written
    num_local_experts: int,
    first_expert: int,
) -> None:
    """Each token's pairs summed into `out`; pairs routed to other ranks' experts count 0."""
    num_tokens, hidden = out.shape
    launch(
        _moe_sum_kernel,
        (num_tokens, triton.cdiv(hidden, 1024)),
        out,
        y,
        topk_ids,
        out,
        hidden,
        num_local_experts,
        first_expert,
        TOP_K=topk_ids.shape[1],
        BLOCK=1024,
        num_warps=4,
    )


# One token (a decode step of one sequence without MTP) with UE8M0 scales: its top-k experts are
# distinct, so each expert multiplies one row, and the tensor-core tile would pad it to 16 rows
# and convert every weight for them. These kernels read the experts' FP8 weights on CUDA cores as
# the dense one-row kernel does (kernels/fp8_linear.py: the same tile loads and per-block sums),
# one program per (pair, output tile), and need no grouped layout: a pair's expert is read from
# the routes. The down kernel sums the token's pairs as a split-K launch sums its splits (the
# last of a tile's pairs to arrive adds the pairs' weighted outputs in slot order, from zeros, in
# fp32, and rounds once): the same numbers as `_moe_sum_kernel`, without its launch.


@dataclass(frozen=True)
class MoeGemvConfig:
    """A launch config of the one-token expert kernels: output tiles of block_n (gate/up's
    program reads gate_up_block_n rows of each half), K steps of block_k (a multiple of 128)."""

    block_n: int
    block_k: int
    num_warps: int
    gate_up_block_n: int | None = None  # None: block_n


# Gate/up in 16-row halves: a K step reads 16 KB of weights a program, as the dense one-row
# kernel's 32-row tiles do (32-row halves, 32 KB a step, ran at 3.4 TB/s: BENCHMARKS.md,
# session 35).
ONE_TOKEN_CONFIG = MoeGemvConfig(block_n=32, block_k=512, num_warps=4, gate_up_block_n=16)


@triton.jit
def _one_token_pair(
    pair,
    ids_ptr,
    w_ptr,
    w_expert_stride,
    shared_w_ptr,
    s_ptr,
    scale_expert_stride,
    shared_s_ptr,
    scale_row_stride,
    shared_scale_row_stride,
    num_local_experts,
    first_expert,
    TOP_K: tl.constexpr,
):
    """A one-token program's pair: whether it is routed (a slot past TOP_K is the shared
    expert's), whether this rank holds its expert, and its weights, scales and scale row stride
    (the shared expert's rows are a routed expert's, the same strides)."""
    routed = pair < TOP_K
    expert = tl.load(ids_ptr + pair, mask=routed, other=0).to(tl.int32) - first_expert
    held = ((expert >= 0) & (expert < num_local_experts)) | ~routed
    e = tl.maximum(expert, 0).to(tl.int64)
    w_expert = tl.where(routed, w_ptr + e * w_expert_stride, shared_w_ptr)
    s_expert = tl.where(routed, s_ptr + e * scale_expert_stride, shared_s_ptr)
    row_stride = tl.where(routed, scale_row_stride, shared_scale_row_stride)
    return routed, held, w_expert, s_expert, row_stride


@triton.jit
def _moe_gemv_gate_up_kernel(
    x_ptr,
    ids_ptr,
    w13_ptr,
    w13_scale_ptr,
    shared_w13_ptr,
    shared_scale_ptr,
    h_ptr,
    w13_expert_stride,
    w13_row_stride,
    scale_expert_stride,
    scale_part_stride,
    scale_row_stride,
    shared_scale_part_stride,
    shared_scale_row_stride,
    hidden,
    intermediate,
    num_local_experts,
    first_expert,
    TOP_K: tl.constexpr,  # the routed pairs; a program past them is the shared expert's
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pair = tl.program_id(0)  # the token's slot
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # of intermediate
    col_mask = cols < intermediate
    dtype = h_ptr.dtype.element_ty
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()  # the down kernel may come in and wait
    routed, held, w_expert, s_expert, row_stride = _one_token_pair(
        pair,
        ids_ptr,
        w13_ptr,
        w13_expert_stride,
        shared_w13_ptr,
        w13_scale_ptr,
        scale_expert_stride,
        shared_scale_ptr,
        scale_row_stride,
        shared_scale_row_stride,
        num_local_experts,
        first_expert,
        TOP_K,
    )
    # The shared expert's scales are the merged linear's grid: up's block rows after gate's.
    part_stride = tl.where(routed, scale_part_stride, shared_scale_part_stride)
    if held:
        w_gate = w_expert + cols[:, None].to(tl.int64) * w13_row_stride
        w_up = w_gate + intermediate * w13_row_stride
        s_gate = s_expert + (cols // _SCALE_BLOCK)[:, None] * row_stride
        s_up = s_gate + part_stride
        acc_gate = tl.zeros([BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            wg, sg = gemv_weights(w_gate, s_gate, k0, hidden, col_mask, BLOCK_K, _SCALE_BLOCK)
            wu, su = gemv_weights(w_up, s_up, k0, hidden, col_mask, BLOCK_K, _SCALE_BLOCK)
            acc_gate += gemv_step(wg, sg, x_ptr, k0, hidden, BLOCK_N, BLOCK_K, _SCALE_BLOCK)
            acc_up += gemv_step(wu, su, x_ptr, k0, hidden, BLOCK_N, BLOCK_K, _SCALE_BLOCK)
        # Round where the twin rounds: the GEMM output, silu, the product.
        gate = acc_gate.to(dtype).to(tl.float32)
        up = acc_up.to(dtype).to(tl.float32)
        silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        tl.store(h_ptr + pair * intermediate + cols, (silu * up).to(dtype), mask=col_mask)


@triton.jit
def _moe_gemv_down_kernel(
    h_ptr,
    ids_ptr,
    topk_weights_ptr,
    w2_ptr,
    w2_scale_ptr,
    shared_w2_ptr,
    shared_scale_ptr,
    out_ptr,
    partial_ptr,
    counter_ptr,
    w2_expert_stride,
    w2_row_stride,
    scale_expert_stride,
    scale_row_stride,
    shared_scale_row_stride,
    hidden,
    intermediate,
    num_local_experts,
    first_expert,
    TOP_K: tl.constexpr,  # the routed pairs; a program past them is the shared expert's
    NUM_PAIRS: tl.constexpr,  # TOP_K, and 1 more with the shared expert
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,  # more than one pair: the pairs summed
    USE_PDL: tl.constexpr,
):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # of hidden
    pair = tl.program_id(1)
    col_mask = cols < hidden
    dtype = h_ptr.dtype.element_ty
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    routed, held, w_expert, s_expert, row_stride = _one_token_pair(
        pair,
        ids_ptr,
        w2_ptr,
        w2_expert_stride,
        shared_w2_ptr,
        w2_scale_ptr,
        scale_expert_stride,
        shared_scale_ptr,
        scale_row_stride,
        shared_scale_row_stride,
        num_local_experts,
        first_expert,
        TOP_K,
    )
    # The shared expert's weight is 1.
    weight = tl.load(topk_weights_ptr + pair, mask=routed, other=1.0).to(tl.float32)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)  # a pair held elsewhere adds 0
    if held:
        w_rows = w_expert + cols[:, None].to(tl.int64) * w2_row_stride
        s_rows = s_expert + (cols // _SCALE_BLOCK)[:, None] * row_stride
        h_row = h_ptr + pair * intermediate
        for k0 in range(0, intermediate, BLOCK_K):
            w, scale = gemv_weights(
                w_rows, s_rows, k0, intermediate, col_mask, BLOCK_K, _SCALE_BLOCK
            )
            acc += gemv_step(w, scale, h_row, k0, intermediate, BLOCK_N, BLOCK_K, _SCALE_BLOCK)
        acc = acc.to(dtype).to(tl.float32) * weight  # as `_moe_down_kernel` weighs a pair
    store_split_k(
        acc,
        out_ptr,
        partial_ptr,
        counter_ptr,
        cols,
        col_mask,
        tl.program_id(0),
        pair,
        NUM_PAIRS,
        hidden,
        SPLIT_K,
    )


def _grouped_moe_one_token(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    first_expert: int,
    w13_scale: torch.Tensor,
    w2_scale: torch.Tensor,
    config: MoeGemvConfig,
    shared: SharedExpert | None = None,
) -> torch.Tensor:
    """The one-token kernels (FP8 experts, power-of-two scales): x [1, hidden] -> [1, hidden];
    the shared expert, when given, is one more pair (the last, weight 1) of the same launches."""
    num_local_experts, two_i, hidden = w13.shape
    intermediate = two_i // 2
    top_k = topk_ids.shape[1]
    if config.block_k % FP8_BLOCK:
        raise ValueError(f"block_k {config.block_k} is not a multiple of {FP8_BLOCK}")
    if w13_scale.stride(-1) != 1 or w2_scale.stride(-1) != 1:
        raise ValueError("the one-token expert kernels read scale rows with stride 1")
    if shared is None:  # never read: any tensors of the same dtypes
        shared_w13, shared_w2, shared_w13_scale, shared_w2_scale = w13, w2, w13_scale, w2_scale
        shared_part_stride = shared_row_stride = shared_w2_row_stride = 0
    else:
        shared_w13, shared_w2, shared_w13_scale, shared_w2_scale = shared.as_routed()
        if shared_w13.stride()[1:] != w13.stride()[1:] or shared_w2.stride()[1:] != w2.stride()[1:]:
            raise ValueError("the shared expert's rows must have the routed experts' strides")
        if shared_w13_scale.stride(-1) != 1 or shared_w2_scale.stride(-1) != 1:
            raise ValueError("the one-token expert kernels read scale rows with stride 1")
        shared_part_stride, shared_row_stride = shared_w13_scale.stride()[1:3]
        shared_w2_row_stride = shared_w2_scale.stride(1)
    num_pairs = top_k + (shared is not None)
    device = x.device
    h = torch.empty(num_pairs, intermediate, dtype=x.dtype, device=device)
    out = torch.empty(1, hidden, dtype=x.dtype, device=device)
    gate_up_block_n = config.gate_up_block_n or config.block_n
    launch(
        _moe_gemv_gate_up_kernel,
        (num_pairs, triton.cdiv(intermediate, gate_up_block_n)),
        x,
        x,
        topk_ids,
        w13,
        w13_scale,
        shared_w13,
        shared_w13_scale,
        h,
        w13.stride(0),
        w13.stride(1),
        w13_scale.stride(0),
        w13_scale.stride(1),
        w13_scale.stride(2),
        shared_part_stride,
        shared_row_stride,
        hidden,
        intermediate,
        num_local_experts,
        first_expert,
        TOP_K=top_k,
        BLOCK_N=gate_up_block_n,
        BLOCK_K=config.block_k,
        num_warps=config.num_warps,
        num_stages=1,
    )
    num_tiles = triton.cdiv(hidden, config.block_n)
    partial, counters = split_k_workspace(out, num_pairs, num_tiles)
    launch(
        _moe_gemv_down_kernel,
        (num_tiles, num_pairs),
        x,
        h,
        topk_ids,
        topk_weights,
        w2,
        w2_scale,
        shared_w2,
        shared_w2_scale,
        out,
        partial,
        counters,
        w2.stride(0),
        w2.stride(1),
        w2_scale.stride(0),
        w2_scale.stride(1),
        shared_w2_row_stride,
        hidden,
        intermediate,
        num_local_experts,
        first_expert,
        TOP_K=top_k,
        NUM_PAIRS=num_pairs,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        SPLIT_K=num_pairs > 1,
        num_warps=config.num_warps,
        num_stages=1,
    )
    return out


def one_token_takes_shared(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    pow2_scales: bool,
    shared: SharedExpert,
) -> bool:
    """Whether `grouped_moe_triton` runs the shared expert inside the one-token kernels: one
    token, FP8 experts and shared expert of the same shapes, every scale a power of two."""
    return (
        x.shape[0] == 1
        and w13.dtype == FP8_DTYPE
        and pow2_scales
        and shared.pow2_scales
        and shared.w13_scale is not None
        and shared.w13.shape == w13.shape[1:]
        and shared.w2.shape == w2.shape[1:]
        and shared.w13.dtype == w13.dtype
        and (shared.w13.shape[0] // 2) % FP8_BLOCK == 0
    )


def grouped_moe_triton(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    first_expert: int = 0,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    config: GroupedGemmConfig | MoeGemvConfig | None = None,
    pow2_scales: bool = False,
    num_experts: int | None = None,
    shared: SharedExpert | None = None,
) -> torch.Tensor:
    """Triton twin of `grouped_moe_reference` (contiguous grouped layout); FP8 experts when
    w13_scale and w2_scale are given (dequantized in registers, activations stay in x's dtype).
    `pow2_scales`: the caller's promise that every scale is a power of two (see POW2_SCALES).
    `num_experts`: the routed experts over all ranks (picks the decode tile, `decode_config`).
    One token with FP8 experts and power-of-two scales takes the one-token kernels
    (`ONE_TOKEN_CONFIG`) unless `config` says otherwise; a `MoeGemvConfig` takes only that.
    `shared` only there (`one_token_takes_shared`): the shared expert as one more pair."""
    device = x.device
    fp8 = w13_scale is not None or w2_scale is not None
    num_tokens, hidden, num_local_experts, intermediate, top_k = check_moe_args(
        x, w13, w2, topk_weights, topk_ids, (FP8_DTYPE,) if fp8 else (x.dtype,)
    )
    if fp8:  # both paths' scales
        check_fp8_scales(w13, w2, w13_scale, w2_scale)
        check_tensor("w13_scale", w13_scale, last_dim_contiguous=False, device=device)
        check_tensor("w2_scale", w2_scale, last_dim_contiguous=False, device=device)
    one_token = num_tokens == 1 and fp8 and pow2_scales
    if config is None and one_token:
        config = ONE_TOKEN_CONFIG
    if shared is not None:
        check_shared_expert(shared, w13, w2)
        if not (isinstance(config, MoeGemvConfig) and shared.pow2_scales):
            raise ValueError(
                "a shared expert goes only with the one-token expert kernels, FP8 with "
                "power-of-two scales (one_token_takes_shared)"
            )
    if isinstance(config, MoeGemvConfig):
        if not one_token:
            raise ValueError(
                "the one-token expert kernels take 1 token of FP8 experts with power-of-two "
                f"scales, not {num_tokens} tokens{'' if fp8 else ' of bf16 experts'}"
                f"{'' if pow2_scales else ' without pow2_scales'}"
            )
        return _grouped_moe_one_token(
            x, w13, w2, topk_weights, topk_ids, first_expert, w13_scale, w2_scale, config, shared
        )
    num_pairs = num_tokens * top_k
    if config is None:
        if num_pairs <= DECODE_MAX_PAIRS:
            config = decode_config(num_local_experts, num_experts)
        else:
            config = PREFILL_CONFIG
    if fp8:
        if FP8_BLOCK % config.block_k:
            raise ValueError(f"FP8 experts need block_k dividing {FP8_BLOCK}, got {config.block_k}")
        w13_scale_strides = w13_scale.stride()
        w2_scale_strides = w2_scale.stride()
    else:  # the scale pointers are never read (W_FP8 off): any tensor will do
        w13_scale, w2_scale = w13, w2
        w13_scale_strides, w2_scale_strides = (0, 0, 0, 0), (0, 0, 0)
    # Short (decode) tiles only: the prefill tile measured 4-5% slower with it.
    scale_products = fp8 and pow2_scales and config.block_m <= POW2_SCALES_MAX_BLOCK_M
    y = torch.empty(num_pairs, hidden, dtype=torch.float32, device=device)  # [T * top_k, hidden]
    out = torch.empty(num_tokens, hidden, dtype=x.dtype, device=device)
    if num_pairs > 0:
        layout = grouped_layout_triton(topk_ids, num_local_experts, first_expert, config.block_m)
        num_blocks = layout.block_expert.shape[0]
        h = torch.empty(layout.sorted_pairs.shape[0], intermediate, dtype=x.dtype, device=device)
        upcast = dot_in_fp32(x.dtype)
        launch(
            _moe_gate_up_kernel,
            (num_blocks, triton.cdiv(intermediate, config.block_n)),
            x,
            x,
            w13,
            w13_scale,
            h,
            layout.sorted_pairs,
            layout.block_expert,
            x.stride(0),
            w13.stride(0),
            w13.stride(1),
            *w13_scale_strides,
            h.stride(0),
            hidden,
            intermediate,
            TOP_K=top_k,
            BLOCK_M=config.block_m,
            BLOCK_N=config.block_n,
            BLOCK_K=config.block_k,
            UPCAST_DOT=upcast,
            W_FP8=fp8,
            POW2_SCALES=scale_products,
            num_warps=config.num_warps,
            num_stages=config.num_stages,
        )
        launch(
            _moe_down_kernel,
            (num_blocks, triton.cdiv(hidden, config.block_n)),
            x,
            h,
            w2,
            w2_scale,
            topk_weights,
            y,
            layout.sorted_pairs,
            layout.block_expert,
            h.stride(0),
            w2.stride(0),
            w2.stride(1),
            *w2_scale_strides,
            y.stride(0),
            hidden,
            intermediate,
            BLOCK_M=config.block_m,
            BLOCK_N=config.block_n,
            BLOCK_K=config.block_k,
            UPCAST_DOT=upcast,
            W_FP8=fp8,
            POW2_SCALES=scale_products,
            num_warps=config.num_warps,
            num_stages=config.num_stages,
        )
        launch_pair_sum(y, topk_ids, out, num_local_experts, first_expert)
    return out


def grouped_moe_deepgemm(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    first_expert: int,
    backend: DeepGemmBackend,
    masked: bool | None = None,
) -> torch.Tensor:
    """`grouped_moe_reference` with DeepGEMM's grouped GEMMs and our SiLU-and-mul between them.

    masked=None picks the masked layout for decode-sized steps (<= DECODE_MAX_PAIRS pairs) and
    the contiguous one otherwise.
    """
    num_tokens, hidden = x.shape
    num_local_experts, two_i, _ = w13.shape
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    if masked is None:
        masked = num_pairs <= DECODE_MAX_PAIRS
    y = torch.zeros(num_pairs, hidden, dtype=torch.float32, device=x.device)
    if num_pairs == 0:
        return y.view(num_tokens, top_k, hidden).sum(1).to(x.dtype)
    pair_weights = topk_weights.reshape(-1).float()
    if masked:
        # [E, max_m = num_tokens, hidden]: top-k experts are distinct, so an expert gets at
        # most one row per token.
        local = topk_ids.reshape(-1).long() - first_expert
        held = (local >= 0) & (local < num_local_experts)
        expert = torch.where(held, local, 0)
        onehot = torch.nn.functional.one_hot(expert, num_local_experts) * held[:, None]
        rank = (onehot.cumsum(0) - onehot).gather(1, expert[:, None]).squeeze(1)
        masked_m = onehot.sum(0).to(torch.int32)  # [E]
        row = torch.where(held, expert * num_tokens + rank, num_local_experts * num_tokens)
        a = torch.zeros(num_local_experts * num_tokens + 1, hidden, dtype=x.dtype, device=x.device)
        a[row] = x.repeat_interleave(top_k, dim=0)
        a = a[:-1].view(num_local_experts, num_tokens, hidden)
        gate_up = torch.empty(num_local_experts, num_tokens, two_i, dtype=x.dtype, device=x.device)
        backend.grouped_gemm_masked(a, w13, gate_up, masked_m, expected_m=max(1, top_k))
        h = silu_and_mul_triton(gate_up)
        down = torch.empty(num_local_experts, num_tokens, hidden, dtype=x.dtype, device=x.device)
        backend.grouped_gemm_masked(h, w2, down, masked_m, expected_m=max(1, top_k))
        rows = down.view(-1, hidden)[torch.where(held, row, 0)].float()
        y = torch.where(held[:, None], rows * pair_weights[:, None], 0.0)
    else:
        layout = grouped_layout(topk_ids, num_local_experts, first_expert, backend.m_alignment())
        valid = layout.sorted_pairs >= 0
        pairs = layout.sorted_pairs.long().clamp(min=0)
        a = torch.where(valid[:, None], x[pairs // top_k], 0).to(x.dtype)  # [rows, hidden]
        m_indices = layout.block_expert.repeat_interleave(layout.block_m)
        m_indices = torch.where(valid, m_indices, -1).to(torch.int32)
        gate_up = torch.empty(a.shape[0], two_i, dtype=x.dtype, device=x.device)
        backend.grouped_gemm_contiguous(a, w13, gate_up, m_indices)
        h = silu_and_mul_triton(gate_up)
        down = torch.empty(a.shape[0], hidden, dtype=x.dtype, device=x.device)
        backend.grouped_gemm_contiguous(h, w2, down, m_indices)
        contribution = down.float() * pair_weights[pairs][:, None]
        y.index_copy_(0, pairs[valid], contribution[valid])  # prefill only: syncs on `valid`
    return y.view(num_tokens, top_k, hidden).sum(1).to(x.dtype)
