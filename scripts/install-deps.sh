#!/usr/bin/env bash
# Installs the Debian packages the given build needs, skipping those present.
#   scripts/install-deps.sh demo   -> compiler and CMake
#   scripts/install-deps.sh tests  -> plus doctest and Google Benchmark
#   scripts/install-deps.sh fidelity -> plus pip, venv and unzip (model download, llama.cpp check)
#   scripts/install-deps.sh llamacpp -> the fidelity set plus patch (kvevict inside llama.cpp)
#   scripts/install-deps.sh fuzz   -> plus clang and its libFuzzer runtime (scripts/run-fuzz.sh)
#   scripts/install-deps.sh bench  -> the tests' set plus matplotlib (the report's plots)
#   scripts/install-deps.sh python -> compiler, CMake, Python with venv and headers (scripts/run-python-tests.sh)
set -euo pipefail
packages=(g++ cmake make)
case "${1:-tests}" in
  tests) packages+=(doctest-dev libbenchmark-dev) ;;
  bench) packages+=(doctest-dev libbenchmark-dev python3 python3-matplotlib) ;;
  fidelity) packages+=(python3-pip python3-venv unzip) ;;
  llamacpp) packages+=(python3-pip python3-venv unzip patch) ;;
  fuzz) packages+=(clang libclang-rt-dev) ;;
  python) packages+=(python3 python3-venv python3-dev) ;;
esac
missing=()
for p in "${packages[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
[ ${#missing[@]} -eq 0 ] && exit 0
sudo=""
[ "$(id -u)" -ne 0 ] && sudo=sudo
echo "installing: ${missing[*]}"
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}"
