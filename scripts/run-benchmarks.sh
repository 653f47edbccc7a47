#!/usr/bin/env bash
# Builds the Google Benchmark binaries (one per family: kvevict_bench_decode,
# kvevict_bench_select, ...) in Release, installing the compiler, CMake,
# Google Benchmark and matplotlib if missing, runs each one RUNS times
# (default 3), and turns the JSON into docs/benchmarks.md's tables and plots with
# scripts/bench_report.py. Every benchmark runs its baseline in the same
# binary; each run reports the median of REPS repetitions (default 5) of at
# least MIN_TIME seconds each (default 0.3).
#
# Extra arguments go to every binary, e.g. --benchmark_filter='/S1/'.
# A full default run takes tens of minutes on 2 cores: filter while working.
# KVEVICT_BENCH_LARGE=1 also registers the scenarios S2-S4 (hundreds of MiB
# of inputs per benchmark). JSON results land in
# $BUILD_DIR/bench-<family>-run<i>.json (BUILD_DIR default build-bench).
# WRITE=1 also updates docs/benchmarks.md, docs/data/host_bench.json and the
# plots, quoting this command, today's date and MACHINE (a description).
#
# Google Benchmark from Debian prints "Library was built as DEBUG. Timings may
# be affected": that is Debian's build of the library itself (its own
# timing code), not ours; our benchmarks are built in Release.
#
# The CUDA benchmarks (kvevict_bench_cuda) and their PyTorch baselines run on
# a GPU machine with scripts/run-gpu-benchmarks.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh bench
build=${BUILD_DIR:-build-bench}
runs=${RUNS:-3}
reps=${REPS:-5}
min_time=${MIN_TIME:-0.3}
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DKVEVICT_BUILD_TESTS=OFF -DKVEVICT_BUILD_EXAMPLES=OFF \
  -DKVEVICT_BUILD_BENCHMARKS=ON >/dev/null
families=(decode select prefill evict_to kv_moves)
cmake --build "$build" -j"${JOBS:-$(nproc)}" --target "${families[@]/#/kvevict_bench_}"
outs=()
for family in "${families[@]}"; do
  for i in $(seq 1 "$runs"); do
    out="$build/bench-$family-run$i.json"
    "$build/benchmarks/kvevict_bench_$family" --benchmark_min_time="$min_time" --benchmark_repetitions="$reps" \
      --benchmark_report_aggregates_only=true --benchmark_out="$out" --benchmark_out_format=json "$@"
    outs+=("$out")
  done
done
# The report. install-deps.sh bench installs Debian's matplotlib, which
# serves the system interpreter: use it where the python3 on PATH (a
# virtualenv, pyenv) has none.
py=python3
"$py" -c 'import matplotlib' 2>/dev/null || py=/usr/bin/python3
write=()
if [ "${WRITE:-0}" = 1 ]; then
  quoted=$(printf ' %q' "$@")
  write=(--write --date "$(date +%F)" --machine "${MACHINE:-}"
         --command "RUNS=$runs REPS=$reps MIN_TIME=$min_time scripts/run-benchmarks.sh$quoted")
fi
"$py" scripts/bench_report.py "${write[@]}" "${outs[@]}"
