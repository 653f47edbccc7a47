#!/usr/bin/env bash
# Reproduces docs/fidelity.md: fetches SmolLM2-135M and Botchan into a cache
# outside the repository, builds the tinyllm engine for this CPU and runs the
# default evaluation (4 windows x 1024 tokens, 6 policies x 3 budgets).
# Extra arguments go to kvevict_fidelity (e.g. --windows 8, --lse-check).
# The JSON lands in build-fidelity/fidelity.json (BUILD_DIR overrides).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/fidelity/prepare.sh
OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(nproc)} "$fidelity" eval --model "$model" --text "$text" \
  --json "$build/fidelity.json" "$@"
