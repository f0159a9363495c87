"""GPU: a torch.profiler table of the runner's sampled decode step (bench_runner_host's stand-in
model; temperature 0.7 with top-p 0.95 and without, 2 drafts, 1 and 64 requests): where the host
time of a sampled step goes.

    python benchmarks/profile_sampled_step.py
"""

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_runner_host import PhaseClock, build_runner, decode_step
from torch.profiler import ProfilerActivity, profile

from workers.batch import SamplingSpec

device = torch.device("cuda")
torch.set_num_threads(1)
clock = PhaseClock()
runner = build_runner(device, "graph", 64, 64 * 3, clock)
vocab = runner.model.config.vocab_size
for temp, top_p in ((0.7, 0.95), (0.7, 1.0)):
    sampling = SamplingSpec(temperature=temp, top_p=top_p)
    for batch in (1, 64):
        runner.execute(decode_step(batch, 1024, 2, vocab, False, sampling))
        step = decode_step(batch, 1024, 2, vocab, True, sampling)
        for _ in range(10):
            runner.execute(step)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(50):
            runner.execute(step)
        print(
            f"temp {temp} top_p {top_p} batch {batch}: "
            f"{(time.perf_counter() - t) / 50 * 1e6:.1f} us/step"
        )
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                runner.execute(step)
        print(
            prof.key_averages().table(
                sort_by="self_cpu_time_total", row_limit=22, max_name_column_width=50
            )
        )
