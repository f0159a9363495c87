"""Prefix caching on the offline engine: time to first token (TTFT) with and without it.

    PYTHONPATH=$PWD python benchmarks/bench_prefix.py [--device cuda] [--json]
        [--conversations 32] [--turns 8] [--system-len 2048] [--user-len 64] [--max-tokens 32]
        [--long-prefix 8192] [--repeats 5] [--num-draft-tokens 0] [--model DIR]

Two measurements:
1. Multi-turn: `--conversations` conversations share a `--system-len`-token system prompt; each
   runs `--turns` turns closed-loop (a conversation sends its next turn, its whole history plus
   `--user-len` new tokens, as soon as the last one finished). TTFT p50/p90 per request from
   `add_request` to the step that returns its first token, and the hit rate (prompt tokens
   served from the cache / prompt tokens). Rows: caching off; on; on in "thinking" mode, where
   like DeepSeek-V3.2's chat encoding the history keeps only each answer and drops the
   reasoning before it (the first `--reasoning-fraction` of each output), so a turn is not a
   pure extension of the last prompt and only the part before the dropped reasoning hits.
2. Long prefix: one request with a fresh `--long-prefix`-token prefix (uncached), then one with
   the same prefix and another suffix (cached); the median TTFT of each over `--repeats`
   prefixes, and their ratio (the issue asks for <= 0.2 at 8k on the H200).

Without `--model`, a tiny random checkpoint (tests' architecture; `--model-overrides` JSON
changes its config, e.g. wider layers) with room for the longest sequence is made in a temp dir.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass

import torch

from cluster.llm import LLM
from cluster.sampling_params import SamplingParams


@dataclass
class WorkloadResult:
    mode: str
    num_requests: int
    ttft_p50_ms: float
    ttft_p90_ms: float
    hit_rate: float  # prompt tokens served from the cache / prompt tokens
    wall_s: float


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _random_tokens(g: torch.Generator, vocab: int, n: int) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def run_multi_turn(llm: LLM, args, mode: str) -> WorkloadResult:
    """Closed-loop conversations; see the module docstring."""
    engine = llm.engine
    vocab = engine.vocab_size
    g = torch.Generator().manual_seed(0)
    system = _random_tokens(g, vocab, args.system_len)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    histories = [list(system) for _ in range(args.conversations)]
    turns_left = [args.turns] * args.conversations
    live: dict[str, tuple[int, float, list[int]]] = {}  # id -> (conversation, t_added, prompt)
    ttfts_s: list[float] = []
    num_prompt = num_cached = 0

    def send(c: int) -> None:
        prompt = histories[c] + _random_tokens(g, vocab, args.user_len)
        request_id = engine.add_request(prompt, params)
        live[request_id] = (c, time.perf_counter(), prompt)
        turns_left[c] -= 1

    start = time.perf_counter()
    for c in range(args.conversations):
        send(c)
    while engine.has_unfinished:
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            c, added, prompt = live[out.request_id]
            if out.new_token_ids and len(out.token_ids) == len(out.new_token_ids):
                ttfts_s.append(now - added)
            if not out.finished:
                continue
            del live[out.request_id]
            num_prompt += len(prompt)
            num_cached += out.num_cached_tokens
            answer = list(out.token_ids)
            if mode == "thinking":  # the chat encoding drops the turn's reasoning
                answer = answer[int(len(answer) * args.reasoning_fraction) :]
            histories[c] = prompt + answer
            if turns_left[c] > 0:
                send(c)
    return WorkloadResult(
        mode=mode,
        num_requests=len(ttfts_s),
        ttft_p50_ms=1e3 * _percentile(ttfts_s, 0.5),
        ttft_p90_ms=1e3 * _percentile(ttfts_s, 0.9),
        hit_rate=num_cached / max(num_prompt, 1),
        wall_s=time.perf_counter() - start,
    )


def _ttft_s(llm: LLM, prompt: list[int]) -> tuple[float, int]:
    """(TTFT, cached tokens) of one request alone in the engine."""
    engine = llm.engine
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    request_id = engine.add_request(prompt, params)
    ttft = None
    cached = 0
    while engine.has_unfinished:
        for out in engine.step():
            if out.request_id == request_id and out.new_token_ids and ttft is None:
                ttft = time.perf_counter() - start
                cached = out.num_cached_tokens
    return ttft, cached


def run_long_prefix(llm: LLM, args) -> dict:
    vocab = llm.engine.vocab_size
    g = torch.Generator().manual_seed(1)
    cold, warm, cached = [], [], []
    for _ in range(args.repeats):
        prefix = _random_tokens(g, vocab, args.long_prefix)
        ttft, _ = _ttft_s(llm, prefix + _random_tokens(g, vocab, args.user_len))
        cold.append(ttft)
        ttft, num_cached = _ttft_s(llm, prefix + _random_tokens(g, vocab, args.user_len))
        warm.append(ttft)
        cached.append(num_cached)
    uncached_ms, cached_ms = 1e3 * statistics.median(cold), 1e3 * statistics.median(warm)
    return {
        "prefix_tokens": args.long_prefix,
        "suffix_tokens": args.user_len,
        "cached_tokens": min(cached),
        "ttft_uncached_ms": uncached_ms,
        "ttft_cached_ms": cached_ms,
        "ratio": cached_ms / uncached_ms,
    }


def _longest(args) -> int:
    """Tokens of the longest request either measurement sends."""
    return max(
        args.system_len + args.turns * (args.user_len + args.max_tokens),
        args.long_prefix + args.user_len + 2,
    )


# `--v32-width N`: DeepSeek-V3.2's attention, indexer and expert widths with N layers (the
# first dense) and 16 routed experts top-8 (the checkpoint stays a few GB): a model whose prefill
# costs per token what the real one's layers do, unlike the host-bound tiny default.
V32_WIDTH_KEYS = (
    "hidden_size",
    "intermediate_size",
    "moe_intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "kv_lora_rank",
    "q_lora_rank",
    "qk_rope_head_dim",
    "v_head_dim",
    "qk_nope_head_dim",
    "index_topk",
    "index_head_dim",
    "index_n_heads",
    "n_shared_experts",
    "routed_scaling_factor",
    "norm_topk_prob",
)


def v32_width_overrides(num_layers: int) -> dict:
    from workers.model_config import DEEPSEEK_V32

    return {
        **{key: DEEPSEEK_V32[key] for key in V32_WIDTH_KEYS},
        "num_hidden_layers": num_layers,
        "first_k_dense_replace": 1,
        "n_routed_experts": 16,
        "n_group": 8,
        "topk_group": 4,
        "num_experts_per_tok": 8,
    }


def _model_dir(args) -> str:
    if args.model:
        return args.model
    from workers.tiny_model import make_tiny_model

    overrides = {"max_position_embeddings": 1 << max(12, (_longest(args) + 64).bit_length())}
    if args.v32_width:
        overrides.update(v32_width_overrides(args.v32_width))
    overrides.update(json.loads(args.model_overrides or "{}"))
    return make_tiny_model(tempfile.mkdtemp(prefix="bench-prefix-"), seed=0, **overrides)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--model-overrides", default=None, help="JSON config overrides (no --model)")
    ap.add_argument(
        "--v32-width",
        type=int,
        default=0,
        metavar="LAYERS",
        help="a DeepSeek-V3.2-width model of LAYERS layers (no --model; see v32_width_overrides)",
    )
    ap.add_argument("--no-multi-turn", action="store_true", help="only the long-prefix measurement")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--conversations", type=int, default=32)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--system-len", type=int, default=2048)
    ap.add_argument("--user-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--reasoning-fraction", type=float, default=0.5)
    ap.add_argument("--long-prefix", type=int, default=8192, help="0 skips measurement 2")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--num-draft-tokens", type=int, default=0)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--max-model-len", type=int, default=None, help="default: the longest request")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead")
    args = ap.parse_args()

    model = _model_dir(args)
    options = dict(
        max_model_len=args.max_model_len or _longest(args) + 64,
        device=args.device,
        num_draft_tokens=args.num_draft_tokens,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    warm_up = SamplingParams(max_tokens=2, temperature=0.0)
    rows: list[WorkloadResult] = []
    modes = () if args.no_multi_turn else (("off", False), ("on", True), ("thinking", True))
    for mode, caching in modes:
        llm = LLM(model, enable_prefix_caching=caching, **options)
        llm.generate([[5, 6, 7]], warm_up)
        rows.append(run_multi_turn(llm, args, mode))
    long_prefix = None
    if args.long_prefix:
        llm = LLM(model, enable_prefix_caching=True, **options)
        llm.generate([[5, 6, 7]], warm_up)
        long_prefix = run_long_prefix(llm, args)

    setup = {
        k: getattr(args, k)
        for k in ("conversations", "turns", "system_len", "user_len", "max_tokens")
    }
    setup.update(
        model=model,
        v32_width=args.v32_width,
        device=args.device,
        num_draft_tokens=args.num_draft_tokens,
    )
    if args.json:
        print(
            json.dumps(
                {
                    "setup": setup,
                    "multi_turn": [asdict(r) for r in rows],
                    "long_prefix": long_prefix,
                }
            )
        )
        return
    print(" ".join(f"{k}={v}" for k, v in setup.items()))
    print(
        f"{'caching':>9} {'requests':>8} {'TTFT p50 ms':>12} {'p90 ms':>9} {'hit rate':>9} "
        f"{'wall s':>7}"
    )
    for r in rows:
        print(
            f"{r.mode:>9} {r.num_requests:>8} {r.ttft_p50_ms:>12.1f} {r.ttft_p90_ms:>9.1f} "
            f"{r.hit_rate:>9.3f} {r.wall_s:>7.1f}"
        )
    if long_prefix:
        lp = long_prefix
        print(
            f"long prefix {lp['prefix_tokens']} + {lp['suffix_tokens']} tokens: TTFT uncached "
            f"{lp['ttft_uncached_ms']:.1f} ms, cached ({lp['cached_tokens']} tokens) "
            f"{lp['ttft_cached_ms']:.1f} ms, ratio {lp['ratio']:.3f}"
        )


if __name__ == "__main__":
    main()
