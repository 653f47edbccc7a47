#!/usr/bin/env bash
# The full CUDA benchmark run: every row of every family of
# kvevict_bench_cuda (benchmarks/cuda/) with its baselines, RUNS times
# (default 3) with JSON out, scripts/bench_torch.py after each run when
# torch is importable (the torch.topk and torch.compile baselines), then
# scripts/bench_report.py's tables and GPU target rows. Figures are per
# layer, timed cold (docs/benchmarks.md, "GPU"). The binary comes from the
# GPU check's pack (scripts/gpu-pack.sh, docs/gpu.md), so the GPU machine
# needs no compiler and no Google Benchmark. Unlike the pack's run.sh, which
# runs the target rows only within 7 minutes, this run is not bounded.
#
#   scripts/gpu-pack.sh                                           # where nvcc is (no GPU needed)
#   scripts/run-gpu-benchmarks.sh                                 # on the GPU machine: everything
#   RUNS=1 scripts/run-gpu-benchmarks.sh --benchmark_filter=/S5/  # a subset
#
# Extra arguments go to kvevict_bench_cuda; TORCH_FILTER (a regular
# expression on row names) to bench_torch.py. Each run reports the median of
# REPS repetitions (default 5) of at least MIN_TIME seconds each (default
# 0.3). PACK is the pack's folder (default .gpu-pack). JSON lands in
# $OUT_DIR/bench-cuda-run<i>.json and bench-torch-run<i>.json (OUT_DIR
# default build-gpu-bench), the report in $OUT_DIR/gpu-report.md.
set -euo pipefail
cd "$(dirname "$0")/.."
pack=${PACK:-.gpu-pack}
out_dir=${OUT_DIR:-build-gpu-bench}
runs=${RUNS:-3}
reps=${REPS:-5}
min_time=${MIN_TIME:-0.3}
bench=$pack/bin/kvevict_bench_cuda
if [ ! -x "$bench" ]; then
  echo "run-gpu-benchmarks: no $bench; build the pack first (scripts/gpu-pack.sh)" >&2
  exit 1
fi
mkdir -p "$out_dir"
torch=0
if python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  torch=1
else
  echo "run-gpu-benchmarks: torch with CUDA is not importable; no torch baselines (their target rows read 'not measured')" >&2
fi
outs=()
for i in $(seq 1 "$runs"); do
  out="$out_dir/bench-cuda-run$i.json"
  LD_LIBRARY_PATH="$pack/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" "$bench" --benchmark_min_time="$min_time" \
    --benchmark_repetitions="$reps" --benchmark_report_aggregates_only=true --benchmark_out="$out" \
    --benchmark_out_format=json "$@"
  outs+=("$out")
  if [ "$torch" = 1 ]; then
    # Right after the CUDA run, so the ratios of run i compare neighbours in time.
    out="$out_dir/bench-torch-run$i.json"
    rm -f "$out"
    python3 scripts/bench_torch.py --out "$out" --reps "$reps" --min-time "$min_time" --filter "${TORCH_FILTER:-.}" ||
      echo "run-gpu-benchmarks: bench_torch.py failed on some rows (see above)" >&2
    if [ -f "$out" ]; then
      outs+=("$out")
    fi
  fi
done
python3 scripts/bench_report.py "${outs[@]}" | tee "$out_dir/gpu-report.md"
