"""The FP8 linear kernel against its twin, and the twins against closed forms."""

from __future__ import annotations

import pytest
import torch

from kernels import fp8_linear
from kernels.fp8 import (
    FP8_BLOCK,
    dequantize_fp8_reference,
    fp8_linear_act_quant_reference,
    fp8_linear_reference,
    quantize_activations_reference,
    quantize_fp8_reference,
)
from kernels.fp8_linear import (
    DECODE_CONFIG,
    PREFILL_CONFIG,
    Fp8TileConfig,
    fp8_linear_triton,
    split_k,
    tile_counters,
)
from tests.kernels.conftest import DEVICE, DTYPES, INTERPRETER, assert_close, needs_triton


def _weight(out_features: int, in_features: int, seed: int = 0):
    """An FP8 weight whose blocks have scales 10**-2 .. 10**2 apart, so a scale read from the
    wrong block moves the result far past any tolerance."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=g)
    rows = torch.arange(out_features)[:, None] // FP8_BLOCK
    cols = torch.arange(in_features)[None, :] // FP8_BLOCK
    w = w * 10.0 ** ((rows * 3 + cols * 5) % 5 - 2)
    return quantize_fp8_reference(w)


def test_dequantization_is_each_block_times_its_scale() -> None:
    weight, scale = _weight(300, 200)
    got = dequantize_fp8_reference(weight, scale)
    for r in range(300):
        for c in (0, 127, 128, 199):
            assert got[r, c] == weight[r, c].float() * scale[r // 128, c // 128]


def test_quantization_round_trips_within_e4m3() -> None:
    w = torch.randn(300, 200)
    weight, scale = quantize_fp8_reference(w)
    assert scale.shape == (3, 2)
    # e4m3 keeps 3 mantissa bits: a relative step of 2**-3, so half of that after rounding.
    err = (dequantize_fp8_reference(weight, scale) - w).abs()
    assert (err <= w.abs() * 2**-4 + scale.repeat_interleave(128, 0)[:300, :1] * 2**-9).all()


def test_activation_quantization_per_token_groups() -> None:
    x = torch.randn(5, 300) * torch.tensor([1.0, 10.0, 100.0, 0.1, 1.0])[:, None]
    q, scale = quantize_activations_reference(x)
    assert scale.shape == (5, 3)
    for t in range(5):
        for g in range(3):
            group = x[t, g * 128 : (g + 1) * 128]
            assert scale[t, g] == group.abs().max() / 448
    deq = q.float() * scale.repeat_interleave(128, 1)[:, :300]
    assert (
        (deq - x).abs() <= x.abs() * 2**-4 + scale.repeat_interleave(128, 1)[:, :300] * 2**-9
    ).all()
    weight, wscale = _weight(64, 300)
    closed = deq @ dequantize_fp8_reference(weight, wscale).t()
    assert torch.allclose(fp8_linear_act_quant_reference(x, weight, wscale), closed)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "num_tokens, out_features, in_features",
    [(1, 200, 300), (7, 128, 256), (33, 64, 1000), (131, 150, 130)],
)
def test_fp8_linear_matches_twin(dtype, num_tokens, out_features, in_features) -> None:
    weight, scale = _weight(out_features, in_features)
    x = torch.randn(num_tokens, in_features, dtype=dtype)
    want = fp8_linear_reference(x, weight, scale)
    got = fp8_linear_triton(x.to(DEVICE), weight.to(DEVICE), scale.to(DEVICE)).cpu()
    assert got.dtype == dtype
    assert_close(got, want)


@needs_triton
@pytest.mark.parametrize("config", [DECODE_CONFIG, PREFILL_CONFIG], ids=["decode", "prefill"])
def test_fp8_linear_either_config_on_any_rows(config) -> None:
    """Split K (decode: few tiles, so K spreads over programs) and whole K give the twin."""
    weight, scale = _weight(96, 520, seed=1)
    x = torch.randn(19, 520)
    got = fp8_linear_triton(x.to(DEVICE), weight.to(DEVICE), scale.to(DEVICE), config).cpu()
    assert_close(got, fp8_linear_reference(x, weight, scale))


# Few programs to aim for, so small shapes split K into several 128-wide ranges (and one split per
# K range is what `UNSPLIT` computes).
SPLIT_CONFIG = Fp8TileConfig(block_m=16, block_n=32, num_warps=4, num_stages=3, split_target=64)
UNSPLIT = Fp8TileConfig(block_m=16, block_n=32, num_warps=4, num_stages=3, split_target=1)
# (rows, out_features, in_features) -> splits with SPLIT_CONFIG: 8; 2 (32 tiles, K 7168 in two
# ranges of 28 blocks); 8 (K 1000: a partial last block); 6 (N 200: a partial last tile).
SPLIT_SHAPES = [(1, 96, 1024), (16, 1024, 7168), (7, 64, 1000), (16, 200, 700)]


def _num_splits(num_rows: int, out_features: int, in_features: int, config) -> tuple[int, int]:
    num_tiles = -(-num_rows // config.block_m) * -(-out_features // config.block_n)
    return split_k(num_tiles, in_features, config.split_target)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SPLIT_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_fp8_linear_split_k_matches_twin(dtype, shape) -> None:
    num_rows, out_features, in_features = shape
    assert _num_splits(*shape, SPLIT_CONFIG)[0] > 1
    weight, scale = _weight(out_features, in_features, seed=3)
    x = torch.randn(num_rows, in_features, dtype=dtype)
    got = fp8_linear_triton(*[t.to(DEVICE) for t in (x, weight, scale)], SPLIT_CONFIG).cpu()
    assert_close(got, fp8_linear_reference(x, weight, scale))


@needs_triton
@pytest.mark.parametrize("shape", SPLIT_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_fp8_linear_split_k_is_the_fixed_order_sum_of_its_splits(shape) -> None:
    """What the two-kernel path gave, bit for bit: each K range's fp32 partial (the kernel on
    that range alone, unsplit), added from zeros in order s = 0 .. S-1; and that sum is the
    per-range fp32 products of the dequantized weight, added in the same order."""
    num_rows, out_features, in_features = shape
    num_splits, k_per_split = _num_splits(*shape, SPLIT_CONFIG)
    weight, scale = _weight(out_features, in_features, seed=4)
    x, weight, scale = (
        torch.randn(num_rows, in_features).to(DEVICE),
        weight.to(DEVICE),
        scale.to(DEVICE),
    )
    dequantized = dequantize_fp8_reference(weight, scale)
    partials, references = [], []
    for s in range(num_splits):
        k0, k1 = s * k_per_split, min((s + 1) * k_per_split, in_features)
        kb0, kb1 = k0 // FP8_BLOCK, -(-k1 // FP8_BLOCK)
        partials.append(
            fp8_linear_triton(x[:, k0:k1], weight[:, k0:k1], scale[:, kb0:kb1], UNSPLIT)
        )
        references.append(x[:, k0:k1] @ dequantized[:, k0:k1].t())
    want = torch.zeros(num_rows, out_features, device=DEVICE)
    for partial in partials:
        want += partial
    got = fp8_linear_triton(x, weight, scale, SPLIT_CONFIG)
    assert torch.equal(got, want)
    assert torch.equal(fp8_linear_triton(x, weight, scale, SPLIT_CONFIG), got)  # again: the same
    assert_close(got.cpu(), sum(references, torch.zeros_like(want)).cpu())


@needs_triton
def test_split_k_leaves_every_tile_counter_at_zero() -> None:
    weight, scale = _weight(200, 700, seed=5)
    x = torch.randn(16, 700).to(DEVICE)
    fp8_linear_triton(x, weight.to(DEVICE), scale.to(DEVICE), SPLIT_CONFIG)
    counters = fp8_linear._TILE_COUNTERS[x.device]  # the launch's: KeyError if it took none
    assert counters.dtype == torch.int32 and counters.numel() >= fp8_linear.MIN_TILE_COUNTERS
    assert int(counters.count_nonzero()) == 0


@needs_triton
@pytest.mark.parametrize("min_counters", [1, 4096], ids=["grown", "up-front"])
def test_split_k_linears_of_different_tile_counts_back_to_back(min_counters, monkeypatch) -> None:
    """Both sizes share the device's counters (grown from 3 to 32 tiles where the buffer starts
    small): each call gives its twin and the bits of its first call, and leaves them at zero."""
    monkeypatch.setattr(fp8_linear, "_TILE_COUNTERS", {})
    monkeypatch.setattr(fp8_linear, "MIN_TILE_COUNTERS", min_counters)
    shapes = [(4, 96, 1024), (20, 500, 384)]  # 3 tiles x 8 splits, 32 tiles x 2 splits
    assert [_num_splits(*shape, SPLIT_CONFIG)[0] for shape in shapes] == [8, 2]
    linears = []
    for num_rows, out_features, in_features in shapes:
        weight, scale = _weight(out_features, in_features, seed=num_rows)
        x = torch.randn(num_rows, in_features)
        want = fp8_linear_reference(x, weight, scale)
        linears.append(([t.to(DEVICE) for t in (x, weight, scale)], want))
    first = [fp8_linear_triton(*args, SPLIT_CONFIG) for args, _ in linears]
    for _ in range(2):
        for (args, want), bits in zip(linears, first):
            got = fp8_linear_triton(*args, SPLIT_CONFIG)
            assert torch.equal(got, bits)
            assert_close(got.cpu(), want)
    counters = fp8_linear._TILE_COUNTERS[first[0].device]
    assert counters.numel() == max(32, min_counters)
    assert int(counters.count_nonzero()) == 0


@pytest.mark.skipif(not INTERPRETER, reason="needs the interpreter's one-by-one programs")
def test_the_tile_sum_is_taken_by_the_arrival_that_finds_num_splits_minus_one(monkeypatch) -> None:
    """The counters are what decides: each left at 1 (as if a split had already arrived), a
    tile's S splits make S + 1 arrivals; the one that finds S - 1 sums and zeroes the counter,
    and the last leaves it at 1. A kernel that ignored the counters, summed in every program or
    never zeroed them would leave 0 or S + 1. (Only the interpreter runs a tile's splits one
    after another, in order: on a GPU the last two arrivals race with the zeroing.)"""
    monkeypatch.setattr(fp8_linear, "_TILE_COUNTERS", {})
    weight, scale = _weight(96, 1024, seed=6)
    args = (torch.randn(4, 1024), weight, scale, SPLIT_CONFIG)
    fp8_linear_triton(*args)
    counters = fp8_linear._TILE_COUNTERS[torch.device("cpu")]
    counters[:3] = 1  # the 3 tiles of 8 splits
    fp8_linear_triton(*args)
    assert counters[:4].tolist() == [1, 1, 1, 0]


def test_tile_counters_grow_outside_a_capture_and_refuse_inside_one(monkeypatch) -> None:
    monkeypatch.setattr(fp8_linear, "_TILE_COUNTERS", {})
    monkeypatch.setattr(fp8_linear, "_OUTGROWN_TILE_COUNTERS", [])
    monkeypatch.setattr(fp8_linear, "MIN_TILE_COUNTERS", 4)
    cpu = torch.device("cpu")
    small = tile_counters(cpu, 3)
    assert small.numel() == 4 and tile_counters(cpu, 4) is small
    grown = tile_counters(cpu, 9)
    assert grown.numel() == 9 and int(grown.count_nonzero()) == 0
    assert fp8_linear._OUTGROWN_TILE_COUNTERS == [small]  # a captured graph may still use it
    # During a capture: what is there is handed out; nothing is allocated.
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    cuda0 = torch.device("cuda", 0)
    with pytest.raises(RuntimeError, match="CUDA-graph capture"):
        tile_counters(cuda0, 1)
    fp8_linear._TILE_COUNTERS[cuda0] = grown  # stands in for a buffer on the GPU
    assert tile_counters(cuda0, 9) is grown
    with pytest.raises(RuntimeError, match="needs 10 tile counters on cuda:0 and has 9"):
        tile_counters(cuda0, 10)


def test_fp8_linear_refuses_a_wrong_scale_grid() -> None:
    weight, scale = _weight(200, 300)
    with pytest.raises(ValueError, match="scale_inv"):
        fp8_linear_triton(torch.randn(2, 300), weight, scale[:1])
