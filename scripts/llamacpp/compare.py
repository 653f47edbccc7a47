"""Cross-check of kvevict inside llama.cpp against tinyllm (docs/llama-cpp.md):
the same teacher-forced windows through both engines, F32 weights and an F32
KV cache in llama.cpp, `--numerics float` in tinyllm.

    compare.py LLAMA.json TINYLLM.json [--expected EXPECTED.json | --record EXPECTED.json]
    compare.py --needle LLAMA.json TINYLLM.json


Checks that the full cache's perplexity agrees to 1e-3 (relative: the two
engines' logits agree to 7e-4, docs/fidelity.md) and every policy's overall
perplexity and perplexity after eviction to 1% (the issue's bound; a
decision that differs moves them by more). With --expected, also that the
llama.cpp figures are within 0.5% of a recorded run (another CPU's float
rounding; a changed decision moves them by more). Prints a Markdown table.

--needle compares `llama_kvevict needle` with `kvevict_needle`: the same
answer, right or wrong, in every trial of every policy.
"""
import json
import sys

FULL_REL, POLICY_REL, RECORD_REL = 1e-3, 1e-2, 5e-3
KEYS = ("ppl_evicted", "ppl_all")


def load(path):
    with open(path) as f:
        return {(r["policy"], r["percent"]): r for r in json.load(f)["results"]}


def rel(a, b):
    return abs(a / b - 1) if b else abs(a)


def needle(llama_path, tiny_path):
    with open(llama_path) as f:
        llama = json.load(f)["results"]
    with open(tiny_path) as f:
        tiny = {(r["setting"], r["policy"], r["percent"], r["length"]): r for r in json.load(f)["results"]}
    errors = []
    print("| setting | policy | budget | length | llama.cpp | tinyllm | trials answered alike |")
    print("|---|---|---|---|---|---|---|")
    for r in llama:
        t = tiny.get((r["setting"], r["policy"], r["percent"], r["length"]))
        if t is None:
            errors.append(f"{r['setting']} {r['policy']} {r['percent']}% at {r['length']}: not in {tiny_path}")
            continue
        alike = sum(a == b for a, b in zip(r["by_depth"], t["by_depth"]))
        print(f"| {r['setting']} | {r['policy']} | {r['percent']}% | {r['length']} | {r['correct']} / {r['trials']} | "
              f"{t['correct']} / {t['trials']} | {alike} / {r['trials']} |")
        if r["by_depth"] != t["by_depth"]:
            errors.append(f"{r['setting']} {r['policy']} {r['percent']}%: trials answered differently")
    for e in errors:
        print("llama.cpp needle cross-check:", e)
    print("llama.cpp needle cross-check:", "FAILED" if errors else f"{len(llama)} rows answer alike")
    return 1 if errors else 0


def main(argv):
    if argv[:1] == ["--needle"]:
        return needle(argv[1], argv[2])
    llama_path, tiny_path = argv[0], argv[1]
    mode, expected_path = (argv[2], argv[3]) if len(argv) == 4 else (None, None)
    llama, tiny = load(llama_path), load(tiny_path)
    errors = []
    print("| policy | budget | llama.cpp ppl after eviction | tinyllm | difference | llama.cpp ppl overall | tinyllm | difference |")
    print("|---|---|---|---|---|---|---|---|")
    for key, r in llama.items():
        if key not in tiny:
            errors.append(f"{key[0]} {key[1]}%: not in {tiny_path}")
            continue
        t = tiny[key]
        bound = FULL_REL if key[0] == "full" else POLICY_REL
        cells = []
        for k in KEYS:
            d = rel(r[k], t[k])
            cells += [f"{r[k]:.4f}", f"{t[k]:.4f}", f"{100 * d:.3f}%"]
            if d > bound:
                errors.append(f"{key[0]} {key[1]}%: {k} {r[k]:.4f} in llama.cpp, {t[k]:.4f} in tinyllm "
                              f"({100 * d:.2f}% > {100 * bound:g}%)")
        print(f"| {key[0]} | {key[1]}% ({r['budget']}) | " + " | ".join(cells) + " |")
    if mode == "--record":
        with open(expected_path, "w") as f:
            json.dump([{k: r[k] for k in ("policy", "percent") + KEYS} for r in llama.values()], f, indent=1)
            f.write("\n")
        print(f"recorded {expected_path}")
    elif mode == "--expected":
        with open(expected_path) as f:
            want = {(r["policy"], r["percent"]): r for r in json.load(f)}
        if set(want) != set(llama):
            errors.append(f"rows {sorted(llama)} differ from the recorded {sorted(want)}")
        for key, w in want.items():
            for k in KEYS:
                if key in llama and rel(llama[key][k], w[k]) > RECORD_REL:
                    errors.append(f"{key[0]} {key[1]}%: {k} {llama[key][k]:.4f}, recorded {w[k]:.4f}")
    elif mode is not None:
        errors.append(f"unknown option {mode}")
    for e in errors:
        print("llama.cpp cross-check:", e)
    print("llama.cpp cross-check:", "FAILED" if errors else f"{len(llama)} rows agree")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
