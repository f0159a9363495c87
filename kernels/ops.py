"""The ops the model calls. Each picks its Triton kernel where `use_triton` says so, else its twin.

Triton on CUDA devices and under Triton's interpreter; the pure-torch twins elsewhere and
whenever MTPSERVE_FORCE_REFERENCE=1. Every function here has its twin's signature. Swapping an
implementation touches only this file.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch

from kernels import deepgemm, platform
from kernels.activation import silu_and_mul_reference, silu_and_mul_triton
from kernels.argmax import argmax_reference, argmax_triton
from kernels.cache_write import (
    cache_rows_write_reference,
    cache_rows_write_triton,
    indexer_k_cache_write_reference,
    indexer_k_cache_write_triton,
    mla_kv_cache_write_reference,
    mla_kv_cache_write_triton,
)
from kernels.fp8 import fp8_linear_reference
from kernels.fp8_cache import fp8_cache_write_reference, fp8_cache_write_triton, is_fp8_cache
from kernels.fp8_gemm import W8A8_CONFIGS, W8A8_MIN_TOKENS, fp8_linear_w8a8
from kernels.fp8_linear import fp8_linear_triton
from kernels.fp8_mla_absorb import (
    absorb_out_reference,
    absorb_out_triton,
    absorb_q_reference,
    absorb_q_triton,
)
from kernels.indexer import indexer_topk_reference, indexer_topk_triton, warm_up_topk_select
from kernels.indexer_fp8 import hadamard_rotate_reference, indexer_fp8_reference
from kernels.linear_fp32 import linear_fp32_reference, linear_fp32_triton, warm_up_linear_fp32
from kernels.moe_experts import DECODE_CONFIG as MOE_DECODE_CONFIG
from kernels.moe_experts import (
    SharedExpert,
    grouped_moe_deepgemm,
    grouped_moe_reference,
    grouped_moe_triton,
    one_token_takes_shared,
    warm_up_grouped_layout,
)
from kernels.moe_experts_w8a8 import grouped_moe_w8a8_triton
from kernels.moe_routing import moe_route_reference, moe_route_triton
from kernels.platform import fp8_tensor_cores, use_triton
from kernels.rmsnorm import (
    add_rms_norm_reference,
    add_rms_norm_triton,
    rms_norm_reference,
    rms_norm_triton,
)
from kernels.rope import rope_cos_sin as rope_cos_sin_reference
from kernels.rope import rope_cos_sin_triton, rope_reference, rope_triton
from kernels.settings import settings
from kernels.sparse_mla import sparse_mla_attention_reference, sparse_mla_attention_triton
from kernels.varlen_attention import (
    flash_varlen_runs,
    varlen_causal_attention_flash,
    varlen_causal_attention_reference,
)

# The FP8 indexer rounding runs as torch ops on every device (a twin; no Triton kernel yet).
indexer_fp8 = indexer_fp8_reference
hadamard_rotate = hadamard_rotate_reference


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if use_triton(x.device):
        return rms_norm_triton(x, weight, eps)
    return rms_norm_reference(x, weight, eps)


def linear_fp32(x: torch.Tensor, weight: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    impl = linear_fp32_triton if use_triton(x.device) else linear_fp32_reference
    return impl(x, weight, scale)


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, pow2_scales: bool = False
) -> torch.Tensor:
    """y = x @ W^T for a block-scaled FP8 weight (kernels/fp8.py). `pow2_scales`: every scale is
    a power of two (`kernels.fp8.scales_are_powers_of_two`): the w8a16 kernel then scales
    partial products instead of weight elements.

    fp32 activations and few rows: the weight dequantized in registers (w8a16, the twin's exact
    math). bf16 / fp16 activations where `use_fp8_w8a8` says so (by default a prompt step of
    at least W8A8_MIN_TOKENS rows on FP8 tensor cores): the activations quantized per token and
    128 columns, then the FP8 x FP8 GEMM (w8a8, the activation twin
    `fp8_linear_act_quant_reference`; Triton, or cuBLASLt's block-scaled GEMM for large row
    counts where it runs: `kernels.fp8_gemm.fp8_linear_w8a8`).
    """
    if not use_triton(x.device):
        return fp8_linear_reference(x, weight, scale_inv)
    if use_fp8_w8a8(x):
        return fp8_linear_w8a8(x, weight, scale_inv)
    return fp8_linear_triton(x, weight, scale_inv, pow2_scales=pow2_scales)


def mla_absorb_q(
    q_nope: torch.Tensor,
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    v_dim: int,
    pow2_scales: bool = False,
) -> torch.Tensor:
    """q_nope [T, H, nope] times each head's W_UK out of an FP8 kv_b_proj -> [T, H, kv_lora]
    (kernels/fp8_mla_absorb.py)."""
    impl = absorb_q_triton if use_triton(q_nope.device) else absorb_q_reference
    return impl(q_nope, weight, scale_inv, v_dim, pow2_scales)


def mla_absorb_out(
    o_latent: torch.Tensor,
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    nope_dim: int,
    pow2_scales: bool = False,
) -> torch.Tensor:
    """o_latent [T, H, kv_lora] times each head's W_UV^T out of an FP8 kv_b_proj -> [T, H, v]."""
    impl = absorb_out_triton if use_triton(o_latent.device) else absorb_out_reference
    return impl(o_latent, weight, scale_inv, nope_dim, pow2_scales)


