#!/usr/bin/env bash
# The GPU check of kvevict's CUDA backend, run from the folder that
# scripts/gpu-pack.sh builds (this script is that folder's run.sh; it needs
# nothing of the repository): every gpu test in full, compute-sanitizer's four
# tools, the CUDA demo, the GPU target rows of kvevict_bench_cuda (docs/benchmarks.md)
# and their PyTorch baselines, then one summary table. Bounded to 7 minutes
# on an H100 by its time limits (docs/gpu.md).
#
#   .gpu-pack/run.sh OUTDIR      # the check; results and logs in OUTDIR
#   .gpu-pack/run.sh OUTDIR --only REGEX   # only the phases whose names match (a rerun of what failed)
#   .gpu-pack/run.sh OUTDIR --perf   # the performance loop, at most 3 minutes: the decode and select
#                                    # tests (correct first), the target rows, Nsight Compute's metrics
#                                    # on the decode step and selection kernels (ncu-*.csv in OUTDIR)
#   .gpu-pack/run.sh --plan [--perf]   # the phases and their limits, checked against 7 (3) minutes; runs nothing
#   .gpu-pack/run.sh --filters   # the sanitizers' doctest filters (scripts/gpu-pack.sh --check checks them)
#
# Nothing has run on a GPU before, so crashes and hangs are expected: every
# phase runs under `timeout -k` and one failing phase never stops the others.
# Stages run one after the other; inside a stage, lanes run side by side,
# each its phases in order. The bound of the run is, summed over stages, the
# longest lane's time limits plus the kill grace of each of its phases.
# The benchmarks run alone on the GPU.
#
# OUTDIR gets a few files: summary.txt (the table, also printed last),
# failures.txt (the end of every failed or timed-out phase's log),
# logs.tar.gz (every log; KEEP_LOGS=1 leaves them in OUTDIR/logs instead),
# bench-cuda.json, bench-torch.json and bench-report.md
# (scripts/bench_report.py's tables and GPU target verdicts).
# Exit status: 1 when a phase failed or timed out, else 77 when one was
# skipped (no device: the binaries exit 77; a tool missing), else 0.
#
# SANITIZER (default /usr/local/cuda/bin/compute-sanitizer) and PYTHON
# (default python3, the one with torch) can be overridden.
set -uo pipefail

PACK=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
SELF=$PACK/$(basename "${BASH_SOURCE[0]}")
BIN=$PACK/bin
LIB=$PACK/lib
SANITIZER=${SANITIZER:-/usr/local/cuda/bin/compute-sanitizer}
PYTHON=${PYTHON:-python3}
BUDGET=420  # seconds: 7 minutes, the bound the limits below must keep
GRACE=5     # timeout -k: seconds from TERM to KILL, counted in every phase's bound

# ============================================================================
# What runs. Test case names follow tests/cuda/*.cu and change with them:
# every filter lives in this block.
# ============================================================================
TESTS=(test_cuda_decode test_cuda_select test_cuda_prefill test_cuda_exact_greedy test_cuda_evict_to)

# racecheck, synccheck and initcheck run these doctest test cases (-tc=,
# comma-separated wildcards); together they launch every kernel. memcheck
# runs every test case. KVEVICT_TEST_QUICK=n runs one stream in n x the
# test's own stride: racecheck is the slowest tool (on an H100, 2026-11-26,
# the decode h2o streams took 17 s at n = 1, the selection's uniform-k case
# and the multi-token streams more than 25 s), so it runs a third of them.
declare -A CHOSEN=(
  # h2o: observe_evict on all four inputs (probs, head_scores, logits,
  # queries), append with the K/V scatter, resets after a bad input;
  # random: its Philox-keyed victim and reset_kernel with request streams;
  # split rows: several blocks per row (the workspace partials, the last
  # block's merge and commit) on every input kind; key_norms: the key-norm
  # source, short and split rows.
  [test_cuda_decode]='cuda h2o*,cuda random*,cuda split rows*,cuda key_norms*,cuda one-launch*'
  # One-block and multi-block paths, the CUB reorder by position, mask-only
  # and indices-only outputs, ragged lengths: every selection kernel.
  [test_cuda_select]='cuda select: uniform k*'
  # h2o: prepare, probs / sums / queries partials, combine, plan, compact and
  # the selection; large head dims: the dynamic shared-memory tile above
  # 48 KiB, rows longer than the stage, the multi-block selection, random
  # and the input-less path; key norms: their scoring kernel.
  [test_cuda_prefill]='cuda prefill h2o*,cuda prefill: large head dims*,cuda prefill by key norms*'
  # Its one test case: exact_greedy_kernel on every layout.
  [test_cuda_exact_greedy]='cuda exact_greedy*'
  # append_tokens and evict_to of every policy (the greedy one included):
  # the plan, selection (one block per row), greedy and refill kernels; the
  # narrow-input refusal of observe_evict. (The 6000-slot streams' multi-block
  # selection is the kernels test_cuda_select runs under these tools.)
  [test_cuda_evict_to]='CUDA multi-token*,CUDA observe*'
)

