#!/usr/bin/env python3
"""Static proxies of the CUDA hot kernels' speed, checked without a GPU.

Compiles hot_kernels.cu for one architecture with ptxas' resource report
(-Xptxas -v) and to PTX, then holds every kernel named in budgets.txt to its
budget: registers, stack, spill stores and loads (bytes), and local-memory
and 16-byte global loads counted in its PTX. A kernel over budget, a budget
that names no kernel, or a kernel that matches two budgets fails the check.
The review behind the numbers: docs/gpu.md, "Static proxies".

  check_proxies.py --nvcc nvcc --include include --arch sm_90 [--report out.md]
"""
import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
LIMITS = ("regs", "stack", "spill_stores", "spill_loads", "local_ptx")  # measured <= budget
FLOORS = ("v4_loads",)  # measured >= budget


def demangle(names):
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True, check=True).stdout
    return dict(zip(names, out.splitlines()))


def ptxas_report(text):
    """{mangled name: {regs, stack, spill_stores, spill_loads}} from -Xptxas -v output."""
    kernels, current = {}, None
    for line in text.splitlines():
        m = re.search(r"Compiling entry function '([^']+)'", line)
        if m:
            current = kernels.setdefault(m.group(1), {})
            continue
        if current is None:
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            current.update(stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
        m = re.search(r"Used (\d+) registers", line)
        if m:
            current["regs"] = int(m.group(1))
    return kernels


def ptx_counts(text):
    """{mangled name: {v4_loads, local_ptx}} from PTX: per .entry body."""
    counts, current = {}, None
    for line in text.splitlines():
        m = re.match(r"\s*\.(?:visible\s+)?\.entry\s+([\w$]+)", line)
        if m:
            current = counts.setdefault(m.group(1), {"v4_loads": 0, "local_ptx": 0})
            continue
        if current is None:
            continue
        if re.search(r"\bld\.global[\w.]*\.v4\b", line):
            current["v4_loads"] += 1
        if re.search(r"\b(ld|st)\.local\b", line):
            current["local_ptx"] += 1
    return counts


def read_budgets(path):
    budgets = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        pattern, *fields = line.split("|")
        values = {}
        for item in " ".join(fields).split():
            key, _, value = item.partition("=")
            if key not in LIMITS + FLOORS:
                sys.exit(f"{path}:{n}: unknown field {key!r}")
            values[key] = int(value)
        budgets.append((pattern.strip(), values, n))
    return budgets


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--nvcc", default="nvcc")
    ap.add_argument("--include", required=True)
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--budgets", default=str(HERE / "budgets.txt"))
    ap.add_argument("--report", help="write the measured table (markdown) here")
    args = ap.parse_args()
    source = HERE / "hot_kernels.cu"
    flags = ["-O3", "-std=c++17", f"-arch={args.arch}", f"-I{args.include}"]
    with tempfile.TemporaryDirectory() as tmp:
        cubin = subprocess.run([args.nvcc, *flags, "-cubin", "-Xptxas", "-v", str(source), "-o", f"{tmp}/k.cubin"],
                               capture_output=True, text=True)
        if cubin.returncode:
            sys.exit(f"nvcc -cubin failed:\n{cubin.stderr}")
        ptx = subprocess.run([args.nvcc, *flags, "-ptx", str(source), "-o", f"{tmp}/k.ptx"], capture_output=True,
                             text=True)
        if ptx.returncode:
            sys.exit(f"nvcc -ptx failed:\n{ptx.stderr}")
        measured = ptxas_report(cubin.stderr + cubin.stdout)
        for name, c in ptx_counts(Path(f"{tmp}/k.ptx").read_text()).items():
            measured.setdefault(name, {}).update(c)
    names = demangle(sorted(measured))
    failures, rows = [], []
    budgets = read_budgets(Path(args.budgets))
    matched = {}
    for pattern, values, line in budgets:
        hits = [m for m in measured if re.search(pattern, names[m])]
        if not hits:
            failures.append(f"budgets.txt:{line}: {pattern!r} names no kernel of hot_kernels.cu")
        for m in hits:
            if m in matched:
                failures.append(f"budgets.txt:{line}: {names[m][:90]} already matched line {matched[m]}")
            matched[m] = line
            got = measured[m]
            for key, limit in values.items():
                value = got.get(key, 0)
                bad = value < limit if key in FLOORS else value > limit
                if bad:
                    failures.append(f"{names[m][:110]}: {key} = {value}, budget {'>=' if key in FLOORS else '<='} "
                                    f"{limit} (budgets.txt:{line})")
            rows.append((names[m], got))
    header = "| kernel | regs | stack B | spill st/ld B | local (PTX) | 16-B loads (PTX) |"
    table = [header, "|---|---|---|---|---|---|"]
    for name, got in rows:
        short = name.replace("void kvevict::gpu::detail::", "").replace("<(kvevict::input_form)1>", "")
        short = short[: short.rfind(">(") + 1] if ">(" in short else short
        short = short.replace("kvevict::", "").replace("gpu::detail::segmented_select_tuning", "tuning")
        table.append(f"| `{short}` | {got.get('regs', '?')} | {got.get('stack', 0)} | {got.get('spill_stores', 0)}/"
                     f"{got.get('spill_loads', 0)} | {got.get('local_ptx', 0)} | {got.get('v4_loads', 0)} |")
    print("\n".join(table))
    if args.report:
        Path(args.report).write_text("\n".join(table) + "\n")
    if failures:
        print("\nover budget:\n  " + "\n  ".join(failures))
        return 1
    print(f"\n{len(rows)} kernels within their budgets ({args.arch})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
