#!/usr/bin/env bash
# Builds everything (library checks, tests, examples, benchmarks) and runs
# the whole test suite through ctest.
#   KVEVICT_SANITIZE=ON  build and run under AddressSanitizer + UBSan
#   BUILD_DIR=dir        build directory (default: build)
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
