#!/usr/bin/env python3
"""Summarises several runs of kvevict_bench_host (Google Benchmark JSON files,
one per run, each with --benchmark_repetitions and aggregates) into what
docs/benchmarks.md quotes: per benchmark the median over runs of each run's
median items/s with the spread across runs, and per scenario the ratio of each
kvevict row to the reference computed within each run (same binary, same
moment), so machine load cancels as far as it can.

  python3 scripts/bench_report.py build-bench/bench-host-run*.json [--json docs/data/host_decode.json]

Prints a Markdown table; --json also writes the summary docs/make_plots.py reads.
"""
import argparse
import json
import statistics
import sys

KVEVICT_ROWS = {"BM_kvevict_h2o_step": "per-sequence h2o", "BM_kvevict_batched_h2o_step": "batched h2o"}
REFERENCE = "BM_reference_realdrop_step"
SHAPES = {"S5": "1 x 8 x 1024", "S0": "24 x 32 x 820"}


def medians_of(path):
    """{(benchmark, scenario): median items/s} of one run."""
    with open(path) as f:
        run = json.load(f)
    out = {}
    for b in run["benchmarks"]:
        if b.get("aggregate_name") != "median":
            continue
        name, scenario = b["run_name"].split("/")
        out[(name, scenario)] = b["items_per_second"]
    return run["context"], out


def spread(values):
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": len(values)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--json")
    ap.add_argument("--date", default="")
    args = ap.parse_args()
    runs = [medians_of(p) for p in args.runs]
    context = runs[0][0]
    scenarios = [s for s in SHAPES if any((REFERENCE, s) in r for _, r in runs)]
    summary = {"date": args.date or context.get("date", "")[:10], "runs": len(runs),
               "host": f"{context.get('num_cpus')} CPUs at {context.get('mhz_per_cpu')} MHz",
               "scenarios": []}
    print(f"{len(runs)} runs; items/s = (sequence, head) steps per second; median [min - max] over runs\n")
    print("| scenario | B x heads x slots | row | items/s | ratio to the reference |")
    print("|---|---|---|---|---|")
    for s in scenarios:
        ref = spread([r[(REFERENCE, s)] for _, r in runs])
        entry = {"label": s, "shape": SHAPES[s], "reference": ref["median"], "reference_spread": ref}
        print(f"| {s} | {SHAPES[s]} | reference real drop | {ref['median'] / 1e3:.1f} k "
              f"[{ref['min'] / 1e3:.1f} - {ref['max'] / 1e3:.1f}] | 1 |")
        for name, label in KVEVICT_ROWS.items():
            if not all((name, s) in r for _, r in runs):
                continue
            speed = spread([r[(name, s)] for _, r in runs])
            ratio = spread([r[(name, s)] / r[(REFERENCE, s)] for _, r in runs])
            entry[name] = {"items_per_second": speed, "ratio": ratio}
            print(f"| {s} | {SHAPES[s]} | kvevict {label} | {speed['median'] / 1e3:.1f} k "
                  f"[{speed['min'] / 1e3:.1f} - {speed['max'] / 1e3:.1f}] | {ratio['median']:.1f}x "
                  f"[{ratio['min']:.1f} - {ratio['max']:.1f}] |")
        summary["scenarios"].append(entry)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