# kvevict_bench_cuda rows (Google Benchmark --benchmark_filter, POSIX
# extended regular expressions): the GPU targets of docs/benchmarks.md only, cold.
# Decode: h2o over S0-S5 and L8 (64 x 8 x 16K) beside the minimal fused kernel and the copy
# bandwidth on the same bytes.
# h2o_step is the one-launch step (gpu::batched_step), h2o the two launches.
BENCH_DECODE='^gpu_decode/(h2o|h2o_step|fused_kernel|d2d_copy)/probs/(S[0-5]|L8)/evict1/powerlaw/f32(/|$)|^gpu_decode/h2o_step/(head_scores|logits)/S[124]/evict1/powerlaw/f32(/|$)'
# Selection: S1-S3, keep 20% and 50%, both ends, beside both CUB sorts.
BENCH_SELECT='^gpu_select/(kvevict|cub_radix_sort|cub_segmented_sort)/(bottom|top)/S[1-3]/keep(20|50)/powerlaw/f32(/|$)'
# Seconds of per-layer time each row accumulates (one replay times 32
# layers, so about 32 x this of GPU time a row), one repetition: a first
# measurement, not the medians of docs/benchmarks.md.
BENCH_MIN_TIME=0.01
# scripts/bench_torch.py rows (Python regular expressions): the baselines of
# the same targets.
TORCH_DECODE='^gpu_decode/torch_compile/probs/(S[0-5]|L8)/evict1/powerlaw/f32$'
TORCH_ROWS="^gpu_select/torch_topk/(bottom|top)/S[1-3]/keep(20|50)/powerlaw/f32\$|$TORCH_DECODE"
# ============================================================================

lane_preflight() { phase preflight 10 "$SELF" --preflight; }

# Plain runs, full mode (every dtype, every stream): CPU-bound host
# references and small kernels, so all side by side.
lane_test_decode() { test_phase test_cuda_decode; }
lane_test_select() { test_phase test_cuda_select; }
lane_test_prefill() { test_phase test_cuda_prefill; }
lane_test_exact_greedy() { test_phase test_cuda_exact_greedy; }
lane_test_evict_to() { test_phase test_cuda_evict_to; }
lane_demo() { phase demo 45 --skip-code 3 env "$LDP" "$BIN/kvevict_demo_cuda" --steps 1024; }
test_phase() { phase "test-${1#test_cuda_}" 45 env "$LDP" "$BIN/$1" "${DOCTEST_ARGS[@]}"; }

