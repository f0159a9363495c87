from __future__ import annotations

import pytest
import torch

from kernels.rope import rope_cos_sin, rope_cos_sin_triton, rope_reference, rope_triton
from tests.kernels.conftest import DEVICE, DTYPES, INTERPRETER, assert_close, needs_triton

pytestmark = needs_triton


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("rope_dims", [None, 16])
def test_rope_matches_twin(dtype, interleaved, rope_dims) -> None:
    """Within a rounding of the twin (the GPU contracts a*c - b*s into one FMA; the twin rounds
    each product). On a strided view (q's rope part inside the projection output, as MLA takes
    it) and on a whole row with pass-through dims (the indexer's q), for 17 heads (a partial
    head block)."""
    torch.manual_seed(int(interleaved))
    positions = torch.tensor([0, 5, 4095, 163839], device=DEVICE)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, 16, 2, device=DEVICE).float() / 16)
    cos, sin = rope_cos_sin(positions, inv_freq, 1.3)
    full = torch.randn(4, 17, 48, dtype=dtype, device=DEVICE) * 3
    x = full[..., 32:] if rope_dims is None else full[..., 8:]  # [4, 17, 16] or [4, 17, 40]
    want = rope_reference(x, cos, sin, interleaved, rope_dims)
    got = rope_triton(x, cos, sin, interleaved, rope_dims)
    assert got.is_contiguous() and got.dtype == dtype
    assert_close(got, want)
    if rope_dims is not None:  # the pass-through dims are copies
        assert torch.equal(got[..., rope_dims:], x[..., rope_dims:])


def test_rope_rejects_mismatched_cos_sin() -> None:
    x = torch.randn(2, 3, 8, device=DEVICE)
    cos = torch.randn(2, 2, device=DEVICE)
    with pytest.raises(ValueError, match="cos/sin"):
        rope_triton(x, cos, cos, True)


@pytest.mark.parametrize("num_tokens", [1, 3, 16, 37])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_cos_sin_match_the_twin(num_tokens, dtype) -> None:
    """Every token of the step in one launch, DeepSeek's 32 frequencies and a YaRN-like scaling;
    positions up to 160k. On CUDA the same bits as the twin (the CUDA math library's cos and sin,
    as torch's); the interpreter's are numpy's, within a rounding."""
    torch.manual_seed(num_tokens)
    positions = torch.randint(0, 163840, (num_tokens,), dtype=dtype, device=DEVICE)
    positions[0] = 0
    inv_freq = 1.0 / 10000 ** (torch.arange(0, 64, 2, device=DEVICE).float() / 64)
    got = rope_cos_sin_triton(positions, inv_freq, 1.3)
    want = rope_cos_sin(positions, inv_freq, 1.3)
    for g, w in zip(got, want):
        assert g.shape == w.shape == (num_tokens, 32) and g.dtype == torch.float32
        if INTERPRETER:
            assert_close(g, w)
        else:
            assert torch.equal(g, w)
    assert torch.equal(got[0][0], torch.full((32,), 1.3, device=DEVICE))  # position 0
    assert torch.equal(got[1][0], torch.zeros(32, device=DEVICE))


def test_cos_sin_of_no_tokens() -> None:
    inv_freq = torch.ones(4, device=DEVICE)
    cos, sin = rope_cos_sin_triton(torch.zeros(0, dtype=torch.int64, device=DEVICE), inv_freq)
    assert cos.shape == sin.shape == (0, 4)
