#!/usr/bin/env bash
# Builds the libFuzzer harnesses with clang++ (AddressSanitizer +
# UndefinedBehaviorSanitizer), replays the inputs of the defects they found
# (fuzz/regressions/<harness>/), then runs each harness for SECONDS (default
# 60), side by side on one core each, starting from the committed seed
# corpus (fuzz/corpus/<harness>/). Fails on any finding: a crash, a
# sanitizer report, a broken invariant, a leak, a timeout or running out of
# memory. See docs/reliability.md, "Fuzzing".
#   scripts/run-fuzz.sh [SECONDS]
#   FUZZ_BUILD_DIR=dir    binaries, working corpus and findings (default: build-fuzz)
#   FUZZ_HARNESSES="a b"  which harnesses to run (default: fuzz_policy_api fuzz_gguf)
#   FUZZ_CXX=clang++-14   the compiler (default: clang++)
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-60}
bash scripts/install-deps.sh fuzz
out=${FUZZ_BUILD_DIR:-build-fuzz}
read -r -a harnesses <<<"${FUZZ_HARNESSES:-fuzz_policy_api fuzz_gguf}"
cxx=${FUZZ_CXX:-clang++}
flags=(-std=c++17 -g -O1 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer
       -Wall -Wextra -Iinclude -Iexamples -Ifuzz)
mkdir -p "$out/obj"

# The policy harness is three translation units, compiled side by side.
declare -A parts=([fuzz_policy_api]="fuzz_policy_api policy_api_sequence policy_api_batched" [fuzz_gguf]="fuzz_gguf")
echo "== building ${harnesses[*]} with $cxx"
pids=()
for h in "${harnesses[@]}"; do
  for p in ${parts[$h]}; do
    "$cxx" "${flags[@]}" -c "fuzz/$p.cpp" -o "$out/obj/$p.o" &
    pids+=($!)
  done
done
for pid in "${pids[@]}"; do wait "$pid"; done
for h in "${harnesses[@]}"; do
  objs=()
  for p in ${parts[$h]}; do objs+=("$out/obj/$p.o"); done
  "$cxx" "${flags[@]}" "${objs[@]}" -o "$out/$h"
done

# The defects found so far stay fixed: each saved input runs once.
status=0
for h in "${harnesses[@]}"; do
  for input in fuzz/regressions/"$h"/*; do
    [ -f "$input" ] || continue
    if ! "$out/$h" "$input" >"$out/replay.log" 2>&1; then
      tail -n 40 "$out/replay.log"
      echo "!! $h: the regression input $input fails again"
      status=1
    fi
  done
done
[ "$status" -eq 0 ] && echo "== regression inputs replayed: clean"

# Each harness, in the background: new inputs go to a working corpus under
# $out, never to the committed seeds; findings to $out/findings/. libFuzzer
# exits non-zero on any of them (-error_exitcode / -timeout_exitcode default
# to 77 / 70).
fuzz() {
  local h=$1 corpus="$out/corpus/$1"
  mkdir -p "$corpus" "$out/findings"
  ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
    "$out/$h" -max_total_time="$seconds" -timeout=20 -rss_limit_mb=2560 -max_len=4096 -print_final_stats=1 \
    -artifact_prefix="$out/findings/$h-" "$corpus" "fuzz/corpus/$h" >"$out/$h.log" 2>&1
}
echo "== ${harnesses[*]} for ${seconds}s each"
declare -A running=()
for h in "${harnesses[@]}"; do
  fuzz "$h" &
  running[$h]=$!
done
for h in "${harnesses[@]}"; do
  rc=0
  wait "${running[$h]}" || rc=$?
  echo "-- $h"
  grep -E '^#[0-9]+.*DONE|^stat::(number_of_executed_units|peak_rss_mb|new_units_added)' "$out/$h.log" || true
  if [ "$rc" -ne 0 ]; then
    tail -n 40 "$out/$h.log"
    echo "!! $h: finding (exit $rc); the input is in $out/findings/, the log in $out/$h.log"
    status=1
  fi
done
exit $status