# Sanitizers: one lane per binary, its four tools in order. Instrumented
# kernels share the GPU (time-sliced), so every limit assumes five lanes.
lane_san_decode() { sanitizer_lane test_cuda_decode; }
lane_san_select() { sanitizer_lane test_cuda_select; }
lane_san_prefill() { sanitizer_lane test_cuda_prefill; }
lane_san_exact_greedy() { sanitizer_lane test_cuda_exact_greedy; }
lane_san_evict_to() { sanitizer_lane test_cuda_evict_to; }
sanitizer_lane() {
  local t=$1 s=${1#test_cuda_}
  phase "memcheck-$s" 65 env "$LDP" KVEVICT_TEST_QUICK=2 "$SANITIZER" --tool memcheck "${SANITIZER_ARGS[@]}" \
    "$BIN/$t" "${DOCTEST_ARGS[@]}"
  local tool limit quick
  for tool in racecheck:40:3 synccheck:15:1 initcheck:20:1; do  # tool:limit:KVEVICT_TEST_QUICK
    IFS=: read -r tool limit quick <<<"$tool"
    phase "$tool-$s" "$limit" env "$LDP" KVEVICT_TEST_QUICK="$quick" "$SANITIZER" --tool "$tool" \
      "${SANITIZER_ARGS[@]}" "$BIN/$t" "${DOCTEST_ARGS[@]}" "-tc=${CHOSEN[$t]}"
  done
}
# torch.compile's first compilations take most of the PyTorch phase: done
# here, beside the sanitizers, into the on-disk caches the timed run reads.
# Its few graph replays are not timed.
lane_torch_warmup() {
  phase torch-warmup 140 env "${TORCH_ENV[@]}" "$PYTHON" "$PACK/bench_torch.py" --filter "$TORCH_DECODE" --reps 1 \
    --min-time 0 --out "$WORK/torch-warmup.json"
}

# The Python package on CUDA tensors (the pack's python/, built when
# scripts/gpu-pack.sh had PACK_PYTHON): every test of tests/python whose id
# names cuda: the CUDA launchers against the host through Python, the
# caller's stream, CUDA graph replay, torch.compile, kvevict.hf generating
# on the GPU. Beside the sanitizers: it times nothing.
lane_python() { phase python-cuda 150 "$SELF" --python-tests; }

# Benchmarks, alone on the GPU. Two processes, so a hang in one family keeps the other's rows.
lane_bench() {
  phase bench-decode 65 env "$LDP" "$BIN/kvevict_bench_cuda" --benchmark_filter="$BENCH_DECODE" \
    --benchmark_min_time="$BENCH_MIN_TIME" --benchmark_out="$LOGS/bench-decode.json" --benchmark_out_format=json
  phase bench-select 45 env "$LDP" "$BIN/kvevict_bench_cuda" --benchmark_filter="$BENCH_SELECT" \
    --benchmark_min_time="$BENCH_MIN_TIME" --benchmark_out="$LOGS/bench-select.json" --benchmark_out_format=json
}
lane_torch() {
  phase bench-torch 55 env "${TORCH_ENV[@]}" "$PYTHON" "$PACK/bench_torch.py" --filter "$TORCH_ROWS" --reps 3 \
    --min-time 0.05 --out "$OUT/bench-torch.json"
}
lane_report() { phase report 5 "$SELF" --report "$OUT"; }

# The performance loop (--perf): what a measure-and-change cycle needs, in
# 3 minutes. Nsight Compute (NCU) replays each kernel: the review's metrics
# (docs/gpu.md, "Performance loop") on a few launches of the target rows.
NCU=${NCU:-/usr/local/cuda/bin/ncu}
NCU_METRICS=gpu__time_duration.sum,smsp__inst_executed.sum,sm__warps_active.avg.pct_of_peak_sustained_active,\
dram__throughput.avg.pct_of_peak_sustained_elapsed,smsp__sass_inst_executed_op_local_ld.sum,launch__registers_per_thread
BENCH_PERF_DECODE='^gpu_decode/(h2o|h2o_step|fused_kernel|d2d_copy)/probs/(S[0-5]|L8)/evict1/powerlaw/f32(/|$)'
BENCH_PERF_SELECT='^gpu_select/(kvevict|cub_segmented_sort)/bottom/S[1-3]/keep(20|50)/powerlaw/f32(/|$)'
NCU_DECODE_ROWS='^gpu_decode/(h2o|h2o_step|fused_kernel)/probs/(S1|S5)/evict1/powerlaw/f32(/|$)'
NCU_SELECT_ROWS='^gpu_select/kvevict/bottom/S3/keep(20|50)/powerlaw/f32(/|$)'
lane_perf_test_decode() { phase test-decode 25 env "$LDP" KVEVICT_TEST_QUICK=1 "$BIN/test_cuda_decode" \
  "${DOCTEST_ARGS[@]}" "-tc=cuda h2o*,cuda split rows*,cuda one-launch*"; }
lane_perf_test_select() { phase test-select 25 env "$LDP" "$BIN/test_cuda_select" "${DOCTEST_ARGS[@]}"; }
lane_perf_bench() {
  phase bench-decode 40 env "$LDP" "$BIN/kvevict_bench_cuda" --benchmark_filter="$BENCH_PERF_DECODE" \
    --benchmark_min_time="$BENCH_MIN_TIME" --benchmark_out="$LOGS/bench-decode.json" --benchmark_out_format=json
  phase bench-select 20 env "$LDP" "$BIN/kvevict_bench_cuda" --benchmark_filter="$BENCH_PERF_SELECT" \
    --benchmark_min_time="$BENCH_MIN_TIME" --benchmark_out="$LOGS/bench-select.json" --benchmark_out_format=json
}
ncu_phase() {  # ncu_phase NAME ROWS KERNELS
  phase "$1" 22 "$NCU" --graph-profiling node -k "regex:$3" -c 12 --csv --metrics "$NCU_METRICS" \
    --log-file "$OUT/$1.csv" env "$LDP" "$BIN/kvevict_bench_cuda" --benchmark_filter="$2" --benchmark_min_time=0
}
lane_ncu() {
  ncu_phase ncu-decode "$NCU_DECODE_ROWS" 'observe_evict|append_kernel|fused'
  ncu_phase ncu-select "$NCU_SELECT_ROWS" 'select_|DeviceSegmentedRadixSort'
}
stages() {
  if [ "${PERF:-0}" = 1 ]; then
    stage preflight lane_preflight
    stage tests lane_perf_test_decode lane_perf_test_select
    stage bench lane_perf_bench
    stage ncu lane_ncu
    stage report lane_report
    return
  fi
  stage preflight lane_preflight
  stage tests lane_test_decode lane_test_select lane_test_prefill lane_test_exact_greedy lane_test_evict_to lane_demo
  stage sanitizers lane_san_decode lane_san_select lane_san_prefill lane_san_exact_greedy lane_san_evict_to \
    lane_torch_warmup lane_python
  stage bench lane_bench
  stage torch lane_torch
  stage report lane_report
}

DOCTEST_ARGS=(--duration=true --abort-after=100)  # per-case times for the next plan; bounded failure logs
SANITIZER_ARGS=(--error-exitcode 1 --print-limit 20)

# ---- machinery ----

# phase NAME LIMIT [--skip-code N] COMMAND...: COMMAND under `timeout -k`,
# its output in $LOGS/NAME.log, its result in $RESULTS/NAME. Exit 77 (or N)
# is a skip; so is a tool that is not there (a pack binary that is not there
# is a failure).
phase() {
  local name=$1 limit=$2
  shift 2
  local skip_code=77
  if [ "$1" = --skip-code ]; then
    skip_code=$2
    shift 2
  fi
  if [ "$MODE" = plan ]; then
    lane_bound=$((lane_bound + limit + GRACE))
    printf '%s\t%s\t%s\n' "$STAGE" "$name" "$limit" >>"$PLAN"
    return 0
  fi
  if [ -n "$ONLY" ] && ! [[ $name =~ $ONLY ]]; then
    record "$name" unselected - -
    return 0
  fi
  local log=$LOGS/$name.log
  printf '# %s (limit %s s):' "$name" "$limit" >"$log"
  printf ' %q' "$@" >>"$log"
  printf '\n' >>"$log"
  local program i=1
  [ "$1" = env ] && while [[ ${!i} == env || ${!i} == *=* ]]; do i=$((i + 1)); done
  program=${!i}
  if ! command -v "$program" >/dev/null 2>&1; then
    echo "# not found: $program" >>"$log"
    case $program in
      "$PACK"/*) record "$name" fail 0.0 127 ;;
      *) record "$name" skip 0.0 127 ;;
    esac
    return 0
  fi
  local start=${EPOCHREALTIME//[.,]/} rc
  # The braces take bash's own "Killed" / "Segmentation fault" notes off the
  # console: the result line of the log says it.
  { timeout -k "$GRACE" "$limit" "$@" >>"$log" 2>&1 </dev/null; } 2>/dev/null
  rc=$?
  local tenths=$(((${EPOCHREALTIME//[.,]/} - start) / 100000)) result
  case $rc in
    0) result=pass ;;
    124 | 137) result=timeout ;;
    "$skip_code") result=skip ;;
    *) result=fail ;;
  esac
  # A doctest filter that matches nothing runs nothing and passes.
  if [ "$result" = pass ] && grep -Eq '^\[doctest\] test cases: +0 \|' "$log"; then
    echo "# no test case matched the filter" >>"$log"
    result=fail
  fi
  echo "# $result, exit $rc, $((tenths / 10)).$((tenths % 10)) s" >>"$log"
  record "$name" "$result" "$((tenths / 10)).$((tenths % 10))" "$rc"
}

record() { echo "$2 $3 $4" >"$RESULTS/$1"; }

# stage NAME LANE...: in plan mode, the longest lane's bound; else the lanes
# side by side, each its phases in order.
stage() {
  STAGE=$1
  shift
  local lane
  if [ "$MODE" = plan ]; then
    local longest=0
    for lane in "$@"; do
      lane_bound=0
      "$lane"
      [ "$lane_bound" -gt "$longest" ] && longest=$lane_bound
    done
    printf '%s\t%s\n' "$STAGE" "$longest" >>"$STAGE_BOUNDS"
    return 0
  fi
  local pids=()
  for lane in "$@"; do
    "$lane" &
    pids+=($!)
  done
  wait "${pids[@]}"
}

# The plan: phases in order (stage, name, limit) and each stage's bound.
make_plan() {
  PLAN=$1/plan.tsv
  STAGE_BOUNDS=$1/stages.tsv
  : >"$PLAN"
  : >"$STAGE_BOUNDS"
  MODE=plan stages
}

print_plan() {
  printf '%-11s %-24s %6s\n' stage phase limit
  local stage name limit bound total=0
  while IFS=$'\t' read -r stage name limit; do printf '%-11s %-24s %5ss\n' "$stage" "$name" "$limit"; done <"$PLAN"
  echo
  echo "per stage, the longest lane's limits plus ${GRACE} s of kill grace a phase:"
  while IFS=$'\t' read -r stage bound; do
    printf '  %-11s %4s s\n' "$stage" "$bound"
    total=$((total + bound))
  done <"$STAGE_BOUNDS"
  printf '  %-11s %4s s (at most %s s)\n' total "$total" "$BUDGET"
  [ "$total" -le "$BUDGET" ]
}

preflight() {
  local bad=0 b device=0
  echo "== pack"
  cat "$PACK/MANIFEST" 2>/dev/null || echo "no MANIFEST"
  echo "== machine"
  uname -a
  echo "cpus: $(nproc)"
  free -g 2>/dev/null | head -2
  echo "== GPU"
  if nvidia-smi -L 2>&1 | grep -q '^GPU '; then
    device=1
    nvidia-smi
    nvidia-smi --query-gpu=name,driver_version,compute_cap,memory.total,compute_mode --format=csv,noheader | head -1 >"$WORK/device"
  else
    echo "no GPU: nvidia-smi lists none"
  fi
  echo "== libraries (from $LIB, then the system's)"
  for b in "$BIN"/*; do
    if LD_LIBRARY_PATH=$LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} ldd "$b" | grep -q 'not found'; then
      echo "${b##*/}: missing:"
      LD_LIBRARY_PATH=$LIB ldd "$b" | grep 'not found'
      bad=1
    fi
  done
  [ "$bad" = 0 ] && echo "every binary's libraries resolve"
  echo "== tools"
  if [ -x "$SANITIZER" ]; then "$SANITIZER" --version | tail -1; else echo "no compute-sanitizer at $SANITIZER"; fi
  "$PYTHON" --version 2>&1 || true
  [ "$bad" = 1 ] && return 1
  [ "$device" = 1 ] || return 77
  return 0
}

