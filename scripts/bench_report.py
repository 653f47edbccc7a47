#!/usr/bin/env python3
"""Turns Google Benchmark JSON from the kvevict_bench_* binaries (several
runs of each, one file per run, with --benchmark_repetitions and
aggregates) into the tables and plots of docs/benchmarks.md.

  python3 scripts/bench_report.py build-bench/bench-*-run*.json            # print the tables
  python3 scripts/bench_report.py --write --date 2026-11-23 \\
      --machine "..." --command "..." build-bench/bench-*-run*.json        # update docs/

Benchmark names are family/method/input/scenario/keep/distribution/dtype
(benchmarks/bench_common.hpp); the "/manual_time" Google Benchmark appends
to the CUDA rows (timed by CUDA events) is dropped. GPU runs
(kvevict_bench_cuda, and scripts/bench_torch.py's JSON for the torch
baselines) go in the same way; without them the GPU target rows read "not
measured". Files of the same binary are the runs of a
family, in the order given. For every row: the median over runs of each
run's median items/s (and bytes/s), with the lowest and highest run; each
ratio to a baseline is computed within one run (same binary, same minute,
so machine load cancels as far as it can) and then summarised the same way.

--write replaces the part of docs/benchmarks.md between the markers
<!-- BEGIN bench_report --> and <!-- END bench_report -->, and writes
docs/data/host_bench.json and the PNG plots in docs/img (needs matplotlib).
"""
import argparse
import collections
import json
import os
import re
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
DOCS = os.path.join(HERE, "..", "docs")
BEGIN, END = "<!-- BEGIN bench_report -->", "<!-- END bench_report -->"

# Targets of the host (issue 9), as (row pattern, baseline of
# the same run, minimum ratio, wording).
TARGETS = [
    (r"^decode/h2o(_batched)?/probs/S1/evict1/powerlaw/f32$", "decode/fused_loop/probs/S1/evict1/powerlaw/f32", 0.70,
     ">= 70% of the fused loop"),
    (r"^decode/h2o(_batched)?/probs/S1/evict1/powerlaw/f32$", "decode/reference_realdrop/probs/S1/evict1/powerlaw/bf16",
     50.0, ">= 50x the reference real drop"),
    (r"^select/kvevict/bottom/N\d+/keep\d+/\w+/f32$", "select/nth_element/bottom/{scenario}/{keep}/{dist}/f32", 2.0,
     ">= 2x std::nth_element"),
]

