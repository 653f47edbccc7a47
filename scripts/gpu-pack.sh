#!/usr/bin/env bash
# Builds the pack of the GPU check (docs/gpu.md): one folder, default
# .gpu-pack/ (git-ignored), that holds everything the check runs on a
# machine with an NVIDIA GPU, its driver, compute-sanitizer and PyTorch but
# no build tools and no Google Benchmark:
#
#   bin/   the gpu tests (test_cuda_*), kvevict_demo_cuda, kvevict_bench_cuda
#   lib/   the shared libraries they need beyond the C and C++ runtimes
#          (Google Benchmark's libbenchmark.so.1debian, libcudart.so.13)
#   run.sh (scripts/gpu-run.sh), bench_torch.py, bench_report.py, MANIFEST
#   python/  when PACK_PYTHON names a Python 3.12 here (the GPU machine's
#          minor version): the package (python/kvevict with its extension,
#          built for that Python with the CUDA backend) and tests/python,
#          for run.sh's python-cuda phase; without it that phase is skipped
#
#   scripts/gpu-pack.sh                 # Release build for sm_90 in build-gpu-pack/, then the pack
#   scripts/gpu-pack.sh --from build    # pack an existing Release build's binaries, building nothing
#   scripts/gpu-pack.sh --perf          # the performance loop's pack only: test_cuda_decode, test_cuda_select
#                                       # and kvevict_bench_cuda (a few minutes here), for run.sh OUTDIR --perf
#   scripts/gpu-pack.sh --check         # then check it: size, time bound, filters, a run without a GPU
#   --out DIR                           # the pack's folder (default .gpu-pack)
#
# The default build compiles SASS for the one architecture (CUDA_ARCH,
# default 90: H100, H200) with -lineinfo, so compute-sanitizer reports name
# source lines, and --compress-mode=size: about 12 MB in all, where the same
# binaries with PTX and line info are about 52 MB. --from takes whatever the
# build directory holds (CI's build/: sm_80 and sm_90, PTX included, no line
# info: about 37 MB).
#
# --check (CI runs it through ctest, test gpu:pack): the folder stays under
# 64 MiB; `run.sh --plan` keeps its time limits within 7 minutes; every
# sanitizer filter of run.sh matches a test case of tests/cuda/; and, when
# this machine has no GPU, `run.sh` runs end to end with every phase skipped
# (the binaries exit 77 without a device), none failed.
set -euo pipefail
cd "$(dirname "$0")/.."

from="" out=.gpu-pack check=0 perf=0
while [ $# -gt 0 ]; do
  case $1 in
    --from) from=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --check) check=1; shift ;;
    --perf) perf=1; shift ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu-pack: unknown argument $1 (--help)" >&2; exit 2 ;;
  esac
done

arch=${CUDA_ARCH:-90}
# The Python package's extension is built for the GPU machine's Python
# (3.12: Ubuntu 24.04's) with this one's nanobind (NANOBIND_PYTHON: the
# test environment of scripts/run-python-tests.sh, or any with nanobind).
pack_python=${PACK_PYTHON:-}
nanobind_python=${NANOBIND_PYTHON:-build-python/venv/bin/python}
limit_bytes=$((64 << 20))
# The GPU machine runs Ubuntu 24.04: glibc 2.39; libstdc++ of GCC 13 at least.
target_glibc=${TARGET_GLIBC:-2.39}
target_glibcxx=${TARGET_GLIBCXX:-3.4.32}
targets=(test_cuda_decode test_cuda_select test_cuda_prefill test_cuda_exact_greedy test_cuda_evict_to
  kvevict_demo_cuda kvevict_bench_cuda)
[ "$perf" = 1 ] && targets=(test_cuda_decode test_cuda_select kvevict_bench_cuda)

if [ -z "$from" ]; then
  build=${BUILD_DIR:-build-gpu-pack}
  bash scripts/install-deps.sh tests
  start=$SECONDS
  cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DKVEVICT_ENABLE_CUDA=ON -DKVEVICT_BUILD_TESTS=ON \
    -DKVEVICT_BUILD_EXAMPLES=ON -DKVEVICT_BUILD_BENCHMARKS=ON -DKVEVICT_INSTALL=OFF \
    -DKVEVICT_CUDA_ARCHITECTURES="$arch-real" -DCMAKE_CUDA_ARCHITECTURES="$arch-real" \
    -DKVEVICT_BENCH_CUDA_ARCHITECTURES="$arch-real" -DCMAKE_CUDA_FLAGS="-lineinfo --compress-mode=size" >/dev/null
  cmake --build "$build" -j"${JOBS:-$(nproc)}" --target "${targets[@]}"
  echo "gpu-pack: built in $((SECONDS - start)) s"
