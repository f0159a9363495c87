"""The one composed engine configuration, and where its "auto" choices are resolved.

`EngineConfig` is what the user asks for, and the one home of every engine default: the CLI
(deploy/engine_args.py), the Serve app's args (deploy/app.py) and the offline `LLM` leave an
option out rather than repeat its default. Three fields are "auto" until the checkpoint is
read; `resolve_config` settles them once, at startup, and logs what it chose and why:

- `num_draft_tokens` None: MTP speculation with `DEFAULT_NUM_DRAFT_TOKENS` drafts when the
  checkpoint has an MTP layer (config.json's `num_nextn_predict_layers` > 0), else off;
- `max_model_len` None: the checkpoint's whole context (`max_position_embeddings`), lowered by
  `fit_context` once the workers have sized the KV pool from memory, if the pool holds less;
- the sampling defaults of requests that leave them out: the checkpoint's
  `generation_config.json` (`read_checkpoint`).

`overlap_steps` "auto" is settled by the executor once the ranks exist (on where they run on
CUDA and MTP is off: `LLMEngine.__init__`), before the context is fitted and the scheduler
made, since it decides the lookahead slot. `lookahead_slots` is the one definition of the KV
room a sequence needs past its tokens.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

# The default MTP draft length k. From BENCHMARKS.md (the shipped model, greedy, 8 prompts):
# over 128-token completions mean tokens/round is 1.86 / 2.57 / 3.19 at k = 1 / 2 / 3 (CPU),
# 1.85 / 2.51 / 3.08 (H200), and engine tokens/s is highest at k = 3 on both (CPU 270 vs 228 at
# k = 2 and 69 off; H200 1832 vs 1604 and 1560 off). On a 4-layer slice of the real model's
# width (H200, "End-to-end decode") a round costs 4.53 / 5.60 / 6.76 ms at b=1, so the implied
# tokens/s are 407 / 448 / 455 at b=1 and 1245 / 1302 / 1306 at b=8: k = 3 is best or tied at
# both, and on the 61-layer model (~24.3 ms a step) the round's extra cost is a smaller share
# still, ~106 tok/s at k = 3 against ~90 at k = 2 (derived). Past k = 3 nothing is measured and
# acceptance falls with each position (0.81, 0.69, 0.61 on the H200), so k = 3.
DEFAULT_NUM_DRAFT_TOKENS = 3
MAX_NUM_DRAFT_TOKENS = 16  # a typo guard: acceptance at position 3 is already 0.61
KV_CACHE_DTYPES = ("auto", "fp8")  # "auto": the model's dtype


class ConfigError(ValueError):
    """Options that cannot serve this checkpoint (or at all); the CLI prints it and exits 2."""


OVERLAP_STEPS = ("auto", "on", "off")


def lookahead_slots(num_draft_tokens: int, overlap_steps: str = "off") -> int:
    """KV slots a sequence may own past `max_model_len`: a step that samples also owns the
    `k - 1` slots that MTP draft steps 1..k-1 write (the positions of the drafts they feed
    back), and `update()` rolls them back with rejected drafts; without MTP, where steps may
    overlap (`EngineConfig.overlap_steps`), the one slot the next decode, launched before this
    step's token is known, writes. The scheduler, the engine's fit of the context and the
    workers' block tables all use this."""
    if num_draft_tokens == 0 and overlap_steps != "off":
        return 1
    return max(0, num_draft_tokens - 1)