# GPU targets (docs/benchmarks.md, "GPU"), checked when kvevict_bench_cuda (and,
# for the torch rows, scripts/bench_torch.py) JSON is given; otherwise each
# reads "not measured". "baselines": templates of the same run's baseline
# rows; with several, the fastest of them in each run. "max_seconds": a
# bound on the row's time per layer instead of a ratio.
GPU_TARGETS = [
    # Issue 37's targets, on the one-launch step (h2o_step: gpu::batched_step);
    # the two-launch h2o rows stay in the tables beside it.
    {"pattern": r"^gpu_decode/h2o_step/probs/(S1|S2|S4|L8)/evict1/powerlaw/f32$",
     "label": "gpu_decode/h2o_step/probs/{S1,S2,S4,L8}/evict1/powerlaw/f32",
     "baselines": ["gpu_decode/d2d_copy/probs/{scenario}/evict1/powerlaw/f32"], "field": "bytes", "minimum": 0.85,
     "wording": ">= 85% of D2D copy bandwidth, cold"},
    {"pattern": r"^gpu_decode/h2o_step/(head_scores|logits)/(S1|S2|S4)/evict1/powerlaw/f32$",
     "label": "gpu_decode/h2o_step/{head_scores,logits}/{S1,S2,S4}/evict1/powerlaw/f32",
     "baselines": ["gpu_decode/d2d_copy/probs/{scenario}/evict1/powerlaw/f32"], "field": "bytes", "minimum": 0.8,
     "wording": ">= 80% of D2D copy bandwidth, cold"},
    {"pattern": r"^gpu_decode/h2o_step/probs/(S\d|L8)/evict1/powerlaw/f32$",
     "label": "gpu_decode/h2o_step/probs/{S0-S5,L8}/evict1/powerlaw/f32",
     "baselines": ["gpu_decode/fused_kernel/probs/{scenario}/evict1/powerlaw/f32"], "minimum": 0.9,
     "wording": ">= 0.9x the fused_kernel baseline, cold"},
    {"pattern": r"^gpu_decode/fused_kernel/probs/(S1|S2|S4|L8)/evict1/powerlaw/f32$",
     "label": "gpu_decode/fused_kernel/probs/{S1,S2,S4,L8}/evict1/powerlaw/f32",
     "baselines": ["gpu_decode/d2d_copy/probs/{scenario}/evict1/powerlaw/f32"], "field": "bytes", "minimum": 0.9,
     "wording": "the baseline itself: >= 90% of D2D copy bandwidth"},
    {"pattern": r"^gpu_decode/h2o_step/probs/(S\d|L8)/evict1/powerlaw/f32$",
     "label": "gpu_decode/h2o_step/probs/{S0-S5,L8}/evict1/powerlaw/f32",
     "baselines": ["gpu_decode/torch_compile/probs/{scenario}/evict1/powerlaw/f32"], "minimum": 1.0,
     "wording": "faster than torch.compile + CUDA graphs, cold"},
    {"pattern": r"^gpu_decode/h2o_step/probs/(S0|S3|S5)/evict1/powerlaw/f32$",
     "label": "gpu_decode/h2o_step/probs/{S0,S3,S5}/evict1/powerlaw/f32",
     "baselines": ["gpu_decode/torch_compile/probs/{scenario}/evict1/powerlaw/f32"], "minimum": 2.0,
     "wording": ">= 2x torch.compile + CUDA graphs, cold"},
    {"pattern": r"^gpu_decode/h2o_step/probs/S5/evict1/powerlaw/f32$",
     "label": "gpu_decode/h2o_step/probs/S5/evict1/powerlaw/f32",
     "max_seconds": 3.0e-6, "wording": "<= 3 us per layer (graph replay, cold)"},
    {"pattern": r"^gpu_select/kvevict/(bottom|top)/(S1|S2|S3)/keep(20|50)/powerlaw/f32$",
     "label": "gpu_select/kvevict/{bottom,top}/{S1,S2,S3}/{keep20,keep50}/powerlaw/f32",
     "baselines": ["gpu_select/torch_topk/{input}/{scenario}/{keep}/{dist}/f32"], "minimum": 2.0,
     "wording": ">= 2x torch.topk (unsorted)"},
    {"pattern": r"^gpu_select/kvevict/(bottom|top)/(S1|S2|S3)/keep(20|50)/powerlaw/f32$",
     "label": "gpu_select/kvevict/{bottom,top}/{S1,S2,S3}/{keep20,keep50}/powerlaw/f32",
     "baselines": ["gpu_select/cub_radix_sort/{input}/{scenario}/{keep}/{dist}/f32",
                   "gpu_select/cub_segmented_sort/{input}/{scenario}/{keep}/{dist}/f32"], "minimum": 5.0,
     "wording": ">= 5x the faster of the two CUB segmented sorts"},
]

TIME_UNITS = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}


class Row:
    """One benchmark name: its fields and its per-run medians."""

    def __init__(self, name):
        self.name = name
        parts = name.split("/")
        if len(parts) != 7:
            raise ValueError(f"{name}: expected family/method/input/scenario/keep/distribution/dtype")
        self.family, self.method, self.input, self.scenario, self.keep, self.dist, self.dtype = parts
        self.items = {}  # run index -> items/s
        self.bytes = {}  # run index -> bytes/s
        self.time = {}  # run index -> seconds per iteration (per layer for the GPU rows)


