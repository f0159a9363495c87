"""The one composed engine configuration. Frozen; "auto" choices are resolved once, at startup."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

DEFAULT_MAX_MODEL_LEN = 8192  # when neither the option nor the checkpoint says less


@dataclass(frozen=True)
class EngineConfig:
    model: str  # checkpoint directory
    served_model_name: str | None = None  # the API's model id; None: derived from `model`
    tp_size: int = 1
    ep_size: int = 1  # expert-parallel size within the TP group (divides tp_size)
    num_draft_tokens: int = 0  # k; 0 turns MTP speculation off
    share_topk: bool = False  # draft steps 1..k-1 reuse draft step 0's top-k row
    device: str = "auto"  # "auto" | "cpu" | "cuda"
    dtype: str = "auto"  # "auto" (bf16 on GPU, fp32 on CPU) | "bfloat16" | "float32"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: min(config.max_position_embeddings, 8192)
    num_kv_blocks: int | None = None  # None: sized from memory
    block_size_tokens: int = 64
    # Full blocks of a prompt that an earlier request computed are reused, not recomputed.
    enable_prefix_caching: bool = True
    max_queued_requests: int = 256
    # "auto" (in-process for TP=1, Ray otherwise) | "inprocess" | "ray" | "package.module:Class"
    executor: str = "auto"
    actor_num_cpus: float = 1.0  # CPU request of each Ray actor (fractions allowed)
    gpu_memory_utilization: float = 0.85
    step_timeout_s: float = 120.0  # a step that takes longer is a dead worker
    indexer_numerics: str = "exact"  # "exact" (transformers) | "fp8" (DeepSeek's deployments)
    # "auto": the MLA latent cache in the model's dtype; "fp8": e4m3 + a scale per 128 values,
    # the RoPE part kept in the model's dtype (FlashMLA's V3.2 format, workers.kv_cache)
    kv_cache_dtype: str = "auto"
    enforce_eager: bool = False  # no CUDA graphs for decode steps
    cpu_threads: int | None = None  # torch intra-op threads per worker; None: half the cores
    # Only TP rank 0 runs the indexers and broadcasts top-k over the TP group (None: on when
    # tp_size > 1). Off: every rank runs the indexer on its own copy of the inputs.
    topk_broadcast: bool | None = None
    # Ray placement group strategy for the ranks (STRICT_PACK: one node; STRICT_SPREAD: one
    # rank per node). Ignored inside a Serve replica that has its own placement group.
    placement_strategy: str = "STRICT_PACK"
    # How the Ray executor sends a step to the ranks: "graph" (a Ray Compiled Graph over
    # shared-memory channels), "calls" (one actor call per rank), "auto" (graph on GPU ranks).
    step_transport: str = "auto"

    def __post_init__(self) -> None:
        if self.tp_size < 1 or self.ep_size < 1 or self.tp_size % self.ep_size:
            raise ValueError(f"ep_size={self.ep_size} must divide tp_size={self.tp_size}")
        from workers.kv_cache import MAX_LOOKAHEAD_SLOTS, check_kv_cache_dtype

        if not 0 <= self.num_draft_tokens <= MAX_LOOKAHEAD_SLOTS + 1:
            raise ValueError(f"num_draft_tokens must be in 0..{MAX_LOOKAHEAD_SLOTS + 1}")
        from workers.model import check_indexer_numerics

        check_indexer_numerics(self.indexer_numerics)  # here, not after the workers load weights
        check_kv_cache_dtype(self.kv_cache_dtype)

    @property
    def topk_src_rank(self) -> int | None:
        """The TP rank that computes top-k for all (None: each rank computes its own)."""
        on = self.tp_size > 1 if self.topk_broadcast is None else self.topk_broadcast
        return 0 if on and self.tp_size > 1 else None

    @classmethod
    def from_dict(cls, d: dict) -> EngineConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"unknown engine options: {sorted(unknown)}")
        return cls(**d)

    @property
    def model_name(self) -> str:
        """The model id clients use: served_model_name, else the checkpoint directory's name
        ("mtpserve-default" for the shipped default model)."""
        import os

        from workers.default_model import SHIPPED_DIR

        if self.served_model_name:
            return self.served_model_name
        path = os.path.realpath(self.model)
        if path == os.path.realpath(SHIPPED_DIR):
            return "mtpserve-default"
        return os.path.basename(path) or path

    @property
    def cuda_graph_max_batch(self) -> int:
        return 0 if self.enforce_eager else self.max_num_seqs

    def replace(self, **changes) -> EngineConfig:
        return dataclasses.replace(self, **changes)
