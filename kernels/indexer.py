"""Lightning-indexer logits over the paged key cache, and causal top-k.

The key cache is the model's dtype (exact numerics) or, with the FP8 numerics, FP8 rows as
DeepSeek keeps them (kernels/fp8_cache.py: e4m3 keys, a float32 scale per 128 dims, 144 bytes a
128-wide key with the row padding), dequantized as they are loaded: exactly the FP8-rounded keys."""

from __future__ import annotations

import torch

from kernels.fp8_cache import (
    FP8_CACHE_GROUP,
    Fp8CacheLayout,
    check_fp8_cache,
    is_fp8_cache,
    unpack_fp8_rows_reference,
)
from kernels.launch import FLOAT_DTYPES, INDEX_DTYPES, check_tensor, dot_in_fp32, launch
from kernels.paged import gather_token_rows, row_chunks, sequence_runs
from kernels.platform import tl, triton


def indexer_topk_reference(
    q: torch.Tensor,
    weights: torch.Tensor,
    k_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_idx: torch.Tensor,
    positions: torch.Tensor,
    topk: int,
    softmax_scale: float,
) -> torch.Tensor:
    """Top-k past positions per query token.

    q [T, H, D], weights [T, H] (already times index_n_heads**-0.5), k_cache
    [num_blocks, block_size, D] (or FP8 rows [num_blocks, block_size, Fp8CacheLayout(D) bytes]),
    block_tables [B, max_blocks], seq_idx [T] (row of block_tables),
    positions [T]. Token t scores keys 0..positions[t] of its sequence:
    score[s] = sum_h weights[t, h] * relu(softmax_scale * q[t, h] . k[s]).
    Returns int32 [T, topk]: the positions of the min(topk, positions[t] + 1) best keys, highest
    score first, then -1. The current token is not forced in.
    """
    num_tokens, _, head_dim = q.shape
    out = torch.full((num_tokens, topk), -1, dtype=torch.int32, device=q.device)
    if num_tokens == 0:
        return out
    layout = Fp8CacheLayout(head_dim) if is_fp8_cache(k_cache) else None

    def score(rows, keys: torch.Tensor, pattern: str) -> None:  # keys [S, D] or [t, S, D]
        keys = (unpack_fp8_rows_reference(keys, layout) if layout else keys).float()
        scores = torch.einsum(pattern, q[rows].float(), keys) * softmax_scale
        logits = torch.einsum("th,ths->ts", weights[rows].float(), scores.relu())  # [t, S]
        out[rows] = topk_select_reference(logits, positions[rows], topk)

    # A run of a prompt's tokens shares its sequence's keys: gathered once, one matmul.
    runs, rest = sequence_runs(seq_idx)
    for run in runs:
        num_keys = int(positions[run].max()) + 1
        span = torch.arange(num_keys, device=q.device)[None, :]
        keys = gather_token_rows(k_cache, block_tables, seq_idx[run.start : run.start + 1], span)
        for rows in row_chunks(run, num_keys * weights.shape[1]):
            score(rows, keys[0], "thd,sd->ths")
    # The other tokens (decodes, verifies, short chunks): each gathers its own sequence's keys.
    rest_positions = positions[rest]
    if rest_positions.numel():
        num_keys = int(rest_positions.max()) + 1  # keys 0..S-1 of every token's sequence
        span = torch.arange(num_keys, device=q.device)
        for rows in row_chunks(rest, num_keys * head_dim):
            ids = seq_idx[rows]
            keys = gather_token_rows(k_cache, block_tables, ids, span.expand(ids.numel(), num_keys))
            score(rows, keys, "thd,tsd->ths")
    return out