# pytest from the pack's copy of tests/python, the package on PYTHONPATH;
# a skip (77) where the pack has no package or there is no GPU.
python_tests() {
  if [ ! -d "$PACK/python/kvevict" ]; then
    echo "the pack holds no Python package (scripts/gpu-pack.sh builds it when PACK_PYTHON names a Python 3.12)"
    return 77
  fi
  if ! "$PYTHON" -c 'import torch' 2>/dev/null; then
    echo "$PYTHON has no torch"
    return 77
  fi
  export PYTHONPATH=$PACK/python PYTHONUNBUFFERED=1
  "$PYTHON" -c 'import sys, torch, kvevict
print("torch", torch.__version__, "kvevict CUDA backend", kvevict.cuda_available, "GPU", torch.cuda.is_available())
sys.exit(0 if kvevict.cuda_available and torch.cuda.is_available() else 77)' || return $?
  # -v and faulthandler: a hang names its test and stack before the phase's
  # limit. test_cuda_host_checks passes fake device pointers (CI runs it):
  # a check that regressed there would launch on them and spoil the CUDA
  # context of every test after it.
  cd "$PACK/python/tests" && "$PYTHON" -m pytest -v -p no:cacheprovider -o faulthandler_timeout=60 \
    -k "cuda and not host_checks" -rs --durations=10 .
}

