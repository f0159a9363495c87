"""The FP8 indexer numerics: the rotation is exact, FP8 rounding stays within e4m3's step."""

from __future__ import annotations

import torch

from kernels.indexer_fp8 import fp8_round_reference, hadamard_rotate_reference


def test_hadamard_rotation_is_orthogonal():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(7, 128, generator=g), torch.randn(5, 128, generator=g)
    rq, rk = hadamard_rotate_reference(q), hadamard_rotate_reference(k)
    torch.testing.assert_close(rq @ rk.t(), q @ k.t(), atol=1e-4, rtol=1e-5)  # scores unchanged
    torch.testing.assert_close(rq.norm(dim=-1), q.norm(dim=-1))
    assert not torch.allclose(rq, q)


def test_fp8_rounding_error_and_idempotence():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(13, 200, generator=g) * torch.logspace(-2, 2, 200)  # wide dynamic range
    r = fp8_round_reference(x)
    # Per 128-block scale amax/448; e4m3 keeps 3 mantissa bits: relative error <= 2**-4 for
    # normal values, absolute <= scale * 2**-9 in the subnormal range.
    blocks = torch.nn.functional.pad(x, (0, 56)).view(13, 2, 128).abs().amax(-1) / 448
    scale = blocks.repeat_interleave(128, 1)[:, :200]
    assert ((r - x).abs() <= x.abs() / 16 + scale * 2**-9 + 1e-12).all()
    assert torch.equal(fp8_round_reference(r), r)
    assert (r != x).any()


def test_fp8_rounding_of_no_rows():
    """No rows in, no rows out (the block count is explicit, not inferred from zero elements)."""
    assert fp8_round_reference(torch.empty(0, 128)).shape == (0, 128)