def topk_select_reference(logits: torch.Tensor, positions: torch.Tensor, topk: int) -> torch.Tensor:
    """int32 [T, topk]: the positions of the min(topk, p + 1) largest of logits[t, 0..p]
    (p = positions[t]), best first, then -1. Entries past p are not read."""
    width = logits.shape[1]
    past = torch.arange(width, device=logits.device)[None, :] > positions[:, None]
    k = min(topk, width)
    # A stable descending sort: ties go to the earlier position, whatever the row's width.
    # (torch.topk breaks ties by where they sit in its work, which moves with the width: a verify
    # row padded to the batch's longest sequence picked other tied keys than a decode row did.)
    order = logits.masked_fill(past, float("-inf")).sort(dim=-1, descending=True, stable=True)
    idx = order.indices[:, :k].to(torch.int32)
    idx = idx.masked_fill_(past[:, :k], -1)  # rank r exists iff r <= p
    return torch.nn.functional.pad(idx, (0, topk - k), value=-1)


# --- Triton ---------------------------------------------------------------------------------------
#
# The logits kernel scores every key up to each token's position over the paged cache; its buffer
# spans every position the block table can address (no host sync, so CUDA-graph capturable), but
# programs whose keys all lie past the token's position exit at once, so a decode step costs what
# its context costs, not what the table could hold. As it scores, it adds each key to its row's
# histogram of the top 12 bits of the logits' order-preserving integer keys (global atomics,
# spread over all its programs).
#
# The select is a radix select over each token's own positions 0..p that starts from that
# histogram, whose top-down sums give the 12-bit bucket holding the topk-th largest key. Three
# kernels, the first two with one program per 2048-position chunk of a row, so a long row is
# spread over the GPU: the first counts its chunk's keys above the bucket and in it; the second
# writes the positions above the bucket to the output and lists those in it, each chunk after
# the chunks before it (rows stay in position order whatever order programs run in), and counts
# the bucket's next 8 bits. The third, one program per token, takes that digit, narrows the list
# to it in one pass (writing the keys above it), resolves the last 12 bits over what is left (8,
# then 4), then takes the keys above the threshold and the first ones equal to it. A bucket too
# big for the list (massive ties) is resolved over the whole row instead. With p + 1 <= topk it
# writes 0..p and reads no logit. A row comes out as a set: the keys above the threshold bucket in
# position order, then the rest in position order; ties go to the earlier position.

# The select's histograms, one row per token: 2**12 buckets of the keys' top 12 bits (counted by
# the logits kernel), then 256 of the threshold bucket's next 8 bits (by the write kernel).
HIST_BITS = tl.constexpr(12)
HIST_BINS = tl.constexpr(1 << 12)
HIST_WIDTH = tl.constexpr((1 << 12) + 256)
# Positions a token's threshold bucket may hold to be resolved from a list (narrower tables: all).
# The bucket of the topk-th key is 1/8 of an octave wide: at 128k positions, ~4k keys of the
# bench's random logits fall in it.
_CANDIDATES = 16384

# Keys per program. 32 keys x 128 dims of bf16 is 8 KiB a program: enough programs at batch 1
# and 8k context (256) to cover the H200's 132 SMs twice.
_INDEXER_BLOCK_S = 32
# Positions per program of the chunked select kernels, and per iteration of the last one.
_SELECT_BLOCK = 2048
# Logits per program of the standalone histogram kernel.
_HIST_BLOCK = 1024


