"""Redraws the figures in docs/img from the figures recorded in README.md and
from the fidelity run in docs/data/fidelity.json (python3 docs/make_plots.py;
needs matplotlib). The benchmark figures of docs/benchmarks.md are drawn by
scripts/bench_report.py --write from the benchmark JSON."""
import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import matplotlib.ticker

here = os.path.dirname(os.path.abspath(__file__))
plain = matplotlib.ticker.FuncFormatter(lambda y, _: f"{y:g}")


def save(fig, name):
    fig.savefig(os.path.join(here, "img", name), dpi=120, bbox_inches="tight")
    plt.close(fig)


# Demo defaults (README.md): attention kept and mean relative error at 20%,
# with the full cache as the reference.
policies = ["full", "h2o", "recent_window", "random", "exact_greedy"]
kept = [100.0, 79.2, 50.5, 38.5, 27.7]
err = [0.0, 0.299, 0.727, 0.802, 0.858]
colors = ["tab:gray", "tab:blue", "tab:orange", "tab:red", "tab:purple"]
fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.6))
a.bar(policies, kept, color=colors)
a.bar_label(a.containers[0], labels=[f"{v:.0f}%" for v in kept], fontsize=8)
a.set_ylabel("% of the full cache's attention kept")
a.set_ylim(0, 112)
b.bar(policies, err, color=colors)
b.bar_label(b.containers[0], labels=[f"{v:.2f}" for v in err], fontsize=8)
b.set_ylabel("mean relative output error")
b.set_ylim(0, max(err) * 1.15)
for axis in (a, b):
    axis.set_xlabel("policy (full cache: no eviction)")
    axis.tick_params(axis="x", labelrotation=20)
fig.suptitle("Demo stream at a 20% KV budget (4 sequences x 8 heads x ~2000 tokens, bf16)")
fig.tight_layout()
save(fig, "demo_20pct.png")

# Fidelity on SmolLM2-135M (docs/fidelity.md), from the run's JSON.
with open(os.path.join(here, "data", "fidelity.json")) as f:
    run = json.load(f)
rows = [r for r in run["results"] if r["policy"] not in ("full", "h2o_lse")]
labels = {"h2o": "h2o (heavy + recent half)", "recent_window": "recent window, 4 sinks",
          "recent_only": "recent only, 0 sinks", "random": "random, unprotected",
          "random_protected": "random, 4 sinks + recent half",
          "exact_greedy": "exact greedy (1-step oracle), unprotected",
          "exact_greedy_protected": "exact greedy, 4 sinks + recent half"}
styles = {"random_protected": "--", "exact_greedy_protected": "--"}
names = [p for p in labels if any(r["policy"] == p for r in rows)]
fig, (a, b) = plt.subplots(1, 2, figsize=(10.5, 4.0))
for p in names:
    rs = sorted((r for r in rows if r["policy"] == p), key=lambda r: r["percent"])
    pct = [r["percent"] for r in rs]
    style = styles.get(p, "-")
    a.plot(pct, [r["ppl_evicted"] / r["ppl_full_same_positions"] for r in rs], marker="o", ls=style, label=labels[p])
    b.plot(pct, [100 * r["top1_agreement"] for r in rs], marker="o", ls=style, label=labels[p])
a.axhline(1.0, color="black", lw=0.8, ls=":", label="full cache")
b.axhline(100.0, color="black", lw=0.8, ls=":")
a.set_yscale("log")
a.yaxis.set_major_formatter(plain)
a.yaxis.set_minor_formatter(plain)
a.set_ylabel("perplexity / full cache's (log scale)")
b.set_ylabel("% top-1 agreement with the full cache")
for axis in (a, b):
    axis.set_xlabel("KV budget, % of the window")
    axis.set_xticks(sorted({r["percent"] for r in rows}))
handles, names_ = a.get_legend_handles_labels()
fig.legend(handles, names_, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=3, frameon=False)
fig.suptitle(f"SmolLM2-135M on Botchan: {run['windows']} windows x {run['window']} tokens, "
             "positions after the first eviction")
fig.tight_layout()
save(fig, "fidelity.png")