def load(paths):
    """{family: {name: Row}}, {family: number of runs}, the first context."""
    by_binary = collections.OrderedDict()
    for p in paths:
        with open(p) as f:
            run = json.load(f)
        by_binary.setdefault(os.path.basename(run["context"]["executable"]), []).append(run)
    rows, runs, context = {}, {}, None
    for binary, files in by_binary.items():
        for i, run in enumerate(files):
            context = context or run["context"]
            has_aggregates = any(b.get("aggregate_name") for b in run["benchmarks"])
            for b in run["benchmarks"]:
                if has_aggregates and b.get("aggregate_name") != "median":
                    continue
                name = re.sub(r"/(manual_time|real_time)$", "", b["run_name"])
                row = rows.setdefault(name, Row(name))
                row.items[i] = b.get("items_per_second", 0.0)
                row.bytes[i] = b.get("bytes_per_second", 0.0)
                if "real_time" in b:
                    row.time[i] = b["real_time"] * TIME_UNITS.get(b.get("time_unit", "ns"), 1e-9)
                runs[row.family] = max(runs.get(row.family, 0), i + 1)
    return rows, runs, context


def spread(values):
    values = list(values)
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": len(values)}


def ratio(row, base, field="items"):
    """Median [min, max] over the runs both rows have of row / base, or None."""
    if base is None:
        return None
    a, b = getattr(row, field), getattr(base, field)
    common = [i for i in a if i in b and b[i] > 0]
    return spread(a[i] / b[i] for i in common) if common else None


def si(x, unit=""):
    for div, suffix in ((1e9, " G"), (1e6, " M"), (1e3, " k")):
        if abs(x) >= div:
            return f"{x / div:.3g}{suffix}{unit}"
    return f"{x:.3g} {unit}".rstrip()


def fmt_speed(s, unit=""):
    if s["runs"] == 1:
        return si(s["median"], unit)
    return f"{si(s['median'], unit)} [{si(s['min'])} - {si(s['max'])}]"


def fmt_ratio(r):
    if r is None:
        return "-"
    if r["runs"] == 1:
        return f"{r['median']:.3g}x"
    return f"{r['median']:.3g}x [{r['min']:.3g} - {r['max']:.3g}]"


def baseline_name(row, method, input_=None, dist=None, dtype="f32"):
    return "/".join([row.family, method, input_ or row.input, row.scenario, row.keep, dist or row.dist, dtype])


def target_checks(rows):
    checks = []
    for pattern, base_template, minimum, wording in TARGETS:
        for name, row in rows.items():
            if not re.match(pattern, name):
                continue
            base = rows.get(base_template.format(scenario=row.scenario, keep=row.keep, dist=row.dist))
            r = ratio(row, base)
            if r is None:
                continue
            met = r["median"] >= minimum
            checks.append({"row": name, "baseline": base.name, "target": wording, "minimum": minimum,
                           "ratio": r, "met": met,
                           "verdict": "met" if met else f"missed: reaches {r['median'] / minimum:.0%} of the target"})
    return checks


def best_of(bases, field):
    """A row whose run i holds the fastest of `bases` in run i (runs all of them have)."""
    if not bases or any(b is None for b in bases):
        return None
    if len(bases) == 1:
        return bases[0]
    best = Row(bases[0].name)
    best.name = "fastest of " + ", ".join(f"`{b.name}`" for b in bases)
    for i in set.intersection(*(set(getattr(b, field)) for b in bases)):
        fastest = max(bases, key=lambda b: getattr(b, field)[i])
        best.items[i], best.bytes[i] = fastest.items[i], fastest.bytes[i]
    return best if best.items else None


def fmt_time(seconds):
    return f"{seconds * 1e6:.3g} us" if seconds < 1e-3 else f"{seconds * 1e3:.3g} ms"