# Google Benchmark writes its JSON as rows finish and closes it at the end:
# a run stopped by its limit leaves a truncated file, cut here after its
# last whole row. The two families become one file, one run.
report() {
  local out=$1 logs=$1/logs
  command -v "$PYTHON" >/dev/null || { echo "no $PYTHON"; return 77; }
  "$PYTHON" - "$logs/bench-decode.json" "$logs/bench-select.json" "$out/bench-cuda.json" "$WORK/notes" <<'EOF'
import json, os, sys
*inputs, merged_path, notes_path = sys.argv[1:]
context, rows, notes = None, [], []
for path in inputs:
    if not os.path.exists(path):
        notes.append(f"{os.path.basename(path)}: none written")
        continue
    text = open(path).read()
    try:
        run = json.loads(text)
    except ValueError:
        cut = text.rfind("\n    }")
        try:
            run = json.loads(text[:cut] + "\n    }\n  ]\n}\n") if cut > 0 else None
        except ValueError:
            run = None
        notes.append(f"{os.path.basename(path)}: truncated" + ("" if run else ", nothing kept"))
    if not run:
        continue
    context = context or run.get("context")
    rows += run.get("benchmarks", [])
names = [r.get("run_name", r.get("name", "")) for r in rows]
decode = sum(n.startswith("gpu_decode/") for n in names)
select = sum(n.startswith("gpu_select/") for n in names)
l8 = sum("/L8/" in n for n in names)
errors = sum(bool(r.get("error_occurred")) for r in rows)
notes.append(f"kvevict_bench_cuda: {decode} decode rows ({l8} of L8), {select} selection rows, {errors} with an error")
if rows and not l8:
    notes.append("kvevict_bench_cuda has no L8 (64 x 8 x 16K) decode row")
if rows:
    with open(merged_path, "w") as f:
        json.dump({"context": context, "benchmarks": rows}, f, indent=1)
with open(notes_path, "a") as f:
    f.write("".join(n + "\n" for n in notes))
print("\n".join(notes))
sys.exit(0 if rows else 77)
EOF
  local rc=$? files=("$out/bench-cuda.json")
  case $rc in 0) ;; 77) return 77 ;; *) return 1 ;; esac
  [ -f "$out/bench-torch.json" ] && files+=("$out/bench-torch.json")
  "$PYTHON" "$PACK/bench_report.py" "${files[@]}" >"$out/bench-report.md" || return 1
  echo "bench-report.md: $(wc -l <"$out/bench-report.md") lines"
}

