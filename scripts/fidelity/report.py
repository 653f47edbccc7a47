"""Writes the generated part of docs/fidelity.md (between the markers
"<!-- report.py: begin -->" and "<!-- report.py: end -->") from
docs/data/fidelity.json (perplexity), needle.json (retrieval) and
fidelity-run.json (date, command, wall time): the run line, the table of
every policy, the targets of issue 28 and the distance to the oracles.

    python3 scripts/fidelity/report.py docs/fidelity.md
"""
import json
import os
import sys

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "docs", "data")
BEGIN, END = "<!-- report.py: begin -->", "<!-- report.py: end -->"

# (row label, perplexity / decode-time name, prompt-compression name); None: not run in that setting.
ROWS = [
    ("full cache", "full", None),
    ("h2o (accumulated attention)", "h2o", "h2o"),
    ("TOVA (decay 0)", "tova", "tova"),
    ("decayed attention, decay 0.9", "decayed", "decayed"),
    ("recent window + 4 sinks", "recent_window", "recent_window"),
    ("key-norm", "key_norm", "key_norm"),
    ("KeyDiff", "key_diff", "key_diff"),
    ("SnapKV (prefill) + h2o decode", None, "snapkv"),
    ("random, h2o's protection", "random_protected", None),
    ("exact_greedy, h2o's protection", "exact_greedy_protected", None),
    ("oracle: look-ahead", "lookahead", None),
    ("oracle: revocable top-k", "topk", None),
]
ORACLES = {"lookahead", "topk"}


def load(name):
    path = os.path.join(DATA, name)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def increase(r):
    return 100.0 * (r["ppl_evicted"] / r["ppl_full_same_positions"] - 1.0)