@triton.jit
def _ordered_key(x):
    """fp32 -> int32 whose unsigned order is x's order (sign bit set for x >= 0, else all bits
    flipped); `key ^ INT32_MIN` has the same order as a signed int."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, ~bits, bits ^ -2147483648)


@triton.jit
def _add_to_histogram(hist_row, logits, mask):
    """hist_row[top HIST_BITS of each logit's key] += 1 where mask."""
    digit = (_ordered_key(logits) >> (32 - HIST_BITS)) & (HIST_BINS - 1)
    tl.atomic_add(hist_row + digit, mask.to(tl.int32), mask=mask, sem="relaxed")


# Batch-dependent sizes, strides and index-tensor offsets are not specialized on: a new batch
# shape must not compile a variant mid-serving (Worker.warm_up compiles the rest).
@triton.jit(
    do_not_specialize=["block_tables_row_stride"],
    do_not_specialize_on_alignment=["block_tables_ptr", "seq_idx_ptr", "positions_ptr"],
)
def _indexer_logits_kernel(
    q_ptr,
    weights_ptr,
    cache_ptr,
    scale_ptr,
    block_tables_ptr,
    seq_idx_ptr,
    positions_ptr,
    logits_ptr,
    hist_ptr,
    q_token_stride,
    q_head_stride,
    weights_token_stride,
    block_tables_row_stride,
    logits_row_stride,
    softmax_scale,
    topk,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE_TOKENS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    COUNT_HIST: tl.constexpr,
    FP8_CACHE: tl.constexpr,
    ROW_BYTES: tl.constexpr,
    SCALE_OFFSET: tl.constexpr,
    GROUP: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    token = tl.program_id(0)
    first_key = tl.program_id(1) * BLOCK_S
    keys = first_key + tl.arange(0, BLOCK_S)  # [BLOCK_S] positions
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    position = tl.load(positions_ptr + token)
    if first_key > position:  # every key here is in the token's future: nothing to score
        return
    seq = tl.load(seq_idx_ptr + token).to(tl.int64)
    causal = keys <= position
    # [BLOCK_S] flat cache rows through the block table
    blocks = tl.load(
        block_tables_ptr + seq * block_tables_row_stride + keys // BLOCK_SIZE_TOKENS,
        mask=causal,
        other=0,
    ).to(tl.int64)
    rows = blocks * BLOCK_SIZE_TOKENS + keys % BLOCK_SIZE_TOKENS
    dim_mask = dims < HEAD_DIM
    if FP8_CACHE:  # e4m3 keys x their group's scale, one byte row per key
        key_in = causal[:, None] & dim_mask[None, :]
        row_bytes = rows * ROW_BYTES
        k = tl.load(cache_ptr + row_bytes[:, None] + dims[None, :], mask=key_in, other=0.0)
        scales = tl.load(
            scale_ptr + (row_bytes + SCALE_OFFSET)[:, None] // 4 + dims[None, :] // GROUP,
            mask=key_in,
            other=0.0,
        )
        k = k.to(tl.float32) * scales  # [BLOCK_S, BLOCK_D]
    else:
        k = tl.load(
            cache_ptr + rows[:, None] * HEAD_DIM + dims[None, :],
            mask=causal[:, None] & dim_mask[None, :],
            other=0.0,
        )  # [BLOCK_S, BLOCK_D]
    head_mask = heads < NUM_HEADS
    q = tl.load(
        q_ptr + token * q_token_stride + heads[:, None] * q_head_stride + dims[None, :],
        mask=head_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )  # [BLOCK_H, BLOCK_D]
    w = tl.load(weights_ptr + token * weights_token_stride + heads, mask=head_mask, other=0.0).to(
        tl.float32
    )
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    if UPCAST_DOT:
        scores = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        scores = tl.dot(q, tl.trans(k.to(q.dtype)))  # [BLOCK_H, BLOCK_S], fp32 accumulate
    scores = tl.maximum(scores * softmax_scale, 0.0)
    logits = tl.sum(scores * w[:, None], axis=0)  # [BLOCK_S]
    logits = tl.where(causal, logits, float("-inf"))
    tl.store(logits_ptr + token * logits_row_stride + keys, logits)
    # Rows of at most topk keys are selected without a histogram.
    if COUNT_HIST:
        if position >= topk:
            _add_to_histogram(hist_ptr + token * HIST_WIDTH, logits, causal)


def indexer_logits_triton(
    q: torch.Tensor,
    weights: torch.Tensor,
    k_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_idx: torch.Tensor,
    positions: torch.Tensor,
    softmax_scale: float,
    histogram: torch.Tensor | None = None,
    topk: int = 0,
) -> torch.Tensor:
    """fp32 logits [T, padded positions]: row t holds the logits of keys 0..positions[t], then -inf
    to the end of that key block; entries past it are never written (callers read 0..p only).

    With `histogram` (zeroed int32 [T, HIST_WIDTH]), rows with positions[t] >= topk also count
    their keys into it, as `key_histogram` does, for `topk_select_triton`."""
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
    device = q.device
    check_tensor("weights", weights, ndim=2, dtypes=FLOAT_DTYPES, device=device)
    num_tokens, num_heads, head_dim = q.shape
    fp8 = is_fp8_cache(k_cache)
    layout = Fp8CacheLayout(head_dim)
    if fp8:
        check_fp8_cache("k_cache", k_cache, layout, device)
    else:
        check_tensor(
            "k_cache", k_cache, ndim=3, dtypes=FLOAT_DTYPES, contiguous=True, device=device
        )
    check_tensor("block_tables", block_tables, ndim=2, dtypes=INDEX_DTYPES, device=device)
    check_tensor("seq_idx", seq_idx, ndim=1, dtypes=INDEX_DTYPES, device=device)
    check_tensor("positions", positions, ndim=1, dtypes=INDEX_DTYPES, device=device)
    if weights.shape != (num_tokens, num_heads):
        raise ValueError(f"weights {tuple(weights.shape)}, expected {(num_tokens, num_heads)}")
    if not fp8 and k_cache.shape[-1] != head_dim:
        raise ValueError(f"k_cache rows are {k_cache.shape[-1]} wide, q heads {head_dim}")
    if seq_idx.shape[0] != num_tokens or positions.shape[0] != num_tokens:
        raise ValueError("seq_idx and positions need one entry per token")
    if histogram is not None:
        _check_histogram(histogram, num_tokens, device)
    block_size_tokens = k_cache.shape[1]
    num_blocks_s = triton.cdiv(block_tables.shape[1] * block_size_tokens, _INDEXER_BLOCK_S)
    logits = torch.empty(
        num_tokens, num_blocks_s * _INDEXER_BLOCK_S, dtype=torch.float32, device=device
    )
    if num_tokens > 0:
        launch(
            _indexer_logits_kernel,
            (num_tokens, num_blocks_s),
            q,
            q,
            weights,
            k_cache,
            k_cache.view(torch.float32) if fp8 else k_cache,
            block_tables,
            seq_idx,
            positions,
            logits,
            logits if histogram is None else histogram,
            q.stride(0),
            q.stride(1),
            weights.stride(0),
            block_tables.stride(0),
            logits.stride(0),
            softmax_scale,
            topk,
            NUM_HEADS=num_heads,
            HEAD_DIM=head_dim,
            BLOCK_SIZE_TOKENS=block_size_tokens,
            BLOCK_H=max(16, triton.next_power_of_2(num_heads)),
            BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
            BLOCK_S=_INDEXER_BLOCK_S,
            UPCAST_DOT=dot_in_fp32(q.dtype),
            COUNT_HIST=histogram is not None,
            FP8_CACHE=fp8,
            ROW_BYTES=layout.bytes_per_token,
            SCALE_OFFSET=layout.scale_offset,
            GROUP=FP8_CACHE_GROUP,
            num_warps=4,
        )
    return logits


def _check_histogram(histogram: torch.Tensor, num_tokens: int, device: torch.device) -> None:
    check_tensor("histogram", histogram, ndim=2, dtypes=(torch.int32,), device=device)
    if histogram.shape != (num_tokens, HIST_WIDTH.value) or not histogram.is_contiguous():
        raise ValueError(
            f"histogram: contiguous {(num_tokens, HIST_WIDTH.value)} expected, got "
            f"{tuple(histogram.shape)}"
        )


@triton.jit
def _key_histogram_kernel(
    logits_ptr,
    positions_ptr,
    hist_ptr,
    logits_row_stride,
    topk,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    token = tl.program_id(0)
    idx = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    position = tl.load(positions_ptr + token)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    if (tl.program_id(1) * BLOCK <= position) & (position >= topk):
        valid = idx <= position
        logits = tl.load(logits_ptr + token.to(tl.int64) * logits_row_stride + idx, mask=valid)
        _add_to_histogram(hist_ptr + token * HIST_WIDTH, logits, valid)


def key_histogram(logits: torch.Tensor, positions: torch.Tensor, topk: int) -> torch.Tensor:
    """int32 [T, HIST_WIDTH], zero but for the first level: per row with positions[t] >= topk,
    how many of logits[t, 0..p] have each top-HIST_BITS key. (The indexer's logits kernel counts
    the same as it writes the logits.)"""
    num_tokens, width = logits.shape
    hist = torch.zeros(num_tokens, HIST_WIDTH.value, dtype=torch.int32, device=logits.device)
    if num_tokens > 0:
        launch(
            _key_histogram_kernel,
            (num_tokens, triton.cdiv(width, _HIST_BLOCK)),
            logits,
            logits,
            positions,
            hist,
            logits.stride(0),
            topk,
            BLOCK=_HIST_BLOCK,
            num_warps=4,
        )
    return hist


@triton.jit
def _pick_digit(counts, bins, need):
    """The bucket holding the need-th largest key of a histogram, how many keys of it are still
    to be taken (need minus the keys of higher buckets), and its size."""
    at_or_above = tl.sum(counts, 0) - tl.cumsum(counts, 0) + counts  # keys with digit >= d
    digit = tl.max(tl.where(at_or_above >= need, bins, -1), 0)
    above = tl.sum(tl.where(bins > digit, counts, 0), 0)
    size = tl.sum(tl.where(bins == digit, counts, 0), 0)
    return digit, need - above, size


@triton.jit
def _needs_chunk(positions_ptr, topk, CHUNK: tl.constexpr):
    """Whether this program's chunk holds keys of a row that needs a select."""
    n = tl.load(positions_ptr + tl.program_id(0)).to(tl.int32) + 1
    return (n > topk) & (tl.program_id(1) * CHUNK < n)


@triton.jit
def _chunk_buckets(hist_ptr, logits_ptr, positions_ptr, logits_row_stride, topk, CHUNK):
    """For this program's chunk of its token's row: its positions, their keys, which of them lie
    above the threshold bucket, and which in it."""
    token = tl.program_id(0)
    idx = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
    valid = idx <= tl.load(positions_ptr + token)
    bins = tl.arange(0, HIST_BINS)
    digit, _, _ = _pick_digit(
        tl.load(hist_ptr + token.to(tl.int64) * HIST_WIDTH + bins), bins, topk
    )
    row = logits_ptr + token.to(tl.int64) * logits_row_stride
    key = _ordered_key(tl.load(row + idx, mask=valid, other=0.0))
    bucket = (key >> (32 - HIST_BITS)) & (HIST_BINS - 1)
    return idx, key, valid & (bucket > digit), valid & (bucket == digit)


# Batch-dependent sizes, strides and index-tensor offsets are not specialized on: a new batch
# shape must not compile a variant mid-serving (Worker.warm_up compiles the rest).
@triton.jit(do_not_specialize_on_alignment=["positions_ptr"])
def _bucket_count_kernel(
    hist_ptr,
    logits_ptr,
    positions_ptr,
    counts_ptr,
    logits_row_stride,
    topk,
    CHUNK: tl.constexpr,
    MAX_CHUNKS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if tl.program_id(1) == 0:  # the second level starts from zero whatever the caller passed
        sub_bins = tl.arange(0, 256)
        tl.store(hist_ptr + tl.program_id(0).to(tl.int64) * HIST_WIDTH + HIST_BINS + sub_bins, 0)
    if _needs_chunk(positions_ptr, topk, CHUNK):
        _, _, above, inside = _chunk_buckets(
            hist_ptr, logits_ptr, positions_ptr, logits_row_stride, topk, CHUNK
        )
        counts = counts_ptr + (tl.program_id(0) * MAX_CHUNKS + tl.program_id(1)) * 2
        tl.store(counts, tl.sum(above.to(tl.int32), 0))
        tl.store(counts + 1, tl.sum(inside.to(tl.int32), 0))


# Batch-dependent sizes, strides and index-tensor offsets are not specialized on: a new batch
# shape must not compile a variant mid-serving (Worker.warm_up compiles the rest).
@triton.jit(do_not_specialize_on_alignment=["positions_ptr"])
def _bucket_write_kernel(
    hist_ptr,
    logits_ptr,
    positions_ptr,
    counts_ptr,
    out_ptr,
    cand_ptr,
    logits_row_stride,
    out_row_stride,
    topk,
    capacity,  # candidate slots per row: a plain argument, so a new table width is no compile
    CHUNK: tl.constexpr,
    MAX_CHUNKS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    token = tl.program_id(0)
    chunk = tl.program_id(1)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if _needs_chunk(positions_ptr, topk, CHUNK):
        idx, key, above, inside = _chunk_buckets(
            hist_ptr, logits_ptr, positions_ptr, logits_row_stride, topk, CHUNK
        )
        # Where this chunk's keys go: after those of the chunks before it, so rows are in
        # position order whatever order the programs run in.
        chunks = tl.arange(0, MAX_CHUNKS)
        counts = counts_ptr + (token * MAX_CHUNKS + chunks) * 2
        before = chunks < chunk
        above_at = tl.sum(tl.load(counts, mask=before, other=0), 0)
        inside_at = tl.sum(tl.load(counts + 1, mask=before, other=0), 0)
        slot = above_at + tl.cumsum(above.to(tl.int32), 0) - 1
        tl.store(out_ptr + token.to(tl.int64) * out_row_stride + slot, idx, mask=above)
        slot = inside_at + tl.cumsum(inside.to(tl.int32), 0) - 1
        inside_listed = inside & (slot < capacity)
        tl.store(cand_ptr + token.to(tl.int64) * capacity + slot, idx, mask=inside_listed)
        # The bucket's next 8 bits, the select's second level.
        sub = (key >> (24 - HIST_BITS)) & 255
        hist2 = hist_ptr + token.to(tl.int64) * HIST_WIDTH + HIST_BINS
        tl.atomic_add(hist2 + sub, inside.to(tl.int32), mask=inside, sem="relaxed")


@triton.jit
def _narrow_list(
    row, cand, num, out_row, written, prefix, SHIFT: tl.constexpr, BLOCK: tl.constexpr
):
    """One pass over the list cand[0..num) (keys of one bucket): keys whose bits from SHIFT up beat
    the prefix's go to out_row after `written`, the positions of those equal to it to the front
    of the list, in order. Returns the new `written` and how many stay listed."""
    offs = tl.arange(0, BLOCK)
    high = (prefix ^ -2147483648) >> SHIFT  # signed order: arithmetic shifts keep it
    kept = num * 0
    for s0 in range(0, num, BLOCK):
        valid = s0 + offs < num
        idx = tl.load(cand + s0 + offs, mask=valid, other=0)
        key = (_ordered_key(tl.load(row + idx, mask=valid, other=0.0)) ^ -2147483648) >> SHIFT
        above = valid & (key > high)
        equal = valid & (key == high)
        tl.store(out_row + written + tl.cumsum(above.to(tl.int32), 0) - 1, idx, mask=above)
        # In place: slots below s0 + BLOCK, whose entries this program has already read.
        tl.store(cand + kept + tl.cumsum(equal.to(tl.int32), 0) - 1, idx, mask=equal)
        written += tl.sum(above.to(tl.int32), 0)
        kept += tl.sum(equal.to(tl.int32), 0)
    return written, kept


@triton.jit
def _load_source(row, cand, j, src_n, listed):
    """Entries j of what the select scans: the candidate list when `listed`, else the row.
    Returns their positions, keys and validity."""
    valid = j < src_n
    idx = tl.load(cand + j, mask=j < tl.where(listed, src_n, 0), other=0)
    idx = tl.where(listed, idx, j)
    return idx, _ordered_key(tl.load(row + idx, mask=valid, other=0.0)), valid


@triton.jit
def _refine(
    row,
    cand,
    prefix,
    remaining,
    src_n,
    listed,
    HI: tl.constexpr,
    LO: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One radix level: bits LO..HI-1 of the keys that share the prefix's bits from HI up give the
    threshold's next digit."""
    offs = tl.arange(0, BLOCK)
    counts = tl.zeros([256], dtype=tl.int32)
    for s0 in range(0, src_n, BLOCK):
        _, key, valid = _load_source(row, cand, s0 + offs, src_n, listed)
        valid = valid & ((key >> HI) == (prefix >> HI))  # equal high bits <=> equal shifts
        counts += tl.histogram((key >> LO) & ((1 << (HI - LO)) - 1), 256, mask=valid)
    digit, remaining, _ = _pick_digit(counts, tl.arange(0, 256), remaining)
    return prefix | (digit << LO), remaining


# Batch-dependent sizes, strides and index-tensor offsets are not specialized on: a new batch
# shape must not compile a variant mid-serving (Worker.warm_up compiles the rest).
@triton.jit(do_not_specialize_on_alignment=["positions_ptr"])
def _topk_select_kernel(
    logits_ptr,
    hist_ptr,
    cand_ptr,
    positions_ptr,
    out_ptr,
    logits_row_stride,
    out_row_stride,
    topk,
    capacity,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    token = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    n = tl.load(positions_ptr + token).to(tl.int32) + 1  # keys 0..n-1 are candidates
    row = logits_ptr + token.to(tl.int64) * logits_row_stride
    out_row = out_ptr + token.to(tl.int64) * out_row_stride
    cand = cand_ptr + token.to(tl.int64) * capacity
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    if n <= topk:
        for j0 in range(0, topk, BLOCK):
            j = j0 + offs
            tl.store(out_row + j, tl.where(j < n, j, -1), mask=j < topk)
    else:
        # The keys above the threshold bucket are written (slots 0..written-1) and the bucket's
        # positions listed in cand, when they fit; else the levels below scan the whole row.
        # `prefix` holds the threshold's bits fixed so far (unsigned bits in an int32),
        # `remaining` how many keys that share them are still to be taken.
        hist_row = hist_ptr + token.to(tl.int64) * HIST_WIDTH
        bins = tl.arange(0, HIST_BINS)
        digit, remaining, size = _pick_digit(tl.load(hist_row + bins), bins, topk)
        written = topk - remaining
        prefix = digit << (32 - HIST_BITS)
        listed = size <= capacity
        src_n = n
        if listed:
            # The second level's histogram came with the list: narrow the list to its digit.
            sub_bins = tl.arange(0, 256)
            sub_hist = tl.load(hist_row + HIST_BINS + sub_bins)
            digit, remaining, _ = _pick_digit(sub_hist, sub_bins, remaining)
            prefix = prefix | (digit << (24 - HIST_BITS))
            written, src_n = _narrow_list(
                row, cand, size, out_row, written, prefix, 24 - HIST_BITS, BLOCK
            )
        else:
            prefix, remaining = _refine(row, cand, prefix, remaining, src_n, listed, 20, 12, BLOCK)
        # The last 12 bits: 8, then 4.
        prefix, remaining = _refine(row, cand, prefix, remaining, src_n, listed, 12, 4, BLOCK)
        prefix, remaining = _refine(row, cand, prefix, remaining, src_n, listed, 4, 0, BLOCK)
        # `prefix` is the threshold key: take the bucket's keys above it and the first
        # `remaining` equal to it (the source is in position order).
        threshold = prefix ^ -2147483648  # signed order for the comparisons
        ties = n * 0
        for s0 in range(0, src_n, BLOCK):
            idx, key, valid = _load_source(row, cand, s0 + offs, src_n, listed)
            valid = valid & ((key >> (32 - HIST_BITS)) == (prefix >> (32 - HIST_BITS)))
            key = key ^ -2147483648
            equal = valid & (key == threshold)
            tie_rank = ties + tl.cumsum(equal.to(tl.int32), 0) - 1
            take = (valid & (key > threshold)) | (equal & (tie_rank < remaining))
            tl.store(out_row + written + tl.cumsum(take.to(tl.int32), 0) - 1, idx, mask=take)
            written += tl.sum(take.to(tl.int32), 0)
            ties += tl.sum(equal.to(tl.int32), 0)


def topk_select_triton(
    logits: torch.Tensor,
    positions: torch.Tensor,
    topk: int,
    histogram: torch.Tensor | None = None,
) -> torch.Tensor:
    """int32 [T, topk]: the positions of the min(topk, p + 1) largest of logits[t, 0..p]
    (p = positions[t]; ties go to the earlier position), as a set (see above), then -1.
    `histogram` is `key_histogram(logits, positions, topk)` where the caller already has it; the
    select rewrites its second level only."""
    check_tensor("logits", logits, ndim=2, dtypes=(torch.float32,))
    check_tensor("positions", positions, ndim=1, dtypes=INDEX_DTYPES, device=logits.device)
    num_tokens, width = logits.shape
    if positions.shape[0] != num_tokens:
        raise ValueError(f"{positions.shape[0]} positions for {num_tokens} logits rows")
    if histogram is None:
        histogram = key_histogram(logits, positions, topk)
    _check_histogram(histogram, num_tokens, logits.device)
    device = logits.device
    out = torch.empty(num_tokens, topk, dtype=torch.int32, device=device)
    if num_tokens == 0:
        return out
    capacity = min(_CANDIDATES, width)
    candidates = torch.empty(num_tokens, capacity, dtype=torch.int32, device=device)
    num_chunks = triton.cdiv(width, _SELECT_BLOCK)
    max_chunks = triton.next_power_of_2(num_chunks)
    counts = torch.empty(num_tokens, max_chunks, 2, dtype=torch.int32, device=device)
    grid = (num_tokens, num_chunks)
    common = dict(CHUNK=_SELECT_BLOCK, MAX_CHUNKS=max_chunks, num_warps=8)
    launch(
        _bucket_count_kernel,
        grid,
        logits,
        histogram,
        logits,
        positions,
        counts,
        logits.stride(0),
        topk,
        **common,
    )
    launch(
        _bucket_write_kernel,
        grid,
        logits,
        histogram,
        logits,
        positions,
        counts,
        out,
        candidates,
        logits.stride(0),
        out.stride(0),
        topk,
        capacity,
        **common,
    )
    launch(
        _topk_select_kernel,
        (num_tokens,),
        logits,
        logits,
        histogram,
        candidates,
        positions,
        out,
        logits.stride(0),
        out.stride(0),
        topk,
        capacity,
        BLOCK=_SELECT_BLOCK,
        num_warps=8,
    )
    return out


def warm_up_topk_select(max_positions: int, topk: int, device: torch.device) -> None:
    """Compile every variant of the select that rows of up to `max_positions` keys use, with one
    dummy row each: its MAX_CHUNKS constexpr is the row's chunk count rounded up to a power of
    two, so a context past each power of two of _SELECT_BLOCK keys would otherwise compile the
    select in the step that first reaches it (2 s on the H200)."""
    max_chunks = triton.next_power_of_2(triton.cdiv(max_positions, _SELECT_BLOCK))
    chunks = 1
    while chunks <= max_chunks:
        width = chunks * _SELECT_BLOCK
        logits = torch.randn(1, width, dtype=torch.float32, device=device)
        positions = torch.full((1,), width - 1, dtype=torch.int64, device=device)
        topk_select_triton(logits, positions, min(topk, width))
        chunks *= 2


def indexer_topk_triton(
    q: torch.Tensor,
    weights: torch.Tensor,
    k_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_idx: torch.Tensor,
    positions: torch.Tensor,
    topk: int,
    softmax_scale: float,
) -> torch.Tensor:
    """Triton twin of `indexer_topk_reference`: the same set per row (see the select's order)."""
    histogram = torch.zeros(q.shape[0], HIST_WIDTH.value, dtype=torch.int32, device=q.device)
    logits = indexer_logits_triton(
        q, weights, k_cache, block_tables, seq_idx, positions, softmax_scale, histogram, topk
    )
    return topk_select_triton(logits, positions, topk, histogram)
