"""FP8 cache rows as DeepSeek stores them: per token, the first `quant_width` values of a row in
float8_e4m3fn with one float32 scale per 128 of them, then an unquantized tail in the model's
dtype, packed in one byte row. The twins (quantize, pack, unpack, write) and the Triton write.

FlashMLA's FP8 sparse-decode cache for DeepSeek-V3.2 is this layout with a 512-wide latent and a
64-wide bf16 RoPE tail: 512 + 4 x 4 + 128 = 656 bytes a token (bf16: 1152). The indexer's key
cache is the layout without a tail, as DeepSeek's reference inference keeps it (`act_quant` of
the key in 1x128 blocks into an FP8 k_cache and a float32 k_scale_cache): 128 + 4 = 132 bytes,
padded to 144 so that every row starts on 16 bytes (bf16: 256).

Scales follow DeepSeek-V3.2's `act_quant` under its config's `scale_fmt: "ue8m0"` (FlashMLA's
quantizer rounds the same way): amax clamped below at 1e-4, scale = amax / 448 rounded up to a
power of two. Here the power is computed exactly from amax's exponent and mantissa bits (448 =
1.75 x 2**8), so the Triton kernel and the twin agree bit for bit with no division in either. A
power-of-two scale also makes dequantization exact in any float dtype (an e4m3 value x 2**e):
a row read back is exactly its FP8 rounding.

The packed row is a float8_e4m3fn tensor [..., bytes_per_token]; its scales and tail are read
through `.view(torch.float32)` and `.view(tail dtype)` of the same storage, so every offset is
aligned to the element it holds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.launch import FLOAT_DTYPES, INDEX_DTYPES, check_tensor, launch
from kernels.platform import tl, triton

FP8_CACHE_DTYPE = torch.float8_e4m3fn
FP8_CACHE_GROUP = 128  # values per scale
AMAX_FLOOR = 1e-4  # DeepSeek's act_quant clamps amax here (an all-zero group gets a tiny scale)
_SCALE_BYTES = 4
_ROW_ALIGN_BYTES = 16


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass(frozen=True)
class Fp8CacheLayout:
    """Byte offsets of one packed row: [quant_width e4m3 | num_groups float32 | tail]."""

    quant_width: int
    tail_width: int = 0
    tail_dtype: torch.dtype = torch.float32

    @property
    def num_groups(self) -> int:
        return -(-self.quant_width // FP8_CACHE_GROUP)

    @property
    def tail_itemsize(self) -> int:
        return torch.finfo(self.tail_dtype).bits // 8

    @property
    def scale_offset(self) -> int:
        return _round_up(self.quant_width, _SCALE_BYTES)

    @property
    def tail_offset(self) -> int:
        return _round_up(self.scale_offset + _SCALE_BYTES * self.num_groups, self.tail_itemsize)

    @property
    def bytes_per_token(self) -> int:
        # Rows start on 16-byte boundaries, as vectorized loads need (132-byte indexer rows
        # were a misaligned address on the H200; FlashMLA's 656-byte latent rows already are).
        end = self.tail_offset + self.tail_width * self.tail_itemsize
        return _round_up(end, _ROW_ALIGN_BYTES)

    @property
    def width(self) -> int:
        """Values a row holds (what it dequantizes to)."""
        return self.quant_width + self.tail_width


def is_fp8_cache(cache: torch.Tensor) -> bool:
    return cache.dtype == FP8_CACHE_DTYPE


def check_fp8_cache(name: str, cache: torch.Tensor, layout: Fp8CacheLayout, device) -> None:
    check_tensor(name, cache, ndim=3, dtypes=(FP8_CACHE_DTYPE,), contiguous=True, device=device)
    if cache.shape[-1] != layout.bytes_per_token:
        raise ValueError(
            f"{name}: FP8 rows of {layout.quant_width} values + a {layout.tail_width}-wide "
            f"{layout.tail_dtype} tail are {layout.bytes_per_token} bytes, the cache's "
            f"{cache.shape[-1]}"
        )


# --- the twins -------------------------------------------------------------------------------


def _pow2_scale(amax: torch.Tensor) -> torch.Tensor:
    """2**ceil(log2(max(amax, 1e-4) / 448)), exactly: amax = 1.m x 2**E -> E - 8, plus one when
    1.m > 1.75. Returns (scale, 1 / scale) as float32."""
    bits = amax.float().clamp(min=AMAX_FLOOR).contiguous().view(torch.int32)
    exponent = ((bits >> 23) & 0xFF) - 127 - 8 + ((bits & 0x7FFFFF) > 0x600000).to(torch.int32)
    scale = ((exponent + 127) << 23).view(torch.float32)
    inverse = ((127 - exponent) << 23).view(torch.float32)
    return scale, inverse


def quantize_fp8_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., W] -> (e4m3 [..., W], float32 scales [..., ceil(W/128)]), per 1x128 group."""
    width = x.shape[-1]
    groups = -(-width // FP8_CACHE_GROUP)
    padded = torch.nn.functional.pad(x.float(), (0, groups * FP8_CACHE_GROUP - width))
    grouped = padded.view(*x.shape[:-1], groups, FP8_CACHE_GROUP)
    scale, inverse = _pow2_scale(grouped.abs().amax(-1))
    q = (grouped * inverse[..., None]).to(FP8_CACHE_DTYPE)
    return q.view(*x.shape[:-1], groups * FP8_CACHE_GROUP)[..., :width], scale


def dequantize_fp8_rows_reference(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(e4m3 [..., W], scales [..., ceil(W/128)]) -> float32 [..., W]."""
    return q.float() * scale.repeat_interleave(FP8_CACHE_GROUP, -1)[..., : q.shape[-1]]


def fp8_round_rows_reference(x: torch.Tensor) -> torch.Tensor:
    """x as its FP8 rows read back, in x's dtype (exact: the scales are powers of two)."""
    return dequantize_fp8_rows_reference(*quantize_fp8_rows_reference(x)).to(x.dtype)


def pack_fp8_rows_reference(rows: torch.Tensor, layout: Fp8CacheLayout) -> torch.Tensor:
    """rows [T, quant_width + tail_width] -> packed e4m3 bytes [T, bytes_per_token]."""
    num_rows = rows.shape[0]
    packed = torch.zeros(
        num_rows, layout.bytes_per_token, dtype=FP8_CACHE_DTYPE, device=rows.device
    )
    q, scale = quantize_fp8_rows_reference(rows[:, : layout.quant_width])
    packed[:, : layout.quant_width] = q
    start = layout.scale_offset // _SCALE_BYTES
    packed.view(torch.float32)[:, start : start + layout.num_groups] = scale
    if layout.tail_width:
        start = layout.tail_offset // layout.tail_itemsize
        tail = rows[:, layout.quant_width :].to(layout.tail_dtype)
        packed.view(layout.tail_dtype)[:, start : start + layout.tail_width] = tail
    return packed


def unpack_fp8_rows_reference(packed: torch.Tensor, layout: Fp8CacheLayout) -> torch.Tensor:
    """packed rows [..., bytes_per_token] -> float32 [..., quant_width + tail_width]."""
    packed = packed.contiguous()
    start = layout.scale_offset // _SCALE_BYTES
    scale = packed.view(torch.float32)[..., start : start + layout.num_groups]
    values = dequantize_fp8_rows_reference(packed[..., : layout.quant_width], scale)
    if not layout.tail_width:
        return values
    start = layout.tail_offset // layout.tail_itemsize
    tail = packed.view(layout.tail_dtype)[..., start : start + layout.tail_width]
    return torch.cat([values, tail.float()], -1)


def fp8_cache_write_reference(
    cache: torch.Tensor, slot_mapping: torch.Tensor, rows: torch.Tensor, quant_width: int
) -> None:
    """cache's slot slot_mapping[t] <- rows[t] packed (its first quant_width values in FP8, the
    rest in rows' dtype) where slot_mapping[t] >= 0."""
    layout = Fp8CacheLayout(quant_width, rows.shape[1] - quant_width, rows.dtype)
    flat = cache.view(-1, cache.shape[-1])
    keep = slot_mapping >= 0
    flat[slot_mapping[keep]] = pack_fp8_rows_reference(rows[keep], layout)


# --- Triton ----------------------------------------------------------------------------------


@triton.jit
def _pow2_scale_bits(amax):
    """The exponent e of `_pow2_scale` for an fp32 amax (already clamped)."""
    bits = amax.to(tl.int32, bitcast=True)
    return ((bits >> 23) & 0xFF) - 135 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)


@triton.jit
def _round_to_e4m3(x):
    """fp32 x (|x| <= 448) rounded to the nearest e4m3 value, ties to even, still in fp32.

    The conversion after it is then exact everywhere: Triton 3.9's interpreter converts fp32 to
    e4m3 by rounding half up without the carry into the exponent (31.65 became 16, not 32)."""
    bits = x.to(tl.int32, bitcast=True)
    # Normal e4m3 (|x| >= 2**-6): keep 3 mantissa bits of 23, ties to even.
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
    # Subnormal e4m3 steps 2**-9; fp32 steps that much in [2**14, 2**15), so the add rounds.
    magnitude = (tl.abs(x) + 16384.0) - 16384.0
    # The sign by its bit: a tiny negative rounds to -0.0, as torch's conversion gives (the
    # compiled `where(x < 0, -m, m)` gave +0.0 on the H200, so the cache differed from its twin).
    sign = bits & -2147483648
    subnormal = (magnitude.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    return tl.where(tl.abs(x) < 0.015625, subnormal, normal)


@triton.jit
def _fp8_cache_write_kernel(
    rows_ptr,
    fp8_ptr,
    scale_ptr,
    tail_ptr,
    slot_ptr,
    rows_row_stride,
    QUANT_WIDTH: tl.constexpr,
    NUM_GROUPS: tl.constexpr,
    TAIL_WIDTH: tl.constexpr,
    ROW_BYTES: tl.constexpr,
    SCALE_OFFSET: tl.constexpr,
    TAIL_OFFSET: tl.constexpr,
    TAIL_ITEMSIZE: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_TAIL: tl.constexpr,
    AMAX_MIN: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    token = tl.program_id(0)
    group = tl.program_id(1)
    cols = group * GROUP + tl.arange(0, GROUP)
    mask = cols < QUANT_WIDTH
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:
        src = rows_ptr + token * rows_row_stride
        x = tl.load(src + cols, mask=mask, other=0.0).to(tl.float32)
        exponent = _pow2_scale_bits(tl.maximum(tl.max(tl.abs(x), axis=0), AMAX_MIN))
        scale = ((exponent + 127) << 23).to(tl.float32, bitcast=True)
        inverse = ((127 - exponent) << 23).to(tl.float32, bitcast=True)
        row = slot * ROW_BYTES
        tl.store(
            fp8_ptr + row + cols,
            _round_to_e4m3(x * inverse).to(fp8_ptr.dtype.element_ty),
            mask=mask,
        )
        tl.store(scale_ptr + (row + SCALE_OFFSET) // 4 + group, scale)
        if TAIL_WIDTH > 0:
            if group == 0:  # the first group's program copies the tail
                tail = tl.arange(0, BLOCK_TAIL)
                tail_mask = tail < TAIL_WIDTH
                values = tl.load(src + QUANT_WIDTH + tail, mask=tail_mask)
                dst = tail_ptr + (row + TAIL_OFFSET) // TAIL_ITEMSIZE + tail
                tl.store(dst, values.to(tail_ptr.dtype.element_ty), mask=tail_mask)


def fp8_cache_write_triton(
    cache: torch.Tensor, slot_mapping: torch.Tensor, rows: torch.Tensor, quant_width: int
) -> None:
    """Triton twin of `fp8_cache_write_reference`: a program per token and 128-group."""
    check_tensor("rows", rows, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=INDEX_DTYPES, device=rows.device)
    if not 0 < quant_width <= rows.shape[1] or slot_mapping.shape[0] != rows.shape[0]:
        raise ValueError(
            f"rows {tuple(rows.shape)}, {slot_mapping.shape[0]} slots, quant_width {quant_width}"
        )
    layout = Fp8CacheLayout(quant_width, rows.shape[1] - quant_width, rows.dtype)
    check_fp8_cache("cache", cache, layout, rows.device)
    if rows.shape[0] == 0:
        return
    launch(
        _fp8_cache_write_kernel,
        (rows.shape[0], layout.num_groups),
        rows,
        rows,
        cache,
        cache.view(torch.float32),
        cache.view(rows.dtype),
        slot_mapping,
        rows.stride(0),
        QUANT_WIDTH=quant_width,
        NUM_GROUPS=layout.num_groups,
        TAIL_WIDTH=layout.tail_width,
        ROW_BYTES=layout.bytes_per_token,
        SCALE_OFFSET=layout.scale_offset,
        TAIL_OFFSET=layout.tail_offset,
        TAIL_ITEMSIZE=layout.tail_itemsize,
        GROUP=FP8_CACHE_GROUP,
        BLOCK_TAIL=max(16, triton.next_power_of_2(max(1, layout.tail_width))),
        AMAX_MIN=AMAX_FLOOR,
        num_warps=1,
    )