@dataclass(frozen=True)
class EngineConfig:
    model: str  # checkpoint directory
    served_model_name: str | None = None  # the API's model id; None: derived from `model`
    tp_size: int = 1
    ep_size: int = 1  # expert-parallel size within the TP group (divides tp_size)
    # k; 0 turns MTP speculation off; None: DEFAULT_NUM_DRAFT_TOKENS when the checkpoint has
    # an MTP layer, else 0 (resolve_config)
    num_draft_tokens: int | None = None
    share_topk: bool = False  # draft steps 1..k-1 reuse draft step 0's top-k row
    device: str = "auto"  # "auto" | "cpu" | "cuda"
    dtype: str = "auto"  # "auto" (bf16 on GPU, fp32 on CPU) | "bfloat16" | "float32"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    # None: the checkpoint's whole context, lowered to what the KV pool holds (fit_context)
    max_model_len: int | None = None
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
    # Without MTP, a rank launches the next step's greedy decodes before this step's tokens are
    # read, so the GPU runs while the engine does its bookkeeping (workers/step_ahead.py).
    # "auto": on CUDA ranks; "on": on CPU too (no gain there: CPU work is not asynchronous);
    # "off": never.
    overlap_steps: str = "auto"
    cpu_threads: int | None = None  # torch intra-op threads per worker; None: half the cores
    # Only TP rank 0 runs the indexers and broadcasts top-k over the TP group (None: on when
    # tp_size > 1). Off: every rank runs the indexer on its own copy of the inputs.
    topk_broadcast: bool | None = None
    # Ray placement group strategy for the ranks (STRICT_PACK: one node; STRICT_SPREAD: one
    # rank per node). Ignored inside a Serve replica that has its own placement group.
    placement_strategy: str = "STRICT_PACK"
    # How the Ray executor sends a step to the ranks: "socket" (a Unix socket to each rank, when
    # every rank is on the coordinator's node), "graph" (a Ray Compiled Graph over shared-memory
    # channels), "calls" (one actor call per rank); "auto": the socket where every rank is on
    # the coordinator's node, else the graph on GPU ranks and calls on CPU ranks.
    step_transport: str = "auto"

    def __post_init__(self) -> None:
        if self.tp_size < 1 or self.ep_size < 1 or self.tp_size % self.ep_size:
            raise ConfigError(f"ep_size={self.ep_size} must divide tp_size={self.tp_size}")
        k = self.num_draft_tokens
        if k is not None and not 0 <= k <= MAX_NUM_DRAFT_TOKENS:
            raise ConfigError(f"num_draft_tokens must be in 0..{MAX_NUM_DRAFT_TOKENS}, got {k}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.overlap_steps not in OVERLAP_STEPS:
            raise ConfigError(
                f"overlap_steps {self.overlap_steps!r} is not one of {list(OVERLAP_STEPS)}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(
                f"kv_cache_dtype {self.kv_cache_dtype!r} is not one of {list(KV_CACHE_DTYPES)}"
            )
        from workers.model import check_indexer_numerics

        check_indexer_numerics(self.indexer_numerics)  # here, not after the workers load weights

    @classmethod
    def default(cls, name: str) -> Any:
        """The default of field `name`: for layers that must know it without a config (the
        Serve app's resource shape, the prefix router's block size)."""
        return cls.__dataclass_fields__[name].default

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
            raise ConfigError(f"unknown engine options: {sorted(unknown)}")
        return cls(**d)

    @property
    def model_name(self) -> str:
        """The model id clients use: served_model_name, else the checkpoint directory's name
        ("mtpserve-default" for the shipped default model)."""
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

    @property
    def cuda_graph_max_rows(self) -> int:
        """Rows of the largest q = 1 graph. A step that prefills replays it, every token a row
        (workers.model_runner), so it holds max_num_seqs decodes or verifies (1 + k tokens
        each) and max_num_seqs tokens of prompts arriving beside them: at least 256, at most
        1024 and max_num_batched_tokens (a step's token budget), never below max_num_seqs."""
        if self.enforce_eager:
            return 0
        per_seq = 2 + (self.num_draft_tokens or 0)
        rows = min(max(per_seq * self.max_num_seqs, 256), 1024, self.max_num_batched_tokens)
        return max(rows, self.max_num_seqs)

    @property
    def is_resolved(self) -> bool:
        return self.num_draft_tokens is not None and self.max_model_len is not None

    @property
    def max_seq_slots(self) -> int:
        """KV slots one sequence may own: its context plus the MTP lookahead (resolved only)."""
        assert self.is_resolved, "resolve_config first"
        return self.max_model_len + lookahead_slots(self.num_draft_tokens, self.overlap_steps)

    def replace(self, **changes) -> EngineConfig:
        return dataclasses.replace(self, **changes)


# --- the checkpoint's defaults --------------------------------------------------------------

# generation_config.json keys the engine's sampler takes, under SamplingParams' names.
GENERATION_CONFIG_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "repetition_penalty")


