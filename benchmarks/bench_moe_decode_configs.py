"""GPU: the w8a16 grouped MoE decode tile configs at 1, 8 and 32 tokens (FP8 experts with UE8M0
scales, DeepSeek-V3.2 widths, top-8 of 256 by random router logits): each tile against the HBM
floor of the experts hit, the six fastest per token count and every output against the shipped
DECODE_CONFIG's.

    python benchmarks/bench_moe_decode_configs.py [--local-experts 32]

--local-experts N: one rank's experts under expert parallelism (N = 256 / EP; 32 at EP=8): the
rank holds experts [0, N) and takes only the pairs routed to them (at one token, one expert on
the average), as the rank shard's MoE layers do. Each timed call takes the next of eight routed
steps, so the experts read change from call to call (one step's experts replayed would be read
from the 50 MB L2).
"""

import argparse
import itertools
import sys
from functools import partial

import torch

sys.path.insert(0, ".")
from benchmarks.bench_fp8_linear import (
    MOE_HIDDEN,
    MOE_INTER,
    copy_bandwidth_gbs,
    graph_us,
    moe_experts,
    moe_step,
)
from kernels.moe_experts import DECODE_CONFIG, GroupedGemmConfig, grouped_moe_triton

STEPS = 8  # routed steps a timed call rotates over

ap = argparse.ArgumentParser()
ap.add_argument("--local-experts", type=int, default=256)
ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32])
ap.add_argument("--block-k", type=int, nargs="+", default=[64, 128])
args = ap.parse_args()

bw = copy_bandwidth_gbs()
w13, w2, s13, s2 = moe_experts(args.local_experts)
pow2 = [torch.exp2(torch.round(torch.log2(s))) for s in (s13, s2)]
cands = [
    GroupedGemmConfig(16, n, k, w, s)
    for n, k, (w, s) in itertools.product(
        (16, 32, 64, 128), args.block_k, ((2, 3), (4, 3), (4, 4), (8, 4))
    )
]
print(f"local experts {args.local_experts} of 256, copy bandwidth {bw:.0f} GB/s", flush=True)
for t in args.tokens:
    steps = [moe_step(t + 1000 * i) for i in range(STEPS)]
    steps = [(x[:t], wts[:t], ids[:t]) for x, wts, ids in steps]
    hit = sum(ids[ids < args.local_experts].unique().numel() for _, _, ids in steps) / STEPS
    floor = hit * 3 * MOE_INTER * MOE_HIDDEN / (bw * 1e9) * 1e6

    def run(config, i, steps=steps):
        x, wts, ids = steps[i % STEPS]
        return grouped_moe_triton(
            x, w13, w2, wts, ids, 0, pow2[0], pow2[1], config=config, pow2_scales=True
        )

    def call(config, turn):  # the next step each call (a graph captures STEPS x 4 of them)
        return run(config, next(turn))

    refs = [run(DECODE_CONFIG, i).float() for i in range(STEPS)]
    res = {}
    for c in cands:
        try:
            outs = [run(c, i).float() for i in range(STEPS)]
            d = max(
                (o - r).abs().max().item() / max(r.abs().max().item(), 1e-30)
                for o, r in zip(outs, refs)
            )
            res[c] = (graph_us(partial(call, c, itertools.count()), reps=STEPS * 4), d)
        except Exception as e:
            print("skip", c, type(e).__name__)
    shipped = res[DECODE_CONFIG][0]
    ranked = sorted(res, key=lambda c: res[c][0])[:6]
    print(
        f"T={t} experts hit {hit:.2f} floor {floor:.1f} us shipped {shipped:.1f} us "
        f"({shipped / max(floor, 1e-9):.2f}x)",
        flush=True,
    )
    for c in ranked:
        print(
            f"   n{c.block_n} k{c.block_k} w{c.num_warps} s{c.num_stages}: "
            f"{res[c][0]:.1f} us ({res[c][0] / max(floor, 1e-9):.2f}x) diff {res[c][1]:.1e}",
            flush=True,
        )