def gpu_target_checks(rows):
    """Every GPU target row: measured, or "not measured" (no GPU JSON, or no baseline run)."""
    checks = []
    for t in GPU_TARGETS:
        matched = [row for name, row in sorted(rows.items(), key=lambda kv: (scenario_order(kv[1].scenario), kv[0]))
                   if re.match(t["pattern"], name)]
        if not matched:
            checks.append({"row": t["label"], "baseline": ", ".join(t.get("baselines", [])) or "-",
                           "target": t["wording"], "ratio": None, "met": None, "verdict": "not measured"})
            continue
        for row in matched:
            if "max_seconds" in t:
                if not row.time:
                    checks.append({"row": row.name, "baseline": "-", "target": t["wording"], "ratio": None,
                                   "met": None, "verdict": "not measured"})
                    continue
                sp = spread(row.time.values())
                met = sp["median"] <= t["max_seconds"]
                checks.append({"row": row.name, "baseline": "-", "target": t["wording"], "ratio": None,
                               "time": sp, "figure": fmt_time(sp["median"]) +
                               (f" [{fmt_time(sp['min'])} - {fmt_time(sp['max'])}]" if sp["runs"] > 1 else ""),
                               "met": met, "verdict": "met" if met else
                               f"missed: {sp['median'] / t['max_seconds']:.2g}x the bound"})
                continue
            names = [b.format(scenario=row.scenario, keep=row.keep, dist=row.dist, input=row.input)
                     for b in t["baselines"]]
            field = t.get("field", "items")
            base = best_of([rows.get(n) for n in names], field)
            r = ratio(row, base, field)
            if r is None:
                checks.append({"row": row.name, "baseline": ", ".join(names), "target": t["wording"], "ratio": None,
                               "met": None, "verdict": "not measured (baseline not in these runs)"})
                continue
            met = r["median"] >= t["minimum"]
            checks.append({"row": row.name, "baseline": base.name, "target": t["wording"], "minimum": t["minimum"],
                           "ratio": r, "met": met,
                           "verdict": "met" if met else f"missed: reaches {r['median'] / t['minimum']:.0%} of the target"})
    return checks


def scenario_order(s):
    m = re.match(r"([SN])(\d+)", s)
    return (m.group(1), int(m.group(2))) if m else (s, 0)


def decode_table(rows):
    """Every decode row with its ratios to the fused loop, the reference and memcpy."""
    out = ["| benchmark | steps/s | bytes/s | vs fused loop | vs reference real drop | of memcpy bytes/s |",
           "|---|---|---|---|---|---|"]
    decode = sorted((r for r in rows.values() if r.family == "decode"), key=lambda r: (scenario_order(r.scenario), r.name))
    for row in decode:
        fused_input = row.input if row.input in ("probs", "probs_shared", "head_scores") else "probs"
        fused = rows.get(baseline_name(row, "fused_loop", fused_input, row.dist if row.dist in
                                       ("powerlaw", "uniform", "neartie") and fused_input == "probs" else "powerlaw"))
        reference = rows.get(baseline_name(row, "reference_realdrop", "probs", "powerlaw", "bf16"))
        memcpy = rows.get(baseline_name(row, "memcpy", "probs", "powerlaw"))
        out.append(f"| `{row.name}` | {fmt_speed(spread(row.items.values()))} | "
                   f"{fmt_speed(spread(row.bytes.values()), 'B/s')} | "
                   f"{fmt_ratio(ratio(row, fused)) if row is not fused else '1'} | "
                   f"{fmt_ratio(ratio(row, reference)) if row is not reference else '1'} | "
                   f"{fmt_ratio(ratio(row, memcpy, 'bytes')) if row is not memcpy else '1'} |")
    return out


