"""GPU: the w8a16 grouped MoE decode tile configs at 1, 8 and 32 tokens (256 FP8 experts with UE8M0
scales, DeepSeek-V3.2 widths): each tile against the HBM floor of the experts hit, the six fastest
per token count and every output against the shipped DECODE_CONFIG's.

    python benchmarks/bench_moe_decode_configs.py
"""

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

bw = copy_bandwidth_gbs()
w13, w2, s13, s2 = moe_experts()
pow2 = [torch.exp2(torch.round(torch.log2(s))) for s in (s13, s2)]
cands = [
    GroupedGemmConfig(16, n, k, w, s)
    for n, k, (w, s) in itertools.product(
        (32, 64, 128), (64, 128), ((2, 3), (4, 3), (4, 4), (4, 5), (8, 4))
    )
]
for t in (1, 8, 32):
    x, wts, ids = moe_step(t)
    hit = ids.unique().numel()
    floor = hit * 3 * MOE_INTER * MOE_HIDDEN / (bw * 1e9) * 1e6
    args = (x, w13, w2, wts, ids, 0, pow2[0], pow2[1])
    ref = grouped_moe_triton(*args, pow2_scales=True).float()
    res = {}
    for c in cands:
        try:
            run = partial(grouped_moe_triton, *args, config=c, pow2_scales=True)
            d = (run().float() - ref).abs().max().item() / ref.abs().max().item()
            res[c] = (graph_us(run), d)
        except Exception as e:
            print("skip", c, type(e).__name__)
    shipped = res[DECODE_CONFIG][0]
    ranked = sorted(res, key=lambda c: res[c][0])[:6]
    print(
        f"T={t} hit {hit} floor {floor:.0f} us shipped {shipped:.0f} us ({shipped / floor:.2f}x)",
        flush=True,
    )
    for c in ranked:
        print(
            f"   n{c.block_n} k{c.block_k} w{c.num_warps} s{c.num_stages}: "
            f"{res[c][0]:.0f} us ({res[c][0] / floor:.2f}x) diff {res[c][1]:.1e}",
            flush=True,
        )
