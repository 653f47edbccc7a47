#!/usr/bin/env bash
# Verifies the CUDA backend on this machine's GPU in one command: builds the
# gpu tests and the CUDA demo for the local GPU's architecture, runs every
# gpu-labelled test, then the same tests under compute-sanitizer's memcheck,
# racecheck, synccheck and initcheck, then the CUDA demo, and prints a
# summary table. The gpu-labelled tests include the CUDA benchmarks' smoke
# run (benchmark:smoke:cuda: kvevict_bench_cuda's S5 rows once) when Google
# Benchmark is found; timed benchmark runs are scripts/run-gpu-benchmarks.sh.
# Logs go to $GPU_CHECK_LOGS (default build-gpu/logs).
#
#   scripts/gpu-check.sh                 # arch from nvidia-smi (e.g. 90 on an H100)
#   CUDA_ARCH=90 scripts/gpu-check.sh    # or given
#   KIT=.offline-kit scripts/gpu-check.sh  # doctest from an offline kit (shared/tools/offline-kit.sh)
#
# Exit status: 0 when every step passed, 1 otherwise.
set -uo pipefail
cd "$(dirname "$0")/.."
build=${BUILD_DIR:-build-gpu}
logs=${GPU_CHECK_LOGS:-$build/logs}
mkdir -p "$logs"
arch=${CUDA_ARCH:-$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d '.')}
if [ -z "$arch" ]; then
  echo "gpu-check: no GPU found (nvidia-smi gives no compute capability); set CUDA_ARCH to build anyway" >&2
  exit 1
fi
prefix=()
if [ -n "${KIT:-}" ]; then
  prefix=(-DCMAKE_PREFIX_PATH="$PWD/$KIT" -DKVEVICT_DOCTEST_DIR="$PWD/$KIT/include")
  export LD_LIBRARY_PATH="$PWD/$KIT/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
fi

results=()
run() {  # run NAME COMMAND...: logs to $logs/NAME.log, records PASS/FAIL
  local name=$1
  shift
  local start=$SECONDS
  if "$@" >"$logs/$name.log" 2>&1; then
    results+=("$(printf '%-34s PASS %5ds' "$name" $((SECONDS - start)))")
  else
    results+=("$(printf '%-34s FAIL %5ds  (see %s)' "$name" $((SECONDS - start)) "$logs/$name.log")")
  fi
}

run configure cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DKVEVICT_ENABLE_CUDA=ON \
  -DKVEVICT_CUDA_ARCHITECTURES="$arch" -DKVEVICT_BUILD_BENCHMARKS=ON -DKVEVICT_BENCH_CUDA_ARCHITECTURES="$arch" \
  "${prefix[@]}"
run build cmake --build "$build" -j"$(nproc)" --target test_cuda_decode test_cuda_exact_greedy test_cuda_select test_cuda_prefill test_cuda_evict_to kvevict_demo_cuda
if cmake --build "$build" --target help 2>/dev/null | grep -q kvevict_bench_cuda; then
  run build-bench-cuda cmake --build "$build" -j"$(nproc)" --target kvevict_bench_cuda
else
  results+=("$(printf '%-34s SKIP        (Google Benchmark not found: no CUDA benchmark smoke run)' build-bench-cuda)")
fi
run gpu-tests ctest --test-dir "$build" -L gpu --output-on-failure
for tool in memcheck racecheck synccheck initcheck; do
  for t in test_cuda_decode test_cuda_exact_greedy test_cuda_select test_cuda_prefill test_cuda_evict_to; do
    # The sanitizers slow kernels down by 10-100x: a sixth of the streams
    # (KVEVICT_TEST_QUICK) and no 128K-slot case keep each run to minutes.
    KVEVICT_TEST_QUICK=1 run "$tool:$t" compute-sanitizer --tool "$tool" --error-exitcode 1 \
      "$build/tests/$t" --test-case-exclude="*128K*"
  done
done
run demo-cuda "$build/examples/kvevict_demo_cuda" --steps 1024

echo
echo "gpu-check on $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1), sm_$arch, $(date -u +%Y-%m-%dT%H:%MZ)"
printf '%s\n' "${results[@]}"
printf '%s\n' "${results[@]}" >"$logs/summary.txt"
! printf '%s\n' "${results[@]}" | grep -q FAIL
