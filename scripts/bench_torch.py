#!/usr/bin/env python3
"""The PyTorch baselines of kvevict_bench_cuda, timed the same way, written
as Google Benchmark JSON so scripts/bench_report.py reads them as one more
run file (executable "bench_torch.py").

  python3 scripts/bench_torch.py --out build-gpu-bench/bench-torch-run1.json
  python3 scripts/bench_torch.py --filter '/S5/' --reps 3 --min-time 0.2

Rows (names as benchmarks/cuda/, family/method/input/scenario/keep/dist/dtype):

- gpu_select/torch_topk/{bottom,top}/S1-S3/keep20|keep50/<dist>/f32:
  torch.topk(sorted=False) of every segment (B x KV heads rows of N scores);
- gpu_select/torch_topk_sorted/...: the same, then the k indices sorted, the
  nearest torch gets to kvevict's output (indices in position order; here
  positions are the indices). Neither is deterministic under ties, nor
  breaks them by position as kvevict does. Items and bytes are counted as
  the kvevict rows (N keys; 8 bytes a key read, 4 a selected index
  written), so ratios of items/s are ratios of time.
- gpu_decode/torch_compile/probs/S0-S5/evict1/powerlaw/f32: the h2o decode
  step written in PyTorch (scores += probs folded over the GQA group; mask
  the protected: 4 sinks and the recent 64; argmin; reset the victim's score
  and give its slot the new position) under torch.compile, the 32 layers'
  compiled steps captured in one CUDA graph;
  gpu_decode/torch_eager_graph/...: the same step uncompiled, in a graph.
  Items and bytes as gpu_decode (one (sequence, KV head) step; the
  probabilities plus 12 bytes of state a slot).

Cold, as the C++ suite (docs/benchmarks.md, "GPU"): 32 layers, each with its own
buffers, in one CUDA graph; before each replay (outside the CUDA events) a
write of twice the L2 evicts the last replay's data; time per layer =
replay / 32. Each repetition runs replays for at least --min-time seconds
and reports their mean; the JSON holds mean / median / stddev aggregates
over --reps repetitions, as --benchmark_repetitions does. The JSON is
rewritten after every row, so a run cut short by a time limit keeps the
rows it measured.
"""
import argparse
import datetime
import json
import os
import re
import statistics
import sys

# (name, B, KV heads, group, N, head_dim): the scenarios of docs/benchmarks.md.
SCENARIOS = [("S0", 24, 32, 1, 820, 128), ("S1", 64, 8, 4, 4096, 128), ("S2", 16, 8, 4, 32768, 128),
             ("S3", 1, 8, 4, 131072, 128), ("S4", 32, 32, 1, 8192, 64), ("S5", 1, 8, 4, 1024, 128),
             ("L8", 64, 8, 4, 16384, 128)]
KEEPS = [("keep20", 20), ("keep50", 50)]
DISTRIBUTIONS = ["powerlaw", "uniform", "neartie"]
LAYERS = 32
RECENT, SINKS = 64, 4


def scores_like(torch, shape, row, dist, gen):
    """Values shaped like benchmarks/bench_common.hpp's probabilities()."""
    u = torch.rand(shape, generator=gen, device="cuda", dtype=torch.float32)
    scale = 1.0 / row
    if dist == "powerlaw":
        return u.pow(8.0) * scale
    if dist == "uniform":
        return u * scale
    ulps = torch.randint(0, 4, shape, generator=gen, device="cuda").float()
    return torch.full(shape, scale, device="cuda").nextafter(torch.tensor(1.0, device="cuda")) + ulps * 1e-7 * scale


class ColdTimer:
    """Captures `layers` calls into one CUDA graph and times its replays."""

    def __init__(self, torch, layer_calls, min_time, reps):
        self.torch, self.min_time, self.reps = torch, min_time, reps
        l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20) or (50 << 20)
        self.flush = torch.empty(2 * l2, dtype=torch.uint8, device="cuda")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside capture: compilation, autotuning, allocator
            for _ in range(3):
                for call in layer_calls:
                    call()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            for call in layer_calls:
                call()
        self.layers = len(layer_calls)

    def run(self):
        """Per repetition: (iterations, mean seconds per layer)."""
        torch = self.torch
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self.graph.replay()
        torch.cuda.synchronize()
        out = []
        for _ in range(self.reps):
            times = []
            while not times or sum(times) * self.layers < self.min_time:
                self.flush.fill_(0x5A)
                start.record()
                self.graph.replay()
                stop.record()
                stop.synchronize()
                times.append(start.elapsed_time(stop) * 1e-3 / self.layers)
            out.append((len(times), statistics.fmean(times)))
        return out


def select_rows(torch, args, measure):
    gen = torch.Generator(device="cuda")
    gen.manual_seed(11)
    for name, b, h, _, n, _ in SCENARIOS:
        if name not in ("S1", "S2", "S3"):
            continue
        segments = b * h
        for keep, percent in KEEPS:
            k = n * percent // 100
            for end in ("bottom", "top"):
                for dist in DISTRIBUTIONS:
                    if not (end == "bottom" and percent == 20) and dist != "powerlaw":
                        continue
                    largest = end == "top"
                    layers = [scores_like(torch, (segments, n), 1, dist, gen) for _ in range(LAYERS)]
                    items, nbytes = segments * n, segments * (n * 8 + k * 4)

                    def topk(x):
                        return lambda: torch.topk(x, k, dim=-1, largest=largest, sorted=False)

                    def topk_sorted(x):
                        return lambda: torch.sort(torch.topk(x, k, dim=-1, largest=largest, sorted=False).indices,
                                                  dim=-1)

                    for method, make in (("torch_topk", topk), ("torch_topk_sorted", topk_sorted)):
                        row = f"gpu_select/{method}/{end}/{name}/{keep}/{dist}/f32"
                        if re.search(args.filter, row):
                            measure(row, [make(x) for x in layers], items, nbytes)
                    del layers
                    torch.cuda.empty_cache()


