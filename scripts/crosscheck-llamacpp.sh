#!/usr/bin/env bash
# Cross-checks the tinyllm engine against llama.cpp (docs/fidelity.md): builds
# llama.cpp from the PyPI source package llama-cpp-python into a virtual
# environment in the cache (slow the first time: it compiles llama.cpp), then
# compares token ids on the whole text and next-token logits over 1024
# positions with the full cache (see scripts/fidelity/llamacpp_crosscheck.py).
# Fails unless ids are identical and, in float arithmetic, top-1 agreement
# >= 98% and perplexity within 2%.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh fidelity
cache=$(bash scripts/fidelity/fetch.sh)
build=${BUILD_DIR:-build-fidelity}
positions=${POSITIONS:-1024}
offset=${OFFSET:-0}
venv="$cache/venv"
if ! "$venv/bin/python" -c "import llama_cpp" 2>/dev/null; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet numpy typing-extensions diskcache jinja2 gguf
  CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAMA_CURL=OFF" CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
    "$venv/bin/pip" install --no-deps --no-binary :all: llama-cpp-python==0.3.36
fi
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DKVEVICT_NATIVE_ARCH=ON -DKVEVICT_BUILD_TESTS=OFF \
  -DKVEVICT_BUILD_BENCHMARKS=OFF >/dev/null
cmake --build "$build" --target kvevict_fidelity -j"$(nproc)"
model="$cache/SmolLM2-135M-Instruct.Q4_1.gguf"
text="$cache/botchan.txt"
"$build/examples/kvevict_fidelity" tokenize --model "$model" --text "$text" --out "$build/ids.txt"
f32="$cache/SmolLM2-135M-Instruct.F32.gguf"
[ -f "$f32" ] || "$venv/bin/python" scripts/fidelity/dequantize_gguf.py "$model" "$f32"
for numerics in float llama_cpp; do
  "$build/examples/kvevict_fidelity" score --model "$model" --text "$text" --offset "$offset" \
    --positions "$positions" --numerics $numerics --out "$build/logits-$numerics.f32"
done
"$venv/bin/python" scripts/fidelity/llamacpp_crosscheck.py --model "$model" --model-f32 "$f32" --text "$text" \
  --ours-ids "$build/ids.txt" --ours-float "$build/logits-float.f32" --ours-llama-cpp "$build/logits-llama_cpp.f32" \
  --offset "$offset" --positions "$positions" --json "$build/crosscheck.json"
