# Sourced by run-fidelity.sh and crosscheck-llamacpp.sh: installs what the
# build needs, fetches the model and text, and builds kvevict_fidelity for
# this CPU. Sets: cache, build, model, text, fidelity and needle (the programs).
bash scripts/install-deps.sh fidelity
cache=$(bash scripts/fidelity/fetch.sh)
build=${BUILD_DIR:-build-fidelity}
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DKVEVICT_NATIVE_ARCH=ON -DKVEVICT_BUILD_TESTS=OFF \
  -DKVEVICT_BUILD_BENCHMARKS=OFF >/dev/null
cmake --build "$build" --target kvevict_fidelity kvevict_needle -j"$(nproc)"
model="$cache/SmolLM2-135M-Instruct.Q4_1.gguf"
text="$cache/botchan.txt"
fidelity="$build/examples/kvevict_fidelity"
needle="$build/examples/tinyllm/kvevict_needle"
