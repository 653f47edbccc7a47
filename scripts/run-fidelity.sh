#!/usr/bin/env bash
# Reproduces docs/fidelity.md: fetches SmolLM2-135M and Botchan into a cache
# outside the repository, builds the tinyllm engine for this CPU and runs the
# default evaluation (4 windows x 1024 tokens, 6 policies x 3 budgets).
# Extra arguments go to kvevict_fidelity (e.g. --windows 8, --lse-check).
# The JSON lands in build-fidelity/fidelity.json.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh fidelity
cache=$(bash scripts/fidelity/fetch.sh)
build=${BUILD_DIR:-build-fidelity}
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DKVEVICT_NATIVE_ARCH=ON -DKVEVICT_BUILD_TESTS=OFF \
  -DKVEVICT_BUILD_BENCHMARKS=OFF >/dev/null
cmake --build "$build" --target kvevict_fidelity -j"$(nproc)"
OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(nproc)} "$build/examples/kvevict_fidelity" eval \
  --model "$cache/SmolLM2-135M-Instruct.Q4_1.gguf" --text "$cache/botchan.txt" --json "$build/fidelity.json" "$@"