# The table; sets passed, failed, timed_out, skipped and not_run.
summary() {
  local stage name limit result secs rc
  passed=0 failed=0 timed_out=0 skipped=0 not_run=0 unselected=0
  echo "kvevict GPU check: $(cat "$WORK/device" 2>/dev/null || echo 'no GPU'); $(date -u +%Y-%m-%dT%H:%MZ);" \
    "pack $(sed -n 's/^commit: //p' "$PACK/MANIFEST" 2>/dev/null)"
  printf '%-11s %-24s %-8s %8s %6s\n' stage phase result seconds limit
  while IFS=$'\t' read -r stage name limit; do
    if [ -f "$RESULTS/$name" ]; then read -r result secs rc <"$RESULTS/$name"; else result="not-run" secs=- rc=-; fi
    printf '%-11s %-24s %-8s %8s %6s\n' "$stage" "$name" "$result" "$secs" "$limit"
    case $result in
      pass) passed=$((passed + 1)) ;; fail) failed=$((failed + 1)) ;; timeout) timed_out=$((timed_out + 1)) ;;
      skip) skipped=$((skipped + 1)) ;; unselected) unselected=$((unselected + 1)) ;;
      *) not_run=$((not_run + 1)) ;;
    esac
  done <"$PLAN"
  [ -s "$WORK/notes" ] && sed 's/^/note: /' "$WORK/notes"
  echo "wall $(((${EPOCHREALTIME//[.,]/} - RUN_START) / 1000000)) s (bound $(awk -F'\t' '{s += $2} END {print s}' "$STAGE_BOUNDS") s);" \
    "$passed passed, $failed failed, $timed_out timed out, $skipped skipped, $not_run not run" \
    "${ONLY:+($unselected not selected by --only $ONLY)}"
}