def select_table(rows):
    out = ["| benchmark | keys/s | bytes/s | vs nth_element | vs partial_sort | vs sort |", "|---|---|---|---|---|---|"]
    select = sorted((r for r in rows.values() if r.family == "select" and r.method == "kvevict"),
                    key=lambda r: (r.input, r.keep, r.dist, scenario_order(r.scenario)))
    for row in select:
        cells = [fmt_ratio(ratio(row, rows.get(baseline_name(row, m)))) for m in ("nth_element", "partial_sort", "sort")]
        out.append(f"| `{row.name}` | {fmt_speed(spread(row.items.values()))} | "
                   f"{fmt_speed(spread(row.bytes.values()), 'B/s')} | " + " | ".join(cells) + " |")
    nth = sorted((r for r in rows.values() if r.family == "select" and r.method != "kvevict"),
                 key=lambda r: (r.input, r.keep, r.dist, r.method, scenario_order(r.scenario)))
    if nth:
        out += ["", "Baselines on their own:", "", "| benchmark | keys/s |", "|---|---|"]
        out += [f"| `{r.name}` | {fmt_speed(spread(r.items.values()))} |" for r in nth]
    return out


def gpu_decode_table(rows):
    """Every gpu_decode row, per layer, with its ratios to the D2D copy, the minimal fused kernel and torch.compile."""
    out = ["| benchmark | us per layer | steps/s | bytes/s | of D2D copy bytes/s | vs fused_kernel | "
           "vs torch.compile |", "|---|---|---|---|---|---|---|"]
    decode = sorted((r for r in rows.values() if r.family == "gpu_decode"),
                    key=lambda r: (scenario_order(r.scenario), r.name))
    for row in decode:
        fused_input = row.input if row.input in ("probs", "head_scores") else "probs"
        fused_dist = row.dist if fused_input == "probs" and row.dist in ("powerlaw", "uniform", "neartie") else "powerlaw"
        fused = rows.get(baseline_name(row, "fused_kernel", fused_input, fused_dist))
        copy = rows.get(baseline_name(row, "d2d_copy", "probs", "powerlaw"))
        torch = rows.get(baseline_name(row, "torch_compile", "probs", "powerlaw"))
        time = fmt_time(spread(row.time.values())["median"]) if row.time else "-"
        out.append(f"| `{row.name}` | {time} | {fmt_speed(spread(row.items.values()))} | "
                   f"{fmt_speed(spread(row.bytes.values()), 'B/s')} | "
                   f"{fmt_ratio(ratio(row, copy, 'bytes')) if row is not copy else '1'} | "
                   f"{fmt_ratio(ratio(row, fused)) if row is not fused else '1'} | "
                   f"{fmt_ratio(ratio(row, torch)) if row is not torch else '1'} |")
    return out


GPU_SELECT_BASELINES = ("torch_topk", "torch_topk_sorted", "cub_radix_sort", "cub_segmented_sort")


def gpu_select_table(rows):
    out = ["| benchmark | us per layer | keys/s | " + " | ".join(f"vs {m}" for m in GPU_SELECT_BASELINES) + " |",
           "|---|---|---|" + "---|" * len(GPU_SELECT_BASELINES)]
    select = sorted((r for r in rows.values() if r.family == "gpu_select" and r.method == "kvevict"),
                    key=lambda r: (r.input, r.keep, r.dist, scenario_order(r.scenario)))
    for row in select:
        cells = [fmt_ratio(ratio(row, rows.get(baseline_name(row, m)))) for m in GPU_SELECT_BASELINES]
        time = fmt_time(spread(row.time.values())["median"]) if row.time else "-"
        out.append(f"| `{row.name}` | {time} | {fmt_speed(spread(row.items.values()))} | " + " | ".join(cells) + " |")
    base = sorted((r for r in rows.values() if r.family == "gpu_select" and r.method != "kvevict"),
                  key=lambda r: (r.input, r.keep, r.dist, r.method, scenario_order(r.scenario)))
    if base:
        out += ["", "Baselines on their own:", "", "| benchmark | us per layer | keys/s |", "|---|---|---|"]
        out += [f"| `{r.name}` | {fmt_time(spread(r.time.values())['median']) if r.time else '-'} | "
                f"{fmt_speed(spread(r.items.values()))} |" for r in base]
    return out


