"""Redraws the figures in docs/img from the figures recorded in
docs/benchmarks.md and README.md, and from the fidelity run in
docs/data/fidelity.json (python3 docs/make_plots.py; needs matplotlib)."""
import os
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
import matplotlib.ticker

here = os.path.dirname(os.path.abspath(__file__))

# Host decode step, median of 5 (docs/benchmarks.md, 2026-11-20).
scenarios = ["S5: 1x8x1024", "S0: 24x32x820"]
kvevict = [147e3, 245e3]
reference = [17.8e3, 10.9e3]
fig, ax = plt.subplots(figsize=(6, 3.2))
x = range(len(scenarios))
ax.bar([i - 0.2 for i in x], kvevict, 0.4, label="kvevict h2o (no K/V moved)")
ax.bar([i + 0.2 for i in x], reference, 0.4, label="reference real drop (top-k + sort + gather)")
ax.set_xticks(list(x), scenarios)
ax.set_ylabel("(sequence, head) steps / s")
ax.set_title("Host decode step, bf16, head_dim 128")
ax.legend(fontsize=8)
fig.tight_layout()
fig.savefig(os.path.join(here, "img", "host_decode.png"), dpi=120)

# Demo defaults (README.md): attention kept and mean relative error at 20%.
policies = ["h2o", "recent_window", "random", "exact_greedy"]
kept = [79.2, 50.5, 39.1, 27.7]
err = [0.299, 0.727, 0.802, 0.858]
fig, (a, b) = plt.subplots(1, 2, figsize=(8, 3.2))
a.bar(policies, kept, color="tab:green")
a.set_ylabel("% of full-cache attention kept")
b.bar(policies, err, color="tab:red")
b.set_ylabel("mean relative output error")
for axis in (a, b):
    axis.tick_params(axis="x", labelrotation=20)
fig.suptitle("Demo stream at a 20% KV budget")
fig.tight_layout()
fig.savefig(os.path.join(here, "img", "demo_20pct.png"), dpi=120)

# Fidelity on SmolLM2-135M (docs/fidelity.md), from the run's JSON.
import json
with open(os.path.join(here, "data", "fidelity.json")) as f:
    run = json.load(f)
rows = [r for r in run["results"] if r["policy"] != "full"]
names = [p for p in ["h2o", "recent_window", "recent_only", "random", "exact_greedy"]
         if any(r["policy"] == p for r in rows)]
labels = {"h2o": "h2o (heavy + recent)", "recent_window": "recent window, 4 sinks",
          "recent_only": "recent only, 0 sinks", "random": "random", "exact_greedy": "exact greedy (1-step oracle)"}
fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
for p in names:
    rs = sorted((r for r in rows if r["policy"] == p), key=lambda r: r["percent"])
    pct = [r["percent"] for r in rs]
    a.plot(pct, [r["ppl_evicted"] / r["ppl_full_same_positions"] for r in rs], marker="o", label=labels[p])
    b.plot(pct, [100 * r["top1_agreement"] for r in rs], marker="o", label=labels[p])
a.axhline(1.0, color="black", lw=0.8, ls="--", label="full cache")
a.set_yscale("log")
plain = matplotlib.ticker.FuncFormatter(lambda y, _: f"{y:g}")
a.yaxis.set_major_formatter(plain)
a.yaxis.set_minor_formatter(plain)
a.set_ylabel("perplexity / full-cache perplexity")
b.set_ylabel("% top-1 agreement with full cache")
for axis in (a, b):
    axis.set_xlabel("KV budget, % of the window")
    axis.set_xticks(sorted({r["percent"] for r in rows}))
a.legend(fontsize=7)
fig.suptitle(f"SmolLM2-135M on Botchan: {run['windows']} windows x {run['window']} tokens, "
             "positions after the first eviction")
fig.tight_layout()
fig.savefig(os.path.join(here, "img", "fidelity.png"), dpi=120)
