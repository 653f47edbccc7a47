#!/usr/bin/env bash
# Builds and runs the demo on its embedded default workload; extra arguments
# go to the demo (see --help).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh demo
build=${BUILD_DIR:-build-demo}
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DKVEVICT_BUILD_TESTS=OFF -DKVEVICT_BUILD_BENCHMARKS=OFF >/dev/null
cmake --build "$build" -j"$(nproc)" --target kvevict_demo
"$build"/examples/kvevict_demo "$@"