# The baseline of each remaining family: (method, input or None for the
# row's own, dtype or None for the row's own).
FAMILY_BASELINES = {
    "prefill": ("reference_keep_gather", None, None),
    "evict_to": ("plain_nth_element", "moves", "none"),
    "scatter": ("memcpy", None, None),
    "compaction": ("memcpy", "block", None),
    "gpu_prefill": ("d2d_copy", None, None),
    "gpu_evict_to": ("d2d_copy", "probs", "f32"),
}
FAMILY_TEXT = {
    "prefill": ("Prefill compression (`kvevict_bench_prefill`)",
                "One item = one (sequence, KV head, prompt token) scored. Baseline: the reference's keep written "
                "plainly (group fold, nth_element, sort, gather into a fresh buffer)."),
    "evict_to": ("Multi-token evict_to (`kvevict_bench_evict_to`)",
                 "One item = one token freed; the step timed is append chunk + observe + evict_to. Baseline: the "
                 "same step with nth_element and no checks, reporting moves."),
    "scatter": ("Scatter (`kvevict_bench_kv_moves`)",
                "One item = one (sequence, KV head) K and V row written. Baseline: memcpy of the same rows."),
    "compaction": ("Compaction (`kvevict_bench_kv_moves`)",
                   "One item = one kept row pair moved. Baseline: one memcpy of the same bytes."),
    "gpu_prefill": ("GPU prefill compression (`kvevict_bench_cuda`)",
                    "Per layer, cold. One item = one (sequence, KV head, prompt token). Baseline: a D2D copy "
                    "touching the same bytes (column sums read, kept K/V rows read and written)."),
    "gpu_evict_to": ("GPU multi-token evict_to (`kvevict_bench_cuda`)",
                     "Per layer, cold. One item = one token freed; the step timed is append chunk + observe + "
                     "evict_to. Baseline: a D2D copy touching the same bytes (probabilities + 12 bytes a slot)."),
}


def family_table(rows, family):
    method, input_, dtype = FAMILY_BASELINES[family]
    out = ["| benchmark | items/s | bytes/s | baseline | ratio to it |", "|---|---|---|---|---|"]
    for row in sorted((r for r in rows.values() if r.family == family and r.method != method),
                      key=lambda r: (scenario_order(r.scenario), r.name)):
        base = rows.get(baseline_name(row, method, input_, None, dtype or row.dtype))
        out.append(f"| `{row.name}` | {fmt_speed(spread(row.items.values()))} | "
                   f"{fmt_speed(spread(row.bytes.values()), 'B/s')} | "
                   f"{fmt_speed(spread(base.items.values())) if base else '-'} | {fmt_ratio(ratio(row, base))} |")
    return out


def targets_table(checks):
    out = ["| row | target | baseline | ratio (median [min - max] over runs) | met |", "|---|---|---|---|---|"]
    for c in checks:
        figure = c.get("figure") or (fmt_ratio(c["ratio"]) if c["ratio"] else "not measured")
        baseline = c["baseline"] if c["baseline"].startswith("fastest of") else f"`{c['baseline']}`"
        out.append(f"| `{c['row']}` | {c['target']} | {baseline} | {figure} | "
                   f"{'**met**' if c['met'] else c['verdict']} |")
    return out