# Set by `prompt_step` around the forward of a step that carries prompt tokens only.
_in_prompt_step: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "in_prompt_step", default=False
)


@contextlib.contextmanager
def prompt_step(on: bool = True) -> Iterator[None]:
    """The forward run inside is a step of prompt tokens only (prefill chunks, no decode or
    verify rows): under MTPSERVE_FP8_W8A8=prefill (the default) its FP8 matmuls of enough rows
    take the w8a8 kernels (`use_fp8_w8a8`). The model runner sets it (ModelRunner._forward)."""
    token = _in_prompt_step.set(on)
    try:
        yield
    finally:
        _in_prompt_step.reset(token)


def use_fp8_w8a8(x: torch.Tensor) -> bool:
    """Whether an FP8 matmul of these activations quantizes them to FP8: the one rule of the
    linears (`fp8_linear`) and the routed experts (`grouped_moe`), x [tokens, ...] the step's.

    bf16 / fp16 activations, at least W8A8_MIN_TOKENS rows, FP8 tensor cores, and
    MTPSERVE_FP8_W8A8: `prefill` (the default) inside `prompt_step`, `all` in any step, `off`
    never. Decodes and verifies stay w8a16 by default, so a request's generated tokens take the
    same kernels whatever else its step holds; prompt steps, where the GEMMs are compute bound,
    run on the FP8 tensor cores (1.45x bf16's prefill tokens/s on the H100's slice, BENCHMARKS)."""
    mode = settings().fp8_w8a8
    return (
        x.dtype in (torch.bfloat16, torch.float16)
        and x.shape[0] >= W8A8_MIN_TOKENS
        and (mode == "all" or (mode == "prefill" and _in_prompt_step.get()))
        and fp8_tensor_cores(x.device)
    )


def w8a8_prompt_rows(device: torch.device) -> int | None:
    """The step size (tokens) from which a prompt-only step's FP8 matmuls take w8a8 on this
    device by default, or None where none does (MTPSERVE_FP8_W8A8 not `prefill`, no FP8 tensor
    cores, no Triton). The model runner runs such steps eagerly: the decode graphs it would
    otherwise replay hold the w8a16 kernels."""
    if settings().fp8_w8a8 != "prefill" or not use_triton(device):
        return None
    return W8A8_MIN_TOKENS if fp8_tensor_cores(device) else None


