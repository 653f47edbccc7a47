"""Redraws the figures in docs/img from the figures recorded in README.md and
from the fidelity run in docs/data/fidelity.json and needle.json (python3 docs/make_plots.py;
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
labels = {"h2o": "h2o (heavy + recent half)", "tova": "TOVA (decay 0)", "decayed": "decayed attention, 0.9",
          "recent_window": "recent window, 4 sinks", "key_norm": "key-norm", "key_diff": "KeyDiff",
          "recent_only": "recent only, 0 sinks", "random": "random, unprotected",
          "random_protected": "random, 4 sinks + recent half",
          "exact_greedy": "exact greedy (1-step oracle), unprotected",
          "exact_greedy_protected": "exact greedy, 4 sinks + recent half",
          "lookahead": "oracle: look-ahead", "topk": "oracle: revocable top-k"}
styles = {"random_protected": "--", "exact_greedy_protected": "--", "lookahead": ":", "topk": ":"}
names = [p for p in labels if any(r["policy"] == p for r in rows)]
fig, (a, b) = plt.subplots(1, 2, figsize=(10.5, 4.2))
for p in names:
    rs = sorted((r for r in rows if r["policy"] == p), key=lambda r: r["percent"])
    pct = [r["percent"] for r in rs]
    style = styles.get(p, "-")
    a.plot(pct, [100 * (r["ppl_evicted"] / r["ppl_full_same_positions"] - 1) for r in rs], marker="o", ls=style,
           label=labels[p])
    b.plot(pct, [100 * r["top1_agreement"] for r in rs], marker="o", ls=style, label=labels[p])
b.axhline(100.0, color="black", lw=0.8, ls=":")
increases = [r["ppl_evicted"] / r["ppl_full_same_positions"] - 1 for r in rows]
if min(increases) > 0:
    a.set_yscale("log")
    a.yaxis.set_minor_formatter(matplotlib.ticker.FuncFormatter(lambda y, _: f"{y:g}" if f"{y:g}"[0] in "25" else ""))
    a.set_ylabel("perplexity increase over the full cache, % (log scale)")
else:  # a policy below the full cache: symlog shows both signs
    a.set_yscale("symlog", linthresh=1.0)
    a.set_ylabel("perplexity increase over the full cache, % (symlog)")
a.yaxis.set_major_formatter(plain)
b.set_ylabel("% top-1 agreement with the full cache")
for axis in (a, b):
    axis.set_xlabel("KV budget, % of the window")
    axis.set_xticks(sorted({r["percent"] for r in rows}))
handles, names_ = a.get_legend_handles_labels()
fig.legend(handles, names_, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=3, frameon=False)
fig.suptitle(f"SmolLM2-135M on Botchan: {run['windows']} window(s) x {run['window']} tokens, "
             "positions after the first eviction")
fig.tight_layout()
save(fig, "fidelity.png")

# Needle retrieval (docs/fidelity.md): one panel per setting and policy,
# rows (budget, context length), columns needle depth, cells the share of
# trials answered.
needle_path = os.path.join(here, "data", "needle.json")
if os.path.exists(needle_path):
    with open(needle_path) as f:
        needle = json.load(f)
    res = needle["results"]
    settings = {"full": "", "decode": "decode", "prefill_in": "prefill, Q in", "prefill_out": "prefill, Q out"}
    panels = []
    for r in res:
        key = (r["setting"], r["policy"])
        if key not in panels:
            panels.append(key)
    depths = sorted({d for r in res for d, _ in r["by_depth"]})
    cols = 5
    nrows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(2.3 * cols, 1.9 * nrows), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.axis("off")
    for ax, (setting, policy) in zip(axes.flat, panels):
        rs = sorted((r for r in res if (r["setting"], r["policy"]) == (setting, policy)),
                    key=lambda r: (r["percent"], r["length"]))
        grid, ylabels = [], []
        for r in rs:
            cells = []
            for d in depths:
                hits = [ok for dd, ok in r["by_depth"] if dd == d]
                cells.append(sum(hits) / len(hits) if hits else float("nan"))
            grid.append(cells)
            ylabels.append(f"{r['percent']}% {r['length']}")
        ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        for i, row in enumerate(grid):
            for j, v in enumerate(row):
                ax.text(j, i, f"{v:.0%}" if v == v else "", ha="center", va="center", fontsize=6)
        ax.set_xticks(range(len(depths)))
        ax.set_xticklabels([f"{d:g}" for d in depths], fontsize=6)
        ax.set_yticks(range(len(ylabels)))
        ax.set_yticklabels(ylabels, fontsize=6)
        ax.set_title(f"{policy} {settings[setting]}".strip(), fontsize=8)
    fig.supxlabel("needle depth (fraction of the haystack)", fontsize=9)
    fig.supylabel("budget, context length (tokens)", fontsize=9)
    fig.suptitle(f"Needle retrieval, SmolLM2-135M: share of {needle['words']} words answered per cell", fontsize=10)
    fig.tight_layout()
    save(fig, "needle.png")
