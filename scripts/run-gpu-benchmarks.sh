#!/usr/bin/env bash
# Builds kvevict_bench_cuda (every CUDA benchmark family with its baselines,
# benchmarks/cuda/) in Release for the local GPU's architecture, runs it RUNS
# times (default 3) with JSON out, runs scripts/bench_torch.py after each run
# when torch is importable (the torch.topk and torch.compile baselines), and
# prints scripts/bench_report.py's tables and GPU target rows. Figures are
# per layer, timed cold (docs/benchmarks.md, "GPU").
#
#   scripts/run-gpu-benchmarks.sh                               # everything
#   RUNS=1 scripts/run-gpu-benchmarks.sh --benchmark_filter=/S5/  # a subset
#
# Extra arguments go to kvevict_bench_cuda; TORCH_FILTER (a regular
# expression on row names) to bench_torch.py. Each run reports the median of
# REPS repetitions (default 5) of at least MIN_TIME seconds each (default
# 0.3). CUDA_ARCH overrides the architecture read from nvidia-smi (90 on an
# H100); KIT=.offline-kit finds Google Benchmark in an offline kit
# (shared/tools/offline-kit.sh) on a machine without internet. JSON lands in
# $BUILD_DIR/bench-cuda-run<i>.json and bench-torch-run<i>.json (BUILD_DIR
# default build-gpu-bench), the report in $BUILD_DIR/gpu-report.md.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${BUILD_DIR:-build-gpu-bench}
runs=${RUNS:-3}
reps=${REPS:-5}
min_time=${MIN_TIME:-0.3}
arch=${CUDA_ARCH:-$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d '.')}
if [ -z "$arch" ]; then
  echo "run-gpu-benchmarks: no GPU found (nvidia-smi gives no compute capability); set CUDA_ARCH to build anyway" >&2
  exit 1
fi
prefix=()
if [ -n "${KIT:-}" ]; then
  prefix=(-DCMAKE_PREFIX_PATH="$PWD/$KIT" -DKVEVICT_DOCTEST_DIR="$PWD/$KIT/include")
  export LD_LIBRARY_PATH="$PWD/$KIT/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
fi
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DKVEVICT_ENABLE_CUDA=ON -DKVEVICT_BUILD_TESTS=OFF \
  -DKVEVICT_BUILD_EXAMPLES=OFF -DKVEVICT_BUILD_BENCHMARKS=ON -DKVEVICT_CUDA_ARCHITECTURES="$arch" \
  -DKVEVICT_BENCH_CUDA_ARCHITECTURES="$arch" "${prefix[@]}" >/dev/null
cmake --build "$build" -j"${JOBS:-$(nproc)}" --target kvevict_bench_cuda
torch=0
if python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  torch=1
else
  echo "run-gpu-benchmarks: torch with CUDA is not importable; no torch baselines (their target rows read 'not measured')" >&2
fi
outs=()
for i in $(seq 1 "$runs"); do
  out="$build/bench-cuda-run$i.json"
  "$build/benchmarks/kvevict_bench_cuda" --benchmark_min_time="$min_time" --benchmark_repetitions="$reps" \
    --benchmark_report_aggregates_only=true --benchmark_out="$out" --benchmark_out_format=json "$@"
  outs+=("$out")
  if [ "$torch" = 1 ]; then
    # Right after the CUDA run, so the ratios of run i compare neighbours in time.
    out="$build/bench-torch-run$i.json"
    rm -f "$out"
    python3 scripts/bench_torch.py --out "$out" --reps "$reps" --min-time "$min_time" --filter "${TORCH_FILTER:-.}" ||
      echo "run-gpu-benchmarks: bench_torch.py failed on some rows (see above)" >&2
    if [ -f "$out" ]; then
      outs+=("$out")
    fi
  fi
done
python3 scripts/bench_report.py "${outs[@]}" | tee "$build/gpu-report.md"
