# Sourced by scripts/run-llamacpp.sh: fetches llama.cpp as the PyPI source
# package llama-cpp-python 0.3.36 ships it (checked by hash), applies
# integrations/llama.cpp/llama-head-cells.patch to a copy in the build
# folder, and builds llama_kvevict (the llama library, ggml's CPU backend
# and the program; a few minutes on 2 cores). Also fetches the model and
# text (scripts/fidelity/fetch.sh). Sets: cache, lbuild, llama_kvevict,
# model, text.
bash scripts/install-deps.sh llamacpp
python=${PYTHON:-python3}
cache=$(PYTHON=$python bash scripts/fidelity/fetch.sh)
lbuild=${LLAMACPP_BUILD_DIR:-build-llamacpp}
sdist=llama_cpp_python-0.3.36.tar.gz
sdist_sha=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
if ! { [ -f "$cache/$sdist" ] && echo "$sdist_sha  $cache/$sdist" | sha256sum --check --status; }; then
  "$python" -m pip download --quiet --no-deps --no-binary :all: --dest "$cache" llama-cpp-python==0.3.36 >&2
  echo "$sdist_sha  $cache/$sdist" | sha256sum --check --status || { echo "$sdist has an unexpected sha256" >&2; exit 1; }
fi
patch_file=integrations/llama.cpp/llama-head-cells.patch
src="$lbuild/llama.cpp"
stamp="$lbuild/llama.cpp.patched"
# the source is unpacked and patched again whenever the patch changes
if [ ! -f "$stamp" ] || ! cmp -s "$stamp" "$patch_file"; then
  rm -rf "$src" "$lbuild/unpack"
  mkdir -p "$lbuild/unpack"
  tar -xzf "$cache/$sdist" -C "$lbuild/unpack" llama_cpp_python-0.3.36/vendor/llama.cpp
  mv "$lbuild/unpack/llama_cpp_python-0.3.36/vendor/llama.cpp" "$src"
  rm -rf "$lbuild/unpack"
  rm -f "$src/.git"  # the sdist's submodule link, which points nowhere here
  patch -d "$src" -p1 --quiet --forward < "$patch_file"
  cp "$patch_file" "$stamp"
fi
# llama.cpp's configure step asks git for a version, which this copy lacks:
# its chatter goes to the log, shown only on failure
if ! { cmake -S integrations/llama.cpp -B "$lbuild/out" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CPP_SOURCE="$(cd "$src" && pwd)" &&
       cmake --build "$lbuild/out" --target llama_kvevict -j"$(nproc)"; } >"$lbuild/build.log" 2>&1; then
  tail -n 40 "$lbuild/build.log" >&2
  echo "building the patched llama.cpp failed (log: $lbuild/build.log)" >&2
  exit 1
fi
llama_kvevict="$lbuild/out/llama_kvevict"
model="$cache/SmolLM2-135M-Instruct.Q4_1.gguf"
text="$cache/botchan.txt"
