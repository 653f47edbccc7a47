#!/usr/bin/env bash
# Cross-checks the tinyllm engine against llama.cpp (docs/fidelity.md): builds
# llama.cpp from the PyPI source package llama-cpp-python into a virtual
# environment in the cache (slow the first time: it compiles llama.cpp), then
# compares token ids on the whole text and next-token logits over 1024
# positions with the full cache (see scripts/fidelity/llamacpp_crosscheck.py).
# Fails unless the ids are identical, in float arithmetic top-1 agreement is
# >= 98% and perplexity within 2%, and as shipped perplexity is within 2%.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/fidelity/prepare.sh
positions=${POSITIONS:-1024}
offset=${OFFSET:-0}
venv="$cache/venv"
if ! "$venv/bin/python" -c "import llama_cpp, gguf" 2>/dev/null; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet numpy==2.4.6 gguf==0.19.0 typing-extensions diskcache jinja2
  CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAMA_CURL=OFF" CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
    "$venv/bin/pip" install --no-deps --no-binary llama-cpp-python llama-cpp-python==0.3.36
fi
f32="$cache/SmolLM2-135M-Instruct.F32.gguf"
if [ ! -f "$f32" ]; then  # written aside, so an interrupted run leaves no truncated file
  "$venv/bin/python" scripts/fidelity/dequantize_gguf.py "$model" "$f32.tmp"
  mv "$f32.tmp" "$f32"
fi
"$fidelity" tokenize --model "$model" --text "$text" --out "$build/ids.txt"
for numerics in float llama_cpp; do
  "$fidelity" score --model "$model" --text "$text" --offset "$offset" --positions "$positions" \
    --numerics $numerics --out "$build/logits-$numerics.f32"
done
"$venv/bin/python" scripts/fidelity/llamacpp_crosscheck.py --model "$model" --model-f32 "$f32" --text "$text" \
  --ours-ids "$build/ids.txt" --ours-float "$build/logits-float.f32" --ours-llama-cpp "$build/logits-llama_cpp.f32" \
  --offset "$offset" --positions "$positions" --json "$build/crosscheck.json"