def main(doc):
    ppl, needle, run = load("fidelity.json"), load("needle.json"), load("fidelity-run.json") or {}
    by_ppl = {(r["policy"], r["percent"]): r for r in ppl["results"]}
    retrieval = {}  # (setting, policy, percent) -> [correct, trials]
    for r in (needle or {}).get("results", []):
        cell = retrieval.setdefault((r["setting"], r["policy"], r["percent"]), [0, 0])
        cell[0] += r["correct"]
        cell[1] += r["trials"]
    full_acc = None
    if ("full", "full", 100) in retrieval:
        c, n = retrieval[("full", "full", 100)]
        full_acc = c / n

    def ppl_cell(name, pct):
        if name == "full":
            return "0 (ppl %.2f)" % by_ppl[("full", 100)]["ppl_all"] if pct == 10 else ""
        r = by_ppl.get((name, pct)) if name else None
        return "%+.1f%%" % increase(r) if r else "n/a"

    def ret_cell(setting, name, pct):
        if name is None:
            return "n/a"
        if name == "full":
            key = ("full", "full", 100)
            if pct != 10 or key not in retrieval:
                return ""
        else:
            key = (setting, name, pct)
        if key not in retrieval:
            return "n/a"
        c, n = retrieval[key]
        return "%.0f%% (%d/%d)" % (100.0 * c / n, c, n)

    out = []
    lengths = sorted({r["length"] for r in (needle or {}).get("results", [])})
    if run:
        out.append("Run of %s on a %d-core x86-64 machine (%s; %d thread(s) per process, the evaluations side by "
                   "side), %d s (%.1f h) of wall time in all:"
                   % (run["date"], run.get("cores", 0), run.get("cpu", "?"), run.get("threads", 0), run["seconds"],
                      run["seconds"] / 3600.0))
        out.append("")
        out.append("```sh\n%s\n```" % run["command"])
        out.append("")
    out.append("- **Model:** %s; **text:** %s." % (ppl["model"], ppl["text"]))
    out.append("- **Perplexity:** %d window(s) x %d tokens from token %d, teacher-forced through the decode cycle; "
               "the increase is over the full cache on the positions after the policy's first eviction (%d s)."
               % (ppl["windows"], ppl["window"], ppl["offset"], ppl["seconds"]))
    if needle:
        depths = sorted({d for r in needle["results"] for d, _ in r["by_depth"]})
        out.append("- **Retrieval:** context lengths %s tokens x needle depths %s x %d words = %d trials per "
                   "setting, policy and budget; %d greedy tokens answer (%d s)."
                   % (", ".join(map(str, lengths)), ", ".join("%g" % d for d in depths), needle["words"],
                      len(lengths) * len(depths) * needle["words"], needle["generate"], needle["seconds"]))
        out.append("- **Look-ahead horizon:** %s." % ("the rest of the window (T = all later queries)"
                                                       if not ppl.get("horizon") else "T = %d" % ppl["horizon"]))
    out.append("")
    out.append("| policy | ppl +, 10% | ppl +, 20% | ppl +, 50% | retrieval, decode 10% | decode 20% "
               "| prefill Q in 10% | Q in 20% | prefill Q out 10% | Q out 20% |")
    out.append("|---|---|---|---|---|---|---|---|---|---|")
    for label, dec, pre in ROWS:
        cells = [ppl_cell(dec, p) for p in (10, 20, 50)]
        cells += [ret_cell("decode", dec, p) for p in (10, 20)]
        if dec == "full":
            cells += ["", "", "", ""]
        else:
            cells += [ret_cell("prefill_in", pre, p) for p in (10, 20)]
            cells += [ret_cell("prefill_out", pre, p) for p in (10, 20)]
        out.append("| %s | %s |" % (label, " | ".join(cells)))
    out.append("")

    # Targets of issue 28 and the distance to the oracles.
    online = [dec for _, dec, _ in ROWS if dec and dec != "full" and dec not in ORACLES]
    out.append("**Targets** (issue 28), best online policy:")
    out.append("")
    for pct, target in ((20, 2.0), (10, 5.0)):
        ranked = sorted((increase(by_ppl[(p, pct)]), p) for p in online if (p, pct) in by_ppl)
        if not ranked:
            continue
        best = ranked[0]
        oracle = ", ".join("%s %+.1f%%" % (o, increase(by_ppl[(o, pct)])) for o in sorted(ORACLES) if (o, pct) in by_ppl)
        verdict = "met" if best[0] <= target else "missed by %.1f points" % (best[0] - target)
        out.append("- perplexity at %d%%: %s %+.1f%% against a target of +%.0f%%: %s (oracles: %s)."
                   % (pct, best[1], best[0], target, verdict, oracle))
    if full_acc:
        names = {"decode": "decode time", "prefill_in": "prefill, question in", "prefill_out": "prefill, question out"}
        for pct in (20, 10):
            for setting in ("decode", "prefill_in", "prefill_out"):
                cands = [(c / n, p) for (s, p, q), (c, n) in retrieval.items()
                         if q == pct and s == setting and p not in ORACLES]
                if not cands:
                    continue
                acc = max(cands)[0]
                name = ", ".join(sorted(p for a, p in cands if a == acc))  # every rule tied at the best
                ratio = acc / full_acc
                verdict = ("met" if ratio >= 0.9 else "missed: %.0f%% of the full cache's" % (100 * ratio)) \
                    if pct == 20 else "no target"
                orc = ["%s %.0f%%" % (o, 100.0 * retrieval[(setting, o, pct)][0] / retrieval[(setting, o, pct)][1])
                       for o in sorted(ORACLES) if (setting, o, pct) in retrieval]
                out.append("- retrieval at %d%%, %s: %s %.0f%% against the full cache's %.0f%% (target: 90%% of it "
                           "at 20%%): %s%s." % (pct, names[setting], name, 100 * acc, 100 * full_acc, verdict,
                                               " (oracles: %s)" % ", ".join(orc) if orc else ""))
    text = "\n".join(out)

    with open(doc) as f:
        page = f.read()
    if BEGIN not in page or END not in page:
        sys.exit(f"{doc}: markers {BEGIN} / {END} not found")
    head, rest = page.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    with open(doc, "w") as f:
        f.write(head + BEGIN + "\n" + text + "\n" + END + tail)
    print(f"{doc}: generated table rewritten")


if __name__ == "__main__":
    main(sys.argv[1])