@dataclass(frozen=True)
class Checkpoint:
    """What a checkpoint directory says about serving it."""

    model_config: Any  # the transformers config from config.json
    context_len: int  # the whole context it was made for, in tokens
    has_mtp_layer: bool  # config.json's num_nextn_predict_layers > 0
    # SamplingParams fields for a request that omits them, from generation_config.json
    sampling_defaults: dict[str, Any] = field(default_factory=dict)


def sampling_defaults(model_dir: str) -> dict[str, Any]:
    """The sampling knobs a checkpoint's generation_config.json sets, as SamplingParams fields.
    Only keys the file really has (transformers' GenerationConfig would fill in its own
    defaults, top_k=50 among them); `do_sample: false` means greedy, as in transformers."""
    path = os.path.join(model_dir, "generation_config.json")
    try:
        with open(path) as f:
            raw = json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}: {e}") from None
    if raw.get("do_sample") is False:
        return {"temperature": 0.0}
    defaults = {k: raw[k] for k in GENERATION_CONFIG_SAMPLING_KEYS if raw.get(k) is not None}
    from cluster.sampling_params import InvalidRequestError, SamplingParams

    try:
        SamplingParams(**defaults).validate()
    except InvalidRequestError as e:
        raise ConfigError(f"{path}: {e.message}") from None
    return defaults


def read_checkpoint(model_dir: str) -> Checkpoint:
    from workers.loader import load_config
    from workers.model_config import context_len

    config = load_config(model_dir)
    return Checkpoint(
        model_config=config,
        context_len=context_len(config),
        has_mtp_layer=getattr(config, "num_nextn_predict_layers", 0) > 0,
        sampling_defaults=sampling_defaults(model_dir),
    )


# --- resolution -----------------------------------------------------------------------------


def resolve_config(config: EngineConfig, checkpoint: Checkpoint) -> EngineConfig:
    """`config` with its checkpoint-dependent "auto" fields settled (the context before the KV
    pool is known: `fit_context` lowers it). Raises ValueError for a draft length the
    checkpoint cannot serve."""
    k = config.num_draft_tokens
    if k is None:
        k = DEFAULT_NUM_DRAFT_TOKENS if checkpoint.has_mtp_layer else 0
        why = "the checkpoint has an MTP layer" if k else "the checkpoint has no MTP layer"
        logger.info("MTP speculation: %d draft tokens (default; %s)", k, why)
    elif k > 0 and not checkpoint.has_mtp_layer:
        raise ConfigError(
            f"num_draft_tokens={k}: {config.model} has no MTP layer (config.json's "
            "num_nextn_predict_layers is 0 or absent); serve it with num_draft_tokens 0"
        )
    return config.replace(
        num_draft_tokens=k, max_model_len=config.max_model_len or checkpoint.context_len
    )


def fit_context(requested: EngineConfig, resolved: EngineConfig, capacity_tokens: int) -> int:
    """The context served, given that the KV pool holds `capacity_tokens`: the resolved one if
    one sequence of it (plus lookahead) fits, else as much as fits. Logs the choice and why."""
    lookahead = lookahead_slots(resolved.num_draft_tokens, resolved.overlap_steps)
    wanted = resolved.max_model_len
    if wanted + lookahead <= capacity_tokens:
        if requested.max_model_len is None:
            logger.info(
                "context: %d tokens, the checkpoint's whole context (max_position_embeddings)",
                wanted,
            )
        return wanted
    fitted = capacity_tokens - lookahead
    if fitted < 2:
        raise ConfigError(
            f"the KV pool holds {capacity_tokens} tokens: too few for any request "
            "(raise num_kv_blocks or gpu_memory_utilization)"
        )
    source = "asked for" if requested.max_model_len else "the checkpoint's whole context"
    (logger.warning if requested.max_model_len else logger.info)(
        "context: %d tokens, not the %d %s: the KV pool holds %d tokens (%d blocks of %d; "
        "num_kv_blocks / gpu_memory_utilization size it), %d of them the lookahead",
        fitted,
        wanted,
        source,
        capacity_tokens,
        capacity_tokens // resolved.block_size_tokens,
        resolved.block_size_tokens,
        lookahead,
    )
    return fitted
