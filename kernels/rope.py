"""Rotary position embedding in the two layouts DeepSeek-V3.2 uses.

MLA rotates *interleaved* pairs (x0, x1), (x2, x3), ... of the last `qk_rope_head_dim` dims; the
indexer rotates *half-split* (NeoX) pairs (x_i, x_{i+d/2}) of its first `qk_rope_head_dim` dims.
Both write the result de-interleaved, [real parts | imaginary parts], as `transformers` does, so
q and k stay consistent and cached keys compare bit-for-bit with the oracle's.
"""

from __future__ import annotations

import torch


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, attention_scaling: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin per position and frequency: [num_tokens, rope_dim // 2], fp32."""
    freqs = positions.float()[:, None] * inv_freq.float()[None, :]
    return freqs.cos() * attention_scaling, freqs.sin() * attention_scaling


def rope_reference(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool
) -> torch.Tensor:
    """Rotate x [num_tokens, ..., rope_dim] by cos/sin [num_tokens, rope_dim // 2]."""
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    cos = cos.reshape(shape).to(x.dtype)
    sin = sin.reshape(shape).to(x.dtype)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
