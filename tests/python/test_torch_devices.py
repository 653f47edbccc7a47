"""BatchedPolicy on torch tensors against the same calls on NumPy arrays, bit
for bit after every call: state (slot table, counts, next slots, lengths,
scores), returned victims / freed counts / reclaimable pages, and the K/V
bytes. On ``cuda`` that is the CUDA backend (the Python package's launchers)
against the host backend; on ``cpu`` torch CPU tensors (DLPack) against
NumPy arrays (the buffer protocol), which is also what runs these tests'
own code where there is no GPU. The host backend itself is checked against
a reference written from the definitions in test_numpy_decisions.py.

Seeded streams over every policy and score input, float32 / float16 /
bfloat16 K/V, the four layouts, GQA groups of 1 and 4, ragged batches
(index lists and flags) and resets; prefill compression by every input;
multi-token append + evict_to; KeyDiff's running anchor. Then, CUDA only:
the kernels run on the stream the caller passes (or torch's current one),
the decode step replays from a CUDA graph and compiles with
torch.compile, and bad input raises the host's message and changes
nothing."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import kvevict as kv  # noqa: E402
from reference import LayerCache, ragged_schedule  # noqa: E402

DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
LAYOUTS = ["bhsd", "bshd", "paged_nhd", "paged_hnd"]
B, H, D = 3, 2, 16
BUDGET = 5
CAPACITY = 8  # above budget + 1: slots past the occupied ones exist and must be ignored
STEPS = 14
SEED = 0x1234_5678_9ABC  # above 2^32: both key words of random's Philox matter

CONFIGS = {
    "h2o": kv.H2OConfig(3, 2),
    "h2o_sinks_decay": kv.H2OConfig(2, 2, "max", decay=0.5, sinks=1),
    "tova": kv.H2OConfig.tova(3, 1, sinks=1),
    "recent_window": kv.RecentWindowConfig(sinks=2, window=3),
    "random": kv.RandomConfig(budget=BUDGET, sinks=1, recent=1, seed=SEED),
    "exact_greedy": kv.ExactGreedyConfig(budget=BUDGET, recent=1, sinks=1),
}
# Score inputs per policy: exact_greedy takes queries only; recent_window and
# random ignore scores (their inputs are still read and checked).
INPUTS = {
    "h2o": ["probs", "head_scores", "logits", "queries"],
    "h2o_sinks_decay": ["probs", "logits"],
    "tova": ["head_scores", "queries"],
    "recent_window": ["probs"],
    "random": ["queries"],
    "exact_greedy": ["queries"],
}


@pytest.fixture(params=["cpu", "cuda"])
def device(request):
    if request.param == "cuda" and not (kv.cuda_available and torch.cuda.is_available()):
        pytest.skip("needs the CUDA backend and a GPU")
    return request.param


def cuda_only():
    if not (kv.cuda_available and torch.cuda.is_available()):
        pytest.skip("needs the CUDA backend and a GPU")


# ---- conversions and bit comparisons -----------------------------------------------------


def to_torch(a, device):
    """A NumPy array (ml_dtypes bfloat16 included) as a torch tensor on device, same bits."""
    a = np.ascontiguousarray(a)
    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16).to(device)
    return torch.from_numpy(a.copy()).to(device)


def bits(x):
    """The bit patterns of a NumPy array or a torch tensor, as a NumPy array."""
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().contiguous()
        if x.dtype in (torch.float16, torch.bfloat16):
            return x.view(torch.int16).numpy()
        return x.view(torch.int32).numpy() if x.dtype == torch.float32 else x.numpy()
    x = np.ascontiguousarray(x)
    if x.dtype.kind in "fV":
        return x.view(np.int16 if x.dtype.itemsize == 2 else np.int32)
    return x


def on_host(tensors):
    """Tensors of one device as CPU tensors, copied in one transfer: each
    copy from a GPU waits for it, and these tests compare after every call
    (the CUDA tests share the GPU with the sanitizers' instrumented runs).
    On the CPU the same copy, so that CI runs this code too."""
    flat = torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors]).cpu()
    out, at = [], 0
    for t in tensors:
        n = t.numel() * t.element_size()
        out.append(flat[at : at + n].clone().view(t.dtype).reshape(t.shape))  # clone: aligned for the view
        at += n
    return out


def grid(rng, shape, dtype):
    """Values on a 1/8 grid in [-1, 1]: exact in every dtype."""
    return (rng.integers(-8, 9, shape) / 8).astype(dtype)


class Twin:
    """One layer on both sides: a NumPy policy and cache (the host backend,
    through the buffer protocol) and a torch policy and cache on `device`
    holding the same bytes. `call` makes the same call on both, converting
    NumPy arguments to torch tensors on the device."""

    CACHE = object()  # stands for the side's CacheView in `call`'s arguments

    def __init__(self, config, layout, dtype, device, rng, group=1, capacity=CAPACITY, **extra):
        self.device, self.group = device, group
        self.ref = kv.BatchedPolicy(config, B, H, capacity, num_q_heads=group * H, **extra)
        self.dut = kv.BatchedPolicy(config, B, H, capacity, num_q_heads=group * H, device=device, **extra)
        self.cache = LayerCache(layout, DTYPES[dtype], B, H, D, capacity, rng)
        c = self.cache
        self.k, self.v = to_torch(c.k, device), to_torch(c.v, device)
        self.table = None if c.table is None else to_torch(c.table, device)
        self.ref_view = kv.CacheView(c.k, c.v, layout, c.table)
        self.dut_view = kv.CacheView(self.k, self.v, layout, self.table)

    def convert(self, x):
        if x is Twin.CACHE:
            return self.dut_view
        if isinstance(x, np.ndarray):
            return to_torch(x, self.device)
        return x

    def call(self, name, *args, **kwargs):
        """The call on both sides; asserts equal results (arrays, or tuples of
        them) and returns the reference's."""
        ref_args = [self.ref_view if a is Twin.CACHE else a for a in args]
        ref_kwargs = {k: self.ref_view if a is Twin.CACHE else a for k, a in kwargs.items()}
        expected = getattr(self.ref, name)(*ref_args, **ref_kwargs)
        got = getattr(self.dut, name)(*[self.convert(a) for a in args], **{k: self.convert(a) for k, a in kwargs.items()})
        if self.device != "cpu":
            self.dut.check()  # the device's status word: raises what the host raised (nothing here)
        assert_same(got, expected, name)
        return expected

    def check(self, what=""):
        """The states and the K/V bytes are equal."""
        fields = ["positions", "counts", "next_slots", "lengths", "scores"]
        if self.ref.streams is not None:
            fields.append("streams")
        got = on_host([getattr(self.dut, f) for f in fields] + [self.k, self.v])
        expected = [getattr(self.ref, f) for f in fields] + [self.cache.k, self.cache.v]
        for name, g, e in zip(fields + ["K", "V"], got, expected):
            e = bits(e)  # as e's type: torch holds random's uint64 streams as int64
            np.testing.assert_array_equal(bits(g).view(e.dtype), e, err_msg=f"{name} {what}")

    def sync_cache(self):
        """Copies the NumPy cache (rows the test wrote there) to the device twin."""
        self.k.copy_(to_torch(self.cache.k, self.device))
        self.v.copy_(to_torch(self.cache.v, self.device))


def assert_same(got, expected, what):
    if isinstance(expected, tuple):
        assert isinstance(got, tuple) and len(got) == len(expected), what
        for g, e in zip(got, expected):
            assert_same(g, e, what)
    elif expected is None:
        assert got is None, what
    else:
        np.testing.assert_array_equal(bits(got), bits(expected), err_msg=what)


def score_input(kind, rng, twin, dtype, capacity=CAPACITY):
    """observe_evict's keyword arguments for one step of input `kind`."""
    Hq = twin.group * H
    lse = (rng.integers(4, 13, (B, Hq)) / 4).astype(np.float32)
    if kind == "probs":
        return dict(probs=rng.random((B, Hq, capacity), dtype=np.float32))
    if kind == "head_scores":
        return dict(head_scores=rng.random((B, H, capacity), dtype=np.float32))
    if kind == "logits":
        return dict(logits=rng.standard_normal((B, Hq, capacity), dtype=np.float32), lse=lse, scale=0.5)
    return dict(queries=grid(rng, (B, Hq, D), DTYPES[dtype]), lse=lse, scale=0.25, cache=Twin.CACHE)


def extra_for(name):
    if name == "exact_greedy":
        return dict(max_tokens=STEPS + 2, head_dim=D)
    return {}


# ---- the decode cycle --------------------------------------------------------------------


DECODE_CASES = [(p, i) for p, inputs in INPUTS.items() for i in inputs]


@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("name,kind", DECODE_CASES, ids=[f"{p}-{i}" for p, i in DECODE_CASES])
def test_decode_stream_equals_the_host(name, kind, dtype, layout, group, device):
    """append (fused K/V scatter) + observe_evict on a ragged stream, with a
    reset midway: the same victims, state and cache bytes after every call."""
    rng = np.random.default_rng([7, len(name), len(kind), len(dtype), len(layout), group])
    twin = Twin(CONFIGS[name], layout, dtype, device, rng, group=group, **extra_for(name))
    evictions = 0
    for step in range(STEPS):
        active, _ = ragged_schedule(step, rng, B)
        rows = grid(rng, (2, B, H, D), DTYPES[dtype])
        twin.call("append", active=active, cache=Twin.CACHE, k_new=rows[0], v_new=rows[1])
        victims = twin.call("observe_evict", active=active, **score_input(kind, rng, twin, dtype))
        evictions += int((victims >= 0).sum())
        twin.check(f"step {step}")
        if step == 8 and name != "exact_greedy":  # exact_greedy's history has no reset mid-stream here
            streams = np.array([5], np.int64) if name == "random" else None
            twin.call("reset", active=np.array([1], np.int32), streams=streams)
            twin.check("after reset")
    assert evictions > 0  # the stream reached the budget


# ---- prefill compression -----------------------------------------------------------------


PREFILL_CASES = [("h2o", "probs"), ("h2o", "column_sums"), ("h2o", "queries"), ("h2o_sinks_decay", "probs"),
                 ("tova", "queries"), ("recent_window", None), ("random", None)]  # fmt: skip


@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("name,kind", PREFILL_CASES, ids=[f"{p}-{i}" for p, i in PREFILL_CASES])
def test_prefill_then_decode_equals_the_host(name, kind, dtype, layout, group, device):
    """Ragged prompts compressed at once (one fits the budget, one is cut),
    returned pages, then a few decode steps from the compressed state."""
    rng = np.random.default_rng([11, len(name), len(kind or ""), len(dtype), len(layout), group])
    capacity = 16
    twin = Twin(CONFIGS[name], layout, dtype, device, rng, group=group, capacity=capacity)
    lengths = np.array([16, 4, 11], np.int32)
    for b, L in enumerate(lengths):
        for h in range(H):
            for s in range(L):
                twin.cache.k_row(b, h, s)[...] = grid(rng, D, DTYPES[dtype])
                twin.cache.v_row(b, h, s)[...] = grid(rng, D, DTYPES[dtype])
    twin.sync_cache()
    Hq, M = group * H, capacity
    inputs = {}
    if kind == "probs":
        inputs = dict(probs=np.tril(rng.random((B, Hq, M, M), dtype=np.float32)))
    elif kind == "column_sums":
        inputs = dict(column_sums=(rng.random((B, Hq, M), dtype=np.float32) * 4))
    elif kind == "queries":
        lse = (rng.integers(4, 13, (B, Hq, M)) / 4).astype(np.float32)
        inputs = dict(queries=grid(rng, (B, Hq, M, D), DTYPES[dtype]), lse=lse, scale=0.25)
    twin.call("prefill", lengths, cache=Twin.CACHE, max_length=M, **inputs)
    twin.check("after prefill")
    for step in range(4):
        rows = grid(rng, (2, B, H, D), DTYPES[dtype])
        twin.call("append", cache=Twin.CACHE, k_new=rows[0], v_new=rows[1])
        twin.call("observe_evict", probs=rng.random((B, Hq, capacity), dtype=np.float32))
        twin.check(f"decode step {step}")


# ---- multi-token steps -------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["bhsd", "paged_nhd"])
@pytest.mark.parametrize("name", ["h2o", "recent_window", "random", "exact_greedy"])
def test_append_tokens_and_evict_to_equal_the_host(name, layout, device):
    """Chunks of tokens appended at once, one observe_evict, then evict_to the
    budget: compaction in the cache, and the moves reported without it."""
    rng = np.random.default_rng([13, len(name), len(layout)])
    capacity, group, dtype = 16, 2, "bfloat16"
    extra = dict(max_tokens=40, head_dim=D) if name == "exact_greedy" else {}
    twin = Twin(CONFIGS[name], layout, dtype, device, rng, group=group, capacity=capacity, **extra)
    for i, chunk in enumerate((6, 4, 7, 3)):
        counts, next_slots, first = twin.ref.counts.copy(), twin.ref.next_slots.copy(), twin.ref.lengths.copy()
        twin.call("append_tokens", chunk)
        twin.check(f"append_tokens {chunk}")
        for b in range(B):  # the caller writes the new rows, the same on both sides
            for h in range(H):
                for j in range(chunk):
                    s = next_slots[b, h] if (j == 0 and next_slots[b, h] >= 0) else counts[b, h] + j
                    assert twin.ref.positions[b, h, s] == first[b] + j
                    twin.cache.k_row(b, h, s)[...] = grid(rng, D, DTYPES[dtype])
                    twin.cache.v_row(b, h, s)[...] = grid(rng, D, DTYPES[dtype])
        twin.sync_cache()
        queries = dict(queries=grid(rng, (B, group * H, D), DTYPES[dtype]),
                       lse=np.full((B, group * H), 2.0, np.float32), scale=0.3)  # fmt: skip
        if name == "exact_greedy":
            twin.call("observe_evict", cache=Twin.CACHE, **queries)
            twin.call("evict_to", BUDGET, cache=Twin.CACHE, **queries)
        else:
            twin.call("observe_evict", probs=rng.random((B, group * H, capacity), dtype=np.float32))
            if i % 2 == 0:
                twin.call("evict_to", BUDGET, cache=Twin.CACHE)
            else:  # moves reported for the caller to apply, here to both caches alike
                moves, move_counts = twin.call("evict_to", BUDGET)
                for b in range(B):
                    for h in range(H):
                        for frm, to in moves[b, h, : move_counts[b, h]]:
                            twin.cache.k_row(b, h, to)[...] = twin.cache.k_row(b, h, frm).copy()
                            twin.cache.v_row(b, h, to)[...] = twin.cache.v_row(b, h, frm).copy()
                twin.sync_cache()
        twin.check(f"evict_to after chunk {chunk}")


# ---- keys-only scores ----------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("score", ["key_norms", "key_diff"])
def test_key_scored_decode_equals_the_host(score, dtype, layout, device):
    """Key-norm and KeyDiff steps from the cached keys (KeyDiff's running
    anchor through appends, evictions and a reset)."""
    rng = np.random.default_rng([17, len(score), len(dtype), len(layout)])
    twin = Twin(kv.H2OConfig.key_norm(3, 1, 1), layout, dtype, device, rng, head_dim=D)
    for step in range(STEPS):
        active, _ = ragged_schedule(step, rng, B)
        rows = grid(rng, (2, B, H, D), DTYPES[dtype])
        twin.call("append", active=active, cache=Twin.CACHE, k_new=rows[0], v_new=rows[1])
        twin.call(f"observe_evict_{score}", Twin.CACHE, active=active)
        twin.check(f"step {step}")
        if step == 9:
            twin.call("reset", active=np.array([0, 2], np.int32))


# ---- CUDA: streams, graphs, torch.compile, refusals ---------------------------------------


def cuda_twin(rng, name="h2o", group=2):
    return Twin(CONFIGS[name], "paged_hnd", "bfloat16", "cuda", rng, group=group)


def fill(twin, rng, steps=BUDGET + 2):
    """Steps until every head is at the budget."""
    for _ in range(steps):
        rows = grid(rng, (2, B, H, D), ml_dtypes.bfloat16)
        twin.call("append", cache=Twin.CACHE, k_new=rows[0], v_new=rows[1])
        twin.call("observe_evict", probs=rng.random((B, twin.group * H, CAPACITY), dtype=np.float32))


@pytest.mark.parametrize("how", ["argument", "current stream"])
def test_cuda_calls_run_on_the_callers_stream(how):
    """The step's inputs are written on a side stream behind a long GPU
    sleep; kvevict must run after them on that stream, given as the
    `stream` argument or as torch's current stream. On any other stream it
    would read the inputs before they are written (zeros), which this
    stream's probabilities are checked to tell apart."""
    cuda_only()
    rng = np.random.default_rng(19)
    twin = cuda_twin(rng)
    fill(twin, rng)
    rows = grid(rng, (2, B, H, D), ml_dtypes.bfloat16)
    Hq, g = twin.group * H, twin.group
    # The precondition: the inputs read too early (zeros) evict other slots
    # than these probabilities, which lift the slots zeros would evict.
    zeros_ref = kv.BatchedPolicy(twin.ref.config, B, H, CAPACITY, num_q_heads=Hq)
    zeros_ref.state[...] = twin.ref.state
    zeros_ref.append()
    zero_victims = zeros_ref.observe_evict(probs=np.zeros((B, Hq, CAPACITY), np.float32))
    probs = rng.random((B, Hq, CAPACITY), dtype=np.float32)
    for b in range(B):
        for q in range(Hq):
            probs[b, q, zero_victims[b, q // g]] += 10
    twin.ref.append(cache=twin.ref_view, k_new=rows[0], v_new=rows[1])
    expected = twin.ref.observe_evict(probs=probs)
    assert (zero_victims >= 0).all() and not np.array_equal(zero_victims, expected)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    k_new, v_new, p = (torch.zeros(x.shape, dtype=t, device="cuda") for x, t in
                       ((rows[0], torch.bfloat16), (rows[1], torch.bfloat16), (probs, torch.float32)))  # fmt: skip
    sources = [to_torch(rows[0], "cuda"), to_torch(rows[1], "cuda"), to_torch(probs, "cuda")]
    victims = torch.full((B, H), -2, dtype=torch.int32, device="cuda")
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # a few tens of milliseconds of GPU time
        for dst, src in zip((k_new, v_new, p), sources):
            dst.copy_(src)
    if how == "argument":
        twin.dut.append(cache=twin.dut_view, k_new=k_new, v_new=v_new, stream=side)
        twin.dut.observe_evict(probs=p, out=victims, stream=side)
    else:
        with torch.cuda.stream(side):
            twin.dut.append(cache=twin.dut_view, k_new=k_new, v_new=v_new)
            twin.dut.observe_evict(probs=p, out=victims)
    torch.cuda.synchronize()
    twin.dut.check()
    np.testing.assert_array_equal(victims.cpu().numpy(), expected)
    twin.check("after the side stream's step")


def test_cuda_graph_replays_the_decode_step():
    """append + observe_evict captured once in a CUDA graph, replayed with new
    inputs copied into its static buffers: every replay equals the host's step."""
    cuda_only()
    rng = np.random.default_rng(23)
    twin = cuda_twin(rng)
    fill(twin, rng, 2)
    Hq = twin.group * H
    k_new = torch.zeros(B, H, D, dtype=torch.bfloat16, device="cuda")
    v_new, probs = torch.zeros_like(k_new), torch.zeros(B, Hq, CAPACITY, device="cuda")
    before = twin.dut.state.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):  # captured, not run
        twin.dut.append(cache=twin.dut_view, k_new=k_new, v_new=v_new)
        victims = twin.dut.observe_evict(probs=probs)
    torch.cuda.synchronize()
    assert torch.equal(twin.dut.state, before)
    for step in range(10):
        rows = grid(rng, (2, B, H, D), ml_dtypes.bfloat16)
        x = rng.random((B, Hq, CAPACITY), dtype=np.float32)
        k_new.copy_(to_torch(rows[0], "cuda"))
        v_new.copy_(to_torch(rows[1], "cuda"))
        probs.copy_(to_torch(x, "cuda"))
        graph.replay()
        torch.cuda.synchronize()
        twin.dut.check()
        twin.ref.append(cache=twin.ref_view, k_new=rows[0], v_new=rows[1])
        np.testing.assert_array_equal(victims.cpu().numpy(), twin.ref.observe_evict(probs=x), err_msg=f"replay {step}")
        twin.check(f"replay {step}")


def test_cuda_decode_step_compiles():
    """The same step through torch.compile (the custom ops and their fake
    kernels, fullgraph) on CUDA tensors equals the host."""
    cuda_only()
    torch._dynamo.reset()
    rng = np.random.default_rng(29)
    twin = cuda_twin(rng)

    def step(policy, view, k_new, v_new, probs):
        policy.append(cache=view, k_new=k_new, v_new=v_new)
        return policy.observe_evict(probs=probs)

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    for i in range(9):
        rows = grid(rng, (2, B, H, D), ml_dtypes.bfloat16)
        x = rng.random((B, twin.group * H, CAPACITY), dtype=np.float32)
        got = compiled(twin.dut, twin.dut_view, to_torch(rows[0], "cuda"), to_torch(rows[1], "cuda"), to_torch(x, "cuda"))
        twin.dut.check()
        twin.ref.append(cache=twin.ref_view, k_new=rows[0], v_new=rows[1])
        np.testing.assert_array_equal(got.cpu().numpy(), twin.ref.observe_evict(probs=x), err_msg=f"step {i}")
        twin.check(f"compiled step {i}")


def raises_alike(twin, name, **kwargs):
    """A call the host refuses with bad data: the device records it and
    check() raises the same exception and message; then the states agree
    (the refused heads unchanged, the rest of the batch stepped)."""
    with pytest.raises(kv.Error) as host_error:
        getattr(twin.ref, name)(**{k: twin.ref_view if a is Twin.CACHE else a for k, a in kwargs.items()})
    getattr(twin.dut, name)(**{k: twin.convert(a) for k, a in kwargs.items()})
    with pytest.raises(kv.Error) as device_error:
        twin.dut.check()
    assert type(device_error.value) is type(host_error.value)
    assert str(device_error.value) == str(host_error.value)
    twin.dut.check()  # check() cleared it
    twin.check(f"after the refused {name}")
    return host_error.value


def test_cuda_refusals_raise_the_host_message_and_change_what_the_host_changes():
    cuda_only()
    rng = np.random.default_rng(31)
    twin = cuda_twin(rng)
    fill(twin, rng)
    Hq = twin.group * H
    twin.call("append", cache=Twin.CACHE, k_new=grid(rng, (B, H, D), ml_dtypes.bfloat16),
              v_new=grid(rng, (B, H, D), ml_dtypes.bfloat16))  # fmt: skip
    before = twin.dut.state.clone()
    # A host tensor for a CUDA policy: refused before any launch, naming the argument.
    with pytest.raises(kv.InvalidArgument, match="probs"):
        twin.dut.observe_evict(probs=torch.rand(B, Hq, CAPACITY))
    assert torch.equal(twin.dut.state, before)
    # A NaN: found on the device; that head unchanged, the rest of the batch steps.
    bad = rng.random((B, Hq, CAPACITY), dtype=np.float32)
    bad[1, 2, 3] = np.nan  # sequence 1, query head 2: KV head 1 of a group of 2
    error = raises_alike(twin, "observe_evict", probs=bad)
    assert isinstance(error, kv.NonFiniteError)
    # The retry of sequence 1 completes the refused head's step and reports
    # the head that had stepped as not appended, as on the host.
    retry = dict(probs=rng.random((B, Hq, CAPACITY), dtype=np.float32), active=np.array([1], np.int32))
    assert isinstance(raises_alike(twin, "observe_evict", **retry), kv.StateError)
