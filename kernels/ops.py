"""The ops the model calls. Each picks its Triton kernel where `use_triton` says so, else its twin.

Swapping an implementation touches only this file.
"""

from __future__ import annotations

from kernels.activation import silu_and_mul_reference
from kernels.cache_write import indexer_k_cache_write_reference, mla_kv_cache_write_reference
from kernels.indexer import indexer_topk_reference
from kernels.moe_experts import grouped_moe_reference
from kernels.moe_routing import moe_route_reference
from kernels.rmsnorm import rms_norm_reference
from kernels.rope import rope_cos_sin, rope_reference
from kernels.sparse_mla import sparse_mla_attention_reference

rms_norm = rms_norm_reference
rope = rope_reference
mla_kv_cache_write = mla_kv_cache_write_reference
indexer_k_cache_write = indexer_k_cache_write_reference
indexer_topk = indexer_topk_reference
sparse_mla_attention = sparse_mla_attention_reference
moe_route = moe_route_reference
grouped_moe = grouped_moe_reference
silu_and_mul = silu_and_mul_reference

__all__ = [
    "rms_norm",
    "rope",
    "rope_cos_sin",
    "mla_kv_cache_write",
    "indexer_k_cache_write",
    "indexer_topk",
    "sparse_mla_attention",
    "moe_route",
    "grouped_moe",
    "silu_and_mul",
]
