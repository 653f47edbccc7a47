#!/usr/bin/env bash
# Builds everything (library checks, tests, examples, benchmarks) and runs
# the whole test suite through ctest.
#   KVEVICT_SANITIZE=ON  build and run under AddressSanitizer + UBSan
#   BUILD_DIR=dir        build directory (default: build)
#   KVEVICT_FUZZ_SECONDS=n  seconds per fuzz harness afterwards (default 60; 0: none)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh tests
build=${BUILD_DIR:-build}
sanitize=${KVEVICT_SANITIZE:-OFF}
type=Release
[ "$sanitize" = ON ] && type=Debug
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE="$type" -DKVEVICT_SANITIZE="$sanitize"
cmake --build "$build" -j"$(nproc)"
ctest --test-dir "$build" --output-on-failure -j"$(nproc)"
bash scripts/run-python-tests.sh  # the Python package (skipped when KVEVICT_SANITIZE=ON)
# The fidelity evaluation's smoke test on SmolLM2 (docs/fidelity.md): the
# model from the PyPI package the Python phase installed; not under sanitizers.
[ "$sanitize" = ON ] || BUILD_DIR="$build" bash scripts/fidelity/smoke.sh
# kvevict inside llama.cpp (docs/llama-cpp.md): llama.cpp from its PyPI source
# package, patched and built (library and one program), cross-checked with
# tinyllm (a 192-token window, against a recorded run too; two needle trials
# with prompt compression); not under sanitizers.
[ "$sanitize" = ON ] || BUILD_DIR="$build" bash scripts/run-llamacpp.sh smoke
# Then each libFuzzer harness for a bounded time (docs/reliability.md,
# "Fuzzing"). Not in the KVEVICT_SANITIZE=ON rerun: the fuzz build carries
# its own sanitizers, and one bounded run per CI pass is the budget.
fuzz_seconds=${KVEVICT_FUZZ_SECONDS:-60}
if [ "$sanitize" != ON ] && [ "$fuzz_seconds" -gt 0 ]; then
  bash scripts/run-fuzz.sh "$fuzz_seconds"
fi