def w8a8_warm_up_rows() -> tuple[int, ...]:
    """Step sizes whose prompt steps compile every w8a8 variant a prompt step can pick: each
    row bucket of the w8a8 linear's tiles from W8A8_MIN_TOKENS on at its top and one below it
    (Triton specializes a row count divisible by 16, and the launchers pick tiles, split-K and
    cuBLASLt by rows; the grouped MoE's pairs follow the tokens)."""
    rows = set()
    for top in W8A8_CONFIGS:
        rows.update(n for n in (top - 1, top) if n >= W8A8_MIN_TOKENS)
    return tuple(sorted(rows))


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    impl = add_rms_norm_triton if use_triton(x.device) else add_rms_norm_reference
    return impl(x, residual, weight, eps)


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, attention_scaling: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin per position and frequency, once per forward for every layer's RoPE (the kernel
    needs the device math library: without it, the twin)."""
    use = use_triton(positions.device) and platform.libdevice is not None
    impl = rope_cos_sin_triton if use else rope_cos_sin_reference
    return impl(positions, inv_freq, attention_scaling)


def rope(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleaved: bool,
    rope_dims: int | None = None,
) -> torch.Tensor:
    """Queries' RoPE (the keys' is fused into the two cache writes)."""
    impl = rope_triton if use_triton(x.device) else rope_reference
    return impl(x, cos, sin, interleaved, rope_dims)


def mla_kv_cache_write(
    kv_a: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: torch.Tensor | None,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """Writes [RMSNorm(latent) | RoPE(k_rope)] rows; into an FP8 cache (kernels/fp8_cache.py)
    as a second kernel that quantizes the rows; None: no cache, only the rows. Returns the rows
    (model dtype)."""
    impl = mla_kv_cache_write_triton if use_triton(kv_a.device) else mla_kv_cache_write_reference
    if kv_cache is None or not is_fp8_cache(kv_cache):
        return impl(kv_a, norm_weight, eps, cos, sin, kv_cache, slot_mapping)
    rows = impl(kv_a, norm_weight, eps, cos, sin, None, slot_mapping)
    fp8_cache_write(kv_cache, slot_mapping, rows, norm_weight.shape[0])
    return rows


def indexer_k_cache_write(
    k: torch.Tensor,
    ln_weight: torch.Tensor,
    ln_bias: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor | None,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    impl = indexer_k_cache_write_triton if use_triton(k.device) else indexer_k_cache_write_reference
    return impl(k, ln_weight, ln_bias, eps, cos, sin, k_cache, slot_mapping)


def cache_rows_write(cache: torch.Tensor, slot_mapping: torch.Tensor, rows: torch.Tensor) -> None:
    impl = cache_rows_write_triton if use_triton(rows.device) else cache_rows_write_reference
    impl(cache, slot_mapping, rows)


def fp8_cache_write(
    cache: torch.Tensor, slot_mapping: torch.Tensor, rows: torch.Tensor, quant_width: int
) -> None:
    """FP8 cache rows (kernels/fp8_cache.py): rows' first quant_width values in e4m3 with a
    float32 scale per 128, the rest as they are."""
    impl = fp8_cache_write_triton if use_triton(rows.device) else fp8_cache_write_reference
    impl(cache, slot_mapping, rows, quant_width)


def indexer_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    k_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_idx: torch.Tensor,
    positions: torch.Tensor,
    topk: int,
    softmax_scale: float,
) -> torch.Tensor:
    impl = indexer_topk_triton if use_triton(q.device) else indexer_topk_reference
    return impl(q, weights, k_cache, block_tables, seq_idx, positions, topk, softmax_scale)


def warm_up_eager_kernels(
    device: torch.device,
    dtype: torch.dtype,
    max_positions: int,
    index_topk: int,
    num_local_experts: int,
    fp32_weight_shapes: list[tuple[int, int]],
) -> None:
    """Compile the variants that an eager step's sizes pick (Triton devices; the twins have none)
    and that neither the graph captures nor the warm-up's dummy prefills are sure to meet: the
    top-k select per power of two of chunks up to `max_positions` keys, the grouped layout per
    pair count, the fp32 linear per row count and weight shape (activations in the model's
    `dtype`)."""
    if not use_triton(device):
        return
    warm_up_topk_select(max_positions, index_topk, device)
    if num_local_experts:
        warm_up_grouped_layout(num_local_experts, MOE_DECODE_CONFIG.block_m, device)
    warm_up_linear_fp32(device, dtype, fp32_weight_shapes)


def sparse_mla_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_idx: torch.Tensor,
    topk_indices: torch.Tensor,
    softmax_scale: float,
    kv_lora_rank: int,
    q_rope: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    impl = sparse_mla_attention_triton if use_triton(q.device) else sparse_mla_attention_reference
    return impl(
        q,
        kv_cache,
        block_tables,
        seq_idx,
        topk_indices,
        softmax_scale,
        kv_lora_rank,
        q_rope,
        positions,
    )


def varlen_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    q_lens: list[int],
    k_lens: list[int],
    scale: float,
) -> torch.Tensor:
    """Causal attention over packed sequences, each one's queries its last keys
    (kernels/varlen_attention.py): PyTorch's flash kernel on CUDA in 16 bits, else the twin."""
    flash = flash_varlen_runs(q) and not platform.force_reference()
    impl = varlen_causal_attention_flash if flash else varlen_causal_attention_reference
    return impl(q, k, v, cu_q, cu_k, q_lens, k_lens, scale)


