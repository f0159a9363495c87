"""Causal attention over packed sequences (kernels/varlen_attention.py): the twin against
PyTorch's own attention with an explicit mask (CPU), the flash path against the twin at
DeepSeek-V3.2's dense-prefill shapes (GPU: 192-wide q and k, 128-wide v, 128 heads)."""

from __future__ import annotations

import pytest
import torch

from kernels.varlen_attention import (
    check_varlen,
    flash_varlen_runs,
    varlen_causal_attention_flash,
    varlen_causal_attention_reference,
)
from tests.kernels.conftest import assert_close


def _case(q_lens, k_lens, heads, dim, v_dim, dtype, device):
    g = torch.Generator().manual_seed(sum(q_lens) + sum(k_lens))
    q = torch.randn(sum(q_lens), heads, dim, generator=g).to(dtype).to(device)
    k = torch.randn(sum(k_lens), heads, dim, generator=g).to(dtype).to(device)
    v = torch.randn(sum(k_lens), heads, v_dim, generator=g).to(dtype).to(device)
    cu = [
        torch.tensor([0, *lens], device=device).cumsum(0).to(torch.int32)
        for lens in (q_lens, k_lens)
    ]
    return q, k, v, cu[0], cu[1]


@pytest.mark.parametrize(
    "q_lens,k_lens",
    [
        ([5], [5]),  # a prompt's first chunk: queries and keys alike
        ([3, 1, 7], [10, 1, 7]),  # chunks after a context, one token alone
        ([4, 6], [20, 6]),
    ],
)
def test_twin_matches_torch_attention_with_a_bottom_right_causal_mask(q_lens, k_lens) -> None:
    q, k, v, cu_q, cu_k = _case(q_lens, k_lens, 3, 12, 8, torch.float32, "cpu")
    scale = 0.3
    got = varlen_causal_attention_reference(q, k, v, cu_q, cu_k, q_lens, k_lens, scale)
    qs = ks = 0
    for n, m in zip(q_lens, k_lens, strict=True):
        # query j of n sees keys 0..m - n + j: the mask's diagonal on the last key
        mask = torch.ones(n, m, dtype=torch.bool).tril(m - n)
        want = torch.nn.functional.scaled_dot_product_attention(
            q[qs : qs + n].transpose(0, 1),
            k[ks : ks + m].transpose(0, 1),
            v[ks : ks + m].transpose(0, 1),
            attn_mask=mask,
            scale=scale,
        ).transpose(0, 1)
        torch.testing.assert_close(got[qs : qs + n], want)
        qs, ks = qs + n, ks + m


def test_bad_spans_are_errors() -> None:
    q, k, v, _, _ = _case([3], [5], 2, 8, 8, torch.float32, "cpu")
    with pytest.raises(ValueError, match="more queries than keys"):
        check_varlen(q, k[:2], v[:2], [3], [2])
    with pytest.raises(ValueError, match="sequences"):
        check_varlen(q, k, v, [2], [5])


def test_flash_is_for_cuda_in_16_bits_only() -> None:
    assert not flash_varlen_runs(torch.zeros(1, 1, 8, dtype=torch.bfloat16))
    if torch.cuda.is_available():
        assert not flash_varlen_runs(torch.zeros(1, 1, 8, device="cuda"))  # fp32


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "q_lens,k_lens,heads",
    [
        ([2048], [2048], 128),  # a 2048-token chunk at context 0, DeepSeek's heads at TP = 1
        ([300, 1, 77], [1500, 1, 77], 16),  # chunks after a context, TP = 8's heads
    ],
)
def test_gpu_flash_matches_twin(q_lens, k_lens, heads, dtype) -> None:
    q, k, v, cu_q, cu_k = _case(q_lens, k_lens, heads, 192, 128, dtype, "cuda")
    assert flash_varlen_runs(q)
    args = (q, k, v, cu_q, cu_k, q_lens, k_lens, 192**-0.5)
    assert_close(varlen_causal_attention_flash(*args), varlen_causal_attention_reference(*args))