def report(rows, runs, context, args):
    lines = []
    load_avg = context.get("load_avg", [])
    lines.append(f"Measured {args.date or context.get('date', '')[:10]} on {args.machine or 'this machine'}"
                 f" ({context.get('num_cpus')} CPUs at {context.get('mhz_per_cpu')} MHz as Google Benchmark saw them"
                 + (f", load average {load_avg[0]:.2f} at the start of the first run" if load_avg else "") + ").")
    if args.command:
        lines += ["", "Command:", "", "```sh", args.command, "```"]
    lines += ["", "Runs per family: " + ", ".join(f"{f} {n}" for f, n in sorted(runs.items())) +
              ". Each figure is the median over runs of each run's median of its repetitions, with the lowest "
              "and highest run in brackets; each ratio is computed within a run, then summarised the same way.", ""]
    checks = target_checks(rows)
    lines += ["### Targets", ""] + (targets_table(checks) if checks else ["No target row was measured in this run."])
    gpu_checks = gpu_target_checks(rows)
    lines += ["", "### GPU targets", "",
              "Per layer, cold (32 layers' steps in one CUDA graph, time = replay / 32). "
              "Rows read *not measured* when these runs hold no kvevict_bench_cuda (or bench_torch.py) JSON.", ""]
    lines += targets_table(gpu_checks)
    checks = checks + gpu_checks
    if any(r.family == "decode" for r in rows.values()):
        lines += ["", "### Decode step (`kvevict_bench_decode`)", "",
                  "One step = one (sequence, KV head): append + observe + evict. bytes/s counts the inputs read "
                  "plus 12 bytes of state a slot (score read and written, position read); *of memcpy bytes/s* is "
                  "the fraction of the memory roof.", ""] + decode_table(rows)
        if args.write:
            lines += ["", "![decode step as a fraction of the memcpy roof](img/host_decode_roof.png)"]
    if any(r.family == "select" for r in rows.values()):
        lines += ["", "### Segmented selection (`kvevict_bench_select`)", "",
                  "keys/s: keys of a segment examined per second (N per call). Baselines build the same keys and "
                  "return the same indices in position order.", ""] + select_table(rows)
        if args.write:
            lines += ["", "![selection throughput vs N](img/host_select.png)"]
    if any(r.family == "gpu_decode" for r in rows.values()):
        lines += ["", "### GPU decode step (`kvevict_bench_cuda`)", "",
                  "One step = one (sequence, KV head) of one layer: append + observe + evict, two launches. bytes/s "
                  "counts the inputs read plus 12 bytes of state a slot; *of D2D copy bytes/s* is the fraction of "
                  "the copy bandwidth (read + written) on the same bytes.", ""] + gpu_decode_table(rows)
    if any(r.family == "gpu_select" for r in rows.values()):
        lines += ["", "### GPU segmented selection (`kvevict_bench_cuda`)", "",
                  "keys/s: keys of every segment examined per second (segments x N per call), per layer, cold. "
                  "Every method counts the same items and bytes, so ratios are ratios of time.", ""]
        lines += gpu_select_table(rows)
    for family, (title, text) in FAMILY_TEXT.items():
        if any(r.family == family for r in rows.values()):
            lines += ["", f"### {title}", "", text, ""] + family_table(rows, family)
    return lines, checks