usage() { sed -n '2,/^set -uo/p' "$SELF" | sed '$d; s/^# \{0,1\}//'; }

case "${1:-}" in
  --plan | --filters | --preflight | --report | --python-tests) ;;
  -h | --help) usage; exit 0 ;;
  "" | -*) usage >&2; exit 2 ;;
esac
LDP="LD_LIBRARY_PATH=$LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# Where a run writes; --plan only reads the commands, never runs them.
OUT=/nowhere LOGS=/nowhere/logs TORCH_ENV=() ONLY=

case "$1" in
  --plan)
    if [ "${2:-}" = --perf ]; then
      PERF=1
      BUDGET=180
    fi
    tmp=$(mktemp -d)
    WORK=$tmp
    make_plan "$tmp"
    print_plan
    rc=$?
    rm -rf "$tmp"
    exit "$rc"
    ;;
  --filters)
    for t in "${TESTS[@]}"; do printf '%s\t%s\n' "$t" "${CHOSEN[$t]}"; done
    exit 0
    ;;
  --python-tests)
    python_tests
    exit $?
    ;;
  --preflight | --report)
    # Run by phases of the main run, which exports WORK.
    WORK=${WORK:?--preflight and --report are phases of a run}
    if [ "$1" = --preflight ]; then preflight; else report "$2"; fi
    exit $?
    ;;
esac

ONLY=
if [ "${2:-}" = --perf ]; then
  PERF=1
  BUDGET=180
elif [ "${2:-}" = --only ]; then
  ONLY=${3:?--only takes a regular expression of phase names}
elif [ $# -gt 1 ]; then
  usage >&2
  exit 2
fi
OUT=$(mkdir -p "$1" && cd "$1" && pwd) || exit 2
LOGS=$OUT/logs
WORK=$(mktemp -d)
export WORK
RESULTS=$WORK/results
rm -rf "$LOGS"
mkdir -p "$LOGS" "$RESULTS"
rm -f "$OUT"/summary.txt "$OUT"/failures.txt "$OUT"/logs.tar.gz "$OUT"/bench-*.json "$OUT"/bench-report.md
trap 'rm -rf "$WORK"' EXIT
# torch.compile's caches, shared by the warm-up and the timed run.
TORCH_ENV=(PYTHONUNBUFFERED=1 TORCHINDUCTOR_FX_GRAPH_CACHE=1 "TORCHINDUCTOR_CACHE_DIR=$WORK/inductor"
  "TRITON_CACHE_DIR=$WORK/triton")
make_plan "$WORK"
print_plan >"$LOGS/plan.txt" || { cat "$LOGS/plan.txt"; echo "run.sh: the limits exceed ${BUDGET} s" >&2; exit 2; }
RUN_START=${EPOCHREALTIME//[.,]/}
MODE=run stages

: >"$OUT/failures.txt"
while IFS=$'\t' read -r _ name _; do
  [ -f "$RESULTS/$name" ] || continue
  read -r result _ <"$RESULTS/$name"
  case $result in fail | timeout) ;; *) continue ;; esac
  { echo "==== $name: $result (logs/$name.log, last 25 lines)"; tail -n 25 "$LOGS/$name.log"; echo; } >>"$OUT/failures.txt"
done <"$PLAN"
summary >"$OUT/summary.txt"
if [ "${KEEP_LOGS:-0}" = 0 ]; then
  tar -czf "$OUT/logs.tar.gz" -C "$OUT" logs && rm -rf "$LOGS"
fi
cat "$OUT/failures.txt" "$OUT/summary.txt"
[ $((failed + timed_out)) -gt 0 ] && exit 1
[ $((skipped + not_run)) -gt 0 ] && exit 77
exit 0
