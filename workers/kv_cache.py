"""The paged cache tensors: per layer (and the MTP layer) one MLA-latent and one indexer-key cache.

Both are [num_blocks, block_size_tokens, width] and share one block table: a token's slot is the
same in every cache of every layer.
"""

from __future__ import annotations

import torch


def max_blocks_per_seq(max_seq_slots: int, block_size_tokens: int) -> int:
    """Block-table entries one sequence may need: `max_seq_slots` is its context plus the MTP
    lookahead (cluster.config's `EngineConfig.max_seq_slots`)."""
    return -(-max_seq_slots // block_size_tokens)


def cache_bytes_per_block(
    config, block_size_tokens: int, dtype: torch.dtype, with_mtp: bool
) -> int:
    layers = config.num_hidden_layers + (1 if with_mtp else 0)
    width = config.kv_lora_rank + config.qk_rope_head_dim + config.index_head_dim
    return layers * block_size_tokens * width * torch.finfo(dtype).bits // 8


def allocate_kv_caches(
    config,
    num_blocks: int,
    block_size_tokens: int,
    dtype: torch.dtype,
    device,
    with_mtp: bool = True,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    layers = config.num_hidden_layers + (1 if with_mtp else 0)
    latent = config.kv_lora_rank + config.qk_rope_head_dim
    kv = [
        torch.zeros(num_blocks, block_size_tokens, latent, dtype=dtype, device=device)
        for _ in range(layers)
    ]
    idx = [
        torch.zeros(
            num_blocks, block_size_tokens, config.index_head_dim, dtype=dtype, device=device
        )
        for _ in range(layers)
    ]
    return kv, idx
