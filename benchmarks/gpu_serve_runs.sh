#!/usr/bin/env bash
# Issue 15's GPU figures on the H200 machine: the serving path against the offline engine
# (bench_serve) and the TP executor's per-step overhead (bench_tp_step). Run from the repository
# root with .raydev/raysite.tar.xz there (Ray and its dependencies as site-packages, for a GPU host
# without a package index; git-ignored). One part
# per call keeps each under the device's 10-minute limit; a second argument "colocated" serves
# ingress and engine as one deployment (AppArgs.colocate, what `mtpserve serve` deploys), "two"
# as two deployments (ingress, model server); "-proxy" after either ("two-proxy",
# "colocated-proxy") sends HTTP through Serve's proxy instead of the ingress replica directly:
#   bash benchmarks/gpu_serve_runs.sh tp_step               # 2 GPUs: per-step overhead, TP=2 vs 1
#   bash benchmarks/gpu_serve_runs.sh tp_step1              # 1 GPU: TP=1 by each transport
#   bash benchmarks/gpu_serve_runs.sh tiny_tp1 [colocated|two]  # tiny model, TP=1
#   bash benchmarks/gpu_serve_runs.sh tiny_tp2 [colocated|two]  # 2 GPUs: tiny model, TP=2
#   bash benchmarks/gpu_serve_runs.sh default_tp1 [colocated|two]  # the default model, MTP k=3
#   bash benchmarks/gpu_serve_runs.sh default_tp2 [colocated|two]  # 2 GPUs: the default model, TP=2
# No shape: bench_serve's default (colocated). JSON lands in $OUT (the device's output folder) or
# /tmp/bench_serve; tables go to stdout. GIT_COMMIT=<sha> names the tree in the JSON where the
# copy's .git is stale.
set -euo pipefail
part=${1:-tiny_tp1}
shape=${2:-}
shift $(($# < 2 ? $# : 2))
more=("$@")  # anything after the shape goes to bench_serve (e.g. --stream-chunks-per-s 2000)
mkdir -p /tmp/site
[ -d /tmp/site/ray ] || tar xJf .raydev/raysite.tar.xz -C /tmp/site
export PYTHONPATH=$PWD:/tmp/site PATH=/tmp/site/bin:$PATH RAY_AUTH_MODE=disabled
out=${OUT:-/tmp/bench_serve}
mkdir -p "$out"
tiny=$(python3 -c "from workers.default_model import tiny_model_path; print(tiny_model_path())")
levels=1,8,32,128

serve_pair() {  # $1: name; the rest: bench_serve arguments (offline and HTTP in one run)
  local name=$1
  shift
  local extra=()
  case $shape in
    colocated*) extra=(--colocate); name=$name-colocated ;;
    two*) extra=(--no-colocate) ;;
  esac
  case $shape in *-proxy) extra+=(--proxy); name=$name-proxy ;; esac
  # Eight requests per client (32 at one): bench_serve's default two made passes of 0.2-0.8 s
  # on the tiny model, mostly a level's first burst and last drain, whose ratios to offline moved
  # 0.57-0.99 between passes. Arguments after the shape override these.
  python3 benchmarks/bench_serve.py --device cuda --concurrency $levels --max-tokens 128 \
    --rounds 8 --min-requests 32 \
    --actor-num-cpus 1 ${extra[@]+"${extra[@]}"} "$@" ${more[@]+"${more[@]}"} \
    --json "$out/$name.json"
}

case $part in
  tp_step)
    python3 benchmarks/bench_tp_step.py --device cuda --model "$tiny" --json "$out/tp_step.json"
    python3 benchmarks/bench_tp_step.py --device cuda --model "$tiny" --num-draft-tokens 3 \
      --transports socket,graph --json "$out/tp_step_mtp3.json"
    ;;
  tp_step1)
    python3 benchmarks/bench_tp_step.py --device cuda --model "$tiny" --tp-sizes 1 \
      --json "$out/tp_step1.json"
    ;;
  tiny_tp1) serve_pair tiny_tp1 --model "$tiny" ;;
  tiny_tp2) serve_pair tiny_tp2 --model "$tiny" --tp 2 ;;
  default_tp1) serve_pair default_tp1 --default-model --num-draft-tokens 3 ;;
  default_tp2) serve_pair default_tp2 --default-model --tp 2 --num-draft-tokens 3 ;;
  *) echo "unknown part $part" >&2; exit 2 ;;
esac
