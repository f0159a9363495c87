"""MTP acceptance and engine throughput of a checkpoint on prompts cut from held-out stdlib files.

    python -m benchmarks.bench_mtp [--model DIR] [--device cpu|cuda] [--num-prompts 4]
        [--prompt-tokens 256] [--max-tokens 96] [--markdown OUT.md]

For every config (MTP off; k = 1, 2, 3; share_topk off/on for k >= 2) one LLM engine greedily
completes all prompts as one batch (ignore_eos), after a short warm-up request. Reported:
acceptance per draft position and mean tokens per round (accepted drafts + 1) over all
rounds, whether every completion equals the MTP-off one token for token, and engine tokens/s
(completion tokens / wall time of the timed generate call, all prompts batched).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import time

import torch

CONFIGS = [(0, False), (1, False), (2, False), (2, True), (3, False), (3, True)]


def heldout_prompts(tokenizer, num_prompts: int, prompt_tokens: int) -> list[tuple[str, list[int]]]:
    """(file, [bos] + its first prompt_tokens tokens) for the first held-out files, by name, that
    are long enough; files from workers.training.corpus's deterministic split."""
    from workers.training.corpus import read_text, split_files, stdlib_root

    root = stdlib_root()
    out = []
    for rel in split_files(root)[1]:
        text = read_text(root, rel)
        if not text:
            continue
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) >= prompt_tokens + 64:
            out.append((rel, [tokenizer.bos_token_id] + ids[:prompt_tokens]))
        if len(out) == num_prompts:
            break
    return out


def run_config(model_dir, prompts, k, share, args) -> dict:
    from cluster.llm import LLM
    from cluster.outputs import SpecDecodeStats
    from cluster.sampling_params import SamplingParams

    # A fixed KV pool: sizing from free memory would see the previous engine's caches.
    llm = LLM(
        model_dir,
        num_draft_tokens=k,
        share_topk=share,
        dtype=args.dtype,
        device=args.device,
        num_kv_blocks=args.num_kv_blocks,
    )
    llm.generate([prompts[0][:32]], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    if args.device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    if args.device == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    spec = SpecDecodeStats()  # the timed requests' own counters, warm-up excluded
    for o in outs:
        if o.spec is not None:
            spec.merge(o.spec)
    num_tokens = sum(len(o.token_ids) for o in outs)
    del llm
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return {
        "k": k,
        "share_topk": share,
        "tokens": [list(o.token_ids) for o in outs],
        "mean_tokens_per_round": spec.mean_tokens_per_round,
        "acceptance_per_position": spec.acceptance_per_position,
        "tok_s": num_tokens / wall,
        "wall_s": wall,
    }


def table(results: list[dict], base_tokens) -> str:
    lines = [
        "| k | share_topk | acceptance per position | mean tokens/round | = MTP off | tok/s |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        acc = ", ".join(f"{a:.3f}" for a in r["acceptance_per_position"]) or "-"
        same = "yes" if r["tokens"] == base_tokens else "NO"
        mtpr = f"{r['mean_tokens_per_round']:.3f}" if r["k"] else "1 (off)"
        lines.append(
            f"| {r['k']} | {'on' if r['share_topk'] else 'off'} | {acc} | {mtpr} | "
            f"{same} | {r['tok_s']:.1f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="checkpoint dir (default: the default model)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, help="float32 (CPU default) | bfloat16 (GPU default)")
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--num-kv-blocks", type=int, default=128)
    p.add_argument("--completions", type=int, default=3, help="greedy completions to print")
    p.add_argument("--markdown", default=None, help="write the report (markdown) here")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    args.dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    from transformers import AutoTokenizer

    from workers.default_model import default_model_path

    model_dir = args.model or default_model_path()
    tok = AutoTokenizer.from_pretrained(model_dir)
    named = heldout_prompts(tok, args.num_prompts, args.prompt_tokens)
    prompts = [ids for _, ids in named]
    results = []
    for k, share in CONFIGS:
        r = run_config(model_dir, prompts, k, share, args)
        print(
            f"k={k} share={share}: {r['mean_tokens_per_round']:.3f} tokens/round, "
            f"acc {r['acceptance_per_position']}, {r['tok_s']:.1f} tok/s",
            flush=True,
        )
        results.append(r)
    base = results[0]["tokens"]
    device_name = (
        torch.cuda.get_device_name() if args.device == "cuda" else f"CPU ({os.cpu_count()} cores)"
    )
    commit = (
        subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, check=False, text=True
        ).stdout.strip()
        or "unknown"
    )
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    cmd = "python -m benchmarks.bench_mtp " + " ".join(argv or os.sys.argv[1:])
    report = [
        (
            f"Command: `{cmd}`; device: {device_name}, dtype {args.dtype}; date {date}; "
            f"commit {commit}. {len(prompts)} prompts of {args.prompt_tokens} tokens "
            f"(+bos) from held-out files {', '.join(f for f, _ in named)}; "
            f"{args.max_tokens} greedy tokens each, batched."
        ),
        "",
        table(results, base),
    ]
    if args.completions:
        report += ["", "Greedy completions (MTP k=3), prompt tail then `⟨completion⟩`:", ""]
        for (rel, ids), toks in list(zip(named, results[4]["tokens"]))[: args.completions]:
            tail = tok.decode(ids[-40:])
            report += [f"`{rel}`:", "```python", tail + "⟨" + tok.decode(toks) + "⟩", "```"]
    text = "\n".join(report)
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results, "prompts": named}, f)


if __name__ == "__main__":
    main()
