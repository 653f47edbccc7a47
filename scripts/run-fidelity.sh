#!/usr/bin/env bash
# Reproduces docs/fidelity.md in one command: fetches SmolLM2-135M and
# Botchan into a cache outside the repository, builds the tinyllm engine for
# this CPU, runs
#   1. perplexity: teacher-forced streaming of FIDELITY_WINDOWS windows x 1024
#      tokens, every policy and both oracles at 10%, 20% and 50% of the window
#      (kvevict_fidelity eval; extra arguments go to it, e.g. --lse-check);
#   2. needle retrieval: FIDELITY_LENGTHS x FIDELITY_DEPTHS x FIDELITY_WORDS
#      trials, decode-time eviction and prompt compression (question inside
#      and outside) at 10% and 20% (kvevict_needle);
# then copies the JSON to docs/data, redraws docs/img/fidelity.png and
# docs/img/needle.png (docs/make_plots.py) and rewrites the generated table
# of docs/fidelity.md (scripts/fidelity/report.py).
#   FIDELITY_WINDOWS=4 FIDELITY_LENGTHS=256,512,1024 FIDELITY_DEPTHS=0.1,0.5,0.9
#   FIDELITY_WORDS=4   the full configuration (the defaults)
#   FIDELITY_STAGE=report  only step 3: redraw and rewrite from docs/data
#   BUILD_DIR=build-fidelity  where the engine is built and the JSON lands
set -euo pipefail
cd "$(dirname "$0")/.."
windows=${FIDELITY_WINDOWS:-4}
lengths=${FIDELITY_LENGTHS:-256,512,1024}
depths=${FIDELITY_DEPTHS:-0.1,0.5,0.9}
words=${FIDELITY_WORDS:-4}

# A Python with matplotlib for the figures (Debian's python3-matplotlib otherwise).
python=${PYTHON:-python3}
if ! "$python" -c "import matplotlib" 2>/dev/null; then
  python=/usr/bin/python3
  "$python" -c "import matplotlib" 2>/dev/null || bash scripts/install-deps.sh bench
fi

if [ "${FIDELITY_STAGE:-all}" != report ]; then
  source scripts/fidelity/prepare.sh
  # The two evaluations run side by side, each on half the cores: on a
  # shared machine one thread per process wastes less in OpenMP barriers.
  half=$(( $(nproc) / 2 ))
  [ "$half" -ge 1 ] || half=1
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$half}
  start=$(date +%s)
  "$fidelity" eval --model "$model" --text "$text" --window 1024 --windows "$windows" --budgets 10,20,50 \
    --json "$build/fidelity.json" "$@" > "$build/fidelity.md" &
  ppl_pid=$!
  "$needle" --model "$model" --text "$text" --lengths "$lengths" --depths "$depths" --words "$words" \
    --budgets 10,20 --json "$build/needle.json" > "$build/needle.md"
  wait "$ppl_pid"
  cat "$build/fidelity.md" "$build/needle.md"
  end=$(date +%s)
  cat > "$build/fidelity-run.json" <<JSON
{"date": "$(date -u +%Y-%m-%d)", "seconds": $((end - start)), "threads": $OMP_NUM_THREADS,
 "cpu": "$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')", "cores": $(nproc),
 "command": "FIDELITY_WINDOWS=$windows FIDELITY_LENGTHS=$lengths FIDELITY_DEPTHS=$depths FIDELITY_WORDS=$words scripts/run-fidelity.sh${*:+ $*}"}
JSON
  cp "$build/fidelity.json" "$build/needle.json" "$build/fidelity-run.json" docs/data/
fi
"$python" docs/make_plots.py
"$python" scripts/fidelity/report.py docs/fidelity.md
