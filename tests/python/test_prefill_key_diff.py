"""KeyDiff prefill (``BatchedPolicy.prefill_key_diff``,
``SequencePolicy.prefill_key_diff``, ``torch.ops.kvevict.prefill_key_diff``)
against a pure-NumPy reference written here from the definition in
``kvevict/policy/key_diff.hpp``, in float64. For the keys ``k_p``, ``p`` in
``[0, L)``, of one (sequence, KV head):

- ``anchor = sum_p k_p / ||k_p||`` (a zero key adds nothing);
- ``score(p) = -(anchor . k_p) / (||anchor|| ||k_p||)``, 0 for a zero key or
  a zero anchor;
- kept: the whole prompt when ``L <= budget``; otherwise the first ``sinks``,
  the last ``recent`` and the ``heavy`` highest (score, position) between
  (the newer on a tie), their K and V rows moved in position order to slots
  ``[0, kept)``.

Cosines are irrational, and the library computes them in float (its anchor
summed exactly in fixed point): its scores must lie within ``MARGIN`` of the
reference's, and its keep set may differ from the reference's only among
keys whose reference scores lie within ``MARGIN`` of the cut (near-ties;
counted, as the exact ties of repeated and zero keys, which the tie rule
decides). Per sequence and batched must agree bit for bit."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import kvevict as kv
from kvevict import _ext
from fake_dlpack import FakeCudaArray
from reference import LayerCache, RefPolicy, prefill_reclaimable_pages, prefill_split

DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
LAYOUTS = ["bhsd", "bshd", "paged_nhd", "paged_hnd"]
B, H, D, PAGE = 4, 2, 16, 4
MARGIN = 1e-5  # far above a float cosine's rounding, far below the gaps of random keys


def make_cache(layout, dtype, capacity, rng):
    return LayerCache(layout, dtype, B, H, D, capacity, rng, PAGE)


def view_of(cache):
    return kv.CacheView(cache.k, cache.v, cache.layout, cache.table)


def fill_prompts(cache, lengths, rng):
    """Keys around a common direction (what KeyDiff ranks), 1 in 16 zero and
    1 in 8 a repeat of an earlier key of the head (exact ties); random values."""
    bias = rng.standard_normal(D)
    for b in range(B):
        for h in range(H):
            for p in range(lengths[b]):
                draw = rng.random()
                if draw < 1 / 16:
                    k = np.zeros(D)
                elif draw < 3 / 16 and p > 0:
                    k = np.asarray(cache.k_row(b, h, int(rng.integers(0, p))), np.float64)
                else:
                    k = bias + rng.standard_normal(D) / 2
                cache.k_row(b, h, p)[...] = k.astype(np.float32).astype(cache.dtype)
                cache.v_row(b, h, p)[...] = rng.standard_normal(D).astype(np.float32).astype(cache.dtype)


def reference_scores(cache, b, h, length):
    """score(p) for p in [0, length) of (b, h), in float64 from the definition."""
    keys = np.array([np.asarray(cache.k_row(b, h, p), np.float64) for p in range(length)])
    norms = np.sqrt((keys * keys).sum(axis=1))
    units = np.zeros_like(keys)
    nonzero = norms > 0
    units[nonzero] = keys[nonzero] / norms[nonzero, None]
    anchor = units.sum(axis=0)
    anchor_norm = np.sqrt((anchor * anchor).sum())
    scores = np.zeros(length)
    if anchor_norm > 0:
        scores[nonzero] = -(keys[nonzero] @ anchor) / (norms[nonzero] * anchor_norm)
    return scores


def check_keep_set(got, ref, length, budget, sinks, recent, counts):
    """The library's kept positions `got` (ascending) against the reference
    scores: the protected ends kept, and between them the reference's keep
    set but for keys within MARGIN of the cut. counts: [near-ties at the
    cut, keep sets that differed]."""
    split = prefill_split(length, budget, sinks, recent)
    if split is None:
        assert got == list(range(length))
        return
    lo, hi, take = split
    assert len(got) == budget and got == sorted(got)
    assert [p for p in got if p < lo or p >= hi] == list(range(lo)) + list(range(hi, length))
    order = sorted(range(lo, hi), key=lambda p: (ref[p], p), reverse=True)  # the highest (score, position) first
    cut = ref[order[take - 1]]
    counts[0] += int(abs(cut - ref[order[take]]) <= MARGIN)
    differ = set(order[:take]) ^ {p for p in got if lo <= p < hi}
    counts[1] += int(bool(differ))
    for p in differ:
        assert abs(ref[p] - cut) <= MARGIN, (p, ref[p], cut)


@pytest.fixture(scope="module")
def near_ties():
    """[near-ties at the cut, keep sets that differed, cases run] over the
    parametrized test; with all of its 96 cases, ties are required (the
    repeated and zero keys must keep making them)."""
    count = [0, 0, 0]
    yield count
    if count[2] == 96:
        assert count[0] > 20, f"only {count[0]} near-ties at the cut: the prompts no longer make them"


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_prefill_equals_the_reference(dtype, layout, group, seed, near_ties):
    rng = np.random.default_rng(seed * 1000 + group * 10 + LAYOUTS.index(layout) + 100 * list(DTYPES).index(dtype))
    heavy, recent, sinks = int(rng.integers(1, 7)), int(rng.integers(0, 3)), int(rng.integers(0, 3))
    decay = [1.0, 0.5, 0.0][seed % 3]  # any decay: KeyDiff asks nothing of it
    config = kv.H2OConfig(heavy, recent, decay=decay, sinks=sinks)
    budget = config.budget
    capacity = budget + 1 + int(rng.integers(0, 20))
    lengths = [int(rng.integers(budget + 1, capacity + 1)) if rng.random() < 0.75 else int(rng.integers(1, capacity + 1))
               for _ in range(B)]  # fmt: skip
    cache = make_cache(layout, DTYPES[dtype], capacity, rng)
    fill_prompts(cache, lengths, rng)
    before, single_cache = cache.copy(), cache.copy()
    # An index list of active sequences on odd seeds: the others stay untouched.
    active = np.array([3, 0, 2], np.int32) if seed % 2 else None
    stepped = [0, 2, 3] if seed % 2 else list(range(B))
    policy = kv.BatchedPolicy(config, B, H, capacity, num_q_heads=H * group)
    single = kv.SequencePolicy(config, B, H, capacity, num_q_heads=H * group)
    if seed % 2:
        reclaimable = policy.prefill_key_diff(np.array(lengths, np.int32), cache=view_of(cache), active=active)
    else:
        reclaimable = policy.prefill_key_diff(lengths, cache=view_of(cache), max_length=capacity)
    for b in range(B):
        if b not in stepped:
            assert reclaimable[b] == 0 and (policy.positions[b] == -1).all() and (policy.counts[b] == 0).all()
            assert policy.lengths[b] == 0
            for h in range(H):
                for s in range(capacity):
                    assert cache.row_bytes("k", b, h, s) == before.row_bytes("k", b, h, s)
                    assert cache.row_bytes("v", b, h, s) == before.row_bytes("v", b, h, s)
            continue
        length = lengths[b]
        want_pages = prefill_reclaimable_pages(layout, length, budget, capacity, PAGE)
        assert reclaimable[b] == want_pages, b
        assert policy.lengths[b] == length
        if seed % 2:
            got = single.prefill_key_diff(b, length, view_of(single_cache))
        else:
            got = single.prefill_key_diff(b, length, single_cache.k, single_cache.v, layout, single_cache.table)
        assert got == (min(length, budget), want_pages)
        for h in range(H):
            ref = reference_scores(before, b, h, length)
            kept = [int(p) for p in policy.positions[b, h] if p >= 0]
            assert policy.counts[b, h] == len(kept)
            np.testing.assert_array_equal(policy.positions[b, h, len(kept):], -1)
            check_keep_set(kept, ref, length, budget, sinks, recent, near_ties)
            for s, p in enumerate(kept):
                assert abs(float(policy.scores[b, h, s]) - ref[p]) <= MARGIN, (b, h, p)
                assert cache.row_bytes("k", b, h, s) == before.row_bytes("k", b, h, p), (b, h, s, p)
                assert cache.row_bytes("v", b, h, s) == before.row_bytes("v", b, h, p), (b, h, s, p)
    # Per sequence == batched, bit for bit: slot tables, scores and the K/V buffers.
    np.testing.assert_array_equal(single.positions(), policy.positions)
    np.testing.assert_array_equal(single.counts(), policy.counts)
    np.testing.assert_array_equal(single.scores().view(np.uint32), policy.scores.view(np.uint32))
    np.testing.assert_array_equal(single_cache.k.view(np.uint8), cache.k.view(np.uint8))
    np.testing.assert_array_equal(single_cache.v.view(np.uint8), cache.v.view(np.uint8))
    near_ties[2] += 1


def test_exact_cases_by_hand():
    """Known cosines: the least similar key kept, equal keys decided by
    position (the newer kept), a zero key scoring +0, and a zero anchor
    (opposite keys) making every score 0."""
    config = kv.H2OConfig(2, recent=1, sinks=1)
    k = np.zeros((2, 1, 8, 2), np.float32)
    # Sequence 0: units sum to (2, 3); (0, 1) scores -3/sqrt(13), (0, -1) +3/sqrt(13), (1, 0) -2/sqrt(13).
    k[0, 0, :7] = [[1, 0], [0, 1], [0, 1], [0, -1], [0, 1], [0, 1], [1, 0]]
    # Sequence 1: (3, 0) and (-3, 0) cancel; with zero keys, every score is 0: the newest between are kept.
    k[1, 0, :6] = [[3, 0], [0, 0], [-3, 0], [0, 0], [0, 0], [0, 0]]
    v = np.arange(32, dtype=np.float32).reshape(2, 1, 8, 2)
    single_k, single_v = k.copy(), v.copy()
    policy = kv.BatchedPolicy(config, 2, 1, 8)
    policy.prefill_key_diff([7, 6], cache=kv.CacheView.bhsd(k, v))
    np.testing.assert_array_equal(policy.positions[0, 0], [0, 3, 5, 6, -1, -1, -1, -1])
    np.testing.assert_array_equal(policy.positions[1, 0], [0, 3, 4, 5, -1, -1, -1, -1])
    np.testing.assert_array_equal(v[0, 0, :4], [[0, 1], [6, 7], [10, 11], [12, 13]])
    s13 = np.sqrt(13.0)
    np.testing.assert_allclose(policy.scores[0, 0, :4], [-2 / s13, 3 / s13, -3 / s13, -2 / s13], atol=1e-6)
    assert (policy.scores[1, 0, :4] == 0).all() and not np.signbit(policy.scores[1, 0, :4]).any()
    single = kv.SequencePolicy(config, 2, 1, 8)
    assert single.prefill_key_diff(0, 7, single_k, single_v) == (4, 0)
    assert single.prefill_key_diff(1, 6, kv.CacheView.bhsd(single_k, single_v)) == (4, 0)
    np.testing.assert_array_equal(single.positions(), policy.positions)
    np.testing.assert_array_equal(single.scores().view(np.uint32), policy.scores.view(np.uint32))


@pytest.mark.parametrize("config", [kv.RecentWindowConfig(2, 3), kv.RandomConfig(5, 1, 1, seed=11)],
                         ids=["recent_window", "random"])
def test_policies_that_ignore_scores_compress_as_without_scores(config):
    """Batched, recent_window and random take KeyDiff as no scores (as key
    norms); their per-sequence policies have no KeyDiff prefill."""
    rng = np.random.default_rng(5)
    a_cache = make_cache("paged_nhd", np.float16, 9, rng)
    lengths = [9, 3, 7, 6]
    fill_prompts(a_cache, lengths, rng)
    b_cache = a_cache.copy()
    a, b = kv.BatchedPolicy(config, B, H, 9), kv.BatchedPolicy(config, B, H, 9)
    ra = a.prefill_key_diff(lengths, cache=view_of(a_cache))
    rb = b.prefill(lengths, cache=view_of(b_cache))
    np.testing.assert_array_equal(ra, rb)
    np.testing.assert_array_equal(a.positions, b.positions)
    np.testing.assert_array_equal(a_cache.k, b_cache.k)
    np.testing.assert_array_equal(a_cache.v, b_cache.v)
    ref = RefPolicy("recent_window" if isinstance(config, kv.RecentWindowConfig) else "random", B, H, H, 9,
                    budget=config.budget, sinks=config.sinks, recent=getattr(config, "recent", 0),
                    seed=getattr(config, "seed", 0))  # fmt: skip
    for s, length in enumerate(lengths):
        ref.prefill(s, length)
    np.testing.assert_array_equal(a.positions, ref.positions)
    single = kv.SequencePolicy(config, B, H, 9)
    k, v = b_cache.k.copy(), b_cache.v.copy()
    with pytest.raises(kv.InvalidArgument, match=r"argument 'in' is key_diff, which the per-sequence \w+_policy does not take"):
        single.prefill_key_diff(0, 9, view_of(b_cache))
    np.testing.assert_array_equal(single.positions(), np.full((B, H, 9), -1))
    np.testing.assert_array_equal(b_cache.k, k)
    np.testing.assert_array_equal(b_cache.v, v)


# ---- errors: the C++ messages, and nothing changes --------------------------------------------


def prompt(config, rng, lengths=(7, 5, 8, 6), layout="bhsd"):
    policy = kv.BatchedPolicy(config, B, H, 8)
    cache = make_cache(layout, np.float32, 8, rng)
    fill_prompts(cache, list(lengths), rng)
    return policy, cache


@pytest.mark.parametrize("bad", [np.nan, np.inf, 3e19])  # 3e19: finite, but its square overflows float32
@pytest.mark.parametrize("layout", ["bhsd", "paged_hnd"])
def test_a_non_finite_key_leaves_its_sequence_unchanged(bad, layout):
    rng = np.random.default_rng(4)
    config = kv.H2OConfig(2, 1, sinks=1)
    lengths = [7, 5, 8, 6]
    policy, cache = prompt(config, rng, lengths, layout)
    ref_policy = kv.BatchedPolicy(config, B, H, 8)
    ref_cache = cache.copy()
    before = cache.copy()
    cache.k_row(1, 1, 3)[2] = bad
    cache.k_row(2, 0, 6)[0] = bad  # a second offender: the lowest (sequence, head, slot) is reported
    with pytest.raises(kv.NonFiniteError, match=r"at sequence 1, head 1, index 3 \(the slot\): a K/V row is not finite"):
        policy.prefill_key_diff(lengths, cache=view_of(cache))
    assert policy.status() == _ext.STATUS_CLEAR  # raised, then cleared
    ref_policy.prefill_key_diff(lengths, cache=view_of(ref_cache), active=np.array([1, 0, 0, 1], np.uint8))
    for b in (1, 2):  # unchanged: state and K/V bytes
        assert (policy.positions[b] == -1).all() and (policy.counts[b] == 0).all() and policy.lengths[b] == 0
        for h in range(H):
            for s in range(8):
                if (b, h, s) not in ((1, 1, 3), (2, 0, 6)):
                    assert cache.row_bytes("k", b, h, s) == before.row_bytes("k", b, h, s)
                assert cache.row_bytes("v", b, h, s) == before.row_bytes("v", b, h, s)
    for b in (0, 3):  # the rest of the batch was compressed as without the offenders
        np.testing.assert_array_equal(policy.positions[b], ref_policy.positions[b])
        np.testing.assert_array_equal(policy.scores[b], ref_policy.scores[b])
        for h in range(H):
            for s in range(8):
                assert cache.row_bytes("k", b, h, s) == ref_cache.row_bytes("k", b, h, s)
                assert cache.row_bytes("v", b, h, s) == ref_cache.row_bytes("v", b, h, s)
    single = kv.SequencePolicy(config, B, H, 8)
    k, v = cache.k.copy(), cache.v.copy()
    with pytest.raises(kv.NonFiniteError,
                       match=r"^kvevict::h2o_policy::prefill: \|\|cache.k\|\|\[1\]\[3\] of sequence 1 is not finite"):
        single.prefill_key_diff(1, 5, view_of(cache))
    np.testing.assert_array_equal(single.positions(), np.full((B, H, 8), -1))
    assert single.length(1) == 0
    np.testing.assert_array_equal(cache.k, k)
    np.testing.assert_array_equal(cache.v, v)
    assert single.prefill_key_diff(1, 3, view_of(cache)) == (3, 0)  # the bad key is past this prompt


def test_argument_errors():
    policy, cache = prompt(kv.H2OConfig(3, 2), np.random.default_rng(1))
    state = policy.state.copy()
    lengths = [7, 5, 8, 6]
    with pytest.raises(kv.InvalidArgument, match=r"argument 'cache' must be a CacheView"):
        policy.prefill_key_diff(lengths, cache=cache.k)
    with pytest.raises(kv.InvalidArgument, match=r"argument 'v_cache' has dtype float16, k_cache has float32"):
        policy.prefill_key_diff(lengths, cache=kv.CacheView.bhsd(cache.k, cache.v.astype(np.float16)))
    with pytest.raises(kv.InvalidArgument, match=r"argument 'k_cache' has dtype int32, expected float32, float16, bfloat16, float8_e4m3fn or float8_e5m2"):
        policy.prefill_key_diff(lengths, cache=kv.CacheView.bhsd(cache.k.astype(np.int32), cache.v.astype(np.int32)))
    with pytest.raises(kv.InvalidArgument, match=r"argument 'k_cache' has 3 dimensions, expected 4"):
        policy.prefill_key_diff(lengths, cache=kv.CacheView.bhsd(cache.k[0], cache.v[0]))
    wide = np.zeros((B, H + 1, 8, D), np.float32)
    with pytest.raises(kv.InvalidArgument, match=r"kvevict::batch::prefill: argument 'cache.num_heads' = 3, the state has 2"):
        policy.prefill_key_diff(lengths, cache=kv.CacheView.bhsd(wide, wide.copy()))
    with pytest.raises(kv.InvalidArgument, match=r"argument 'lengths' has 3 entries, expected num_seqs = 4"):
        policy.prefill_key_diff([7, 5, 8], cache=view_of(cache))
    with pytest.raises(kv.InvalidArgument, match=r"argument 'lengths' has dtype int64, expected int32"):
        _ext.prefill_key_diff(policy._desc, policy.state, np.array(lengths, np.int64), 8, 0, cache.k, cache.v, None,
                              None, None)  # fmt: skip
    # The layout is a typed _ext.CacheLayout: a value outside it does not reach the call.
    with pytest.raises(TypeError, match=r"incompatible function arguments"):
        _ext.prefill_key_diff(policy._desc, policy.state, np.array(lengths, np.int32), 8, 9, cache.k, cache.v, None,
                              None, None)  # fmt: skip
    with pytest.raises(ValueError):
        _ext.CacheLayout(9)
    with pytest.raises(kv.InvalidArgument, match=r"argument 'k_cache' is on cuda:0, the state is on cpu"):
        policy.prefill_key_diff(lengths, cache=kv.CacheView.bhsd(FakeCudaArray(cache.k.shape), cache.v))
    np.testing.assert_array_equal(policy.state, state)
    single = kv.SequencePolicy(kv.H2OConfig(3, 2), B, H, 8)
    with pytest.raises(kv.InvalidArgument, match=r"argument 'v_cache' is required"):
        single.prefill_key_diff(0, 7, cache.k)
    with pytest.raises(kv.InvalidArgument, match=r"come from the CacheView"):
        single.prefill_key_diff(0, 7, view_of(cache), layout="bshd")
    with pytest.raises(kv.InvalidArgument, match=r"argument 'layout' = 'hnd' is not one of"):
        single.prefill_key_diff(0, 7, cache.k, cache.v, "hnd")
    with pytest.raises(kv.InvalidArgument, match=r"argument 'k_cache' has dtype int32"):
        single.prefill_key_diff(0, 7, cache.k.astype(np.int32), cache.v.astype(np.int32))
    np.testing.assert_array_equal(single.positions(), np.full((B, H, 8), -1))
    greedy = kv.BatchedPolicy(kv.ExactGreedyConfig(4, 1, 1), B, H, 8, max_tokens=16, head_dim=D)
    state = greedy.state.copy()
    with pytest.raises(kv.InvalidArgument, match=r"belongs to exact_greedy \(it has a history\): its prefill is the greedy removal judged with the last prompt row.s queries"):
        greedy.prefill_key_diff(lengths, cache=view_of(cache))
    np.testing.assert_array_equal(greedy.state, state)


# ---- torch: the op, CPU tensors, torch.compile ------------------------------------------------


def test_torch_op_opcheck_and_cpu_tensors():
    torch = pytest.importorskip("torch")
    import kvevict.ops as ops

    rng = np.random.default_rng(3)
    config = kv.H2OConfig(3, 1, sinks=1)
    lengths = [8, 4, 7, 6]
    ncache = make_cache("paged_hnd", ml_dtypes.bfloat16, 8, rng)
    fill_prompts(ncache, lengths, rng)
    tk = torch.from_numpy(ncache.k.view(np.uint16).copy()).view(torch.bfloat16)
    tv = torch.from_numpy(ncache.v.view(np.uint16).copy()).view(torch.bfloat16)
    table = torch.from_numpy(ncache.table)
    npol = kv.BatchedPolicy(config, B, H, 8, num_q_heads=2 * H)
    tp = kv.BatchedPolicy(config, B, H, 8, num_q_heads=2 * H, device="cpu")
    d = list(tp.descriptor)
    tl = torch.tensor(lengths, dtype=torch.int32)
    # opcheck on copies (it runs the op several times; each needs a fresh state)
    torch.library.opcheck(ops.prefill_key_diff, (tp.state.clone(), d, tl, 8, tk.clone(), tv.clone(), table, None, 3, None))
    torch.library.opcheck(ops.prefill_key_diff,
                          (tp.state.clone(), d, tl, 8, torch.randn(B, H, 8, D).half(), torch.randn(B, H, 8, D).half(),
                           None, None, 0, torch.tensor([1, 0, 0, 1], dtype=torch.uint8)))  # fmt: skip
    tr = tp.prefill_key_diff(tl, cache=kv.CacheView.paged(tk, tv, table, "hnd"))
    nr = npol.prefill_key_diff(lengths, cache=view_of(ncache))
    np.testing.assert_array_equal(tr.numpy(), nr)
    np.testing.assert_array_equal(tp.positions.numpy(), npol.positions)
    np.testing.assert_array_equal(tp.scores.numpy().view(np.uint32), npol.scores.view(np.uint32))
    np.testing.assert_array_equal(tk.view(torch.int16).numpy(), ncache.k.view(np.int16))
    np.testing.assert_array_equal(tv.view(torch.int16).numpy(), ncache.v.view(np.int16))
    bad = torch.randn(B, H, 8, D)
    bad[2, 0, 1, 0] = float("nan")
    fresh = kv.BatchedPolicy(config, B, H, 8, device="cpu")
    with pytest.raises(kv.NonFiniteError, match=r"at sequence 2, head 0, index 1 \(the slot\): a K/V row is not finite"):
        torch.ops.kvevict.prefill_key_diff(fresh.state, list(fresh.descriptor), tl, 8, bad, torch.zeros_like(bad), None, None, 0)
    assert (fresh.positions[2] == -1).all() and (fresh.positions[0] >= 0).any()


def test_torch_compile_traces_the_key_diff_prefill():
    torch = pytest.importorskip("torch")
    torch._dynamo.reset()
    config = kv.H2OConfig(3, 2)
    g = torch.Generator().manual_seed(2)
    k = torch.randn(B, H, 8, D, generator=g) + 1
    v = torch.randn(B, H, 8, D, generator=g)
    lengths = torch.tensor([8, 3, 7, 6], dtype=torch.int32)

    def run(p, k, v):
        pages = p.prefill_key_diff(lengths, cache=kv.CacheView.bhsd(k, v), max_length=8)
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
    desc = _ext.Descriptor(kv.config.policy_spec(kv.H2OConfig(3, 2), B, H, H, 8))
    state = FakeCudaArray((desc.state_bytes,), "uint8")
    lengths = FakeCudaArray((B,), "int32")
    k, v = FakeCudaArray((B, H, 8, D), "float16"), FakeCudaArray((B, H, 8, D), "float16")
    with pytest.raises(kv.InvalidArgument, match=r"'k_cache' is on cpu, the state is on cuda:0"):
        _ext.prefill_key_diff(desc, state, lengths, 8, 0, np.zeros((B, H, 8, D), np.float16), v, None, None, None)
    wide_k, wide_v = FakeCudaArray((B, H, 8, 12289), "float16"), FakeCudaArray((B, H, 8, 12289), "float16")
    with pytest.raises(kv.InvalidArgument,
                       match=r"kvevict::cuda::prefill: argument 'in.cache.head_dim' = 12289 needs more than 48 KiB"):
        _ext.prefill_key_diff(desc, state, lengths, 8, 0, wide_k, wide_v, None, None, None)
    try:
        import torch

        if torch.cuda.is_available():
            return  # the fake arrays must not reach a real launch
    except ImportError:
        pass
    nbytes = _ext.prefill_key_diff(desc, state, lengths, 8, 0, k, v, None, None, None)  # the size query
    assert nbytes > 0
    workspace = FakeCudaArray((nbytes,), "uint8")
    with pytest.raises(kv.CudaError, match=r"kvevict::cuda: prefill failed: cuda"):
        _ext.prefill_key_diff(desc, state, lengths, 8, 0, k, v, None, None, None, None, workspace)


@pytest.mark.parametrize("layout", ["bhsd", "paged_nhd"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_cuda_equals_the_host(dtype, layout, cuda_torch):
    """The same bits on the GPU as on the host (the anchor is an exact
    integer sum, so the kernel's order of terms does not matter)."""
    torch = cuda_torch
    tdt = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
    rng = np.random.default_rng(11)
    config = kv.H2OConfig(3, 1, sinks=1)
    lengths = [8, 2, 7, 6]
    cache = make_cache(layout, np.float32, 8, rng)
    fill_prompts(cache, lengths, rng)
    hk, hv = torch.from_numpy(cache.k).to(tdt), torch.from_numpy(cache.v).to(tdt)
    table = None if cache.table is None else torch.from_numpy(cache.table)
    gk, gv = hk.cuda(), hv.cuda()
    host = kv.BatchedPolicy(config, B, H, 8, num_q_heads=4 * H, device="cpu")
    gpu = kv.BatchedPolicy(config, B, H, 8, num_q_heads=4 * H, device="cuda")
    active = torch.tensor([1, 1, 0, 1], dtype=torch.uint8)
    hr = host.prefill_key_diff(torch.tensor(lengths, dtype=torch.int32), cache=kv.CacheView(hk, hv, layout, table),
                               active=active)  # fmt: skip
    gr = gpu.prefill_key_diff(torch.tensor(lengths, dtype=torch.int32).cuda(), max_length=8, active=active.cuda(),
                              cache=kv.CacheView(gk, gv, layout, None if table is None else table.cuda()))  # fmt: skip
    gpu.check()
    assert torch.equal(hr, gr.cpu())
    assert torch.equal(host.positions, gpu.positions.cpu())
    assert torch.equal(host.scores.view(torch.int32), gpu.scores.cpu().view(torch.int32))
    assert torch.equal(hk.view(torch.uint8), gk.cpu().view(torch.uint8))
    assert torch.equal(hv.view(torch.uint8), gv.cpu().view(torch.uint8))
    if layout == "bhsd":  # a NaN key: recorded on the device, raised by check
        fresh = kv.BatchedPolicy(config, B, H, 8, device="cuda")
        gk[1, 0, 0, 0] = float("nan")
        fresh.prefill_key_diff(torch.tensor(lengths, dtype=torch.int32).cuda(), max_length=8,
                               cache=kv.CacheView.bhsd(gk, gv))  # fmt: skip
        with pytest.raises(kv.NonFiniteError, match=r"at sequence 1, head 0, index 0 \(the slot\): a K/V row is not finite"):
            fresh.check()
        assert (fresh.positions[1].cpu() == -1).all()
