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
  # Perplexity and each context length of the retrieval run side by side
  # as separate processes, the cores shared among them: on a shared 2-core
  # machine one thread per process wastes less in OpenMP barriers than two.
  IFS=, read -r -a length_list <<< "$lengths"
  cores=$(nproc --all)  # plain nproc would answer OMP_NUM_THREADS
  per=$(( cores / (1 + ${#length_list[@]}) ))
  [ "$per" -ge 1 ] || per=1
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$per}
  start=$(date +%s)
  pids=()
  "$fidelity" eval --model "$model" --text "$text" --window 1024 --windows "$windows" --budgets 10,20,50 \
    --json "$build/fidelity.json" "$@" > "$build/fidelity.md" &
  pids+=($!)
  for length in "${length_list[@]}"; do
    "$needle" --model "$model" --text "$text" --lengths "$length" --depths "$depths" --words "$words" \
      --budgets 10,20 --json "$build/needle-$length.json" > "$build/needle-$length.md" 2> "$build/needle-$length.log" &
    pids+=($!)
  done
  status=0
  for pid in "${pids[@]}"; do wait "$pid" || status=1; done
  [ "$status" = 0 ] || { echo "run-fidelity.sh: an evaluation failed (logs in $build)" >&2; exit 1; }
  cat "$build/fidelity.md" "$build"/needle-*.md
  # One needle.json: the lengths' rows in the order asked, the longest wall time.
  "$python" - "$build/needle.json" "${length_list[@]/#/$build/needle-}" <<'PY'
import json, sys
runs = [json.load(open(p + ".json")) for p in sys.argv[2:]]
merged = dict(runs[0], seconds=max(r["seconds"] for r in runs), results=[x for r in runs for x in r["results"]])
json.dump(merged, open(sys.argv[1], "w"), indent=1)
PY
  end=$(date +%s)
  cat > "$build/fidelity-run.json" <<JSON
{"date": "$(date -u +%Y-%m-%d)", "seconds": $((end - start)), "threads": $OMP_NUM_THREADS,
 "cpu": "$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')", "cores": $cores,
 "command": "FIDELITY_WINDOWS=$windows FIDELITY_LENGTHS=$lengths FIDELITY_DEPTHS=$depths FIDELITY_WORDS=$words scripts/run-fidelity.sh${*:+ $*}"}
JSON
  cp "$build/fidelity.json" "$build/needle.json" "$build/fidelity-run.json" docs/data/
fi
"$python" docs/make_plots.py
"$python" scripts/fidelity/report.py docs/fidelity.md