def moe_route(
    router_logits: torch.Tensor,
    correction_bias: torch.Tensor,
    num_groups: int,
    topk_groups: int,
    top_k: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    impl = moe_route_triton if use_triton(router_logits.device) else moe_route_reference
    return impl(
        router_logits,
        correction_bias,
        num_groups,
        topk_groups,
        top_k,
        norm_topk_prob,
        routed_scaling_factor,
    )


def grouped_moe(
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
    """Routed experts; FP8 experts (e4m3, 128x128 block scales) when the scales are given.
    `shared`: the shared expert too, as one more pair of weight 1 in the same sum, where
    `moe_takes_shared` says so (the twin takes it always).
    `pow2_scales`: every scale is a power of two (`kernels.fp8.scales_are_powers_of_two`), which
    lets the w8a16 kernels scale partial products instead of weight elements. `num_experts`:
    the routed experts over all ranks (the w8a16 decode tile follows the rank's share).

    FP8 experts take the w8a8 kernels (x and the intermediate quantized per token in 1x128
    groups, both GEMMs on FP8 tensor cores; twin `grouped_moe_w8a8_reference`) where
    `use_fp8_w8a8` says so, as the FP8 linears do: by default prompt steps of W8A8_MIN_TOKENS
    tokens or more (with top-8, past the decode-sized DECODE_MAX_PAIRS); else weights
    dequantized in registers against x's dtype (w8a16).
    """
    fp8 = w13_scale is not None or w2_scale is not None
    if not use_triton(x.device):
        return grouped_moe_reference(
            x, w13, w2, topk_weights, topk_ids, first_expert, w13_scale, w2_scale, shared=shared
        )
    if shared is None and fp8 and use_fp8_w8a8(x):
        return grouped_moe_w8a8_triton(
            x, w13, w2, topk_weights, topk_ids, first_expert, w13_scale, w2_scale
        )
    # FP8 experts skip DeepGEMM: its FP8 grouped GEMMs take FP8 activations with per-token 1x128
    # scales in its own TMA-aligned (on Blackwell packed UE8M0) layout, and one scale grid over
    # [gate | up] where we keep one per part; our Triton kernels take our layout.
    if shared is None and not fp8 and deepgemm.use_deepgemm(x):
        return grouped_moe_deepgemm(
            x, w13, w2, topk_weights, topk_ids, first_expert, deepgemm.backend
        )
    return grouped_moe_triton(
        x,
        w13,
        w2,
        topk_weights,
        topk_ids,
        first_expert,
        w13_scale,
        w2_scale,
        pow2_scales=pow2_scales,
        num_experts=num_experts,
        shared=shared,
    )


def moe_takes_shared(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, pow2_scales: bool, shared: SharedExpert
) -> bool:
    """Whether `grouped_moe` runs this step's shared expert inside the routed experts' launches
    (one token of FP8 experts on the GPU: `kernels.moe_experts.one_token_takes_shared`); where
    not, the caller runs it as its own MLP. On CPU never, so the CPU's numbers stay the MLP's."""
    return use_triton(x.device) and one_token_takes_shared(x, w13, w2, pow2_scales, shared)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return silu_and_mul_triton(x) if use_triton(x.device) else silu_and_mul_reference(x)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """The index of each row's largest value (last dim), exactly torch.argmax's."""
    return argmax_triton(x) if use_triton(x.device) else argmax_reference(x)


__all__ = [
    "argmax",
    "rms_norm",
    "add_rms_norm",
    "linear_fp32",
    "fp8_linear",
    "rope",
    "rope_cos_sin",
    "mla_kv_cache_write",
    "indexer_k_cache_write",
    "cache_rows_write",
    "fp8_cache_write",
    "indexer_fp8",
    "hadamard_rotate",
    "indexer_topk",
    "warm_up_eager_kernels",
    "sparse_mla_attention",
    "moe_route",
    "grouped_moe",
    "silu_and_mul",
]
