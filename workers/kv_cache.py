"""The paged cache tensors: per layer (and the MTP layer) one MLA-latent and one indexer-key cache,
and what a token costs in them (the one accounting the worker and `mtpserve plan` share).

Both are [num_blocks, block_size_tokens, row] and share one block table: a token's slot is the
same in every cache of every layer. A row is `width` values of the model's dtype, or packed FP8
bytes (kernels/fp8_cache.py) where the CacheFormat says so: the latent with
kv_cache_dtype="fp8" (FlashMLA's V3.2 format, RoPE part kept in the model's dtype), the indexer
keys with the fp8 indexer numerics (e4m3 + a float32 scale per 128, as DeepSeek keeps them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.fp8_cache import FP8_CACHE_DTYPE, Fp8CacheLayout

# Whether each kv_cache_dtype (cluster.config.KV_CACHE_DTYPES, checked there) stores the latent
# in FP8.
_LATENT_FP8 = {"auto": False, "fp8": True}


def max_blocks_per_seq(max_seq_slots: int, block_size_tokens: int) -> int:
    """Block-table entries one sequence may need: `max_seq_slots` is its context plus the MTP
    lookahead (cluster.config's `EngineConfig.max_seq_slots`)."""
    return -(-max_seq_slots // block_size_tokens)


@dataclass(frozen=True)
class CacheFormat:
    """Which of a layer's two caches hold FP8 rows (the rest hold the model's dtype)."""

    latent_fp8: bool = False  # kv_cache_dtype == "fp8"
    index_fp8: bool = False  # indexer_numerics == "fp8": the keys FP8 scoring reads

    @classmethod
    def of(cls, kv_cache_dtype: str = "auto", indexer_numerics: str = "exact") -> CacheFormat:
        if kv_cache_dtype not in _LATENT_FP8:
            raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} is not one of {list(_LATENT_FP8)}")
        return cls(latent_fp8=_LATENT_FP8[kv_cache_dtype], index_fp8=indexer_numerics == "fp8")

    def latent_row(self, config, dtype: torch.dtype) -> tuple[int, torch.dtype]:
        """(row length, element dtype) of a latent cache row."""
        if self.latent_fp8:
            layout = Fp8CacheLayout(config.kv_lora_rank, config.qk_rope_head_dim, dtype)
            return layout.bytes_per_token, FP8_CACHE_DTYPE
        return config.kv_lora_rank + config.qk_rope_head_dim, dtype

    def index_row(self, config, dtype: torch.dtype) -> tuple[int, torch.dtype]:
        """(row length, element dtype) of an indexer-key cache row."""
        if self.index_fp8:
            return Fp8CacheLayout(config.index_head_dim).bytes_per_token, FP8_CACHE_DTYPE
        return config.index_head_dim, dtype

    def bytes_per_token_per_layer(self, config, dtype: torch.dtype) -> int:
        total = 0
        for width, row_dtype in (self.latent_row(config, dtype), self.index_row(config, dtype)):
            total += width * torch.finfo(row_dtype).bits // 8
        return total


def cache_bytes_per_block(
    config,
    block_size_tokens: int,
    dtype: torch.dtype,
    with_mtp: bool,
    cache_format: CacheFormat = CacheFormat(),
) -> int:
    """Bytes one block of every layer's caches takes (block_size_tokens=1: per token)."""
    layers = config.num_hidden_layers + (1 if with_mtp else 0)
    return layers * block_size_tokens * cache_format.bytes_per_token_per_layer(config, dtype)


def allocate_kv_caches(
    config,
    num_blocks: int,
    block_size_tokens: int,
    dtype: torch.dtype,
    device,
    with_mtp: bool = True,
    cache_format: CacheFormat = CacheFormat(),
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    layers = config.num_hidden_layers + (1 if with_mtp else 0)
    latent, latent_dtype = cache_format.latent_row(config, dtype)
    index, index_dtype = cache_format.index_row(config, dtype)
    kv = [
        torch.zeros(num_blocks, block_size_tokens, latent, dtype=latent_dtype, device=device)
        for _ in range(layers)
    ]
    idx = [
        torch.zeros(num_blocks, block_size_tokens, index, dtype=index_dtype, device=device)
        for _ in range(layers)
    ]
    return kv, idx
