"""Compares a smoke run of the fidelity evaluation with the recorded one
(scripts/fidelity/smoke.sh): perplexities within 0.5% (relative), top-1
agreement within 0.01, needle answers exactly. The tolerance covers another
compiler's or CPU's float rounding; a changed policy decision moves these
figures by more.

    smoke_check.py EXPECTED.json PPL.json NEEDLE.json           check
    smoke_check.py --record EXPECTED.json PPL.json NEEDLE.json  write EXPECTED.json
"""
import json
import sys

PPL_REL, AGREE_ABS = 5e-3, 1e-2


def figures(ppl_path, needle_path):
    with open(ppl_path) as f:
        ppl = json.load(f)
    with open(needle_path) as f:
        needle = json.load(f)
    return {
        "perplexity": [{k: r[k] for k in ("policy", "percent", "ppl_evicted", "ppl_all", "top1_agreement")}
                       for r in ppl["results"]],
        "needle": [{k: r[k] for k in ("setting", "policy", "percent", "length", "correct", "trials", "by_depth")}
                   for r in needle["results"]],
    }


def main(argv):
    record = argv[:1] == ["--record"]
    if record:
        argv = argv[1:]
    expected_path, ppl_path, needle_path = argv
    got = figures(ppl_path, needle_path)
    if record:
        with open(expected_path, "w") as f:
            json.dump(got, f, indent=1)
            f.write("\n")
        print(f"recorded {expected_path}")
        return 0
    with open(expected_path) as f:
        want = json.load(f)
    errors = []
    if [(r["policy"], r["percent"]) for r in got["perplexity"]] != [(r["policy"], r["percent"]) for r in want["perplexity"]]:
        errors.append("perplexity rows differ: %s" % [(r["policy"], r["percent"]) for r in got["perplexity"]])
    for g, w in zip(got["perplexity"], want["perplexity"]):
        for k in ("ppl_evicted", "ppl_all"):
            if w[k] and abs(g[k] / w[k] - 1) > PPL_REL:
                errors.append(f"{g['policy']} {g['percent']}%: {k} {g[k]:.4f}, recorded {w[k]:.4f}")
        if abs(g["top1_agreement"] - w["top1_agreement"]) > AGREE_ABS:
            errors.append(f"{g['policy']} {g['percent']}%: top-1 agreement {g['top1_agreement']:.4f}, "
                          f"recorded {w['top1_agreement']:.4f}")
    if got["needle"] != want["needle"]:
        errors.append(f"needle answers differ:\n  got      {got['needle']}\n  recorded {want['needle']}")
    for e in errors:
        print("fidelity smoke:", e)
    print("fidelity smoke:", "FAILED" if errors else
          f"{len(got['perplexity'])} perplexity rows and {len(got['needle'])} needle rows match the recorded run")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
