"""Row argmax over the vocabulary: the greedy token of every logit row, and each MTP draft.

torch's reduction gives one row of 129,280 logits to too few threads at decode: 28 us of a b=1
step in graph replay on the H200 (BENCHMARKS.md, session 35). Here every row is split into
chunks, one program each; a second launch picks among the chunks' winners.

The result is torch.argmax's exactly, in any order of reduction: the lowest index of the largest
value, and a NaN counts as larger than everything (the lowest NaN's index wins).
"""

from __future__ import annotations

import torch

from kernels.launch import FLOAT_DTYPES, check_tensor, launch
from kernels.platform import tl, triton


def argmax_reference(x: torch.Tensor) -> torch.Tensor:
    """x [..., V] -> the index of each row's largest value [...] (int64)."""
    return x.argmax(-1)


# --- Triton -------------------------------------------------------------------------------

# Elements per program: DeepSeek's 129,280-entry row is 64 programs at b=1.
_CHUNK = 2048


@triton.jit
def _first_largest(values, index, valid, NO_INDEX: tl.constexpr):
    """(the largest value, its lowest index) among `valid` lanes that hold no NaN."""
    top = tl.max(tl.where(valid, values, -float("inf")), axis=0)
    return top, tl.min(tl.where(valid & (values == top), index, NO_INDEX), axis=0)


@triton.jit
def _argmax_chunk_kernel(
    x_ptr,
    best_ptr,  # [rows, chunks] fp32: each chunk's largest value
    where_ptr,  # [rows, chunks] int32: its index in the row; -1 - index of the chunk's first NaN
    x_row_stride,
    width,
    num_chunks,
    CHUNK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    valid = cols < width
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    values = tl.load(x_ptr + row.to(tl.int64) * x_row_stride + cols, mask=valid, other=0.0)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    values = values.to(tl.float32)
    is_nan = valid & (values != values)
    first_nan = tl.min(tl.where(is_nan, cols, 2147483647), axis=0)
    best, where = _first_largest(values, cols, valid & ~is_nan, 2147483647)
    where = tl.where(first_nan < 2147483647, -1 - first_nan, where)
    tl.store(best_ptr + row * num_chunks + chunk, best)
    tl.store(where_ptr + row * num_chunks + chunk, where)


@triton.jit
def _argmax_pick_kernel(
    best_ptr,
    where_ptr,
    out_ptr,  # [rows] int64
    num_chunks,
    CHUNKS: tl.constexpr,  # num_chunks rounded up to a power of two
    USE_PDL: tl.constexpr,
):
    row = tl.program_id(0)
    chunks = tl.arange(0, CHUNKS)
    valid = chunks < num_chunks
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    best = tl.load(best_ptr + row * num_chunks + chunks, mask=valid, other=0.0)
    where = tl.load(where_ptr + row * num_chunks + chunks, mask=valid, other=0)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    # A chunk's winner carries its index in the row, so the lowest index among equal winners
    # is the row's first: the same rule as inside a chunk. The first NaN beats everything.
    is_nan = valid & (where < 0)
    first_nan = tl.min(tl.where(is_nan, -1 - where, 2147483647), axis=0)
    _, index = _first_largest(best, where, valid & ~is_nan, 2147483647)
    index = tl.where(first_nan < 2147483647, first_nan, index)
    tl.store(out_ptr + row, index.to(tl.int64))


def argmax_triton(x: torch.Tensor) -> torch.Tensor:
    """Triton twin of `argmax_reference`: x [..., V] -> [...] int64."""
    check_tensor("x", x, dtypes=FLOAT_DTYPES)
    width = x.shape[-1]
    if width == 0:
        raise ValueError("argmax of an empty row")
    if width >= 2**31 - 1:
        raise ValueError(f"rows of {width} elements: more than int32 indexes")
    x2d = x.reshape(-1, width)
    rows = x2d.shape[0]
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    if rows == 0:
        return out.view(x.shape[:-1])
    chunk = min(_CHUNK, triton.next_power_of_2(width))
    num_chunks = triton.cdiv(width, chunk)
    best = torch.empty(rows, num_chunks, dtype=torch.float32, device=x.device)
    where = torch.empty(rows, num_chunks, dtype=torch.int32, device=x.device)
    launch(
        _argmax_chunk_kernel,
        (rows, num_chunks),
        x,
        x2d,
        best,
        where,
        x2d.stride(0),
        width,
        num_chunks,
        CHUNK=chunk,
        num_warps=4,
    )
    launch(
        _argmax_pick_kernel,
        (rows,),
        x,
        best,
        where,
        out,
        num_chunks,
        CHUNKS=triton.next_power_of_2(num_chunks),
        num_warps=1 if num_chunks <= 32 else 2,
    )
    return out.view(x.shape[:-1])
