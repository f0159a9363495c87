"""Fused norm + RoPE + paged-cache write for the two per-token caches of a layer, and a plain
write of given rows.

Paged caches are [num_blocks, block_size_tokens, width]; `slot_mapping[t]` is the flat slot
(block * block_size_tokens + offset) of token t, or -1 for a token whose key is not stored.
Given no cache (None), the fused writes only compute and return the rows: an FP8 cache is then
written from them by `kernels.fp8_cache`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.launch import FLOAT_DTYPES, INDEX_DTYPES, check_tensor, launch
from kernels.platform import tl, triton
from kernels.rmsnorm import rms_norm_reference
from kernels.rope import rope_pair, rope_reference


def cache_rows_write_reference(
    cache: torch.Tensor, slot_mapping: torch.Tensor, rows: torch.Tensor
) -> None:
    """cache's slot slot_mapping[t] <- rows[t] (cast to the cache's dtype) where it is >= 0."""
    flat = cache.view(-1, cache.shape[-1])
    keep = slot_mapping >= 0
    flat[slot_mapping[keep]] = rows[keep].to(cache.dtype)


def mla_kv_cache_write_reference(
    kv_a: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: torch.Tensor | None,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """kv_a [T, kv_lora_rank + rope_dim] -> cache row [RMSNorm(latent) | RoPE_interleaved(k_rope)].

    Returns the rows written ([T, kv_lora_rank + rope_dim]), also for tokens with slot -1.
    """
    kv_lora_rank = norm_weight.shape[0]
    latent, k_rope = kv_a.split([kv_lora_rank, kv_a.shape[-1] - kv_lora_rank], dim=-1)
    rows = torch.cat(
        [rms_norm_reference(latent, norm_weight, eps), rope_reference(k_rope, cos, sin, True)], -1
    )
    if kv_cache is not None:
        cache_rows_write_reference(kv_cache, slot_mapping, rows)
    return rows


def indexer_k_cache_write_reference(
    k: torch.Tensor,
    ln_weight: torch.Tensor,
    ln_bias: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor | None,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """k [T, index_head_dim] -> LayerNorm(k) with its first rope dims rotated half-split; cached."""
    rope_dim = cos.shape[-1] * 2
    k = F.layer_norm(k, (k.shape[-1],), ln_weight, ln_bias, eps)
    rows = rope_reference(k[:, None], cos, sin, False, rope_dim)[:, 0]
    if k_cache is not None:
        cache_rows_write_reference(k_cache, slot_mapping, rows)
    return rows


# --- Triton ---------------------------------------------------------------------------------------


@triton.jit
def _mla_kv_cache_write_kernel(
    kv_a_ptr,
    weight_ptr,
    cos_ptr,
    sin_ptr,
    cache_ptr,
    slot_ptr,
    rows_ptr,
    kv_a_row_stride,
    cos_row_stride,
    sin_row_stride,
    eps,
    KV_LORA_RANK: tl.constexpr,
    ROPE_HALF: tl.constexpr,
    BLOCK_LATENT: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    WRITE_CACHE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    token = tl.program_id(0)
    width: tl.constexpr = KV_LORA_RANK + 2 * ROPE_HALF
    cols = tl.arange(0, BLOCK_LATENT)
    lat_mask = cols < KV_LORA_RANK
    half = tl.arange(0, BLOCK_HALF)
    half_mask = half < ROPE_HALF
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    src = kv_a_ptr + token * kv_a_row_stride
    latent = tl.load(src + cols, mask=lat_mask, other=0.0)
    x1 = tl.load(src + KV_LORA_RANK + 2 * half, mask=half_mask, other=0.0)  # interleaved pairs
    x2 = tl.load(src + KV_LORA_RANK + 2 * half + 1, mask=half_mask, other=0.0)
    cos = tl.load(cos_ptr + token * cos_row_stride + half, mask=half_mask, other=0.0)
    sin = tl.load(sin_ptr + token * sin_row_stride + half, mask=half_mask, other=0.0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()

    lat32 = latent.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(lat32 * lat32, axis=0) / KV_LORA_RANK + eps)
    w = tl.load(weight_ptr + cols, mask=lat_mask, other=0.0).to(tl.float32)
    normed = w * (lat32 * rstd).to(latent.dtype).to(tl.float32)
    re, im = rope_pair(x1.to(tl.float32), x2.to(tl.float32), cos, sin, latent.dtype)

    row_dtype = rows_ptr.dtype.element_ty
    dst = rows_ptr + token * width
    tl.store(dst + cols, normed.to(row_dtype), mask=lat_mask)
    tl.store(dst + KV_LORA_RANK + half, re.to(row_dtype), mask=half_mask)
    tl.store(dst + KV_LORA_RANK + ROPE_HALF + half, im.to(row_dtype), mask=half_mask)
    if WRITE_CACHE & (slot >= 0):
        cache_dtype = cache_ptr.dtype.element_ty
        dst = cache_ptr + slot * width
        tl.store(dst + cols, normed.to(row_dtype).to(cache_dtype), mask=lat_mask)
        tl.store(dst + KV_LORA_RANK + half, re.to(row_dtype).to(cache_dtype), mask=half_mask)
        tl.store(
            dst + KV_LORA_RANK + ROPE_HALF + half, im.to(row_dtype).to(cache_dtype), mask=half_mask
        )


def _check_cache_args(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cache: torch.Tensor | None,
    slot_mapping: torch.Tensor,
    width: int,
) -> None:
    num_tokens = x.shape[0]
    check_tensor("cos", cos, ndim=2, dtypes=FLOAT_DTYPES, device=x.device)
    check_tensor("sin", sin, ndim=2, dtypes=FLOAT_DTYPES, device=x.device)
    if cache is not None:
        check_tensor("cache", cache, ndim=3, dtypes=FLOAT_DTYPES, contiguous=True, device=x.device)
    check_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=INDEX_DTYPES, device=x.device)
    if cos.shape != sin.shape or cos.shape[0] != num_tokens:
        raise ValueError(f"cos {tuple(cos.shape)} / sin {tuple(sin.shape)} vs {num_tokens} tokens")
    if slot_mapping.shape[0] != num_tokens:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} slots for {num_tokens} tokens")
    if cache is not None and cache.shape[-1] != width:
        raise ValueError(f"cache rows are {cache.shape[-1]} wide, expected {width}")


def mla_kv_cache_write_triton(
    kv_a: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: torch.Tensor | None,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """Triton twin of `mla_kv_cache_write_reference`: one program per token."""
    check_tensor("kv_a", kv_a, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor("norm_weight", norm_weight, ndim=1, dtypes=FLOAT_DTYPES, device=kv_a.device)
    kv_lora_rank = norm_weight.shape[0]
    rope_half = cos.shape[-1]
    width = kv_lora_rank + 2 * rope_half
    if kv_a.shape[1] != width:
        raise ValueError(f"kv_a is {kv_a.shape[1]} wide, expected {kv_lora_rank} + {2 * rope_half}")
    _check_cache_args(kv_a, cos, sin, kv_cache, slot_mapping, width)
    rows = torch.empty(
        kv_a.shape[0],
        width,
        device=kv_a.device,
        dtype=torch.promote_types(norm_weight.dtype, kv_a.dtype),
    )
    if kv_a.shape[0] > 0:
        launch(
            _mla_kv_cache_write_kernel,
            (kv_a.shape[0],),
            kv_a,
            kv_a,
            norm_weight,
            cos,
            sin,
            rows if kv_cache is None else kv_cache,
            slot_mapping,
            rows,
            kv_a.stride(0),
            cos.stride(0),
            sin.stride(0),
            eps,
            KV_LORA_RANK=kv_lora_rank,
            ROPE_HALF=rope_half,
            BLOCK_LATENT=triton.next_power_of_2(kv_lora_rank),
            BLOCK_HALF=triton.next_power_of_2(rope_half),
            WRITE_CACHE=kv_cache is not None,
            num_warps=4,
        )
    return rows


@triton.jit
def _indexer_k_cache_write_kernel(
    k_ptr,
    ln_weight_ptr,
    ln_bias_ptr,
    cos_ptr,
    sin_ptr,
    cache_ptr,
    slot_ptr,
    rows_ptr,
    k_row_stride,
    cos_row_stride,
    sin_row_stride,
    eps,
    HEAD_DIM: tl.constexpr,
    ROPE_HALF: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    WRITE_CACHE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    token = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < HEAD_DIM
    half = tl.arange(0, BLOCK_HALF)
    half_mask = half < ROPE_HALF
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    src = k_ptr + token * k_row_stride
    k = tl.load(src + cols, mask=mask, other=0.0)
    k1 = tl.load(src + half, mask=half_mask, other=0.0)  # half-split pairs (i, i + ROPE_HALF)
    k2 = tl.load(src + ROPE_HALF + half, mask=half_mask, other=0.0)
    cos = tl.load(cos_ptr + token * cos_row_stride + half, mask=half_mask, other=0.0)
    sin = tl.load(sin_ptr + token * sin_row_stride + half, mask=half_mask, other=0.0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()

    k32 = k.to(tl.float32)
    mean = tl.sum(k32, axis=0) / HEAD_DIM
    centered = tl.where(mask, k32 - mean, 0.0)
    rstd = tl.rsqrt(tl.sum(centered * centered, axis=0) / HEAD_DIM + eps)
    w = tl.load(ln_weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(ln_bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    normed = (centered * rstd * w + b).to(k.dtype)
    w1 = tl.load(ln_weight_ptr + half, mask=half_mask, other=0.0).to(tl.float32)
    b1 = tl.load(ln_bias_ptr + half, mask=half_mask, other=0.0).to(tl.float32)
    w2 = tl.load(ln_weight_ptr + ROPE_HALF + half, mask=half_mask, other=0.0).to(tl.float32)
    b2 = tl.load(ln_bias_ptr + ROPE_HALF + half, mask=half_mask, other=0.0).to(tl.float32)
    n1 = ((k1.to(tl.float32) - mean) * rstd * w1 + b1).to(k.dtype).to(tl.float32)
    n2 = ((k2.to(tl.float32) - mean) * rstd * w2 + b2).to(k.dtype).to(tl.float32)
    re, im = rope_pair(n1, n2, cos, sin, k.dtype)

    tail = mask & (cols >= 2 * ROPE_HALF)
    dst = rows_ptr + token * HEAD_DIM
    tl.store(dst + cols, normed, mask=tail)
    tl.store(dst + half, re, mask=half_mask)
    tl.store(dst + ROPE_HALF + half, im, mask=half_mask)
    if WRITE_CACHE & (slot >= 0):
        cache_dtype = cache_ptr.dtype.element_ty
        dst = cache_ptr + slot * HEAD_DIM
        tl.store(dst + cols, normed.to(cache_dtype), mask=tail)
        tl.store(dst + half, re.to(cache_dtype), mask=half_mask)
        tl.store(dst + ROPE_HALF + half, im.to(cache_dtype), mask=half_mask)


def indexer_k_cache_write_triton(
    k: torch.Tensor,
    ln_weight: torch.Tensor,
    ln_bias: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor | None,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """Triton twin of `indexer_k_cache_write_reference`: one program per token."""
    check_tensor("k", k, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor("ln_weight", ln_weight, ndim=1, dtypes=FLOAT_DTYPES, device=k.device)
    check_tensor("ln_bias", ln_bias, ndim=1, dtypes=FLOAT_DTYPES, device=k.device)
    head_dim = k.shape[1]
    rope_half = cos.shape[-1]
    if ln_weight.shape[0] != head_dim or ln_bias.shape[0] != head_dim:
        raise ValueError(f"LayerNorm params must have {head_dim} entries")
    if 2 * rope_half > head_dim:
        raise ValueError(f"rope dims {2 * rope_half} exceed head_dim {head_dim}")
    _check_cache_args(k, cos, sin, k_cache, slot_mapping, head_dim)
    rows = torch.empty_like(k, memory_format=torch.contiguous_format)
    if k.shape[0] > 0:
        launch(
            _indexer_k_cache_write_kernel,
            (k.shape[0],),
            k,
            k,
            ln_weight,
            ln_bias,
            cos,
            sin,
            rows if k_cache is None else k_cache,
            slot_mapping,
            rows,
            k.stride(0),
            cos.stride(0),
            sin.stride(0),
            eps,
            HEAD_DIM=head_dim,
            ROPE_HALF=rope_half,
            BLOCK_D=triton.next_power_of_2(head_dim),
            BLOCK_HALF=triton.next_power_of_2(rope_half),
            WRITE_CACHE=k_cache is not None,
            num_warps=4,
        )
    return rows


@triton.jit
def _cache_rows_write_kernel(
    rows_ptr,
    cache_ptr,
    slot_ptr,
    rows_row_stride,
    WIDTH: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    token = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:
        row = tl.load(rows_ptr + token * rows_row_stride + cols, mask=cols < WIDTH)
        dst = cache_ptr + slot * WIDTH + cols
        tl.store(dst, row.to(cache_ptr.dtype.element_ty), mask=cols < WIDTH)


def cache_rows_write_triton(
    cache: torch.Tensor, slot_mapping: torch.Tensor, rows: torch.Tensor
) -> None:
    """Triton twin of `cache_rows_write_reference`: no host sync, so CUDA-graph capturable."""
    check_tensor("rows", rows, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor("cache", cache, ndim=3, dtypes=FLOAT_DTYPES, contiguous=True, device=rows.device)
    check_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=INDEX_DTYPES, device=rows.device)
    if slot_mapping.shape[0] != rows.shape[0] or cache.shape[-1] != rows.shape[1]:
        raise ValueError(
            f"rows {tuple(rows.shape)}, {slot_mapping.shape[0]} slots, cache rows "
            f"{cache.shape[-1]} wide"
        )
    if rows.shape[0] > 0:
        launch(
            _cache_rows_write_kernel,
            (rows.shape[0],),
            rows,
            rows,
            cache,
            slot_mapping,
            rows.stride(0),
            WIDTH=rows.shape[1],
            BLOCK=triton.next_power_of_2(rows.shape[1]),
            num_warps=1,
        )