else
  build=$from
fi

cache=$build/CMakeCache.txt
[ -f "$cache" ] || { echo "gpu-pack: $build is not a CMake build directory" >&2; exit 1; }
cache_value() { sed -n "s/^$1:[A-Z]*=//p" "$cache"; }
if [ "$(cache_value CMAKE_BUILD_TYPE)" != Release ]; then
  echo "gpu-pack: $build is a $(cache_value CMAKE_BUILD_TYPE) build; the check times Release code" >&2
  exit 1
fi
archs="$(cache_value KVEVICT_CUDA_ARCHITECTURES);$(cache_value KVEVICT_BENCH_CUDA_ARCHITECTURES)"
if ! grep -Eq "(^|;)$arch(-real)?(;|$)" <<<"$archs"; then
  echo "gpu-pack: $build has no sm_$arch code (architectures $archs)" >&2
  exit 1
fi

binaries=()
for t in "${targets[@]}"; do
  f=$(find "$build/tests" "$build/examples" "$build/benchmarks" -maxdepth 1 -type f -name "$t" 2>/dev/null | head -1)
  [ -n "$f" ] || { echo "gpu-pack: $build has no $t (Google Benchmark and nvcc found?)" >&2; exit 1; }
  binaries+=("$f")
done

rm -rf "$out"
mkdir -p "$out/bin" "$out/lib"
cp "${binaries[@]}" "$out/bin/"
# Carried: every library outside the C and C++ runtimes that any machine
# with a C++ program has (Ubuntu 24.04's are newer than this build needs;
# checked below).
system='^(linux-vdso|ld-linux-x86-64|libc|libm|libstdc\+\+|libgcc_s|libdl|libpthread|librt)\.so'
for f in "${binaries[@]}"; do
  if ldd "$f" | grep -q 'not found'; then
    echo "gpu-pack: $f: a library is missing here:" >&2
    ldd "$f" | grep 'not found' >&2
    exit 1
  fi
  ldd "$f" | awk '$2 == "=>" && $3 ~ /^\// {print $1, $3}' | while read -r name path; do
    grep -Eq "$system" <<<"$name" || cp -L "$path" "$out/lib/$name"
  done
done
if [ -n "$pack_python" ]; then
  pybuild=${build%/}-python
  nanobind_dir=$("$nanobind_python" -m nanobind --cmake_dir) || {
    echo "gpu-pack: $nanobind_python has no nanobind (NANOBIND_PYTHON)" >&2
    exit 1
  }
  start=$SECONDS
  cmake -S . -B "$pybuild" -DCMAKE_BUILD_TYPE=Release -DKVEVICT_BUILD_PYTHON=ON -DKVEVICT_ENABLE_CUDA=ON \
    -DKVEVICT_BUILD_TESTS=OFF -DKVEVICT_BUILD_EXAMPLES=OFF -DKVEVICT_BUILD_BENCHMARKS=OFF -DKVEVICT_INSTALL=OFF \
    -DPython_EXECUTABLE="$(command -v "$pack_python")" -Dnanobind_ROOT="$nanobind_dir" \
    -DKVEVICT_PYTHON_CUDA_ARCHITECTURES="$arch-real" -DCMAKE_CUDA_FLAGS="-lineinfo --compress-mode=size" >/dev/null
  cmake --build "$pybuild" -j"${JOBS:-$(nproc)}" --target _ext
  echo "gpu-pack: Python extension for $("$pack_python" --version 2>&1) built in $((SECONDS - start)) s"
  mkdir -p "$out/python/kvevict" "$out/python/tests"
  cp python/kvevict/*.py python/kvevict/*.pyi python/kvevict/py.typed "$out/python/kvevict/"
  cp "$pybuild"/python/_ext*.so "$out/python/kvevict/"
  cp tests/python/*.py "$out/python/tests/"
fi
cp scripts/gpu-run.sh "$out/run.sh"
cp scripts/bench_torch.py scripts/bench_report.py "$out/"
chmod +x "$out/run.sh"

# The newest glibc and libstdc++ symbol versions the pack needs.
# (Only the files packed: without PACK_PYTHON there is no extension, and an
# unmatched glob would fail objdump and, under pipefail, the pack.)
packed=("$out"/bin/* "$out"/lib/*)
[ -z "$pack_python" ] || packed+=("$out"/python/kvevict/*.so)
newest() { objdump -T "${packed[@]}" | grep -oE "\\b$1_[0-9]+(\\.[0-9]+)*" | sort -uV | tail -1; }
version_ok() { [ -z "$1" ] || [ "$(printf '%s\n%s\n' "${1#*_}" "$2" | sort -V | tail -1)" = "$2" ]; }
glibc=$(newest GLIBC)
glibcxx=$(newest GLIBCXX)
if ! version_ok "$glibc" "$target_glibc" || ! version_ok "$glibcxx" "$target_glibcxx"; then
  echo "gpu-pack: the pack needs $glibc and $glibcxx; the GPU machine has GLIBC_$target_glibc, GLIBCXX_$target_glibcxx" >&2
  exit 1
fi

commit=unknown
if head=$(git rev-parse --short=12 HEAD 2>/dev/null); then
  commit=$head
  git diff --quiet HEAD -- include tests benchmarks examples scripts python || commit="$commit+uncommitted"
fi
{
  echo "commit: $commit"
  [ "$perf" = 1 ] && echo "kind: the performance loop's pack (run.sh OUTDIR --perf)"
  echo "packed: $(date -u +%Y-%m-%dT%H:%MZ) from $(cd "$build" && pwd)"
  echo "build: $(cache_value CMAKE_BUILD_TYPE); architectures $(cache_value KVEVICT_CUDA_ARCHITECTURES)" \
    "(benchmark $(cache_value KVEVICT_BENCH_CUDA_ARCHITECTURES)); CUDA flags: $(cache_value CMAKE_CUDA_FLAGS)"
  echo "nvcc: $("$(cache_value CMAKE_CUDA_COMPILER)" --version 2>/dev/null | sed -n 's/.*release \([0-9.]*\),.*/\1/p')"
  echo "needs: $glibc, $glibcxx"
  folders=(bin lib)
  if [ -d "$out/python" ]; then
    echo "python: the package and tests/python; extension for $("$pack_python" --version 2>&1)"
    folders+=(python)
  fi
  (cd "$out" && find "${folders[@]}" -name '*.py' -prune -o -type f -printf '%s %p\n' | sort -k2)
} >"$out/MANIFEST"

