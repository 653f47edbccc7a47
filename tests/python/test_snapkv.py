"""SnapKV prefill (``BatchedPolicy.prefill_snapkv``,
``SequencePolicy.prefill_snapkv``, ``torch.ops.kvevict.prefill_snapkv``)
against a pure-NumPy reference written here from the definition in
``kvevict/policy/snapkv.hpp``. For a prompt of ``L`` tokens, window ``w``,
``f = L - w`` and query head ``q``:

- ``sum(q, p)``: the window rows ``i`` in ``[max(p, f), L)`` of ``P[q][i][p]``,
  left to right (each weighted by ``decay^(L-1-i)`` under a score decay);
- ``pooled(q, p)``: for ``p < f`` the max, or the sum divided by
  ``pool_width`` (mean), of ``sum(q, j)`` over ``j`` in ``[p - r, p + r]``,
  ``r = pool_width // 2``, positions outside ``[0, f)`` counting as zero;
  for ``p >= f`` (the window) ``sum(q, p)`` itself;
- ``score(h, p)``: the group fold (sum / mean / max) of ``pooled``;
- kept: the first ``sinks``, the last ``max(recent, w)`` positions and the
  top of the rest by (score, position), every prompt of ``L <= budget`` whole.

Probabilities lie on a grid (multiples of 1/64), so every window sum is
exact and the reference may add in any order; the scores then equal the
reference bit for bit. Logits and queries inputs are checked against the
probabilities they stand for. Entries the definition never reads (columns
past a window row's own position, columns past the prompt) hold NaN, so
reading one would be refused."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import kvevict as kv
from kvevict import _ext
from fake_dlpack import FakeCudaArray
from reference import RefPolicy, attention_logit, fold_group, probability_from_logit, ragged_schedule

DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
LAYOUTS = ["bhsd", "bshd", "paged_nhd", "paged_hnd"]
WINDOW_INPUTS = (_ext.PrefillInput.window_probs, _ext.PrefillInput.window_logits, _ext.PrefillInput.window_queries)
B, H, D, PAGE = 3, 2, 8, 4


class Cache:
    """One layer's K and V buffers in a layout, and the rows of logical slot (b, h, s)."""

    def __init__(self, layout, dtype, capacity, rng):
        self.layout, self.dtype, self.table = layout, dtype, None
        if layout in ("bhsd", "bshd"):
            shape = (B, H, capacity, D) if layout == "bhsd" else (B, capacity, H, D)
        else:
            pages = -(-capacity // PAGE)
            num_pages = pages * B + 1  # one page no sequence uses
            shape = (num_pages, PAGE, H, D) if layout == "paged_nhd" else (num_pages, H, PAGE, D)
            self.table = rng.permutation(num_pages)[: pages * B].reshape(B, pages).astype(np.int32)
        self.k = rng.standard_normal(shape).astype(np.float32).astype(dtype)
        self.v = rng.standard_normal(shape).astype(np.float32).astype(dtype)
        self.view = kv.CacheView(self.k, self.v, layout, self.table)

    def copy(self):
        other = object.__new__(Cache)
        other.layout, other.dtype = self.layout, self.dtype
        other.table = None if self.table is None else self.table.copy()
        other.k, other.v = self.k.copy(), self.v.copy()
        other.view = kv.CacheView(other.k, other.v, other.layout, other.table)
        return other

    def row(self, x, b, h, s):
        if self.layout == "bhsd":
            return x[b, h, s]
        if self.layout == "bshd":
            return x[b, s, h]
        page = self.table[b, s // PAGE]
        return x[page, s % PAGE, h] if self.layout == "paged_nhd" else x[page, h, s % PAGE]


def as_bytes(row):
    return np.ascontiguousarray(row).tobytes()


# ---- the reference ------------------------------------------------------------------------


def decay_power(decay, n):
    """decay^n by binary exponentiation, every product rounded to float32 (column_sums.hpp)."""
    result, base = np.float32(1.0), np.float32(decay)
    while n > 0:
        if n & 1:
            result = np.float32(result * base)
        if n > 1:
            base = np.float32(base * base)
        n >>= 1
    return result


def snap_scores(window, length, snap, group, reduce, decay):
    """window [Hq, w, >= L] float32 (row r is prompt row L - w + r) -> [H][L] float32 scores."""
    Hq, w = window.shape[0], snap.window
    first, r = length - w, snap.pool_width // 2
    sums = np.zeros((Hq, length), np.float32)
    for q in range(Hq):
        for p in range(length):
            total = np.float32(0.0)
            for i in range(max(p, first), length):
                x = np.float32(window[q, i - first, p])
                if decay != 1.0:
                    x = np.float32(decay_power(decay, length - 1 - i) * x)
                total = np.float32(total + x)
            sums[q, p] = total
    pooled = sums.copy()
    for p in range(first):
        near = [sums[:, j] if 0 <= j < first else np.zeros(Hq, np.float32) for j in range(p - r, p + r + 1)]
        if snap.pooling == "max":
            pooled[:, p] = np.max(near, axis=0)
        else:
            total = np.zeros(Hq, np.float32)
            for x in near:  # left to right (off the grid, the order fixes the bits)
                total = (total + x).astype(np.float32)
            pooled[:, p] = (total / np.float32(snap.pool_width)).astype(np.float32)
    return [fold_group(pooled[h * group : (h + 1) * group], reduce) for h in range(Hq // group)]


def reference_prefill(ref, b, length, scores, snap, ties=None):
    """RefPolicy's prefill with the window protected: the last max(recent, window)
    positions. ties: [cuts where equal scores straddle the cut, cuts], counted."""
    recent = ref.recent
    ref.recent = max(recent, snap.window)
    try:
        kept = ref.prefill(b, length, scores)
    finally:
        ref.recent = recent
    if ties is not None and length > ref.budget:
        lo = min(ref.sinks, length)
        between = range(lo, max(length - max(recent, snap.window), lo))
        for h, keep in enumerate(kept):
            chosen = [p for p in keep if p in between]
            rest = [p for p in between if p not in keep]
            if chosen and rest:
                ties[0] += min(scores[h][p] for p in chosen) == max(scores[h][p] for p in rest)
                ties[1] += 1
    return kept


def reference_reclaimable(layout, length, budget, capacity):
    if layout in ("bhsd", "bshd"):
        return 0
    pages = lambda n: -(-n // PAGE)  # noqa: E731
    return max(0, pages(length) - pages(min(budget + 1, capacity)))


def grid_window(rng, lengths, Hq, w, columns):
    """[B, Hq, w, columns] probabilities on the 1/64 grid where the definition
    reads them (p <= the row's prompt position < L), NaN elsewhere."""
    probs = np.full((len(lengths), Hq, w, columns), np.nan, np.float32)
    for b, length in enumerate(lengths):
        for r in range(w):
            row = length - w + r
            if row >= 0:
                probs[b, :, r, : row + 1] = rng.integers(0, 65, (Hq, row + 1)) / np.float32(64)
    return probs


def check_state(policy, ref):
    np.testing.assert_array_equal(policy.positions, ref.positions, err_msg="positions")
    np.testing.assert_array_equal(policy.counts, ref.counts, err_msg="counts")
    np.testing.assert_array_equal(policy.next_slots, ref.next_slots, err_msg="next_slots")
    np.testing.assert_array_equal(policy.lengths, ref.lengths, err_msg="lengths")
    np.testing.assert_array_equal(policy.scores, ref.scores, err_msg="scores")


def check_rows(cache, before, policy, stepped):
    """Every kept slot of a stepped sequence holds its position's rows; the others' bytes are untouched."""
    for b in range(B):
        for h in range(H):
            for s in range(policy.capacity):
                p = int(policy.positions[b, h, s])
                if b in stepped and p >= 0:
                    assert as_bytes(cache.row(cache.k, b, h, s)) == as_bytes(before.row(before.k, b, h, p)), (b, h, s)
                    assert as_bytes(cache.row(cache.v, b, h, s)) == as_bytes(before.row(before.v, b, h, p)), (b, h, s)
                elif b not in stepped:
                    assert as_bytes(cache.row(cache.k, b, h, s)) == as_bytes(before.row(before.k, b, h, s)), (b, h, s)
                    assert as_bytes(cache.row(cache.v, b, h, s)) == as_bytes(before.row(before.v, b, h, s)), (b, h, s)


# ---- decisions on the grid ------------------------------------------------------------------

CASES = [  # (window, pool_width, pooling, sinks, recent, reduce, decay)
    (4, 7, "max", 1, 2, "sum", 1.0),
    (4, 5, "mean", 0, 2, "sum", 1.0),
    (1, 3, "max", 2, 0, "mean", 1.0),
    (6, 1, "mean", 1, 9, "max", 1.0),  # recent above the window; pool width 1 is no pooling
    (5, 9, "mean", 0, 0, "sum", 0.5),
    (3, 5, "max", 1, 1, "sum", 0.0),  # TOVA: the last window row alone
]


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_probs_prefill_equals_the_reference(dtype, layout, group, case, cut_ties):
    w, width, pooling, sinks, recent, reduce, decay = CASES[case]
    seed = case * 100 + group * 10 + LAYOUTS.index(layout) + 1000 * list(DTYPES).index(dtype)
    rng = np.random.default_rng(seed)
    snap = kv.SnapKV(w, width, pooling)
    heavy = int(rng.integers(1, 6)) + max(0, w - recent)  # 1..5 positions kept by score beside the window
    config = kv.H2OConfig(heavy, recent, reduce, decay, sinks)
    budget = config.budget
    capacity = budget + 1 + int(rng.integers(4, 24))
    # Prompts above the budget, one within it, every one at least the window.
    lengths = [int(rng.integers(budget + 1, capacity + 1)), int(rng.integers(w, budget + 1)),
               int(rng.integers(max(w, budget - 2), capacity + 1))]  # fmt: skip
    Hq = H * group
    cache = Cache(layout, DTYPES[dtype], capacity, rng)
    before, single_cache = cache.copy(), cache.copy()
    columns = max(lengths) + int(rng.integers(0, 3))  # at least max_length columns
    probs = grid_window(rng, lengths, Hq, w, columns)
    active, stepped = ragged_schedule(case + group, rng, B)
    policy = kv.BatchedPolicy(config, B, H, capacity, num_q_heads=Hq)
    single = kv.SequencePolicy(config, B, H, capacity, num_q_heads=Hq)
    ref = RefPolicy("h2o", B, H, Hq, capacity, budget=budget, sinks=sinks, recent=recent, reduce=reduce, decay=decay)
    reclaimable = policy.prefill_snapkv(lengths, cache=cache.view, snap=snap, probs=probs, active=active)
    for b in range(B):
        if b not in stepped:
            assert reclaimable[b] == 0
            continue
        length = lengths[b]
        scores = snap_scores(probs[b], length, snap, group, reduce, decay)
        kept = reference_prefill(ref, b, length, scores, snap, cut_ties)
        want_pages = reference_reclaimable(layout, length, budget, capacity)
        assert reclaimable[b] == want_pages, b
        got = single.prefill_snapkv(b, length, single_cache.view, snap=snap, probs=probs[b, :, :, :length])
        assert got == (len(kept[0]), want_pages)
    check_state(policy, ref)
    check_rows(cache, before, policy, stepped)
    cut_ties[2] += 1
    stepped_mask = np.isin(np.arange(B), stepped)
    np.testing.assert_array_equal(single.positions()[stepped_mask], policy.positions[stepped_mask])
    np.testing.assert_array_equal(single.counts()[stepped_mask], policy.counts[stepped_mask])
    np.testing.assert_array_equal(single.scores()[stepped_mask], policy.scores[stepped_mask])
    check_rows(single_cache, before, policy, stepped)
    # Decode goes on with the configuration's own recent window (the window is protected at prefill only).
    for _ in range(2):
        policy.append(active=stepped)
        for b in stepped:
            ref.append(b)
        x = rng.integers(0, 65, (B, Hq, capacity)).astype(np.float32) / 64
        victims = policy.observe_evict(probs=x, active=stepped)
        for b in stepped:
            for h in range(H):
                ref.add_increments(b, h, fold_group(x[b, h * group : (h + 1) * group], reduce))
            np.testing.assert_array_equal(victims[b], ref.evict(b))
        check_state(policy, ref)


@pytest.fixture(scope="module")
def cut_ties():
    """[cuts where equal scores straddle the cut, cuts] over the parametrized
    test; when all of its 144 cases ran, ties are required (the grid and the
    pooling plateaus must keep making them, so the tie rule is checked)."""
    count = [0, 0, 0]  # ties, cuts, cases
    yield count
    if count[2] == 144:
        assert count[0] > 100, f"only {count[0]} of {count[1]} cuts fell on a tie: the grid no longer makes them"


def test_the_presets():
    assert kv.SnapKV.paper() == kv.SnapKV(32, 7, "max") == kv.SnapKV()
    assert kv.SnapKV.kvpress() == kv.SnapKV(64, 5, "mean")
    # The paper's preset on a long prompt: the sink, the last 32 positions and the pooled neighbourhood of a peak.
    config = kv.H2OConfig(heavy=39, recent=0, sinks=1)  # budget 40: 1 sink + the window + 7 by score
    policy = kv.BatchedPolicy(config, 1, 1, 80)
    probs = np.zeros((1, 1, 32, 80), np.float32)
    for r in range(32):
        probs[0, 0, r, : 80 - 32 + r + 1] = 1 / 64
        probs[0, 0, r, 20] = 0.5  # every window row attends to position 20
    k, v = np.zeros((2, 1, 1, 80, D), np.float32)
    policy.prefill_snapkv([80], cache=kv.CacheView.bhsd(k, v), snap=kv.SnapKV.paper(), probs=probs)
    kept = [int(p) for p in policy.positions[0, 0] if p >= 0]
    # max pooling of width 7 lifts positions 17..23 (3 on each side of 20) to the peak's sum
    assert kept == [0] + list(range(17, 24)) + list(range(48, 80))


# ---- logits and queries: the probabilities they stand for -----------------------------------


@pytest.mark.parametrize("q_float32", [False, True])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("layout,dtype", [("bhsd", "float32"), ("paged_nhd", "bfloat16"), ("bshd", "float16"),
                                          ("paged_hnd", "float16")])  # fmt: skip
def test_logits_and_queries_equal_their_probabilities(layout, dtype, group, q_float32):
    rng = np.random.default_rng(group * 31 + LAYOUTS.index(layout) + 7 * q_float32)
    snap = kv.SnapKV(5, 3, "mean" if group == 1 else "max")
    config = kv.H2OConfig(4, 2, "sum", 1.0, 1)
    budget, capacity, Hq = config.budget, 24, H * group
    lengths = [22, 6, 17]
    scale = 0.5
    base = "base2" if group == 4 else "natural"
    cache = Cache(layout, DTYPES[dtype], capacity, rng)
    before = cache.copy()
    qdtype = np.float32 if q_float32 else DTYPES[dtype]
    queries = (rng.integers(-8, 9, (B, Hq, snap.window, D)) / np.float32(8)).astype(qdtype)
    lse = (rng.integers(4, 13, (B, Hq, snap.window)) / np.float32(4)).astype(np.float32)
    M = max(lengths)
    logits = np.full((B, Hq, snap.window, M), np.nan, np.float32)
    probs = np.full_like(logits, np.nan)
    itemsize = np.dtype(DTYPES[dtype]).itemsize
    for b, length in enumerate(lengths):
        for qh in range(Hq):
            for r in range(snap.window):
                row = length - snap.window + r
                for p in range(row + 1):
                    k = cache.row(cache.k, b, qh // group, p)
                    logits[b, qh, r, p] = attention_logit(queries[b, qh, r], k, itemsize)
                    probs[b, qh, r, p] = probability_from_logit(logits[b, qh, r, p], scale, lse[b, qh, r], base)
    runs = {}
    for name, kwargs in (("probs", dict(probs=probs)), ("logits", dict(logits=logits, lse=lse)),
                         ("queries", dict(queries=queries, lse=lse))):  # fmt: skip
        c = before.copy()
        p = kv.BatchedPolicy(config, B, H, capacity, num_q_heads=Hq)
        pages = p.prefill_snapkv(np.array(lengths, np.int32), cache=c.view, snap=snap, scale=scale, base=base,
                                 max_length=M, **kwargs)  # fmt: skip
        single, sc = kv.SequencePolicy(config, B, H, capacity, num_q_heads=Hq), before.copy()
        for b, length in enumerate(lengths):
            one = {k: v[b] for k, v in kwargs.items()}
            got = single.prefill_snapkv(b, length, sc.k, sc.v, layout, sc.table, snap=snap, scale=scale, base=base, **one)
            assert got == (int(p.counts[b, 0]), pages[b])
        np.testing.assert_array_equal(single.positions(), p.positions)
        np.testing.assert_array_equal(single.scores(), p.scores)
        np.testing.assert_array_equal(sc.k, c.k)
        np.testing.assert_array_equal(sc.v, c.v)
        runs[name] = (p, c, pages)
    ref = RefPolicy("h2o", B, H, Hq, capacity, budget=budget, sinks=1, recent=2)
    for b, length in enumerate(lengths):
        reference_prefill(ref, b, length, snap_scores(probs[b], length, snap, group, "sum", 1.0), snap)
    # queries recompute the logits in the same order: the same bits as the logits path
    for name in ("logits", "queries"):
        p, c, pages = runs[name]
        np.testing.assert_array_equal(pages, runs["probs"][2])
        np.testing.assert_array_equal(p.positions, ref.positions, err_msg=name)
        np.testing.assert_array_equal(p.counts, ref.counts, err_msg=name)
        check_rows(c, before, p, range(B))
    np.testing.assert_array_equal(runs["queries"][0].scores, runs["logits"][0].scores)
    np.testing.assert_array_equal(runs["probs"][0].scores, ref.scores)
    # NumPy's exp and kvevict's may differ in a probability's last bit
    np.testing.assert_allclose(runs["logits"][0].scores, ref.scores, rtol=4e-6, atol=0)
    np.testing.assert_array_equal(runs["probs"][0].positions, ref.positions)


# ---- errors: the C++ messages, and nothing changes --------------------------------------------


def prompt(config=None, capacity=12, layout="bhsd", group=1):
    rng = np.random.default_rng(9)
    config = config or kv.H2OConfig(3, 2, sinks=1)
    policy = kv.BatchedPolicy(config, B, H, capacity, num_q_heads=H * group)
    cache = Cache(layout, np.float32, capacity, rng)
    return policy, cache, rng


def unchanged(policy, state, cache, k, v):
    np.testing.assert_array_equal(policy.state, state)
    np.testing.assert_array_equal(cache.k, k)
    np.testing.assert_array_equal(cache.v, v)


@pytest.mark.parametrize(
    "snap,lengths,error,message,single_message",
    [
        (kv.SnapKV(4, 4), [9, 7, 8], kv.OutOfRange, r"argument 'in.snap.pool_width' = 4 must be odd and positive", None),
        (kv.SnapKV(4, 0), [9, 7, 8], kv.OutOfRange, r"argument 'in.snap.pool_width' = 0 must be odd and positive", None),
        (kv.SnapKV(6, 3), [9, 7, 8], kv.BudgetError,
         r"argument 'in.snap.window' = 6 plus sinks = 1 exceeds the budget 6: the window is always kept", None),
        (kv.SnapKV(5, 3), [4, 3, 4], kv.OutOfRange, r"argument 'in.snap.window' = 5 exceeds prompts.max_length = 4",
         r"argument 'length' = 4 is below in.snap.window = 5"),  # per sequence: the prompt is too short
        (kv.SnapKV(0, 3), [9, 7, 8], kv.OutOfRange, r"argument 'in.snap.window' = 0 is below 1", None),
    ],
    ids=["even_width", "zero_width", "window_above_budget", "window_above_max_length", "empty_window"],
)
def test_bad_parameters_raise_the_library_message_and_change_nothing(snap, lengths, error, message, single_message):
    policy, cache, rng = prompt()
    probs = grid_window(rng, lengths, H, snap.window, max(lengths))
    state, k, v = policy.state.copy(), cache.k.copy(), cache.v.copy()
    with pytest.raises(error, match="kvevict::batch::prefill: " + message):
        policy.prefill_snapkv(lengths, cache=cache.view, snap=snap, probs=probs)
    unchanged(policy, state, cache, k, v)
    single = kv.SequencePolicy(kv.H2OConfig(3, 2, sinks=1), B, H, 12)
    with pytest.raises(error, match="kvevict::h2o_policy::prefill: " + (single_message or message)):
        single.prefill_snapkv(0, lengths[0], cache.view, snap=snap, probs=probs[0])
    assert (single.positions() == -1).all()
    np.testing.assert_array_equal(cache.k, k)
    np.testing.assert_array_equal(cache.v, v)


def test_a_prompt_shorter_than_the_window_leaves_its_sequence_unchanged():
    policy, cache, rng = prompt()
    lengths = [9, 3, 8]  # sequence 1 holds 3 rows, the window 4
    snap = kv.SnapKV(4, 3)
    probs = grid_window(rng, lengths, H, 4, 9)
    before = cache.copy()
    with pytest.raises(kv.OutOfRange, match=r"kvevict::batch::prefill: at sequence 1, head 0, index 3"):
        policy.prefill_snapkv(lengths, cache=cache.view, snap=snap, probs=probs)
    assert policy.status() == _ext.STATUS_CLEAR  # raised, then cleared
    assert (policy.positions[1] == -1).all() and (policy.counts[1] == 0).all() and policy.lengths[1] == 0
    # the rest of the batch: as a call without sequence 1
    other, other_cache, _ = prompt()
    other.prefill_snapkv(lengths, cache=other_cache.view, snap=snap, probs=probs, active=[0, 2])
    np.testing.assert_array_equal(policy.positions, other.positions)
    np.testing.assert_array_equal(policy.scores, other.scores)
    np.testing.assert_array_equal(cache.k, other_cache.k)
    check_rows(cache, before, policy, [0, 2])
    single = kv.SequencePolicy(kv.H2OConfig(3, 2, sinks=1), B, H, 12)
    with pytest.raises(kv.OutOfRange, match=r"kvevict::h2o_policy::prefill: argument 'length' = 3 is below "
                                             r"in.snap.window = 4"):  # fmt: skip
        single.prefill_snapkv(1, 3, cache.view, snap=snap, probs=probs[1, :, :, :3])
    assert (single.positions() == -1).all()


@pytest.mark.parametrize("input_kind", ["probs", "logits", "lse"])
def test_a_nan_leaves_its_sequence_unchanged(input_kind):
    policy, cache, rng = prompt(group=2)
    lengths = [9, 7, 8]
    snap = kv.SnapKV(3, 3, "mean")
    probs = grid_window(rng, lengths, 2 * H, 3, 9)
    kwargs = dict(probs=probs)
    if input_kind != "probs":
        # logits whose probabilities are exp(logit - lse) with lse 0
        kwargs = dict(logits=np.where(probs > 0, np.log(np.where(probs > 0, probs, 1)), -30).astype(np.float32),
                      lse=np.zeros((B, 2 * H, 3), np.float32))  # fmt: skip
    x = kwargs.get("probs", kwargs.get("logits"))
    ref_policy, ref_cache, _ = prompt(group=2)
    ref_policy.prefill_snapkv(lengths, cache=ref_cache.view, snap=snap, active=[0, 2], **kwargs)
    before = cache.copy()
    if input_kind == "lse":
        kwargs["lse"][1, 3, 2] = np.nan  # query head 3 is KV head 1's
        match = r"kvevict::batch::prefill: at sequence 1, head 1, index 3 \(.*\): .*LSE"
    else:
        x[1, 2, 1, 4] = np.nan  # window row 1 of sequence 1 is prompt row 5: column 4 is read
        match = r"kvevict::batch::prefill: at sequence 1, head 1, index 4 \(.*\): an input is NaN"
    with pytest.raises(kv.NonFiniteError, match=match):
        policy.prefill_snapkv(lengths, cache=cache.view, snap=snap, **kwargs)
    assert (policy.positions[1] == -1).all() and policy.lengths[1] == 0
    np.testing.assert_array_equal(policy.positions, ref_policy.positions)
    np.testing.assert_array_equal(policy.scores, ref_policy.scores)
    check_rows(cache, before, policy, [0, 2])
    single = kv.SequencePolicy(kv.H2OConfig(3, 2, sinks=1), B, H, 12, num_q_heads=2 * H)
    one = {k: v[1] for k, v in kwargs.items()}
    k, v = cache.k.copy(), cache.v.copy()
    with pytest.raises(kv.NonFiniteError, match=r"kvevict::h2o_policy::prefill: argument '(probs|logits|lse)"):
        single.prefill_snapkv(1, 7, cache.view, snap=snap, **one)
    assert (single.positions() == -1).all()
    np.testing.assert_array_equal(cache.k, k)
    np.testing.assert_array_equal(cache.v, v)


def test_only_a_policy_that_keeps_by_score_takes_it():
    snap = kv.SnapKV(2, 3)
    lengths = [9, 7, 8]
    for config in (kv.RecentWindowConfig(1, 4), kv.RandomConfig(5, 1, 1)):
        policy, cache, rng = prompt(config)
        probs = grid_window(rng, lengths, H, 2, 9)
        state, k, v = policy.state.copy(), cache.k.copy(), cache.v.copy()
        with pytest.raises(kv.InvalidArgument, match=r"kvevict::batch::prefill: argument 'in.snap' asks for SnapKV "
                                                      r"scores, which only a policy that keeps by score \(h2o\) uses"):
            policy.prefill_snapkv(lengths, cache=cache.view, snap=snap, probs=probs)
        unchanged(policy, state, cache, k, v)
        single = kv.SequencePolicy(config, B, H, 12)
        with pytest.raises(kv.InvalidArgument, match=r"argument 'in.snap' asks for SnapKV scores"):
            single.prefill_snapkv(0, 9, cache.view, snap=snap, probs=probs[0])
        assert (single.positions() == -1).all()
    greedy = kv.BatchedPolicy(kv.ExactGreedyConfig(4, 1, 1), B, H, 12, max_tokens=16, head_dim=D)
    state = greedy.state.copy()
    with pytest.raises(kv.InvalidArgument, match=r"belongs to exact_greedy \(it has a history\): its prefill is the greedy removal judged with the last prompt row.s queries"):
        greedy.prefill_snapkv(lengths, cache=cache.view, snap=snap, probs=probs)
    np.testing.assert_array_equal(greedy.state, state)
    # TOVA and key-norm configurations keep by score: accepted
    for config in (kv.H2OConfig.tova(3, 2, 1), kv.H2OConfig.key_norm(3, 2, 1)):
        policy, cache, rng = prompt(config)
        policy.prefill_snapkv(lengths, cache=cache.view, snap=snap, probs=grid_window(rng, lengths, H, 2, 9))
        assert (policy.counts == 6).all()


def test_python_argument_errors():
    policy, cache, rng = prompt()
    lengths = [9, 7, 8]
    probs = grid_window(rng, lengths, H, 4, 9)
    lse = np.zeros((B, H, 4), np.float32)
    state, k, v = policy.state.copy(), cache.k.copy(), cache.v.copy()
    snap = kv.SnapKV(4, 3)
    with pytest.raises(kv.InvalidArgument, match=r"argument 'probs' has 4 window rows \(dimension 2\), but snap.window = 5"):
        policy.prefill_snapkv(lengths, cache=cache.view, snap=kv.SnapKV(5, 3), probs=probs)
    with pytest.raises(kv.InvalidArgument, match=r"kvevict.SnapKV: argument 'pooling' = 'avg' is not 'max' or 'mean'"):
        policy.prefill_snapkv(lengths, cache=cache.view, snap=kv.SnapKV(4, 3, "avg"), probs=probs)
    with pytest.raises(kv.InvalidArgument, match=r"pass exactly one of 'probs', 'logits', 'queries' \(got probs, logits\)"):
        policy.prefill_snapkv(lengths, cache=cache.view, snap=snap, probs=probs, logits=probs, lse=lse)
    with pytest.raises(kv.InvalidArgument, match=r"argument 'lse' is required with 'logits'"):
        policy.prefill_snapkv(lengths, cache=cache.view, snap=snap, logits=probs)
    with pytest.raises(kv.InvalidArgument, match=r"argument 'snap' is a tuple, expected SnapKV"):
        policy.prefill_snapkv(lengths, cache=cache.view, snap=(4, 3), probs=probs)
    with pytest.raises(kv.InvalidArgument, match=r"argument 'base' = 'e' is not 'natural'"):
        policy.prefill_snapkv(lengths, cache=cache.view, snap=snap, logits=probs, lse=lse, base="e")
    # the extension's own checks, with the C++ library's argument names
    with pytest.raises(kv.InvalidArgument, match=r"kvevict::python::prefill: argument 'probs' has dtype float64"):
        policy.prefill_snapkv(lengths, cache=cache.view, snap=snap, probs=probs.astype(np.float64))
    with pytest.raises(kv.InvalidArgument, match=r"kvevict::batch::prefill: argument 'probs.extents\[3\]' = 8"):
        policy.prefill_snapkv(lengths, cache=cache.view, snap=snap, probs=probs[..., :8])
    with pytest.raises(kv.InvalidArgument, match=r"kvevict::batch::prefill: argument 'lse.extents\[2\]' = 3"):
        policy.prefill_snapkv(lengths, cache=cache.view, snap=snap, logits=probs, lse=lse[..., :3])
    with pytest.raises(kv.InvalidArgument, match=r"argument 'queries' has dtype float16, expected float32 or the cache's float32"):
        policy.prefill_snapkv(lengths, cache=cache.view, snap=snap, queries=np.zeros((B, H, 4, D), np.float16), lse=lse)
    with pytest.raises(kv.InvalidArgument, match=r"argument 'probs' is on cuda:0, the state is on cpu"):
        policy.prefill_snapkv(lengths, cache=cache.view, snap=snap, probs=FakeCudaArray(probs.shape))
    desc, st = policy._desc, policy.state
    args = (np.array(lengths, np.int32), 9)
    window_probs, window_logits = _ext.PrefillInput.window_probs, _ext.PrefillInput.window_logits
    # pooling is a typed _ext.SnapPooling: a value outside it does not reach the call (nor the library's check).
    for pooling in (2, 300):
        with pytest.raises(TypeError, match=r"incompatible function arguments"):
            _ext.prefill_snapkv(desc, st, *args, window_probs, probs, None, 1.0, 0, 3, pooling, 0, cache.k, cache.v,
                                None, None, None)  # fmt: skip
    with pytest.raises(kv.InvalidArgument, match=r"argument 'input' = none is not window_probs, window_logits or "
                                                 r"window_queries"):
        _ext.prefill_snapkv(desc, st, *args, _ext.PrefillInput.none, probs, None, 1.0, 0, 3, 0, 0, cache.k, cache.v,
                            None, None, None)  # fmt: skip
    with pytest.raises(kv.InvalidArgument, match=r"kvevict::python::prefill: argument 'lse' is required with logits"):
        _ext.prefill_snapkv(desc, st, *args, window_logits, probs, None, 1.0, 0, 3, 0, 0, cache.k, cache.v, None,
                            None, None)  # fmt: skip
    unchanged(policy, state, cache, k, v)
    single = kv.SequencePolicy(kv.H2OConfig(3, 2, sinks=1), B, H, 12)
    with pytest.raises(kv.InvalidArgument, match=r"argument 'probs' has 4 window rows \(dimension 1\), but snap.window = 3"):
        single.prefill_snapkv(0, 9, cache.view, snap=kv.SnapKV(3, 3), probs=probs[0])
    with pytest.raises(kv.InvalidArgument, match=r"argument 'v_cache' is required"):
        single.prefill_snapkv(0, 9, cache.k, snap=snap, probs=probs[0])
    with pytest.raises(kv.InvalidArgument, match=r"kvevict::h2o_policy::prefill: argument 'probs.extents\[2\]' = 8"):
        single.prefill_snapkv(0, 9, cache.view, snap=snap, probs=probs[0, :, :, :8])
    assert (single.positions() == -1).all()
    np.testing.assert_array_equal(cache.k, k)


# ---- torch: the op, CPU tensors, torch.compile ------------------------------------------------


def test_torch_op_opcheck_and_cpu_tensors():
    torch = pytest.importorskip("torch")
    import kvevict.ops as ops

    rng = np.random.default_rng(3)
    config = kv.H2OConfig(3, 1, "mean", sinks=1)
    lengths = [12, 5, 9]
    snap = kv.SnapKV(4, 5, "mean")
    ncache = Cache("paged_hnd", ml_dtypes.bfloat16, 12, rng)
    tk = torch.from_numpy(ncache.k.view(np.uint16).copy()).view(torch.bfloat16)
    tv = torch.from_numpy(ncache.v.view(np.uint16).copy()).view(torch.bfloat16)
    table = torch.from_numpy(ncache.table)
    probs = grid_window(rng, lengths, 2 * H, 4, 12)
    tprobs = torch.from_numpy(probs)
    queries = torch.from_numpy((rng.integers(-8, 9, (B, 2 * H, 4, D)) / 8).astype(np.float32))
    lse = torch.from_numpy((rng.integers(8, 13, (B, 2 * H, 4)) / 4).astype(np.float32))
    tp = kv.BatchedPolicy(config, B, H, 12, num_q_heads=2 * H, device="cpu")
    d = list(tp.descriptor)
    tl = torch.tensor(lengths, dtype=torch.int32)
    flags = torch.tensor([1, 0, 1], dtype=torch.uint8)
    # opcheck on copies (it runs the op several times; each needs a fresh state)
    for input, x, l, pooling in ((0, tprobs, None, 1), (1, torch.nan_to_num(tprobs.log(), nan=0.0), lse, 0),
                                 (2, queries, lse, 1)):  # fmt: skip
        torch.library.opcheck(ops.prefill_snapkv, (tp.state.clone(), d, tl, 12, input, x, l, 0.5, 1, 5, pooling,
                                                   tk.clone(), tv.clone(), table, None, 3, flags))  # fmt: skip
    torch.library.opcheck(ops.prefill_snapkv, (tp.state.clone(), d, tl, 12, 2, queries.half(), lse, 1.0, 0, 3, 0,
                                               torch.randn(B, H, 12, D).half(), torch.randn(B, H, 12, D).half(),
                                               None, None, 0, None))  # fmt: skip
    npol = kv.BatchedPolicy(config, B, H, 12, num_q_heads=2 * H)
    tr = tp.prefill_snapkv(tl, cache=kv.CacheView.paged(tk, tv, table, "hnd"), snap=snap, probs=tprobs)
    nr = npol.prefill_snapkv(lengths, cache=ncache.view, snap=snap, probs=probs)
    np.testing.assert_array_equal(tr.numpy(), nr)
    np.testing.assert_array_equal(tp.positions.numpy(), npol.positions)
    np.testing.assert_array_equal(tp.scores.numpy(), npol.scores)
    np.testing.assert_array_equal(tk.view(torch.int16).numpy(), ncache.k.view(np.int16))
    np.testing.assert_array_equal(tv.view(torch.int16).numpy(), ncache.v.view(np.int16))
    bad = tprobs.clone()
    bad[2, 1, 3, 0] = float("nan")
    fresh = kv.BatchedPolicy(config, B, H, 12, num_q_heads=2 * H, device="cpu")
    with pytest.raises(kv.NonFiniteError, match=r"at sequence 2, head 0, index 0 \(.*\): an input is NaN"):
        torch.ops.kvevict.prefill_snapkv(fresh.state, list(fresh.descriptor), tl, 12, 0, bad, None, 1.0, 0, 5, 1,
                                         torch.zeros(B, H, 12, D), torch.zeros(B, H, 12, D), None, None, 0)  # fmt: skip
    state = fresh.state.clone()
    with pytest.raises(kv.OutOfRange, match=r"in.snap.pool_width' = 2"):
        torch.ops.kvevict.prefill_snapkv(fresh.state, list(fresh.descriptor), tl, 12, 0, tprobs, None, 1.0, 0, 2, 1,
                                         torch.zeros(B, H, 12, D), torch.zeros(B, H, 12, D), None, None, 0)  # fmt: skip
    assert torch.equal(fresh.state, state)


def test_torch_compile_traces_the_snapkv_prefill():
    torch = pytest.importorskip("torch")
    torch._dynamo.reset()
    config = kv.H2OConfig(3, 2, sinks=1)
    snap = kv.SnapKV(3, 3)
    rng = np.random.default_rng(6)
    lengths = torch.tensor([12, 4, 9], dtype=torch.int32)
    probs = torch.from_numpy(np.nan_to_num(grid_window(rng, lengths.tolist(), H, 3, 12)))
    k, v = torch.randn(B, H, 12, D), torch.randn(B, H, 12, D)

    def run(p, k, v):
        pages = p.prefill_snapkv(lengths, cache=kv.CacheView.bhsd(k, v), snap=snap, probs=probs, max_length=12)
        p.append()
        return pages

    eager = kv.BatchedPolicy(config, B, H, 12, device="cpu")
    compiled = kv.BatchedPolicy(config, B, H, 12, device="cpu")
    ke, ve, kc, vc = k.clone(), v.clone(), k.clone(), v.clone()
    fn = torch.compile(run, backend="aot_eager", fullgraph=True)
    assert torch.equal(run(eager, ke, ve), fn(compiled, kc, vc))
    assert torch.equal(eager.positions, compiled.positions)
    assert torch.equal(eager.scores, compiled.scores)
    assert torch.equal(ke, kc) and torch.equal(ve, vc)


# ---- CUDA: the host-side checks (no GPU needed), and the kernels when there is one -----------


@pytest.mark.skipif(not kv.cuda_available, reason="this kvevict was built without CUDA (no nvcc)")
@pytest.mark.parametrize("input", [0, 1, 2])
def test_cuda_checks_before_a_launch(input):
    desc = _ext.Descriptor(kv.config.policy_spec(kv.H2OConfig(3, 2, sinks=1), B, H, H, 12))
    state = FakeCudaArray((desc.state_bytes,), "uint8")
    lengths = FakeCudaArray((B,), "int32")
    k, v = FakeCudaArray((B, H, 12, D), "float16"), FakeCudaArray((B, H, 12, D), "float16")
    x_dtype = "float16" if input == 2 else "float32"
    x = FakeCudaArray((B, H, 4, D) if input == 2 else (B, H, 4, 12), x_dtype)
    lse = None if input == 0 else FakeCudaArray((B, H, 4))

    def call(pool_width, *rest, x=x, lse=lse):
        return _ext.prefill_snapkv(desc, state, lengths, 12, WINDOW_INPUTS[input], x, lse, 1.0, 0, pool_width, 0, 0,
                                   k, v, None, None,
                                   None, None, *rest)  # fmt: skip

    with pytest.raises(kv.OutOfRange, match=r"kvevict::cuda::prefill: argument 'in.snap.pool_width' = 4"):
        call(4)
    narrow = FakeCudaArray((B, H, 4, D + 1) if input == 2 else (B, H, 4, 11), x_dtype)
    with pytest.raises(kv.InvalidArgument, match=r"kvevict::cuda::prefill: argument '(probs|logits|q).extents\[3\]'"):
        call(3, x=narrow)
    if lse is not None:
        with pytest.raises(kv.InvalidArgument, match=r"kvevict::cuda::prefill: argument 'lse.extents\[2\]' = 3"):
            call(3, lse=FakeCudaArray((B, H, 3)))
    with pytest.raises(kv.InvalidArgument, match=r"is on cpu, the state is on cuda:0"):
        call(3, x=np.zeros(x.shape, np.float16 if input == 2 else np.float32))
    try:
        import torch

        if torch.cuda.is_available():
            return  # the fake arrays must not reach a real launch
    except ImportError:
        pass
    nbytes = call(3)  # the size query
    assert nbytes > 0
    with pytest.raises(kv.CudaError, match=r"kvevict::cuda: prefill failed: cuda"):
        call(3, FakeCudaArray((nbytes,), "uint8"))


@pytest.mark.parametrize("input_kind", ["probs", "logits", "queries"])
@pytest.mark.parametrize("layout,dtype", [("bhsd", "float32"), ("paged_nhd", "bfloat16"), ("bshd", "float16")])
def test_cuda_equals_the_host(layout, dtype, input_kind, cuda_torch):
    torch = cuda_torch
    tdt = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
    rng = np.random.default_rng(11)
    config = kv.H2OConfig(4, 2, "max", sinks=1)
    group, capacity = 4, 40
    lengths = [40, 5, 27]
    snap = kv.SnapKV(5, 3, "mean" if input_kind == "logits" else "max")
    cache = Cache(layout, np.float32, capacity, rng)
    hk, hv = torch.from_numpy(cache.k).to(tdt), torch.from_numpy(cache.v).to(tdt)
    table = None if cache.table is None else torch.from_numpy(cache.table)
    gk, gv = hk.cuda(), hv.cuda()
    probs = torch.from_numpy(np.nan_to_num(grid_window(rng, lengths, group * H, 5, capacity)))
    lse = torch.from_numpy((rng.integers(4, 13, (B, group * H, 5)) / 4).astype(np.float32))
    kwargs = {"probs": dict(probs=probs), "logits": dict(logits=torch.randn(B, group * H, 5, capacity), lse=lse),
              "queries": dict(queries=torch.randn(B, group * H, 5, D).to(tdt), lse=lse)}[input_kind]  # fmt: skip
    host = kv.BatchedPolicy(config, B, H, capacity, num_q_heads=group * H, device="cpu")
    gpu = kv.BatchedPolicy(config, B, H, capacity, num_q_heads=group * H, device="cuda")
    active = torch.tensor([1, 1, 0], dtype=torch.uint8)
    hr = host.prefill_snapkv(torch.tensor(lengths, dtype=torch.int32), cache=kv.CacheView(hk, hv, layout, table),
                             snap=snap, active=active, scale=0.5, **kwargs)  # fmt: skip
    gr = gpu.prefill_snapkv(torch.tensor(lengths, dtype=torch.int32).cuda(), max_length=capacity, active=active.cuda(),
                            cache=kv.CacheView(gk, gv, layout, None if table is None else table.cuda()), snap=snap,
                            scale=0.5, **{k: v.cuda() for k, v in kwargs.items()})  # fmt: skip
    gpu.check()
    assert torch.equal(hr, gr.cpu())
    assert torch.equal(host.positions, gpu.positions.cpu())
    assert torch.equal(host.scores, gpu.scores.cpu())
    assert torch.equal(hk, gk.cpu()) and torch.equal(hv, gv.cpu())
    if input_kind == "probs":  # a NaN: recorded on the device, raised by check
        fresh = kv.BatchedPolicy(config, B, H, capacity, num_q_heads=group * H, device="cuda")
        bad = probs.cuda()
        bad[1, 0, 4, 2] = float("nan")
        fresh.prefill_snapkv(torch.tensor(lengths, dtype=torch.int32).cuda(), max_length=capacity, snap=snap,
                             cache=kv.CacheView(gk, gv, layout, None if table is None else table.cuda()), probs=bad)
        with pytest.raises(kv.NonFiniteError, match=r"at sequence 1, head 0, index 2 \(.*\): an input is NaN"):
            fresh.check()
        assert (fresh.positions[1].cpu() == -1).all()
