"""Causal attention over packed sequences of different lengths (multi-head, one key and value
per head), each sequence's queries its last keys: the dense form of MLA for prompt tokens that
see no more positions than the indexer keeps (DeepSeek-V3.2's sparse attention is then dense).

q [Tq, H, D] holds sequence i's queries at rows cu_q[i]:cu_q[i + 1], k [Tk, H, D] and v [Tk, H,
Dv] its keys at rows cu_k[i]:cu_k[i + 1]; query j of a sequence of n queries and m keys sees keys
0..m - n + j (the queries are the sequence's last n positions). Dv may differ from D.

The CUDA path is PyTorch's FlashAttention-2 varlen kernel (`aten._flash_attention_forward`, what
`torch.nn.attention.varlen` calls; its causal mask is aligned to the last key, as above); it takes
one head width for q, k and v, so a narrower v is zero-padded to D and the output cut back.
"""

from __future__ import annotations

import torch

FLASH_DTYPES = (torch.float16, torch.bfloat16)
FLASH_MAX_HEAD_DIM = 256


def varlen_causal_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,  # the flash kernel's; the twin walks q_lens and k_lens
    cu_k: torch.Tensor,
    q_lens: list[int],
    k_lens: list[int],
    scale: float,
) -> torch.Tensor:
    """The twin: per sequence, scores in fp32, the causal mask aligned to the last key, softmax,
    the weighted sum of v in fp32. -> [Tq, H, Dv] in q's dtype."""
    check_varlen(q, k, v, q_lens, k_lens)
    out = torch.empty(*q.shape[:2], v.shape[-1], dtype=q.dtype, device=q.device)
    q_start = k_start = 0
    for n, m in zip(q_lens, k_lens, strict=True):
        qs = q[q_start : q_start + n].float().transpose(0, 1)  # [H, n, D]
        ks = k[k_start : k_start + m].float().transpose(0, 1)  # [H, m, D]
        vs = v[k_start : k_start + m].float().transpose(0, 1)  # [H, m, Dv]
        scores = torch.matmul(qs, ks.transpose(1, 2)) * scale  # [H, n, m]
        seen = torch.arange(m, device=q.device)[None, :] <= (
            torch.arange(n, device=q.device)[:, None] + (m - n)
        )
        scores = scores.masked_fill(~seen, float("-inf"))
        weighted = torch.matmul(scores.softmax(-1), vs)  # [H, n, Dv]
        out[q_start : q_start + n] = weighted.transpose(0, 1).to(q.dtype)
        q_start, k_start = q_start + n, k_start + m
    return out


def check_varlen(q, k, v, q_lens: list[int], k_lens: list[int]) -> None:
    if q.ndim != 3 or k.ndim != 3 or v.ndim != 3:
        raise ValueError(f"q, k, v need [tokens, heads, dim]: {q.shape}, {k.shape}, {v.shape}")
    if q.shape[1:] != k.shape[1:] or k.shape[:2] != v.shape[:2]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if len(q_lens) != len(k_lens) or sum(q_lens) != q.shape[0] or sum(k_lens) != k.shape[0]:
        raise ValueError(f"{len(q_lens)} sequences of {q_lens} queries and {k_lens} keys")
    if any(n > m or n < 0 for n, m in zip(q_lens, k_lens, strict=True)):
        raise ValueError(f"a sequence has more queries than keys: {q_lens}, {k_lens}")


def flash_varlen_runs(q: torch.Tensor) -> bool:
    """The flash kernel takes these inputs: CUDA, 16-bit, heads at most 256 wide."""
    return (
        q.is_cuda
        and q.dtype in FLASH_DTYPES
        and q.shape[-1] <= FLASH_MAX_HEAD_DIM
        and hasattr(torch.ops.aten, "_flash_attention_forward")
    )


def varlen_causal_attention_flash(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,  # int32 [N + 1], on q's device
    cu_k: torch.Tensor,  # int32 [N + 1]
    q_lens: list[int],
    k_lens: list[int],
    scale: float,
) -> torch.Tensor:
    check_varlen(q, k, v, q_lens, k_lens)
    width = v.shape[-1]
    if width < q.shape[-1]:
        v = torch.nn.functional.pad(v, (0, q.shape[-1] - width))
    out = torch.ops.aten._flash_attention_forward(
        q,
        k,
        v,
        cu_q,
        cu_k,
        max(q_lens),
        max(k_lens),
        0.0,  # dropout
        True,  # causal, aligned to the last key
        False,  # no debug mask
        scale=scale,
    )[0]
    return out[..., :width]