bytes=$(du -sb "$out" | cut -f1)
echo "gpu-pack: $out: $((bytes / 1024)) KiB ($(ls "$out/bin" | wc -l) binaries, libraries: $(ls "$out/lib" | tr '\n' ' '))"
if [ "$bytes" -ge "$limit_bytes" ]; then
  echo "gpu-pack: $out is $bytes bytes, over the 64 MiB that travel to the GPU machine" >&2
  exit 1
fi
[ "$check" = 1 ] || exit 0

# ---- --check ----
echo "gpu-pack: the time limits of run.sh"
if [ "$perf" = 1 ]; then "$out/run.sh" --plan --perf | tail -7; else "$out/run.sh" --plan | tail -8; fi

# doctest wildcards (* and ?, case-insensitive) against the TEST_CASE names.
bad=0
while IFS=$'\t' read -r t patterns; do
  names=$(grep -ho 'TEST_CASE("[^"]*")' "tests/cuda/$t.cu" | sed 's/^TEST_CASE("//; s/")$//')
  IFS=, read -ra list <<<"$patterns"
  for p in "${list[@]}"; do
    re=$(sed 's/[][\.^$+(){}|]/\\&/g; s/\*/.*/g; s/?/./g' <<<"$p")
    if ! grep -Eiq "^$re\$" <<<"$names"; then
      echo "gpu-pack: run.sh's filter '$p' matches no test case of tests/cuda/$t.cu" >&2
      bad=1
    fi
  done
done < <("$out/run.sh" --filters)
[ "$bad" = 0 ] || exit 1
echo "gpu-pack: every sanitizer filter matches a test case"

if nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
  echo "gpu-pack: this machine has a GPU: no run without one (run $out/run.sh OUTDIR for the check itself)"
  exit 0
fi
dry=$(mktemp -d)
trap 'rm -rf "$dry"' EXIT
set +e
perf_args=()
[ "$perf" = 1 ] && perf_args=(--perf)
"$out/run.sh" "$dry/out" "${perf_args[@]}" >"$dry/log" 2>&1
rc=$?
set -e
tail -n 45 "$dry/log"
if [ "$rc" != 77 ] || ! grep -Eq '0 failed, 0 timed out, [0-9]+ skipped, 0 not run' "$dry/out/summary.txt" ||
  grep -Eq ' (pass|fail|timeout|not-run) ' <(sed -n '/^stage /,/^wall /p' "$dry/out/summary.txt"); then
  echo "gpu-pack: run.sh without a GPU: exit $rc; every phase should be skipped" >&2
  exit 1
fi
echo "gpu-pack: run.sh without a GPU: every phase skipped, exit 77, $(ls "$dry/out" | tr '\n' ' ')"
