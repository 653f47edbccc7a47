"""kvevict's batched decisions through NumPy (no torch) against the pure-NumPy
reference in reference.py: every policy and input kind, float32 / float16 /
bfloat16 K/V, strided and paged layouts, GQA groups of 1 and 4, ragged
batches (active lists and flags), prefill compression and multi-token
evict_to."""

from __future__ import annotations

import subprocess
import sys
import zlib

import ml_dtypes
import numpy as np
import pytest

import kvevict as kv
from reference import (
    RefPolicy,
    attention_logit,
    column_sums,
    fold_group,
    leave_one_out_errors,
    philox4x32_10,
    probability_from_logit,
    ragged_schedule,
)

DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
B, H, D = 3, 2, 12
BUDGET = 5
CAPACITY = 7
PAGE = 4


def make_config(kind, reduce="sum", decay=1.0, sinks=0):
    if kind == "h2o":
        config = kv.H2OConfig(heavy=3 - sinks, recent=2, reduce=reduce, decay=decay, sinks=sinks)
        return config, dict(budget=5, recent=2, reduce=reduce, decay=decay, sinks=sinks)
    if kind == "recent_window":
        return kv.RecentWindowConfig(sinks=2, window=3), dict(budget=5, sinks=2)
    if kind == "random":
        seed = 0x1234_5678_9ABC  # above 2^32: both key words matter
        return kv.RandomConfig(budget=5, sinks=1, recent=1, seed=seed), dict(budget=5, sinks=1, recent=1, seed=seed)
    return kv.ExactGreedyConfig(budget=5, recent=1, sinks=1), dict(budget=5, sinks=1, recent=1)


