#!/usr/bin/env python3
"""Compares tinyllm with llama.cpp (through llama-cpp-python) on the same text.

Inputs are what `kvevict_fidelity tokenize` and `kvevict_fidelity score`
wrote: our token ids of the whole text, and our float32 logits for
`positions` tokens from `offset` with the full cache, once in plain float
arithmetic and once rounding as llama.cpp's CPU backend does. Three
comparisons, each over the same positions:

  float      our float engine vs llama.cpp on an F32 copy of the weights
             (dequantize_gguf.py) with an F32 KV cache: both plain float,
             so this is the check of the engine (bounds: top-1 >= 98%,
             perplexity within 2%)
  as shipped our llama.cpp-like rounding vs llama.cpp's defaults on the
             Q4_1 file (f16 KV cache, 8-bit activations)
  noise      llama.cpp against itself: f16 vs f32 KV cache on the Q4_1 file,
             the spread that rounding alone causes in this model
"""
import argparse
import json
import os
import sys

import numpy as np
import llama_cpp

F32 = 0  # GGML_TYPE_F32


def nll(logits, targets):
    m = logits.max(axis=1, keepdims=True)
    lse = m[:, 0] + np.log(np.exp(logits - m).sum(axis=1))
    return lse - logits[np.arange(len(targets)), targets]


def compare(a, b, tokens):
    targets = np.array(tokens[1:])
    pa, pb = np.exp(nll(a[:-1], targets).mean()), np.exp(nll(b[:-1], targets).mean())
    return {
        "top1_agreement": float((a.argmax(axis=1) == b.argmax(axis=1)).mean()),
        "ppl_a": float(pa),
        "ppl_b": float(pb),
        "ppl_relative_diff": float(pa / pb - 1.0),
        "max_abs_logit_diff": float(np.abs(a - b).max()),
        "mean_abs_logit_diff": float(np.abs(a - b).mean()),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, help="the Q4_1 GGUF")
    ap.add_argument("--model-f32", required=True, help="its F32 copy")
    ap.add_argument("--text", required=True)
    ap.add_argument("--ours-ids", required=True)
    ap.add_argument("--ours-float", required=True, help="our logits, --numerics float")
    ap.add_argument("--ours-llama-cpp", required=True, help="our logits, --numerics llama_cpp")
    ap.add_argument("--offset", type=int, default=0)
    ap.add_argument("--positions", type=int, default=1024)
    ap.add_argument("--json")
    a = ap.parse_args()

    def llama(path, **kw):
        return llama_cpp.Llama(model_path=path, n_ctx=a.positions, n_batch=a.positions, n_ubatch=a.positions,
                               logits_all=True, n_threads=os.cpu_count(), verbose=False, **kw)

    def logits(llm, tokens):
        llm.reset()
        llm.eval(tokens)
        return np.array(llm.scores[:len(tokens)], dtype=np.float64)

    text = open(a.text, "rb").read()
    q4 = llama(a.model)
    ref_ids = q4.tokenize(text, add_bos=False, special=False)
    our_ids = [int(x) for x in open(a.ours_ids).read().split()]
    tokens = ref_ids[a.offset:a.offset + a.positions]
    shipped = logits(q4, tokens)
    del q4
    noise = logits(llama(a.model, type_k=F32, type_v=F32), tokens)
    exact = logits(llama(a.model_f32, type_k=F32, type_v=F32), tokens)

    def ours(path):
        return np.fromfile(path, dtype=np.float32).astype(np.float64).reshape(-1, shipped.shape[1])[:a.positions]

    r = {
        "llama_cpp_python": llama_cpp.__version__,
        "text_tokens": len(ref_ids),
        "token_ids_identical": ref_ids == our_ids,
        "positions": a.positions,
        "offset": a.offset,
        "float": compare(ours(a.ours_float), exact, tokens),
        "as_shipped": compare(ours(a.ours_llama_cpp), shipped, tokens),
        "noise_llama_cpp_f16_vs_f32_kv": compare(shipped, noise, tokens),
    }
    print(json.dumps(r, indent=2))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f, indent=2)
    f = r["float"]
    ok = r["token_ids_identical"] and f["top1_agreement"] >= 0.98 and abs(f["ppl_relative_diff"]) <= 0.02 \
        and abs(r["as_shipped"]["ppl_relative_diff"]) <= 0.02
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
