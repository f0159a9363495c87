"""`mtpserve plan`: what one rank holds, from a checkpoint or from config.json alone.

The model is built on the meta device with one rank's parallel state (no memory is touched), its
layers turned FP8 where the checkpoint's are, and its parameters counted: the weight bytes per
rank are those of the real shards. The KV bytes per token are `workers.kv_cache`'s, the function
the worker sizes its caches with (with the same cache format: an FP8 latent cache under
kv_cache_dtype="fp8", FP8 indexer keys under the fp8 indexer numerics), so the plan and the
engine account the same way.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import asdict, dataclass

import torch

from workers.kv_cache import CacheFormat, cache_bytes_per_block

# What the plan leaves for activations, CUDA graphs and the allocator's slack: the worker sizes
# its caches to gpu_memory_utilization of the total, minus what is in use after loading.
DEFAULT_GPU_MEMORY_UTILIZATION = 0.85


@dataclass
class MemoryPlan:
    tp_size: int
    ep_size: int
    weight_bytes_per_rank: int
    weight_bytes_by_dtype: dict[str, int]  # dtype name -> bytes over all ranks
    kv_bytes_per_token: int  # per rank: every cache (latent, indexer keys, the MTP layer's)
    kv_cache_dtype: str  # the latent cache's: "auto" (the model's dtype) or "fp8"
    indexer_numerics: str  # "fp8" also keeps the indexer keys in FP8
    gpu_memory_bytes: int
    max_cached_tokens: int
    max_model_len: int
    fits: bool
    fp8_source: str  # where the FP8 layout came from: "checkpoint", "config" or "none"

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)


def _fp8_names(model_dir: str, config) -> tuple[dict[str, str], str]:
    """Checkpoint names whose weights are FP8 (with a scale beside them), from the checkpoint's
    index if there is one; from config.json alone, the layout DeepSeek ships under an FP8
    `quantization_config` (every weight the model multiplies by)."""
    from workers.loader import CheckpointError, checkpoint_files

    try:
        return checkpoint_files(model_dir), "checkpoint"
    except (CheckpointError, FileNotFoundError):
        pass
    quant = getattr(config, "quantization_config", None) or {}
    if not isinstance(quant, dict):
        quant = quant.to_dict()
    return {}, "config" if quant.get("quant_method") == "fp8" else "none"


def use_fp8_as_shipped(model) -> None:
    """Make FP8 every layer DeepSeek's FP8 checkpoints ship in FP8 (what `quantization_config`
    describes: every weight the model multiplies by, the routed experts, and MLA's kv_b_proj
    where its heads' parts are whole scale blocks); the embeddings, LM head, norms, router and
    the indexer's head weights stay in their dtypes."""
    for module in model.modules():
        if hasattr(module, "use_fp8") and getattr(module, "quantizable", True):
            module.use_fp8()


def plan_memory(
    model_dir: str,
    tp_size: int = 1,
    ep_size: int = 1,
    gpu_memory_gib: float = 141.0,
    max_model_len: int | None = None,
    dtype: torch.dtype = torch.bfloat16,
    utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
    kv_cache_dtype: str = "auto",
    indexer_numerics: str = "exact",
) -> MemoryPlan:
    from parallel.state import ParallelState, get_parallel_state, set_parallel_state
    from workers.loader import has_mtp_layer, keep_fp8_weights, load_config
    from workers.model import DeepseekV32ForCausalLM
    from workers.model_config import check_model_config, context_len

    cache_format = CacheFormat.of(kv_cache_dtype, indexer_numerics)
    config = load_config(model_dir)
    check_model_config(config, tp_size, ep_size)
    names, fp8_source = _fp8_names(model_dir, config)
    if names:
        with_mtp = has_mtp_layer(names, config.num_hidden_layers)
    else:
        with_mtp = getattr(config, "num_nextn_predict_layers", 1) > 0
    previous = get_parallel_state()
    set_parallel_state(ParallelState(tp_rank=0, tp_size=tp_size, ep_size=ep_size))
    try:
        with torch.device("meta"):
            model = DeepseekV32ForCausalLM(config, dtype=dtype, with_mtp=with_mtp)
        if fp8_source == "checkpoint":
            keep_fp8_weights(model, names)
        elif fp8_source == "config":
            use_fp8_as_shipped(model)
    finally:
        set_parallel_state(previous)
    by_dtype: dict[str, int] = {}
    seen = set()
    for p in itertools.chain(model.parameters(), model.buffers()):
        if id(p) in seen:
            continue
        seen.add(id(p))
        name = str(p.dtype).removeprefix("torch.")
        by_dtype[name] = by_dtype.get(name, 0) + p.numel() * p.element_size()
    per_rank = sum(by_dtype.values())
    kv_per_token = cache_bytes_per_block(config, 1, dtype, with_mtp, cache_format)
    total = int(gpu_memory_gib * 2**30)
    budget = max(0, int(total * utilization) - per_rank)
    max_cached = budget // kv_per_token
    context = max_model_len or context_len(config)  # the engine's default context
    return MemoryPlan(
        tp_size=tp_size,
        ep_size=ep_size,
        weight_bytes_per_rank=per_rank,
        weight_bytes_by_dtype={k: v * tp_size for k, v in by_dtype.items()},
        kv_bytes_per_token=kv_per_token,
        kv_cache_dtype=kv_cache_dtype,
        indexer_numerics=indexer_numerics,
        gpu_memory_bytes=total,
        max_cached_tokens=int(max_cached),
        max_model_len=context,
        fits=max_cached >= context,
        fp8_source=fp8_source,
    )


def _size(num_bytes: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.1f} {unit}"
    return f"{num_bytes:.0f} B"


def describe(plan: MemoryPlan) -> str:
    lines = [
        f"TP={plan.tp_size} EP={plan.ep_size}, FP8 layout from the {plan.fp8_source}",
        f"weights per rank: {_size(plan.weight_bytes_per_rank)}",
        "weights over all ranks by dtype: "
        + ", ".join(f"{k} {_size(v)}" for k, v in sorted(plan.weight_bytes_by_dtype.items())),
        f"KV cache per token per rank: {plan.kv_bytes_per_token} bytes (latent "
        f"{plan.kv_cache_dtype}, indexer numerics {plan.indexer_numerics})",
        f"tokens that fit in the rest of {_size(plan.gpu_memory_bytes)}: {plan.max_cached_tokens}",
        f"max_model_len {plan.max_model_len}: "
        + ("fits" if plan.fits else "does NOT fit (lower --max-model-len or add ranks)"),
    ]
    return "\n".join(lines)
