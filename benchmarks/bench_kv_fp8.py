"""Accuracy of the FP8 MLA latent cache (kv_cache_dtype="fp8") on a checkpoint: greedy agreement
and held-out perplexity, against the cache in the model's dtype.

    python -m benchmarks.bench_kv_fp8 [--model DIR] [--device cpu|cuda] [--dtype float32]
        [--num-prompts 8] [--prompt-tokens 128] [--max-tokens 64] [--ppl-windows 16]

Greedy: for each of (auto, fp8) x (MTP off, k=3), one LLM engine completes the prompts (cut from
held-out stdlib files, as bench_mtp does) as one batch; agreement is the fraction of generated
positions whose token equals the reference's (auto, MTP off), and "= MTP off" says whether MTP
gave the same tokens as MTP off under the same cache dtype (it must: lossless). Tokens after a
first disagreement continue from different text, so the agreement counts those too.

Perplexity: the model over non-overlapping held-out windows (sparse attention as served), each
one prefill over a paged cache of the given dtype, so every attention reads its keys back from
the cache: mean next-token loss over all positions.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import subprocess
import time

import torch

from benchmarks.bench_mtp import heldout_prompts


def greedy_tokens(model_dir, prompts, kv_cache_dtype: str, k: int, args) -> list[list[int]]:
    from cluster.llm import LLM
    from cluster.sampling_params import SamplingParams

    llm = LLM(
        model_dir,
        num_draft_tokens=k,
        dtype=args.dtype,
        device=args.device,
        kv_cache_dtype=kv_cache_dtype,
        num_kv_blocks=args.num_kv_blocks,
    )
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params)
    del llm
    return [list(o.token_ids) for o in outs]


def heldout_windows(tokenizer, num_windows: int, window: int) -> list[torch.Tensor]:
    """Consecutive `window`-token pieces of the held-out files' token stream, bos-separated."""
    from workers.training.corpus import read_text, split_files, stdlib_root

    root = stdlib_root()
    stream: list[int] = []
    for rel in split_files(root)[1]:
        text = read_text(root, rel)
        if text:
            stream += [tokenizer.bos_token_id] + tokenizer.encode(text, add_special_tokens=False)
        if len(stream) >= num_windows * window:
            break
    n = min(num_windows, len(stream) // window)
    return [torch.tensor(stream[i * window : (i + 1) * window]) for i in range(n)]


@torch.no_grad()
def perplexity(model_dir, windows, kv_cache_dtype: str, args) -> float:
    from workers.attention_metadata import AttentionMetadata
    from workers.kv_cache import CacheFormat, allocate_kv_caches
    from workers.loader import load_model
    from workers.worker import resolve_dtype

    device = torch.device(args.device)
    model, config = load_model(model_dir, resolve_dtype(args.dtype, device), device, False)
    block = 64
    num_blocks = -(-windows[0].numel() // block)
    caches = allocate_kv_caches(
        config,
        num_blocks + 1,
        block,
        model.dtype,
        device,
        with_mtp=False,
        cache_format=CacheFormat.of(kv_cache_dtype),
    )
    model.bind_caches(*caches)
    table = torch.arange(1, num_blocks + 1, dtype=torch.int32, device=device)[None]
    total, count = 0.0, 0
    for tokens in windows:
        positions = torch.arange(tokens.numel(), device=device)
        meta = AttentionMetadata(
            positions=positions,
            slot_mapping=positions + block,  # blocks 1.. in order; block 0 stays unused
            seq_idx=torch.zeros_like(positions),
            block_tables=table,
        )
        logits = model.compute_logits(model(tokens.to(device), meta))[:-1]
        loss = torch.nn.functional.cross_entropy(logits, tokens[1:].to(device), reduction="sum")
        total += loss.item()
        count += tokens.numel() - 1
    return math.exp(total / count)


def agreement(tokens: list[list[int]], reference: list[list[int]]) -> float:
    same = sum(a == b for row, ref in zip(tokens, reference) for a, b in zip(row, ref))
    return same / sum(len(ref) for ref in reference)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="checkpoint (default: the shipped model)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--num-draft-tokens", type=int, default=3, help="k of the MTP-on rows")
    p.add_argument("--ppl-windows", type=int, default=16)
    p.add_argument("--ppl-window-tokens", type=int, default=1024)
    p.add_argument("--num-kv-blocks", type=int, default=64)
    args = p.parse_args(argv)

    from transformers import AutoTokenizer

    from workers.default_model import default_model_path

    model_dir = args.model or default_model_path()
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = [ids for _, ids in heldout_prompts(tok, args.num_prompts, args.prompt_tokens)]
    started = time.perf_counter()
    k = args.num_draft_tokens
    runs = {
        (kv, kk): greedy_tokens(model_dir, prompts, kv, kk, args)
        for kv in ("auto", "fp8")
        for kk in (0, k)
    }
    windows = heldout_windows(tok, args.ppl_windows, args.ppl_window_tokens)
    ppl = {kv: perplexity(model_dir, windows, kv, args) for kv in ("auto", "fp8")}
    reference = runs["auto", 0]

    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    device = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU ({os.cpu_count()})"
    print(
        f"model {os.path.basename(os.path.realpath(model_dir))}; device {device}, dtype "
        f"{args.dtype}; date {date}; commit {commit}; {len(prompts)} prompts of "
        f"{args.prompt_tokens} tokens x {args.max_tokens} greedy tokens; perplexity over "
        f"{len(windows)} x {args.ppl_window_tokens} held-out tokens; "
        f"{time.perf_counter() - started:.0f} s\n"
    )
    print("| latent cache | MTP | greedy agreement with (auto, MTP off) | = MTP off | perplexity |")
    print("|---|---|---|---|---|")
    for (kv, kk), tokens in runs.items():
        lossless = "yes" if tokens == runs[kv, 0] else "NO"
        print(
            f"| {kv} | {'off' if kk == 0 else f'k={kk}'} | {agreement(tokens, reference):.3f} | "
            f"{lossless if kk else '-'} | {ppl[kv]:.3f} |"
        )


if __name__ == "__main__":
    main()