def plot(rows, date):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    img = os.path.join(DOCS, "img")
    # Selection: keys/s vs N per method, bottom-k and top-k at 20%, power law.
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
    styles = {"kvevict": ("tab:blue", "o"), "nth_element": ("tab:orange", "s"), "partial_sort": ("tab:green", "^"),
              "sort": ("tab:red", "v")}
    for ax, end in zip(axes, ("bottom", "top")):
        for keep, ls in (("keep20", "-"), ("keep50", "--")):
            for method, (color, marker) in styles.items():
                pts = sorted((scenario_order(r.scenario)[1], statistics.median(r.items.values()))
                             for r in rows.values() if r.family == "select" and r.method == method and r.input == end
                             and r.keep == keep and r.dist == "powerlaw")
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] / 1e6 for p in pts], ls=ls, color=color, marker=marker,
                            label=f"{method}, {keep[4:]}%")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("segment length N (keys)")
        ax.set_title(f"{end}-k, power-law scores, positions shuffled", fontsize=9)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("million keys / s (one segment per call)")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=8, ncol=4, loc="upper center", bbox_to_anchor=(0.5, 0.0), frameon=False)
    fig.suptitle(f"Host segmented selection vs the standard library ({date}, median over runs)", fontsize=10)
    fig.tight_layout()
    fig.savefig(os.path.join(img, "host_select.png"), dpi=120, bbox_inches="tight")
    plt.close(fig)

    # Decode: fraction of the memcpy roof (bytes/s over memcpy's bytes/s of
    # the same bytes), power law, probabilities, per scenario.
    methods = [("h2o", "kvevict h2o, per-sequence API", "tab:blue"),
               ("h2o_batched", "kvevict h2o, batched host API", "tab:cyan"),
               ("fused_loop", "minimal fused loop (practical limit)", "tab:gray"),
               ("reference_realdrop", "reference real drop (top-k + sort + gather)", "tab:orange")]
    scenarios = sorted({r.scenario for r in rows.values() if r.family == "decode" and r.method == "memcpy"},
                       key=scenario_order)
    if scenarios:
        fig, ax = plt.subplots(figsize=(7.5, 3.8))
        width = 0.8 / len(methods)
        for j, (method, label, color) in enumerate(methods):
            xs, ys = [], []
            for i, s in enumerate(scenarios):
                dtype = "bf16" if method == "reference_realdrop" else "f32"
                row = rows.get(f"decode/{method}/probs/{s}/evict1/powerlaw/{dtype}")
                roof = rows.get(f"decode/memcpy/probs/{s}/evict1/powerlaw/f32")
                r = ratio(row, roof, "items") if row else None  # same steps, so items ratio = share of the roof
                if r:
                    xs.append(i + (j - 1.5) * width)
                    ys.append(r["median"])
            bars = ax.bar(xs, ys, width, label=label, color=color)
            ax.bar_label(bars, labels=[f"{y:.0%}" if y >= 0.01 else f"{y:.1%}" for y in ys], fontsize=7, padding=1)
        ax.axhline(1.0, color="black", lw=0.8, ls=":", label="memcpy of the same bytes (the roof)")
        ax.set_yscale("log")
        ax.set_xticks(range(len(scenarios)), scenarios)
        ax.set_ylabel("steps/s as a fraction of memcpy's (log)")
        ax.set_xlabel("scenario (docs/benchmarks.md)")
        ax.set_title(f"Host h2o decode step from probabilities, power law ({date}, median of per-run ratios)",
                     fontsize=9)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, frameon=False)
        fig.savefig(os.path.join(img, "host_decode_roof.png"), dpi=120, bbox_inches="tight")
        plt.close(fig)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="Google Benchmark JSON files")
    ap.add_argument("--write", action="store_true", help="update docs/benchmarks.md, docs/data and docs/img")
    ap.add_argument("--date", default="")
    ap.add_argument("--machine", default="")
    ap.add_argument("--command", default="")
    args = ap.parse_args()
    rows, runs, context = load(args.runs)
    date = args.date or context.get("date", "")[:10]
    lines, checks = report(rows, runs, context, args)
    print("\n".join(lines))
    if not args.write:
        return 0
    path = os.path.join(DOCS, "benchmarks.md")
    with open(path) as f:
        page = f.read()
    if BEGIN not in page or END not in page:
        sys.exit(f"{path}: markers {BEGIN} / {END} not found")
    head, rest = page.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    with open(path, "w") as f:
        f.write(head + BEGIN + "\n" + "\n".join(lines) + "\n" + END + tail)
    summary = {"date": date, "machine": args.machine, "command": args.command, "runs": runs,
               "targets": checks,
               "rows": {n: {"items_per_second": spread(r.items.values()), "bytes_per_second": spread(r.bytes.values())}
                        for n, r in sorted(rows.items())}}
    with open(os.path.join(DOCS, "data", "host_bench.json"), "w") as f:
        json.dump(summary, f, indent=1)
        f.write("\n")
    plot(rows, date)
    return 0


if __name__ == "__main__":
    sys.exit(main())
