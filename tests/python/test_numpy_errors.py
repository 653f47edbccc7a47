"""Bad input through NumPy: a clear exception naming the argument, and the
state (and cache) left as it was.

Argument errors (dtype, rank, extents, strides, device, configuration) are
found before anything runs, so the state's bytes are unchanged. Bad data
(NaN, a negative probability) leaves the (sequence, head) it belongs to
unchanged while the rest of the batch steps (docs/semantics.md, "Devices"),
and the call raises the lowest offender."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import kvevict as kv
from fake_dlpack import FakeCudaArray

B, H, G, C, D = 2, 2, 2, 6, 4
HQ = H * G


def make(config=None, **kw):
    policy = kv.BatchedPolicy(config or kv.H2OConfig(heavy=3, recent=2), B, H, C, num_q_heads=HQ, **kw)
    k = np.zeros((B, H, C, D), np.float32)
    v = np.zeros((B, H, C, D), np.float32)
    return policy, kv.CacheView.bhsd(k, v)


def step(policy, cache, rng, probs=None):
    rows = rng.standard_normal((B, H, D)).astype(np.float32)
    policy.append(cache=cache, k_new=rows, v_new=rows)
    return policy.observe_evict(probs=rng.random((B, HQ, C)).astype(np.float32) if probs is None else probs)


def warmed(rng, steps=8, config=None):
    policy, cache = make(config)
    for _ in range(steps):
        step(policy, cache, rng)
    return policy, cache


def semantic(policy):
    return {
        "positions": policy.positions.copy(),
        "counts": policy.counts.copy(),
        "next_slots": policy.next_slots.copy(),
        "lengths": policy.lengths.copy(),
        "scores": policy.scores.copy(),
    }


def assert_same(before, after):
    for name in before:
        np.testing.assert_array_equal(before[name], after[name], err_msg=name)


def raises_unchanged(policy, cache, exc, match, fn):
    """fn() raises exc matching `match`; the state bytes and the cache do not change."""
    state = policy.state.copy()
    k, v = cache.k.copy(), cache.v.copy()
    with pytest.raises(exc, match=match):
        fn()
    np.testing.assert_array_equal(policy.state, state)
    np.testing.assert_array_equal(cache.k, k)
    np.testing.assert_array_equal(cache.v, v)


# ---- argument errors: nothing changes --------------------------------------------


def test_wrong_dtype():
    policy, cache = warmed(np.random.default_rng(0))
    probs = np.random.default_rng(1).random((B, HQ, C))  # float64
    rows = np.zeros((B, H, D), np.float32)
    policy.append(cache=cache, k_new=rows, v_new=rows)
    raises_unchanged(policy, cache, kv.InvalidArgument, r"'probs' has dtype float64, expected float32",
                     lambda: policy.observe_evict(probs=probs))


def test_wrong_rank_and_extents():
    policy, cache = warmed(np.random.default_rng(0))
    rows = np.zeros((B, H, D), np.float32)
    policy.append(cache=cache, k_new=rows, v_new=rows)
    ok = np.random.default_rng(1).random((B, HQ, C)).astype(np.float32)
    raises_unchanged(policy, cache, kv.InvalidArgument, r"'probs' has 2 dimensions, expected 3",
                     lambda: policy.observe_evict(probs=ok[0]))
    raises_unchanged(policy, cache, kv.InvalidArgument, r"'probs.extents\[1\]' = 3, expected 4",
                     lambda: policy.observe_evict(probs=ok[:, :3]))
    raises_unchanged(policy, cache, kv.InvalidArgument, r"'probs.extents\[2\]' = 0, expected at least 1",
                     lambda: policy.observe_evict(probs=ok[:, :, :0]))
    # every head holds 6 tokens: a 5-column input is refused per (b, h), each head left as it was
    raises_unchanged(policy, cache, kv.InvalidArgument,
                     r"at sequence 0, head 0, index 6 \(the tokens the head holds\): the input has fewer columns than the head holds tokens",
                     lambda: policy.observe_evict(probs=ok[:, :, :5]))
    raises_unchanged(policy, cache, kv.InvalidArgument, r"'lse.extents\[1\]'",
                     lambda: policy.observe_evict(logits=ok, lse=np.zeros((B, 3), np.float32)))
    # the same input, strided and in a wider buffer, is accepted
    wide = np.zeros((HQ, B, 2 * C), np.float32).transpose(1, 0, 2)[:, :, 3 : 3 + C]
    wide[...] = ok
    policy.observe_evict(probs=wide)


def test_strides_that_are_refused():
    policy, cache = warmed(np.random.default_rng(0))
    rows = np.zeros((B, H, D), np.float32)
    raises_unchanged(policy, cache, kv.InvalidArgument, r"'k_new.strides\[2\]' = 2, rows must be contiguous",
                     lambda: policy.append(cache=cache, k_new=np.zeros((B, H, 2 * D), np.float32)[:, :, ::2], v_new=rows))
    raises_unchanged(policy, cache, kv.InvalidArgument, r"'k_new' has a negative stride",
                     lambda: policy.append(cache=cache, k_new=rows[:, ::-1], v_new=rows))
    k2 = np.zeros((B, H, C, 2 * D), np.float32)[..., ::2]
    v2 = np.zeros((B, H, C, 2 * D), np.float32)[..., ::2]
    raises_unchanged(policy, cache, kv.InvalidArgument, r"'k_cache' has stride 2 in its last dimension",
                     lambda: policy.append(cache=kv.CacheView.bhsd(k2, v2), k_new=rows, v_new=rows))
    v_t = np.zeros((B, C, H, D), np.float32).transpose(0, 2, 1, 3)  # same shape, other strides
    raises_unchanged(policy, cache, kv.InvalidArgument, r"'v_cache' has stride",
                     lambda: policy.append(cache=kv.CacheView.bhsd(cache.k, v_t), k_new=rows, v_new=rows))
    raises_unchanged(policy, cache, kv.InvalidArgument, r"'active' is not contiguous",
                     lambda: policy.append(np.array([0, 9, 1], np.int32)[::2]))


def test_paged_table_errors():
    policy = kv.BatchedPolicy(kv.RecentWindowConfig(1, 3), B, H, 8)
    pool = np.zeros((6, 4, H, D), np.float16)
    table = np.array([[0, 1], [2, 3]], np.int32)
    rows = np.zeros((B, H, D), np.float16)
    cache = kv.CacheView.paged(pool, pool.copy(), table)
    raises_unchanged(policy, cache, kv.InvalidArgument, r"'page_table' has dtype int64, expected int32",
                     lambda: policy.append(cache=kv.CacheView.paged(pool, cache.v, table.astype(np.int64)), k_new=rows, v_new=rows))
    wide = np.zeros((B, 4), np.int32)[:, ::2]
    raises_unchanged(policy, cache, kv.InvalidArgument, r"'page_table' rows must be contiguous",
                     lambda: policy.append(cache=kv.CacheView.paged(pool, cache.v, wide), k_new=rows, v_new=rows))
    raises_unchanged(policy, cache, kv.InvalidArgument, r"'page_table' has 1 pages of 4 slots per sequence",
                     lambda: policy.append(cache=kv.CacheView.paged(pool, cache.v, table[:, :1]), k_new=rows, v_new=rows))
    raises_unchanged(policy, cache, kv.InvalidArgument, r"'k_new' has dtype float32, the cache holds float16",
                     lambda: policy.append(cache=cache, k_new=rows.astype(np.float32), v_new=rows))
    # a page id outside the pool, in a row the call touches: bad_page, nothing appended
    bad = np.array([[0, 1], [9, 3]], np.int32)
    before = semantic(policy)
    with pytest.raises(kv.OutOfRange, match=r"sequence 1, head 0, index 0 \(the slot\): a page id is outside"):
        policy.append(cache=kv.CacheView.paged(pool, cache.v, bad), k_new=rows, v_new=rows)
    after = semantic(policy)
    np.testing.assert_array_equal(after["lengths"], [1, 0])  # sequence 0 stepped, 1 did not
    np.testing.assert_array_equal(after["positions"][1], before["positions"][1])


def test_dtype_mismatches_in_the_cache():
    policy, cache = make()
    rows = np.zeros((B, H, D), np.float32)
    half = np.zeros((B, H, C, D), np.float16)
    raises_unchanged(policy, cache, kv.InvalidArgument, r"'v_cache' has dtype float16, k_cache has float32",
                     lambda: policy.append(cache=kv.CacheView.bhsd(cache.k, half), k_new=rows, v_new=rows))
    raises_unchanged(policy, cache, kv.InvalidArgument, r"'k_cache' has dtype int32",
                     lambda: policy.append(cache=kv.CacheView.bhsd(cache.k.view(np.int32), cache.v), k_new=rows, v_new=rows))
    q = np.zeros((B, HQ, D), ml_dtypes.bfloat16)
    policy.append(cache=cache, k_new=rows, v_new=rows)
    raises_unchanged(policy, cache, kv.InvalidArgument, r"'queries' has dtype bfloat16, expected float32 or the cache's float32",
                     lambda: policy.observe_evict(queries=q, lse=np.zeros((B, HQ), np.float32), cache=cache))


def test_device_mismatch():
    policy, cache = warmed(np.random.default_rng(0))
    rows = np.zeros((B, H, D), np.float32)
    policy.append(cache=cache, k_new=rows, v_new=rows)
    raises_unchanged(policy, cache, kv.InvalidArgument, r"'probs' is on cuda:0, the state is on cpu",
                     lambda: policy.observe_evict(probs=FakeCudaArray((B, HQ, C))))
    raises_unchanged(policy, cache, kv.InvalidArgument, r"'lse' is on cuda:0",
                     lambda: policy.observe_evict(logits=np.zeros((B, HQ, C), np.float32), lse=FakeCudaArray((B, HQ))))


def test_outputs_must_be_writable_int32():
    policy, cache = warmed(np.random.default_rng(0))
    rows = np.zeros((B, H, D), np.float32)
    policy.append(cache=cache, k_new=rows, v_new=rows)
    probs = np.ones((B, HQ, C), np.float32)
    ro = np.zeros((B, H), np.int32)
    ro.flags.writeable = False
    raises_unchanged(policy, cache, kv.InvalidArgument, r"'victims' is read-only",
                     lambda: policy.observe_evict(probs=probs, out=ro))
    raises_unchanged(policy, cache, kv.InvalidArgument, r"'victims' has dtype int64",
                     lambda: policy.observe_evict(probs=probs, out=np.zeros((B, H), np.int64)))


def test_configuration_errors():
    with pytest.raises(kv.BudgetError, match=r"'config.heavy' = -1 is negative"):
        kv.BatchedPolicy(kv.H2OConfig(-1, 2), 1, 1, 8)
    with pytest.raises(kv.BudgetError, match=r"'shape.capacity' = 4 cannot hold budget = 4"):
        kv.BatchedPolicy(kv.H2OConfig(2, 2), 1, 1, 4)
    with pytest.raises(kv.BudgetError, match=r"'config.sinks \+ config.recent' = 4 leaves no evictable token"):
        kv.BatchedPolicy(kv.RandomConfig(budget=4, sinks=2, recent=2), 1, 1, 8)
    with pytest.raises(kv.InvalidArgument, match=r"'shape.num_q_heads' = 3 is not a multiple"):
        kv.BatchedPolicy(kv.H2OConfig(2, 2), 1, 2, 8, num_q_heads=3)
    with pytest.raises(kv.InvalidArgument, match=r"'reduce' = 'median'"):
        kv.BatchedPolicy(kv.H2OConfig(2, 2, reduce="median"), 1, 1, 8)
    with pytest.raises(kv.InvalidArgument, match=r"'max_tokens' and 'head_dim' are required"):
        kv.BatchedPolicy(kv.ExactGreedyConfig(4, 1), 1, 1, 8)
    with pytest.raises(kv.InvalidArgument, match=r"'history.max_tokens' = 4 is below the capacity 8"):
        kv.BatchedPolicy(kv.ExactGreedyConfig(4, 1), 1, 1, 8, max_tokens=4, head_dim=8)
    with pytest.raises(kv.BudgetError, match="heavy_ratio"):
        kv.H2OConfig.from_ratios(100, 1.5, 0.1)
    assert kv.H2OConfig.from_ratios(1000, 0.1, 0.1) == kv.H2OConfig(100, 100)
    assert kv.RecentWindowConfig.from_ratio(1000, 0.2, sinks=4) == kv.RecentWindowConfig(4, 196)


def test_exceptions_are_python_exceptions_too():
    assert issubclass(kv.InvalidArgument, ValueError) and issubclass(kv.InvalidArgument, kv.Error)
    assert issubclass(kv.BudgetError, kv.InvalidArgument)
    assert issubclass(kv.OutOfRange, IndexError) and issubclass(kv.NonFiniteError, ValueError)
    assert issubclass(kv.StateError, RuntimeError) and not issubclass(kv.StateError, ValueError)


# ---- bad data: the offending head is unchanged --------------------------------------


@pytest.mark.parametrize("bad,exc,what", [
    (np.nan, kv.NonFiniteError, "an input is NaN"),
    (np.inf, kv.NonFiniteError, "an input is infinite"),
    (-0.5, kv.InvalidArgument, "a probability is negative"),
])
def test_bad_probability_leaves_the_head_unchanged(bad, exc, what):
    rng = np.random.default_rng(3)
    policy, cache = warmed(rng)
    twin, twin_cache = warmed(np.random.default_rng(3))
    rows = rng.standard_normal((B, H, D)).astype(np.float32)
    for p, c in ((policy, cache), (twin, twin_cache)):
        p.append(cache=c, k_new=rows, v_new=rows)
    before = semantic(policy)
    probs = rng.random((B, HQ, C)).astype(np.float32)
    broken = probs.copy()
    broken[1, 3, 2] = bad  # sequence 1, query head 3 = KV head 1, slot 2
    with pytest.raises(exc, match=rf"at sequence 1, head 1, index 2 \(the slot\): {what} \(that head was left unchanged\)"):
        policy.observe_evict(probs=broken)
    after = semantic(policy)
    for name in ("positions", "scores"):
        np.testing.assert_array_equal(after[name][1, 1], before[name][1, 1], err_msg=name)
    assert after["counts"][1, 1] == before["counts"][1, 1]
    # The rest of the batch stepped; a retry for sequence 1 completes the
    # refused head's step (docs/integration.md, "After a bad input"). Its
    # other head already stepped, so the retry reports that one as not appended.
    with pytest.raises(kv.StateError, match="at sequence 1, head 0, index 0: observe \\+ evict without an append"):
        policy.observe_evict(probs=probs, active=[1])
    twin.observe_evict(probs=probs)
    assert_same(semantic(twin), semantic(policy))


def test_nan_in_a_single_sequence_batch_changes_nothing():
    policy = kv.BatchedPolicy(kv.H2OConfig(2, 2), 1, 2, 6, num_q_heads=4)
    rng = np.random.default_rng(0)
    for _ in range(7):
        policy.append()
        policy.observe_evict(probs=rng.random((1, 4, 6)).astype(np.float32))
    policy.append()
    before = semantic(policy)
    probs = rng.random((1, 4, 6)).astype(np.float32)
    probs[0, :, 0] = np.nan  # every head
    with pytest.raises(kv.NonFiniteError, match=r"at sequence 0, head 0, index 0 \(the slot\): an input is NaN"):
        policy.observe_evict(probs=probs)
    assert_same(before, semantic(policy))
    assert policy.status() == kv._ext.STATUS_CLEAR  # raised, then cleared


def test_queries_and_lse_must_be_finite():
    policy, cache = warmed(np.random.default_rng(0))
    rows = np.zeros((B, H, D), np.float32)
    policy.append(cache=cache, k_new=rows, v_new=rows)
    before = semantic(policy)
    q = np.ones((B, HQ, D), np.float32)
    lse = np.zeros((B, HQ), np.float32)
    lse[0, 1] = np.inf
    with pytest.raises(kv.NonFiniteError, match=r"at sequence 0, head 0, index 1 \(the query head\): the LSE of a query head is not finite"):
        policy.observe_evict(queries=q, lse=lse, cache=cache)
    after = semantic(policy)
    np.testing.assert_array_equal(after["scores"][0, 0], before["scores"][0, 0])


def test_protocol_errors():
    policy, cache = warmed(np.random.default_rng(0))
    probs = np.ones((B, HQ, C), np.float32)
    before = semantic(policy)
    with pytest.raises(kv.StateError, match="observe \\+ evict without an append since the last one"):
        policy.observe_evict(probs=probs)
    assert_same(before, semantic(policy))
    rows = np.zeros((B, H, D), np.float32)
    policy.append(cache=cache, k_new=rows, v_new=rows)
    before = semantic(policy)
    with pytest.raises(kv.StateError, match="has no free slot"):
        policy.append(cache=cache, k_new=rows, v_new=rows)  # budget + 1 already: evict first
    assert_same(before, semantic(policy))
    with pytest.raises(kv.StateError, match="evict_to after an append that was not observed"):
        policy.evict_to(5, cache=cache)


def test_active_list_entries_out_of_range():
    policy, cache = make()
    with pytest.raises(kv.OutOfRange, match="an active-list entry is not a sequence index"):
        policy.append([5])
    assert (policy.lengths == 0).all()
    with pytest.raises(kv.InvalidArgument, match=r"'active' has 3 flags, expected one per sequence \(2\)"):
        policy.append(np.ones(3, np.uint8))
    with pytest.raises(kv.InvalidArgument, match=r"'active' has dtype int64"):
        policy.append(np.array([0], np.int64))
    with pytest.raises(kv.OutOfRange, match=r"'active.count' = 3 is outside"):
        policy.append(np.array([0, 1, 0], np.int32))


def test_reset_stream_out_of_range():
    policy = kv.BatchedPolicy(kv.RandomConfig(4, 1, 1), 2, 1, 6)
    state = policy.state.copy()
    with pytest.raises(kv.OutOfRange, match=r"'streams\[1\]' = 9223372036854775808 exceeds max_random_stream"):
        policy.reset(streams=np.array([1, 2**63], np.uint64))
    np.testing.assert_array_equal(policy.state, state)


def test_prefill_errors():
    policy = kv.BatchedPolicy(kv.RecentWindowConfig(1, 3), B, H, 8)
    k = np.zeros((B, H, 8, D), np.float32)
    cache = kv.CacheView.bhsd(k, k.copy())
    with pytest.raises(kv.OutOfRange, match=r"'prompts.max_length' = 9 is outside \[1, capacity = 8\]"):
        policy.prefill([9, 2], cache=cache)
    with pytest.raises(kv.InvalidArgument, match="belongs to h2o, whose prefill needs scores"):
        kv.BatchedPolicy(kv.H2OConfig(2, 2), B, H, 8).prefill([3, 3], cache=cache)
    policy.append()
    before = semantic(policy)
    with pytest.raises(kv.StateError, match="prefill of a sequence that already holds tokens"):
        policy.prefill([3, 3], cache=cache)
    assert_same(before, semantic(policy))


def test_exact_greedy_takes_queries_only():
    policy, cache = make(kv.ExactGreedyConfig(4, 1, 1), max_tokens=16, head_dim=D)
    rows = np.zeros((B, H, D), np.float32)
    policy.append(cache=cache, k_new=rows, v_new=rows)
    raises_unchanged(policy, cache, kv.InvalidArgument, "is not queries \\+ LSE, which exact_greedy needs",
                     lambda: policy.observe_evict(probs=np.ones((B, HQ, C), np.float32)))
