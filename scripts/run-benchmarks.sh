#!/usr/bin/env bash
# Builds the Google Benchmark binaries in Release (installs the compiler,
# CMake and Google Benchmark if missing) and runs each one RUNS times
# (default 3): every benchmark runs its baseline in the same binary, medians
# of 5 repetitions per run. Extra arguments go to the benchmark binaries
# (e.g. --benchmark_filter=S0). JSON results land in
# $BUILD_DIR/bench-<name>-run<i>.json (BUILD_DIR default build-bench), and
# scripts/bench_report.py prints the summary docs/benchmarks.md quotes: the
# median over runs, the spread across runs, and the per-run ratios.
#
# Google Benchmark from Debian prints "Library was built as DEBUG. Timings may
# be affected": that is Debian's build of the library itself (its own
# timing code), not ours; our benchmarks are built in Release.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh tests
build=${BUILD_DIR:-build-bench}
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DKVEVICT_BUILD_TESTS=OFF -DKVEVICT_BUILD_EXAMPLES=OFF \
  -DKVEVICT_BUILD_BENCHMARKS=ON >/dev/null
cmake --build "$build" -j"$(nproc)" --target kvevict_bench_host
runs=${RUNS:-3}
for bench in "$build"/benchmarks/kvevict_bench_*; do
  [ -x "$bench" ] || continue
  name=$(basename "$bench")
  outs=()
  for i in $(seq 1 "$runs"); do
    out="$build/bench-${name#kvevict_bench_}-run$i.json"
    "$bench" --benchmark_min_time=0.3 --benchmark_repetitions=5 --benchmark_report_aggregates_only=true \
      --benchmark_out="$out" --benchmark_out_format=json "$@"
    outs+=("$out")
  done
  if [ "$name" = kvevict_bench_host ] && command -v python3 >/dev/null; then
    python3 scripts/bench_report.py "${outs[@]}"
  fi
done
