"""The engine options of every entry point (`mtpserve serve`, `mtpserve generate`, the batch job
`python -m deploy.batch`): one definition, vLLM's flag names with the short forms kept as
aliases, help on each. Defaults live in `cluster.config.EngineConfig`: an option left unset is
left out, so the engine's default applies."""

from __future__ import annotations

import argparse
import json
from typing import Any

from cluster.config import (
    DEFAULT_NUM_DRAFT_TOKENS,
    KV_CACHE_DTYPES,
    OVERLAP_STEPS,
    EngineConfig,
)

SPECULATIVE_METHODS = ("mtp", "deepseek_mtp")  # vLLM's names for DeepSeek's MTP layer


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default=None, help="checkpoint directory (default: the project's default model)"
    )
    parser.add_argument(
        "--tensor-parallel-size",
        "--tp",
        dest="tp_size",
        type=int,
        default=None,
        help="tensor-parallel size: ranks that share each layer (default 1)",
    )
    parser.add_argument(
        "--expert-parallel-size",
        "--ep",
        dest="ep_size",
        type=int,
        default=None,
        help="expert-parallel size within the TP group: ranks that split the routed experts "
        "(divides --tensor-parallel-size; default 1)",
    )
    parser.add_argument(
        "--speculative-config",
        default=None,
        help='MTP speculative decoding as vLLM takes it: \'{"method": "mtp", '
        '"num_speculative_tokens": 3}\' (0 turns it off; default: on, with '
        f"k = {DEFAULT_NUM_DRAFT_TOKENS}, when the checkpoint has an MTP layer)",
    )
    parser.add_argument(
        "--num-draft-tokens",
        type=int,
        default=None,
        help="MTP draft length k, short for --speculative-config (default: "
        f"{DEFAULT_NUM_DRAFT_TOKENS} when the checkpoint has an MTP layer, else 0; 0: off)",
    )
    parser.add_argument(
        "--share-topk",
        action="store_true",
        default=None,
        help="MTP draft steps 1..k-1 reuse draft step 0's top-k indices",
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="context length served, in tokens (default: the checkpoint's whole context, "
        "or what the KV cache holds if less)",
    )
    parser.add_argument(
        "--max-num-seqs", type=int, default=None, help="sequences in one engine step at most"
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="tokens in one engine step at most (prefill chunks are cut to fit)",
    )
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="share of each GPU's memory the weights, KV cache and graphs may take",
    )
    parser.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="reuse the KV of full 64-token blocks an earlier prompt computed (default: on)",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        default=None,
        choices=list(KV_CACHE_DTYPES),
        help="dtype of the MLA latent cache: auto (the model's dtype) or fp8 (e4m3 with a scale "
        "per 128 values, the rope part in the model's dtype, as DeepSeek stores it; about 0.65x "
        "the bytes per token)",
    )
    parser.add_argument(
        "--device",
        default=None,
        choices=["auto", "cpu", "cuda"],
        help="where the model runs (default auto: the GPU if there is one)",
    )
    parser.add_argument(
        "--overlap-steps",
        default=None,
        choices=list(OVERLAP_STEPS),
        help="without MTP, launch the next step's greedy decodes before this step's tokens are "
        "read, so the GPU runs while the engine does its bookkeeping (default auto: on GPU ranks)",
    )
    parser.add_argument(
        "--indexer-numerics",
        default=None,
        choices=["exact", "fp8"],
        help="exact indexer scores (transformers') or FP8 after a Hadamard rotation (DeepSeek's)",
    )


def _num_draft_tokens(args: argparse.Namespace) -> int | None:
    spec, short = args.speculative_config, args.num_draft_tokens
    if spec is None:
        return short
    try:
        config = json.loads(spec)
    except json.JSONDecodeError as e:
        raise ValueError(f"--speculative-config is not JSON: {e}") from None
    if not isinstance(config, dict):
        raise ValueError("--speculative-config must be a JSON object")
    unknown = set(config) - {"method", "num_speculative_tokens", "model"}
    if unknown:
        raise ValueError(f"--speculative-config: unknown keys {sorted(unknown)}")
    method = config.get("method", "mtp")
    if method not in SPECULATIVE_METHODS:
        raise ValueError(
            f"--speculative-config: method {method!r} is not served; the draft model is the "
            f"checkpoint's MTP layer: {SPECULATIVE_METHODS}"
        )
    k = config.get("num_speculative_tokens")
    if not isinstance(k, int) or isinstance(k, bool) or k < 0:
        raise ValueError("--speculative-config: num_speculative_tokens must be an integer >= 0")
    if short is not None and short != k:
        raise ValueError(f"--num-draft-tokens {short} contradicts --speculative-config's {k}")
    return k


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The `EngineConfig` fields the user set (model excluded). Raises ValueError on a bad
    --speculative-config or options EngineConfig refuses (checked here, before any start-up)."""
    options = {
        "tp_size": args.tp_size,
        "ep_size": args.ep_size,
        "num_draft_tokens": _num_draft_tokens(args),
        "share_topk": args.share_topk,
        "max_model_len": args.max_model_len,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "enable_prefix_caching": args.enable_prefix_caching,
        "device": args.device,
        "indexer_numerics": args.indexer_numerics,
        "kv_cache_dtype": args.kv_cache_dtype,
        "overlap_steps": args.overlap_steps,
    }
    options = {name: value for name, value in options.items() if value is not None}
    EngineConfig(model="", **options)  # its checks, without reading the checkpoint
    return options
