"""Key-norm prefill (``BatchedPolicy.prefill_key_norms``,
``SequencePolicy.prefill_key_norms``, ``torch.ops.kvevict.prefill_key_norms``)
against a pure-NumPy reference written here from the definition: position
``p`` of (b, h) scores ``-||k||_2`` of the key in slot ``p``; a prompt of
``L <= budget`` tokens is kept whole, otherwise the first ``sinks``, the last
``recent`` and the ``kept`` positions of the smallest norm between them (the
newer on a tie) stay, and their K and V rows move in position order to slots
``[0, kept)``; a paged cache gets back ``max(0, pages(L) - pages(min(budget +
1, capacity)))`` trailing pages. Keys lie on a coarse grid ({-1, 0, 1}, or
multiples of 1/32), so every square and sum is exact in every dtype, norms
compare exactly and tie at the cut (the tests count those ties)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import kvevict as kv
from kvevict import _ext
from fake_dlpack import FakeCudaArray

DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
LAYOUTS = ["bhsd", "bshd", "paged_nhd", "paged_hnd"]
B, H, D, PAGE = 4, 2, 8, 4


class Cache:
    """One layer's K and V buffers in a layout, and the rows of logical slot (b, h, s)."""

    def __init__(self, layout, dtype, capacity, rng):
        self.layout = layout
        self.table = None
        if layout in ("bhsd", "bshd"):
            shape = (B, H, capacity, D) if layout == "bhsd" else (B, capacity, H, D)
        else:
            pages = -(-capacity // PAGE)
            num_pages = pages * B + 1  # one page no sequence uses
            shape = (num_pages, PAGE, H, D) if layout == "paged_nhd" else (num_pages, H, PAGE, D)
            self.table = rng.permutation(num_pages)[: pages * B].reshape(B, pages).astype(np.int32)
        self.k = np.zeros(shape, dtype)
        self.v = np.zeros(shape, dtype)
        self.view = kv.CacheView(self.k, self.v, layout, self.table)

    def copy(self):
        other = object.__new__(Cache)
        other.layout, other.table = self.layout, None if self.table is None else self.table.copy()
        other.k, other.v = self.k.copy(), self.v.copy()
        other.view = kv.CacheView(other.k, other.v, other.layout, other.table)
        return other

    def _row(self, x, b, h, s):
        if self.layout == "bhsd":
            return x[b, h, s]
        if self.layout == "bshd":
            return x[b, s, h]
        page = self.table[b, s // PAGE]
        return x[page, s % PAGE, h] if self.layout == "paged_nhd" else x[page, h, s % PAGE]

    def k_row(self, b, h, s):
        return self._row(self.k, b, h, s)

    def v_row(self, b, h, s):
        return self._row(self.v, b, h, s)


def fill_prompts(cache, lengths, rng, seed, dtype):
    """Writes grid keys and random values into slots [0, L) of every (b, h);
    returns the exact squared norms, squares[b][h][p]."""
    squares = [[[] for _ in range(H)] for _ in range(B)]
    for b in range(B):
        for h in range(H):
            for p in range(lengths[b]):
                if seed % 2 == 0:
                    k = rng.integers(-1, 2, D).astype(np.float32)
                else:
                    k = rng.integers(-64, 65, D).astype(np.float32) / 32
                cache.k_row(b, h, p)[...] = k.astype(dtype)
                cache.v_row(b, h, p)[...] = rng.standard_normal(D).astype(np.float32).astype(dtype)
                squares[b][h].append(float(np.sum(np.asarray(cache.k_row(b, h, p), np.float64) ** 2)))
    return squares


def reference_keep(squares, length, kept, recent, sinks):
    """The kept positions, ascending, and whether the tie rule decided the cut."""
    if length <= kept + recent + sinks:
        return list(range(length)), False
    protected = [p for p in range(length) if p < sinks or p >= length - recent]
    between = [p for p in range(length) if sinks <= p < length - recent]
    between.sort(key=lambda p: (squares[p], -p))  # smallest norm first, the newer on a tie
    tie = len(between) > kept and squares[between[kept - 1]] == squares[between[kept]]
    return sorted(protected + between[:kept]), tie


def reference_reclaimable(layout, length, budget, capacity):
    if layout in ("bhsd", "bshd"):
        return 0
    pages = lambda n: -(-n // PAGE)  # noqa: E731
    return max(0, pages(length) - pages(min(budget + 1, capacity)))


def as_bytes(row):
    return np.ascontiguousarray(row).tobytes()


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_prefill_equals_the_reference(dtype, layout, group, seed, cut_ties):
    rng = np.random.default_rng(seed * 1000 + group * 10 + LAYOUTS.index(layout) + 100 * list(DTYPES).index(dtype))
    kept, recent, sinks = int(rng.integers(1, 6)), int(rng.integers(0, 3)), int(rng.integers(0, 3))
    config = kv.H2OConfig.key_norm(kept, recent, sinks)
    budget = config.budget
    capacity = budget + 1 + int(rng.integers(0, 12))
    lengths = [int(rng.integers(budget + 1, capacity + 1)) if rng.random() < 0.75 else int(rng.integers(1, capacity + 1))
               for _ in range(B)]  # fmt: skip
    cache = Cache(layout, DTYPES[dtype], capacity, rng)
    squares = fill_prompts(cache, lengths, rng, seed, DTYPES[dtype])
    before = cache.copy()
    single_cache = cache.copy()
    # An index list of active sequences on odd seeds: the others stay untouched.
    active = np.array([3, 0, 2], np.int32) if seed % 2 else None
    stepped = [0, 2, 3] if seed % 2 else list(range(B))
    policy = kv.BatchedPolicy(config, B, H, capacity, num_q_heads=H * group)
    single = kv.SequencePolicy(config, B, H, capacity, num_q_heads=H * group)
    if seed % 2:
        reclaimable = policy.prefill_key_norms(np.array(lengths, np.int32), cache=cache.view, active=active)
    else:
        reclaimable = policy.prefill_key_norms(lengths, cache=cache.view, max_length=capacity)
    for b in range(B):
        if b not in stepped:
            assert reclaimable[b] == 0 and (policy.positions[b] == -1).all() and (policy.counts[b] == 0).all()
            assert policy.lengths[b] == 0
            for h in range(H):
                for s in range(capacity):
                    assert as_bytes(cache.k_row(b, h, s)) == as_bytes(before.k_row(b, h, s))
                    assert as_bytes(cache.v_row(b, h, s)) == as_bytes(before.v_row(b, h, s))
            continue
        length = lengths[b]
        want_pages = reference_reclaimable(layout, length, budget, capacity)
        assert reclaimable[b] == want_pages, b
        assert policy.lengths[b] == length
        if seed % 2:
            got = single.prefill_key_norms(b, length, single_cache.view)
        else:
            got = single.prefill_key_norms(b, length, single_cache.k, single_cache.v, layout, single_cache.table)
        for h in range(H):
            want, tie = reference_keep(squares[b][h], length, kept, recent, sinks)
            cut_ties[0] += tie
            assert got == (len(want), want_pages)
            assert policy.counts[b, h] == len(want)
            expected = want + [-1] * (capacity - len(want))
            np.testing.assert_array_equal(policy.positions[b, h], expected, err_msg=f"{b} {h}")
            for s, p in enumerate(want):
                # -||k||: the exact square root of an exact sum, rounded once to float32.
                assert policy.scores[b, h, s] == -np.sqrt(np.float32(squares[b][h][p])), (b, h, p)
                assert as_bytes(cache.k_row(b, h, s)) == as_bytes(before.k_row(b, h, p)), (b, h, s, p)
                assert as_bytes(cache.v_row(b, h, s)) == as_bytes(before.v_row(b, h, p)), (b, h, s, p)
                assert as_bytes(single_cache.k_row(b, h, s)) == as_bytes(before.k_row(b, h, p))
                assert as_bytes(single_cache.v_row(b, h, s)) == as_bytes(before.v_row(b, h, p))
    np.testing.assert_array_equal(single.positions(), policy.positions)
    np.testing.assert_array_equal(single.counts(), policy.counts)
    np.testing.assert_array_equal(single.scores(), policy.scores)
    cut_ties[1] += 1


@pytest.fixture(scope="module")
def cut_ties():
    """[ties at the cut, cases run] over the parametrized test; when all of its
    96 cases ran, the ties are required (the grid must keep making them)."""
    count = [0, 0]
    yield count
    if count[1] == 96:
        assert count[0] > 50, f"only {count[0]} ties at the cut: the grid no longer makes them"


def test_the_tie_rule_keeps_the_newer_key():
    """Five equal keys between a sink and a recent token, kept 2: the two newest stay."""
    config = kv.H2OConfig.key_norm(2, recent=1, sinks=1)
    policy = kv.BatchedPolicy(config, 1, 1, 8)
    k = np.ones((1, 1, 8, 2), np.float32)
    k[0, 0, 0] = 9  # the sink: kept although its norm is the largest
    k[0, 0, 3] = 0.5  # the smallest norm: kept
    v = np.arange(16, dtype=np.float32).reshape(1, 1, 8, 2)
    policy.prefill_key_norms([7], cache=kv.CacheView.bhsd(k, v))
    np.testing.assert_array_equal(policy.positions[0, 0], [0, 3, 5, 6, -1, -1, -1, -1])
    np.testing.assert_array_equal(v[0, 0, :4], [[0, 1], [6, 7], [10, 11], [12, 13]])


@pytest.mark.parametrize("config", [kv.RecentWindowConfig(2, 3), kv.RandomConfig(5, 1, 1, seed=11)],
                         ids=["recent_window", "random"])
def test_policies_that_ignore_scores_compress_as_without_scores(config):
    rng = np.random.default_rng(5)
    a_cache = Cache("paged_nhd", np.float16, 9, rng)
    fill_prompts(a_cache, [9, 3, 7, 6], rng, 1, np.float16)
    b_cache = a_cache.copy()
    a, b = kv.BatchedPolicy(config, B, H, 9), kv.BatchedPolicy(config, B, H, 9)
    ra = a.prefill_key_norms([9, 3, 7, 6], cache=a_cache.view)
    rb = b.prefill([9, 3, 7, 6], cache=b_cache.view)
    np.testing.assert_array_equal(ra, rb)
    np.testing.assert_array_equal(a.positions, b.positions)
    np.testing.assert_array_equal(a_cache.k, b_cache.k)
    np.testing.assert_array_equal(a_cache.v, b_cache.v)


# ---- errors: the C++ messages, and nothing changes --------------------------------------------


def prompt(config, rng, lengths=(7, 5, 8, 6), layout="bhsd"):
    policy = kv.BatchedPolicy(config, B, H, 8)
    cache = Cache(layout, np.float32, 8, rng)
    fill_prompts(cache, list(lengths), rng, 1, np.float32)
    return policy, cache


@pytest.mark.parametrize("decay", [1.0, 0.5])
def test_a_decay_other_than_0_is_refused_and_nothing_changes(decay):
    policy, cache = prompt(kv.H2OConfig(3, 2, decay=decay), np.random.default_rng(0))
    state, k, v = policy.state.copy(), cache.k.copy(), cache.v.copy()
    with pytest.raises(kv.InvalidArgument, match=r"kvevict::batch::prefill: argument 'in' is key_norms.*decay"):
        policy.prefill_key_norms([7, 5, 8, 6], cache=cache.view)
    np.testing.assert_array_equal(policy.state, state)
    np.testing.assert_array_equal(cache.k, k)
    np.testing.assert_array_equal(cache.v, v)
    single = kv.SequencePolicy(kv.H2OConfig(3, 2, decay=decay), B, H, 8)
    with pytest.raises(kv.InvalidArgument, match=r"kvevict::h2o_policy::prefill: .*decay"):
        single.prefill_key_norms(0, 7, cache.view)
    np.testing.assert_array_equal(single.positions(), np.full((B, H, 8), -1))
    np.testing.assert_array_equal(cache.k, k)
    np.testing.assert_array_equal(cache.v, v)


@pytest.mark.parametrize("bad", [np.nan, np.inf, 3e19])  # 3e19: finite, but its square overflows float32
@pytest.mark.parametrize("layout", ["bhsd", "paged_hnd"])
def test_a_non_finite_key_leaves_its_sequence_unchanged(bad, layout):
    rng = np.random.default_rng(4)
    config = kv.H2OConfig.key_norm(2, 1, 1)
    lengths = [7, 5, 8, 6]
    policy, cache = prompt(config, rng, lengths, layout)
    ref_policy = kv.BatchedPolicy(config, B, H, 8)
    ref_cache = cache.copy()
    before = cache.copy()
    cache.k_row(1, 1, 3)[2] = bad
    cache.k_row(2, 0, 6)[0] = bad  # a second offender: the lowest (sequence, head, slot) is reported
    with pytest.raises(kv.NonFiniteError, match=r"at sequence 1, head 1, index 3 \(the slot\): a K/V row is not finite"):
        policy.prefill_key_norms(lengths, cache=cache.view)
    assert policy.status() == _ext.STATUS_CLEAR  # raised, then cleared
    ref_policy.prefill_key_norms(lengths, cache=ref_cache.view, active=np.array([1, 0, 1, 1], np.uint8))
    for b in (1, 2):  # unchanged: state and K/V bytes
        assert (policy.positions[b] == -1).all() and (policy.counts[b] == 0).all() and policy.lengths[b] == 0
        for h in range(H):
            for s in range(8):
                if (b, h, s) not in ((1, 1, 3), (2, 0, 6)):
                    assert as_bytes(cache.k_row(b, h, s)) == as_bytes(before.k_row(b, h, s))
                assert as_bytes(cache.v_row(b, h, s)) == as_bytes(before.v_row(b, h, s))
    for b in (0, 3):  # the rest of the batch was compressed as without the offenders
        np.testing.assert_array_equal(policy.positions[b], ref_policy.positions[b])
        np.testing.assert_array_equal(policy.scores[b], ref_policy.scores[b])
        for h in range(H):
            for s in range(8):
                assert as_bytes(cache.k_row(b, h, s)) == as_bytes(ref_cache.k_row(b, h, s))
                assert as_bytes(cache.v_row(b, h, s)) == as_bytes(ref_cache.v_row(b, h, s))
    single = kv.SequencePolicy(config, B, H, 8)
    k, v = cache.k.copy(), cache.v.copy()
    with pytest.raises(kv.NonFiniteError, match=r"kvevict::h2o_policy::prefill: argument '-\|\|cache.k\|\|\[1\]\[3\]'"):
        single.prefill_key_norms(1, 7, cache.view)
    np.testing.assert_array_equal(single.positions(), np.full((B, H, 8), -1))
    np.testing.assert_array_equal(cache.k, k)
    np.testing.assert_array_equal(cache.v, v)


def test_argument_errors():
    policy, cache = prompt(kv.H2OConfig.key_norm(3, 2), np.random.default_rng(1))
    state = policy.state.copy()
    with pytest.raises(kv.InvalidArgument, match=r"argument 'cache' must be a CacheView"):
        policy.prefill_key_norms([7, 5, 8, 6], cache=cache.k)
    with pytest.raises(kv.InvalidArgument, match=r"argument 'v_cache' has dtype float16, k_cache has float32"):
        policy.prefill_key_norms([7, 5, 8, 6], cache=kv.CacheView.bhsd(cache.k, cache.v.astype(np.float16)))
    with pytest.raises(kv.InvalidArgument, match=r"argument 'lengths' has 3 entries, expected num_seqs = 4"):
        policy.prefill_key_norms([7, 5, 8], cache=cache.view)
    with pytest.raises(kv.InvalidArgument, match=r"argument 'k_cache' is on cuda:0, the state is on cpu"):
        policy.prefill_key_norms([7, 5, 8, 6], cache=kv.CacheView.bhsd(FakeCudaArray(cache.k.shape), cache.v))
    np.testing.assert_array_equal(policy.state, state)
    # A SnapKV input is a PrefillInput, but not prefill's (it has its own call).
    with pytest.raises(kv.InvalidArgument, match=r"argument 'input' = window_probs is not probs, sums, queries, none "
                                                 r"or key_norms"):
        _ext.prefill(policy._desc, policy.state, np.array([7, 5, 8, 6], np.int32), 8, _ext.PrefillInput.window_probs,
                     None, None, 1.0, 0, 0,
                     cache.k, cache.v, None, None, None)  # fmt: skip
    single = kv.SequencePolicy(kv.H2OConfig.key_norm(3, 2), B, H, 8)
    with pytest.raises(kv.InvalidArgument, match=r"argument 'v_cache' is required"):
        single.prefill_key_norms(0, 7, cache.k)
    with pytest.raises(kv.InvalidArgument, match=r"come from the CacheView"):
        single.prefill_key_norms(0, 7, cache.view, layout="bshd")
    with pytest.raises(kv.InvalidArgument, match=r"argument 'layout' = 'hnd' is not one of"):
        single.prefill_key_norms(0, 7, cache.k, cache.v, "hnd")
    np.testing.assert_array_equal(policy.state, state)
    greedy = kv.BatchedPolicy(kv.ExactGreedyConfig(4, 1, 1), B, H, 8, max_tokens=16, head_dim=D)
    state = greedy.state.copy()
    with pytest.raises(kv.InvalidArgument, match=r"belongs to exact_greedy \(it has a history\): its prefill is the greedy removal judged with the last prompt row.s queries"):
        greedy.prefill_key_norms([7, 5, 8, 6], cache=cache.view)
    np.testing.assert_array_equal(greedy.state, state)


# ---- torch: the op, CPU tensors, torch.compile ------------------------------------------------


def test_torch_op_opcheck_and_cpu_tensors():
    torch = pytest.importorskip("torch")
    import kvevict.ops as ops

    rng = np.random.default_rng(3)
    config = kv.H2OConfig.key_norm(3, 1, 1)
    lengths = [8, 4, 7, 6]
    ncache = Cache("paged_hnd", ml_dtypes.bfloat16, 8, rng)
    fill_prompts(ncache, lengths, rng, 2, ml_dtypes.bfloat16)
    tk = torch.from_numpy(ncache.k.view(np.uint16).copy()).view(torch.bfloat16)
    tv = torch.from_numpy(ncache.v.view(np.uint16).copy()).view(torch.bfloat16)
    table = torch.from_numpy(ncache.table)
    npol = kv.BatchedPolicy(config, B, H, 8, num_q_heads=2 * H)
    tp = kv.BatchedPolicy(config, B, H, 8, num_q_heads=2 * H, device="cpu")
    d = list(tp.descriptor)
    tl = torch.tensor(lengths, dtype=torch.int32)
    # opcheck on copies (it runs the op several times; each needs a fresh state)
    torch.library.opcheck(ops.prefill_key_norms, (tp.state.clone(), d, tl, 8, tk.clone(), tv.clone(), table, None, 3, None))
    torch.library.opcheck(ops.prefill_key_norms,
                          (tp.state.clone(), d, tl, 8, torch.randn(B, H, 8, D).half(), torch.randn(B, H, 8, D).half(),
                           None, None, 0, torch.tensor([1, 0, 0, 1], dtype=torch.uint8)))  # fmt: skip
    tr = tp.prefill_key_norms(tl, cache=kv.CacheView.paged(tk, tv, table, "hnd"))
    nr = npol.prefill_key_norms(lengths, cache=ncache.view)
    np.testing.assert_array_equal(tr.numpy(), nr)
    np.testing.assert_array_equal(tp.positions.numpy(), npol.positions)
    np.testing.assert_array_equal(tp.scores.numpy(), npol.scores)
    np.testing.assert_array_equal(tk.view(torch.int16).numpy(), ncache.k.view(np.int16))
    np.testing.assert_array_equal(tv.view(torch.int16).numpy(), ncache.v.view(np.int16))
    bad = torch.zeros(B, H, 8, D)
    bad[2, 0, 1, 0] = float("nan")
    fresh = kv.BatchedPolicy(config, B, H, 8, device="cpu")
    with pytest.raises(kv.NonFiniteError, match=r"at sequence 2, head 0, index 1 \(the slot\): a K/V row is not finite"):
        torch.ops.kvevict.prefill_key_norms(fresh.state, list(fresh.descriptor), tl, 8, bad, torch.zeros_like(bad), None, None, 0)
    decay = kv.BatchedPolicy(kv.H2OConfig(3, 1), B, H, 8, device="cpu")
    state = decay.state.clone()
    with pytest.raises(kv.InvalidArgument, match="decay"):
        torch.ops.kvevict.prefill_key_norms(decay.state, list(decay.descriptor), tl, 8, bad, torch.zeros_like(bad), None, None, 0)
    assert torch.equal(decay.state, state)


def test_torch_compile_traces_the_key_norm_prefill():
    torch = pytest.importorskip("torch")
    torch._dynamo.reset()
    config = kv.H2OConfig.key_norm(3, 2)
    g = torch.Generator().manual_seed(2)
    k = torch.randint(-1, 2, (B, H, 8, D), generator=g).float()
    v = torch.randn(B, H, 8, D, generator=g)
    lengths = torch.tensor([8, 3, 7, 6], dtype=torch.int32)

    def run(p, k, v):
        pages = p.prefill_key_norms(lengths, cache=kv.CacheView.bhsd(k, v), max_length=8)
        p.append()
        return pages

    eager = kv.BatchedPolicy(config, B, H, 8, device="cpu")
    compiled = kv.BatchedPolicy(config, B, H, 8, device="cpu")
    ke, ve, kc, vc = k.clone(), v.clone(), k.clone(), v.clone()
    fn = torch.compile(run, backend="aot_eager", fullgraph=True)
    assert torch.equal(run(eager, ke, ve), fn(compiled, kc, vc))
    assert torch.equal(eager.positions, compiled.positions)
    assert torch.equal(eager.scores, compiled.scores)
    assert torch.equal(ke, kc) and torch.equal(ve, vc)


# ---- CUDA: the host-side checks (no GPU needed), and the kernel when there is one -------------


@pytest.mark.skipif(not kv.cuda_available, reason="this kvevict was built without CUDA (no nvcc)")
def test_cuda_checks_before_a_launch():
    def fake_state(config):
        desc = _ext.Descriptor(kv.config.policy_spec(config, B, H, H, 8))
        return desc, FakeCudaArray((desc.state_bytes,), "uint8")

    lengths = FakeCudaArray((B,), "int32")
    k, v = FakeCudaArray((B, H, 8, D), "float16"), FakeCudaArray((B, H, 8, D), "float16")
    desc, state = fake_state(kv.H2OConfig(3, 2))
    with pytest.raises(kv.InvalidArgument, match=r"kvevict::cuda::prefill: argument 'in' is key_norms.*decay"):
        _ext.prefill(desc, state, lengths, 8, 4, None, None, 1.0, 0, 0, k, v, None, None, None)
    desc, state = fake_state(kv.H2OConfig.key_norm(3, 2))
    with pytest.raises(kv.InvalidArgument, match=r"'k_cache' is on cpu, the state is on cuda:0"):
        _ext.prefill(desc, state, lengths, 8, 4, None, None, 1.0, 0, 0, np.zeros((B, H, 8, D), np.float16), v, None, None, None)
    try:
        import torch

        if torch.cuda.is_available():
            return  # the fake arrays must not reach a real launch
    except ImportError:
        pass
    nbytes = _ext.prefill(desc, state, lengths, 8, 4, None, None, 1.0, 0, 0, k, v, None, None, None)  # the size query
    assert nbytes > 0
    workspace = FakeCudaArray((nbytes,), "uint8")
    with pytest.raises(kv.CudaError, match=r"kvevict::cuda: prefill failed: cuda"):
        _ext.prefill(desc, state, lengths, 8, 4, None, None, 1.0, 0, 0, k, v, None, None, None, None, workspace)


@pytest.mark.parametrize("layout", ["bhsd", "paged_nhd"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_cuda_equals_the_host(dtype, layout, cuda_torch):
    torch = cuda_torch
    tdt = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
    rng = np.random.default_rng(11)
    config = kv.H2OConfig.key_norm(3, 1, 1)
    lengths = [8, 2, 7, 6]
    cache = Cache(layout, np.float32, 8, rng)
    fill_prompts(cache, lengths, rng, 2, np.float32)
    hk, hv = torch.from_numpy(cache.k).to(tdt), torch.from_numpy(cache.v).to(tdt)
    table = None if cache.table is None else torch.from_numpy(cache.table)
    gk, gv = hk.cuda(), hv.cuda()
    host = kv.BatchedPolicy(config, B, H, 8, num_q_heads=4 * H, device="cpu")
    gpu = kv.BatchedPolicy(config, B, H, 8, num_q_heads=4 * H, device="cuda")
    active = torch.tensor([1, 1, 0, 1], dtype=torch.uint8)
    hr = host.prefill_key_norms(torch.tensor(lengths, dtype=torch.int32), cache=kv.CacheView(hk, hv, layout, table),
                                active=active)  # fmt: skip
    gr = gpu.prefill_key_norms(torch.tensor(lengths, dtype=torch.int32).cuda(), max_length=8, active=active.cuda(),
                               cache=kv.CacheView(gk, gv, layout, None if table is None else table.cuda()))  # fmt: skip
    gpu.check()
    assert torch.equal(hr, gr.cpu())
    assert torch.equal(host.positions, gpu.positions.cpu())
    assert torch.equal(host.scores, gpu.scores.cpu())
    assert torch.equal(hk, gk.cpu()) and torch.equal(hv, gv.cpu())
    if layout == "bhsd":  # a NaN key: recorded on the device, raised by check
        fresh = kv.BatchedPolicy(config, B, H, 8, device="cuda")
        gk[1, 0, 0, 0] = float("nan")
        fresh.prefill_key_norms(torch.tensor(lengths, dtype=torch.int32).cuda(), max_length=8,
                                cache=kv.CacheView.bhsd(gk, gv))  # fmt: skip
        with pytest.raises(kv.NonFiniteError, match=r"at sequence 1, head 0, index 0 \(the slot\): a K/V row is not finite"):
            fresh.check()
        assert (fresh.positions[1].cpu() == -1).all()