def decode_step(torch, b, h, g, n):
    """One layer's h2o step in PyTorch; every tensor is updated in place."""

    def step(scores, positions, probs, length):
        scores += probs.view(b, h, g, n).sum(dim=2)
        protected = (positions >= length - RECENT) | (positions < SINKS)
        victim = scores.masked_fill(protected, float("inf")).argmin(dim=-1, keepdim=True)
        scores.scatter_(-1, victim, 0.0)
        positions.scatter_(-1, victim, length.expand_as(victim).to(positions.dtype))
        length += 1

    return step


def decode_rows(torch, args, measure):
    gen = torch.Generator(device="cuda")
    gen.manual_seed(1)
    for name, b, h, g, n, _ in SCENARIOS:
        items = b * h
        nbytes = b * h * g * n * 4 + b * h * n * 12
        step = decode_step(torch, b, h, g, n)
        for method, fn in (("torch_compile", None), ("torch_eager_graph", step)):
            row = f"gpu_decode/{method}/probs/{name}/evict1/powerlaw/f32"
            if not re.search(args.filter, row):
                continue
            if fn is None:
                torch._dynamo.reset()
                fn = torch.compile(step, fullgraph=True, dynamic=False)
            layers = []
            for _ in range(LAYERS):
                perm = torch.argsort(torch.rand((b * h, n), generator=gen, device="cuda"), dim=-1)
                layers.append((torch.zeros((b, h, n), device="cuda"),
                               perm.view(b, h, n).to(torch.int32).contiguous(),
                               scores_like(torch, (b, h * g, n), n, "powerlaw", gen),
                               torch.tensor(n, device="cuda", dtype=torch.int64)))
            calls = [(lambda layer=layer: fn(*layer)) for layer in layers]
            measure(row, calls, items, nbytes)
            del layers, calls
            torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench-torch.json", help="Google Benchmark JSON to write")
    ap.add_argument("--filter", default=".", help="regular expression on row names (as --benchmark_filter)")
    ap.add_argument("--reps", type=int, default=5, help="repetitions (median reported)")
    ap.add_argument("--min-time", type=float, default=0.3, help="seconds of replays per repetition")
    args = ap.parse_args()
    try:
        import torch
    except ImportError:
        print("bench_torch.py: torch is not importable; no torch baselines", file=sys.stderr)
        return 77
    if not torch.cuda.is_available():
        print("bench_torch.py: no CUDA device; no torch baselines", file=sys.stderr)
        return 77
    prop = torch.cuda.get_device_properties(0)
    benchmarks = []
    context = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "host_name": os.uname().nodename,
               "executable": "bench_torch.py", "num_cpus": os.cpu_count(), "mhz_per_cpu": 0,
               "library_build_type": "release", "torch_version": torch.__version__, "cuda_version": torch.version.cuda,
               "device": prop.name, "layers": LAYERS}

    def write():
        """The JSON so far, rewritten after every row: a run stopped by a time limit keeps the rows it measured."""
        with open(args.out + ".part", "w") as f:
            json.dump({"context": context, "benchmarks": benchmarks}, f, indent=1)
        os.replace(args.out + ".part", args.out)

    def emit(row, reps, items, nbytes):
        means = [t for _, t in reps]
        aggregates = {"mean": statistics.fmean(means), "median": statistics.median(means),
                      "stddev": statistics.stdev(means) if len(means) > 1 else 0.0}
        for agg, t in aggregates.items():
            rate = 0.0 if agg == "stddev" or t <= 0 else 1.0 / t  # bench_report.py reads the median
            benchmarks.append({"name": f"{row}_{agg}", "run_name": row, "run_type": "aggregate",
                               "repetitions": len(reps), "threads": 1, "aggregate_name": agg,
                               "aggregate_unit": "time", "iterations": sum(i for i, _ in reps),
                               "real_time": t * 1e6, "cpu_time": t * 1e6, "time_unit": "us",
                               "items_per_second": items * rate, "bytes_per_second": nbytes * rate})
        write()
        print(f"{row:70s} {aggregates['median'] * 1e6:10.2f} us/layer", flush=True)

    failures = []

    def measure(row, calls, items, nbytes):
        """Times one row; a failure (e.g. capture refused) is reported, and the others still run."""
        try:
            emit(row, ColdTimer(torch, calls, args.min_time, args.reps).run(), items, nbytes)
        except Exception as e:  # noqa: BLE001 - any failure of one row must not lose the others
            failures.append(row)
            print(f"{row}: FAILED: {type(e).__name__}: {e}", file=sys.stderr, flush=True)

    select_rows(torch, args, measure)
    decode_rows(torch, args, measure)
    write()
    if failures:
        print(f"bench_torch.py: {len(failures)} rows failed: {', '.join(failures)}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
