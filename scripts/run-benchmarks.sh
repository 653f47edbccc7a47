#!/usr/bin/env bash
# Builds the Google Benchmark binaries in Release (installs the compiler,
# CMake and Google Benchmark if missing) and runs each one: every benchmark
# runs its baseline in the same binary, medians of 5 repetitions. Extra
# arguments go to the benchmark binaries (e.g. --benchmark_filter=S1).
# JSON results land in $BUILD_DIR/bench-*.json (BUILD_DIR default build-bench).
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
for bench in "$build"/benchmarks/kvevict_bench_*; do
  [ -x "$bench" ] || continue
  name=$(basename "$bench")
  "$bench" --benchmark_min_time=0.3 --benchmark_repetitions=5 --benchmark_report_aggregates_only=true \
    --benchmark_out="$build/bench-${name#kvevict_bench_}.json" --benchmark_out_format=json "$@"
done
