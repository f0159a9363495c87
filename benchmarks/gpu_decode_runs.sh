#!/usr/bin/env bash
# Issue 17's GPU figures on the H200 machine, one part per call (each under the device's
# 10-minute limit). Run from the repository root; GIT_COMMIT=<sha> names the tree where the
# copy's .git is stale.
#   bash benchmarks/gpu_decode_runs.sh tests    # the FP8 / fp32-linear kernels' and the engine's GPU tests
#   bash benchmarks/gpu_decode_runs.sh decode   # bench_decode --fp8: prefill, b = 1 / 8 / 32, MTP rounds
#   bash benchmarks/gpu_decode_runs.sh profile  # the kernels of a b = 1 and a b = 32 step (PDL off)
#   bash benchmarks/gpu_decode_runs.sh pdl      # the b = 1 step with PDL off for one kernel at a time
#   bash benchmarks/gpu_decode_runs.sh linears  # bench_linear_fp32 and bench_fp8_linear tables
#   bash benchmarks/gpu_decode_runs.sh shard    # the real model's rank shard: its b = 1 step's kernels
#                                               # and the experts its routers sent the rank
#   bash benchmarks/gpu_decode_runs.sh prefill  # prefill tok/s, FP8 (the default w8a8 prompt
#                                               # steps, and w8a16 everywhere) against bf16,
#                                               # every slice with its experts shared (the bf16
#                                               # slice then fits 80 GB), FP8 also without; then
#                                               # the kernels of a chunk in FP8 and in bf16
#   bash benchmarks/gpu_decode_runs.sh mla      # sparse-MLA tiles for a 2048-token prefill chunk
#   bash benchmarks/gpu_decode_runs.sh dense    # prompt steps before index_topk attending densely
#                                               # (MTPSERVE_DENSE_PROMPTS=on, opt-in on CUDA):
#                                               # the flash path's and the engine's GPU tests,
#                                               # warm-up with it on, then prefill FP8 and bf16
#                                               # (context 0: dense and sparse rows)
set -euo pipefail
part=${1:-decode}
export PYTHONPATH=$PWD
case "$part" in
  tests)
    python3 -m pytest -q -m "gpu or not gpu" tests/kernels/test_linear_fp32.py \
      tests/kernels/test_gpu_fp8_linear.py tests/workers/test_gpu_engine.py \
      tests/workers/test_host_copy.py 2>&1 | tail -15 ;;
  decode)
    python3 benchmarks/bench_decode.py --fp8 --skip-transformers ;;
  profile)
    for batch in 1 32; do
      python3 benchmarks/bench_decode.py --fp8 --skip-transformers --profile \
        --profile-batch "$batch" 2>&1 | grep -v -i warn
    done ;;
  pdl)
    python3 benchmarks/bench_decode.py --fp8 --skip-transformers --pdl-per-kernel ;;
  linears)
    python3 benchmarks/bench_linear_fp32.py --tokens 1 2 4 8 16 32
    python3 benchmarks/bench_fp8_linear.py --tokens 1 8 32 ;;
  shard)
    python3 benchmarks/bench_rank_shard.py --skip-mtp --profile --profile-batch 1 2>&1 |
      grep -v -i warn ;;
  prefill)
    prefill() { echo "== $*"; python3 benchmarks/bench_decode.py --skip-transformers --prefill-only "$@" 2>&1 | grep -v -i warn; }
    prefill --fp8
    prefill --fp8 --share-experts
    MTPSERVE_FP8_W8A8=off prefill --fp8 --share-experts
    prefill --share-experts
    prefill --fp8 --share-experts --profile
    prefill --share-experts --profile ;;
  mla)
    python3 benchmarks/bench_kernels.py --sweep-mla-prefill 2>&1 | grep -v -i warn ;;
  dense)
    # The dense test turns MTPSERVE_DENSE_PROMPTS on itself (its sparse run needs the default).
    python3 -m pytest -q -m gpu tests/kernels/test_varlen_attention.py \
      tests/workers/test_gpu_engine.py -k "varlen or dense" 2>&1 | tail -5
    MTPSERVE_DENSE_PROMPTS=on python3 -m pytest -q -m gpu tests/workers/test_gpu_engine.py \
      -k nothing_compiles 2>&1 | tail -5
    for a in --fp8 ""; do
      echo "== prefill $a"
      python3 benchmarks/bench_decode.py --skip-transformers --prefill-only --share-experts $a \
        2>&1 | grep -v -i warn
    done ;;
  *)
    echo "unknown part $part (tests, decode, profile, pdl, linears, shard, prefill, mla, dense)" >&2
    exit 2 ;;
esac