class Cache:
    """A K/V cache in one layout, and the row of logical slot (b, h, s)."""

    def __init__(self, layout, dtype, rng, capacity=CAPACITY, num_seqs=B):
        self.layout, self.dtype = layout, dtype
        if layout in ("bhsd", "bshd"):
            shape = (num_seqs, H, capacity, D) if layout == "bhsd" else (num_seqs, capacity, H, D)
            self.k = np.zeros(shape, dtype)
            self.v = np.zeros(shape, dtype)
            self.view = kv.CacheView(self.k, self.v, layout)
        else:
            pages = -(-capacity // PAGE)
            num_pages = pages * num_seqs + 2  # two pages no sequence uses
            order = layout.split("_")[1]
            shape = (num_pages, PAGE, H, D) if order == "nhd" else (num_pages, H, PAGE, D)
            self.k = np.zeros(shape, dtype)
            self.v = np.zeros(shape, dtype)
            self.table = rng.permutation(num_pages)[: pages * num_seqs].reshape(num_seqs, pages).astype(np.int32)
            self.view = kv.CacheView.paged(self.k, self.v, self.table, order)

    def row(self, arr, b, h, s):
        if self.layout == "bhsd":
            return arr[b, h, s]
        if self.layout == "bshd":
            return arr[b, s, h]
        page = self.table[b, s // PAGE]
        return arr[page, s % PAGE, h] if self.layout == "paged_nhd" else arr[page, h, s % PAGE]

    def set_row(self, arr, b, h, s, value):
        self.row(arr, b, h, s)[...] = value


def bits(x):
    """Bit patterns, so that rows compare exactly in every dtype."""
    x = np.ascontiguousarray(x)
    return x.view(np.uint16) if x.dtype.itemsize == 2 else x.view(np.uint32)


def check_state(policy, ref, exact_scores=True):
    np.testing.assert_array_equal(policy.positions, ref.positions, err_msg="positions")
    np.testing.assert_array_equal(policy.counts, ref.counts, err_msg="counts")
    np.testing.assert_array_equal(policy.next_slots, ref.next_slots, err_msg="next_slots")
    np.testing.assert_array_equal(policy.lengths, ref.lengths, err_msg="lengths")
    if exact_scores:
        np.testing.assert_array_equal(policy.scores, ref.scores, err_msg="scores")
    else:
        np.testing.assert_allclose(policy.scores, ref.scores, rtol=2e-6, atol=1e-30, err_msg="scores")


def check_cache(cache, policy, rows_k, rows_v):
    """Every occupied slot holds the K/V rows of the position it records."""
    for b in range(policy.num_seqs):
        for h in range(H):
            for s in range(policy.capacity):
                p = int(policy.positions[b, h, s])
                if p >= 0:
                    np.testing.assert_array_equal(bits(cache.row(cache.k, b, h, s)), bits(rows_k[b][p][h]))
                    np.testing.assert_array_equal(bits(cache.row(cache.v, b, h, s)), bits(rows_v[b][p][h]))


def active_for(step, rng):
    """A ragged schedule: every sequence, an index list, or flags."""
    return ragged_schedule(step, rng, B)


def greedy_scores(ref, b, h, q_rows, scale):
    """exact_greedy's score of every cached slot of (b, h): the group's summed
    leave-one-out errors, from the reference history."""
    length = int(ref.lengths[b])
    keys = np.stack([ref.hist_k[b][h][p] for p in range(length)]).astype(np.float32)
    vals = np.stack([ref.hist_v[b][h][p] for p in range(length)]).astype(np.float32)
    pos = ref.positions[b, h]
    slots = [s for s in range(ref.capacity) if pos[s] >= 0]
    cached = np.zeros(length, bool)
    cached[[int(pos[s]) for s in slots]] = True
    total = np.zeros(len(slots), np.float64)
    for q in range(h * ref.g, (h + 1) * ref.g):
        total += leave_one_out_errors(q_rows[q].astype(np.float32), keys, vals, scale, cached, [int(pos[s]) for s in slots])
    for s, e in zip(slots, total):
        ref.scores[b, h, s] = np.float32(e)


def ref_increments(ref, cache, input_kind, x, lse, scale, base, b, q_rows=None):
    """[H][capacity] float32 increments of sequence b for the reference."""
    g, W = ref.g, ref.capacity
    out = np.zeros((H, W), np.float32)
    if input_kind == "head_scores":
        return x[b, :, :W].astype(np.float32)
    for h in range(H):
        per_q = np.zeros((g, W), np.float32)
        for j in range(g):
            qh = h * g + j
            for s in range(W):
                if ref.positions[b, h, s] < 0:
                    continue
                if input_kind == "probs":
                    per_q[j, s] = x[b, qh, s]
                elif input_kind == "logits":
                    per_q[j, s] = probability_from_logit(x[b, qh, s], scale, lse[b, qh], base)
                else:
                    logit = attention_logit(q_rows[qh], cache.row(cache.k, b, h, s), np.dtype(cache.dtype).itemsize)
                    per_q[j, s] = probability_from_logit(logit, scale, lse[b, qh], base)
        out[h] = fold_group(per_q, ref.reduce)
    return out


def run_decode(
    kind, input_kind, dtype_name, layout, g, steps=22, seed=0, reduce="sum", q_float32=False, decay=1.0, sinks=0
):
    rng = np.random.default_rng(seed)
    dtype = DTYPES[dtype_name]
    Hq = H * g
    config, ref_args = make_config(kind, reduce, decay, sinks)
    extra = dict(max_tokens=steps + 2, head_dim=D) if kind == "exact_greedy" else {}
    policy = kv.BatchedPolicy(config, B, H, CAPACITY, num_q_heads=Hq, **extra)
    ref = RefPolicy(kind, B, H, Hq, CAPACITY, head_dim=D, **ref_args)
    cache = Cache(layout, dtype, rng)
    rows_k = [dict() for _ in range(B)]
    rows_v = [dict() for _ in range(B)]
    scale, base = 0.37, ("base2" if seed % 2 else "natural")
    for step in range(steps):
        active, bs = active_for(step, rng)
        k_new = rng.standard_normal((B, H, D)).astype(np.float32).astype(dtype)
        v_new = rng.standard_normal((B, H, D)).astype(np.float32).astype(dtype)
        policy.append(active, cache=cache.view, k_new=k_new, v_new=v_new)
        for b in bs:
            p = int(ref.lengths[b])
            rows_k[b][p], rows_v[b][p] = k_new[b].copy(), v_new[b].copy()
            for h in range(H):
                ref.hist_k[b][h][p] = k_new[b, h].astype(np.float32)
                ref.hist_v[b][h][p] = v_new[b, h].astype(np.float32)
            ref.append(b)
        W = BUDGET + 1 + (step % 3)  # inputs may be wider than budget + 1
        lse = None
        q = None
        if input_kind == "probs":
            x = (rng.random((B, Hq, W)) ** 4).astype(np.float32)
            victims = policy.observe_evict(probs=x, active=active)
        elif input_kind == "head_scores":
            x = rng.standard_normal((B, H, W)).astype(np.float32)  # signed increments are allowed
            victims = policy.observe_evict(head_scores=x, active=active)
        elif input_kind == "logits":
            x = (3 * rng.standard_normal((B, Hq, W))).astype(np.float32)
            lse = (rng.random((B, Hq)) * 4).astype(np.float32)
            victims = policy.observe_evict(logits=x, lse=lse, scale=scale, base=base, active=active)
        else:
            qdt = np.float32 if q_float32 else dtype
            x = rng.standard_normal((B, Hq, D)).astype(np.float32).astype(qdt)
            q = x
            lse = (rng.random((B, Hq)) * 3).astype(np.float32)
            victims = policy.observe_evict(queries=x, lse=lse, scale=scale, base=base, cache=cache.view, active=active)
        expected = np.full((B, H), -1, np.int32)
        for b in bs:
            if kind == "exact_greedy":
                for h in range(H):
                    greedy_scores(ref, b, h, q[b], scale)
            else:
                inc = ref_increments(ref, cache, input_kind, x, lse, scale, base, b, q_rows=None if q is None else q[b])
                for h in range(H):
                    ref.add_increments(b, h, inc[h])
            expected[b] = ref.evict(b)
        np.testing.assert_array_equal(victims, expected, err_msg=f"victims at step {step}")
        check_state(policy, ref, exact_scores=input_kind in ("probs", "head_scores"))
        check_cache(cache, policy, rows_k, rows_v)
    return policy, ref


LAYOUTS = ["bhsd", "paged_nhd"]


@pytest.mark.parametrize("g", [1, 4])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("input_kind", ["probs", "head_scores", "logits", "queries"])
@pytest.mark.parametrize("kind", ["h2o", "recent_window", "random"])
def test_decode_matches_reference(kind, input_kind, dtype, layout, g):
    policy, ref = run_decode(kind, input_kind, dtype, layout, g, seed=zlib.crc32(f"{kind}{input_kind}{dtype}{layout}{g}".encode()) % 1000)
    # The stream must have evicted: every sequence ran past the budget.
    assert (policy.lengths > BUDGET + 1).all()


@pytest.mark.parametrize("g", [1, 4])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_exact_greedy_matches_reference(dtype, layout, g):
    policy, _ = run_decode("exact_greedy", "queries", dtype, layout, g, steps=14, seed=7 + g)
    assert (policy.lengths > BUDGET + 1).all()


@pytest.mark.parametrize("layout", ["bshd", "paged_hnd"])
@pytest.mark.parametrize("kind", ["h2o", "random"])
def test_other_layouts(kind, layout):
    run_decode(kind, "queries", "bfloat16", layout, 4, seed=3)


@pytest.mark.parametrize("reduce", ["mean", "max"])
def test_h2o_group_reductions(reduce):
    run_decode("h2o", "probs", "float32", "bhsd", 4, reduce=reduce, seed=11)


@pytest.mark.parametrize("input_kind", ["probs", "head_scores", "queries"])
@pytest.mark.parametrize("decay,sinks", [(0.0, 0), (0.5, 1), (0.9, 0)])
def test_h2o_decay_and_sinks(decay, sinks, input_kind):
    """TOVA (decay 0) and moving averages, with a sink: score <- decay * score + increment."""
    policy, _ = run_decode("h2o", input_kind, "bfloat16", "bhsd", 4, decay=decay, sinks=sinks, seed=int(decay * 10) + sinks)
    assert policy.config.decay == decay


def test_tova_preset_and_bad_decays():
    assert kv.H2OConfig.tova(4, recent=1, sinks=1) == kv.H2OConfig(4, 1, "mean", 0.0, 1)
    assert kv.H2OConfig(2, 2, sinks=1).budget == 5
    for bad in (1.5, -0.1, float("nan"), 1e300):
        with pytest.raises(kv.OutOfRange, match="'config.decay'"):
            kv.BatchedPolicy(kv.H2OConfig(2, 2, decay=bad), 1, 1, 6)
    with pytest.raises(kv.BudgetError, match="'config.sinks'"):
        kv.BatchedPolicy(kv.H2OConfig(2, 2, sinks=-1), 1, 1, 6)


def test_float32_queries_over_a_half_cache():
    run_decode("h2o", "queries", "float16", "paged_nhd", 4, seed=5, q_float32=True)


def test_ties_are_broken_by_position():
    """Probabilities on a coarse grid tie often; h2o then evicts the older token."""
    rng = np.random.default_rng(1)
    config, args = make_config("h2o")
    policy = kv.BatchedPolicy(config, 1, 1, CAPACITY)
    ref = RefPolicy("h2o", 1, 1, 1, CAPACITY, **args)
    for _ in range(30):
        policy.append()
        ref.append(0)
        x = (rng.integers(0, 2, (1, 1, CAPACITY)) / 4).astype(np.float32)
        victims = policy.observe_evict(probs=x)
        ref.add_increments(0, 0, x[0, 0])
        assert victims[0, 0] == ref.evict(0)[0]
        check_state(policy, ref)


def test_philox_known_answers():
    """The reference's Philox4x32-10 against the Random123 known-answer vectors."""
    out = philox4x32_10((0, 0, 0, 0), (0, 0))
    assert [int(x) for x in out] == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    out = philox4x32_10((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2)
    assert [int(x) for x in out] == [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]
    out = philox4x32_10((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0))
    assert [int(x) for x in out] == [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]


def test_random_request_streams():
    """reset with streams: draws follow the request stream, not the sequence index."""
    config, args = make_config("random")
    policy = kv.BatchedPolicy(config, 2, H, CAPACITY)
    ref = RefPolicy("random", 2, H, H, CAPACITY, **args)
    streams = np.array([2**40 + 3, 17], np.uint64)
    policy.reset(streams=streams)
    ref.streams = [int(s) for s in streams]
    np.testing.assert_array_equal(policy.streams, streams)
    rng = np.random.default_rng(2)
    for _ in range(16):
        policy.append()
        for b in range(2):
            ref.append(b)
        x = rng.random((2, H, CAPACITY)).astype(np.float32)
        victims = policy.observe_evict(probs=x)
        for b in range(2):
            for h in range(H):
                ref.add_increments(b, h, x[b, h])  # random keeps scores too (unused by its rule)
        np.testing.assert_array_equal(victims, [ref.evict(0), ref.evict(1)])
        check_state(policy, ref)


# ---- prefill ---------------------------------------------------------------------


@pytest.mark.parametrize("g", [1, 4])
@pytest.mark.parametrize(
    "kind,input_kind",
    [("h2o", "probs"), ("h2o", "column_sums"), ("h2o", "queries"), ("recent_window", None), ("random", None)],
)
@pytest.mark.parametrize("layout,dtype", [("bhsd", "float32"), ("paged_nhd", "bfloat16"), ("bshd", "float16")])
def test_prefill_matches_reference(kind, input_kind, layout, dtype, g):
    rng = np.random.default_rng(g * 7 + len(layout))
    capacity = 70  # prompts beyond 64 rows use two column-sum chunks
    Hq = H * g
    config, args = make_config(kind)
    policy = kv.BatchedPolicy(config, B, H, capacity, num_q_heads=Hq)
    ref = RefPolicy(kind, B, H, Hq, capacity, **args)
    cache = Cache(layout, DTYPES[dtype], rng, capacity=capacity)
    lengths = np.array([68, 4, 23], np.int32)  # one prompt within the budget
    M = int(lengths.max())
    prompt_k = rng.standard_normal((B, M, H, D)).astype(np.float32).astype(DTYPES[dtype])
    prompt_v = rng.standard_normal((B, M, H, D)).astype(np.float32).astype(DTYPES[dtype])
    for b in range(B):
        for p in range(lengths[b]):
            for h in range(H):
                cache.set_row(cache.k, b, h, p, prompt_k[b, p, h])
                cache.set_row(cache.v, b, h, p, prompt_v[b, p, h])
    scale = 0.25
    probs = rng.random((B, Hq, M, M)).astype(np.float32) * np.tril(np.ones((M, M), np.float32))
    kwargs = {}
    if input_kind == "probs":
        kwargs["probs"] = probs
    elif input_kind == "column_sums":
        sums = np.zeros((B, Hq, M), np.float32)  # each prompt's own rows only
        for b in range(B):
            for q in range(Hq):
                sums[b, q, : lengths[b]] = column_sums(probs[b, q], int(lengths[b]))
        kwargs["column_sums"] = sums
    elif input_kind == "queries":
        kwargs["queries"] = rng.standard_normal((B, Hq, M, D)).astype(np.float32).astype(DTYPES[dtype])
        kwargs["lse"] = (rng.random((B, Hq, M)) * 3 + 2).astype(np.float32)
    reclaimable = policy.prefill(lengths, cache=cache.view, scale=scale, **kwargs)
    for b in range(B):
        L = int(lengths[b])
        head_scores = None
        if input_kind is not None:
            per_q = np.zeros((Hq, L), np.float32)
            for qh in range(Hq):
                h = qh // g
                if input_kind == "queries":
                    mat = np.zeros((L, L), np.float32)
                    for i in range(L):
                        for p in range(i + 1):
                            logit = attention_logit(kwargs["queries"][b, qh, i], prompt_k[b, p, h], np.dtype(DTYPES[dtype]).itemsize)
                            mat[i, p] = probability_from_logit(logit, scale, kwargs["lse"][b, qh, i], "natural")
                    per_q[qh] = column_sums(mat, L)
                else:
                    per_q[qh] = column_sums(probs[b, qh], L)
            head_scores = [fold_group(per_q[h * g : (h + 1) * g], "sum") for h in range(H)]
        ref.prefill(b, L, head_scores)
    check_state(policy, ref, exact_scores=input_kind != "queries")
    rows_k = [{p: prompt_k[b, p] for p in range(lengths[b])} for b in range(B)]
    rows_v = [{p: prompt_v[b, p] for p in range(lengths[b])} for b in range(B)]
    check_cache(cache, policy, rows_k, rows_v)
    pages_kept = -(-min(BUDGET + 1, capacity) // PAGE)
    expected_pages = [max(0, -(-int(L) // PAGE) - pages_kept) if layout.startswith("paged") else 0 for L in lengths]
    np.testing.assert_array_equal(reclaimable, expected_pages)
    # Decode continues from the compressed prompt.
    for _ in range(3):
        k_new = rng.standard_normal((B, H, D)).astype(np.float32).astype(DTYPES[dtype])
        policy.append(cache=cache.view, k_new=k_new, v_new=k_new)
        for b in range(B):
            ref.append(b)
        x = rng.random((B, Hq, capacity)).astype(np.float32)
        victims = policy.observe_evict(probs=x)
        for b in range(B):
            for h in range(H):
                ref.add_increments(b, h, fold_group(x[b, h * g : (h + 1) * g], "sum"))
            np.testing.assert_array_equal(victims[b], ref.evict(b))
        check_state(policy, ref, exact_scores=input_kind != "queries")


# ---- multi-token steps -------------------------------------------------------------


@pytest.mark.parametrize(
    "kind,with_cache",
    [(k, c) for k in ("h2o", "recent_window", "random") for c in (True, False)] + [("exact_greedy", True)],
)
def test_evict_to_matches_reference(kind, with_cache):
    """append_tokens + observe_evict + evict_to; without a cache the moves are
    reported (exact_greedy's evict_to always reads the cache)."""
    rng = np.random.default_rng(4)
    capacity, g = 16, 2
    Hq = H * g
    config, args = make_config(kind)
    extra = dict(max_tokens=40, head_dim=D) if kind == "exact_greedy" else {}
    policy = kv.BatchedPolicy(config, B, H, capacity, num_q_heads=Hq, **extra)
    ref = RefPolicy(kind, B, H, Hq, capacity, head_dim=D, **args)
    cache = Cache("paged_nhd", np.float32, rng, capacity=capacity)
    rows = [dict() for _ in range(B)]
    scale = 0.3
    for chunk in (6, 4, 7, 3):  # chunked prefill then speculative-decoding-sized steps
        counts = policy.counts.copy()
        next_slots = policy.next_slots.copy()
        policy.append_tokens(chunk)
        for b in range(B):
            first = int(ref.lengths[b])
            for j in range(chunk):
                row = rng.standard_normal((H, D)).astype(np.float32)
                rows[b][first + j] = row
                for h in range(H):
                    s = next_slots[b, h] if (j == 0 and next_slots[b, h] >= 0) else counts[b, h] + j
                    cache.set_row(cache.k, b, h, s, row[h])
                    cache.set_row(cache.v, b, h, s, -row[h])
                    ref.hist_k[b][h][first + j] = row[h]
                    ref.hist_v[b][h][first + j] = -row[h]
            ref.append_tokens(b, chunk)
        check_state(policy, ref)
        q = rng.standard_normal((B, Hq, D)).astype(np.float32)
        lse = np.full((B, Hq), 2.0, np.float32)
        if kind == "exact_greedy":
            victims = policy.observe_evict(queries=q, lse=lse, scale=scale, cache=cache.view)
        else:
            x = rng.random((B, Hq, capacity)).astype(np.float32)
            victims = policy.observe_evict(probs=x)
        for b in range(B):
            if kind == "exact_greedy":
                for h in range(H):
                    greedy_scores(ref, b, h, q[b], scale)
            else:
                for h in range(H):
                    ref.add_increments(b, h, fold_group(x[b, h * g : (h + 1) * g], "sum"))
            np.testing.assert_array_equal(victims[b], ref.evict(b))
        rescore = (lambda b, h: greedy_scores(ref, b, h, q[b], scale)) if kind == "exact_greedy" else None
        expected = [ref.evict_to(b, BUDGET, rescore) for b in range(B)]
        if with_cache:
            kw = dict(queries=q, lse=lse, scale=scale) if kind == "exact_greedy" else {}
            freed = policy.evict_to(BUDGET, cache=cache.view, **kw)
            np.testing.assert_array_equal(freed, [e[0] for e in expected])
            mirror = {b: {p: r for p, r in rows[b].items()} for b in range(B)}
            for b in range(B):
                for h in range(H):
                    for s in range(capacity):
                        p = int(policy.positions[b, h, s])
                        if p >= 0:
                            np.testing.assert_array_equal(cache.row(cache.k, b, h, s), mirror[b][p][h])
                            np.testing.assert_array_equal(cache.row(cache.v, b, h, s), -mirror[b][p][h])
        else:
            moves, move_counts = policy.evict_to(BUDGET)
            for b in range(B):
                for h in range(H):
                    got = [tuple(m) for m in moves[b, h, : move_counts[b, h]]]
                    assert sorted(got) == sorted(expected[b][1][h])
                    for frm, to in got:  # apply the moves to keep the cache consistent
                        cache.set_row(cache.k, b, h, to, cache.row(cache.k, b, h, frm).copy())
                        cache.set_row(cache.v, b, h, to, cache.row(cache.v, b, h, frm).copy())
        check_state(policy, ref, exact_scores=kind != "exact_greedy")


def test_numpy_path_does_not_import_torch():
    code = (
        "import sys, numpy as np, kvevict as kv\n"
        "p = kv.BatchedPolicy(kv.H2OConfig(2, 2), 1, 1, 5)\n"
        "p.append(); p.observe_evict(probs=np.ones((1, 1, 5), np.float32))\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
