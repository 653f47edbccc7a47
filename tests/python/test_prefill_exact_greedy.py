"""exact_greedy's batched prefill (BatchedPolicy.prefill_exact_greedy: the
C++ batched_prefill with the queries of each prompt's last row, on the
host) against a brute-force greedy removal written from the definition,
and against the batched decode route that reaches the same tokens
(append_tokens, observe + evict, evict_to)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import kvevict as kv
from reference import leave_one_out_errors

B, H, G, D = 3, 2, 2, 8
HQ = H * G
BUDGET, SINKS, RECENT = 5, 1, 1
CAP = 12
SCALE = 0.4


def config():
    return kv.ExactGreedyConfig(budget=BUDGET, recent=RECENT, sinks=SINKS)


def policy(capacity=CAP, max_tokens=16):
    return kv.BatchedPolicy(config(), B, H, capacity, num_q_heads=HQ, max_tokens=max_tokens, head_dim=D)


def brute_force_greedy(k, v, q_group, length):
    """The kept positions of one (sequence, KV head), from the definition:
    from every prompt position, drop the unprotected one (not among the
    first SINKS nor the last RECENT) whose removal changes the group's
    attention output least (leave-one-out errors summed over the group's
    query heads, as float32; the lowest (error, position)), until BUDGET
    remain."""
    cached = np.ones(length, bool)
    while cached.sum() > BUDGET:
        members = [p for p in range(length) if cached[p] and SINKS <= p < length - RECENT]
        total = np.zeros(len(members))
        for q in q_group:
            total += leave_one_out_errors(q, k[:length], v[:length], SCALE, cached, members)
        victim = min(range(len(members)), key=lambda i: (np.float32(total[i]), members[i]))
        cached[members[victim]] = False
    return np.flatnonzero(cached)


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_prefill_matches_brute_force(dtype):
    rng = np.random.default_rng(11)
    lengths = np.array([9, 5, 12], np.int32)  # above, at and far above the budget
    k = rng.standard_normal((B, H, CAP, D)).astype(dtype)
    v = rng.standard_normal((B, H, CAP, D)).astype(dtype)
    k0, v0 = k.copy(), v.copy()
    q = rng.standard_normal((B, HQ, D)).astype(np.float32)
    p = policy()
    reclaimable = p.prefill_exact_greedy(lengths, cache=kv.CacheView.bhsd(k, v), queries=q, scale=SCALE)
    np.testing.assert_array_equal(reclaimable, 0)  # a strided cache has no pages
    np.testing.assert_array_equal(p.lengths, lengths)
    for b in range(B):
        L = int(lengths[b])
        kept_count = min(L, BUDGET)
        for h in range(H):
            kf, vf = k0[b, h].astype(np.float32), v0[b, h].astype(np.float32)
            kept = brute_force_greedy(kf, vf, q[b, h * G:(h + 1) * G], L)
            assert len(kept) == kept_count
            assert p.counts[b, h] == kept_count
            np.testing.assert_array_equal(p.positions[b, h, :kept_count], kept, err_msg=f"(b, h) = ({b}, {h})")
            assert (p.positions[b, h, kept_count:] == -1).all()
            # the kept rows moved, in position order, to slots [0, kept)
            np.testing.assert_array_equal(k[b, h, :kept_count], k0[b, h, kept])
            np.testing.assert_array_equal(v[b, h, :kept_count], v0[b, h, kept])
            np.testing.assert_array_equal(p.scores[b, h], 0)  # the next observe scores them all


def test_prefill_agrees_with_the_decode_route():
    """The same tokens as append_tokens(L) + observe_evict(queries) + evict_to(budget)."""
    rng = np.random.default_rng(3)
    L = 10
    k = rng.standard_normal((B, H, CAP, D)).astype(np.float32)
    v = rng.standard_normal((B, H, CAP, D)).astype(np.float32)
    q = rng.standard_normal((B, HQ, D)).astype(np.float32)
    lse = np.zeros((B, HQ), np.float32)
    by_prefill = policy()
    kp, vp = k.copy(), v.copy()
    by_prefill.prefill_exact_greedy(np.full(B, L, np.int32), cache=kv.CacheView.bhsd(kp, vp), queries=q, lse=lse,
                                    scale=SCALE)
    by_decode = policy()
    kd, vd = k.copy(), v.copy()
    view = kv.CacheView.bhsd(kd, vd)
    by_decode.append_tokens(L)
    by_decode.observe_evict(queries=q, lse=lse, scale=SCALE, cache=view)
    by_decode.evict_to(BUDGET, cache=view, queries=q, lse=lse, scale=SCALE)
    for b in range(B):
        for h in range(H):
            a = by_prefill.positions[b, h]
            d = by_decode.positions[b, h]
            assert sorted(a[a >= 0]) == sorted(d[d >= 0])
            # every kept position's row is the prompt's row of that position
            for s in range(CAP):
                if a[s] >= 0:
                    np.testing.assert_array_equal(kp[b, h, s], k[b, h, a[s]])


def test_prefill_refusals():
    rng = np.random.default_rng(5)
    k = rng.standard_normal((B, H, CAP, D)).astype(np.float32)
    v = rng.standard_normal((B, H, CAP, D)).astype(np.float32)
    q = rng.standard_normal((B, HQ, D)).astype(np.float32)
    # Not an exact_greedy state: the library refuses queries without a history.
    h2o = kv.BatchedPolicy(kv.H2OConfig(3, 2), B, H, CAP, num_q_heads=HQ)
    with pytest.raises(kv.InvalidArgument, match=r"kvevict::batch::prefill: argument 'last_rows' are queries, the "
                                                 r"prefill input of exact_greedy alone"):
        h2o.prefill_exact_greedy([6, 6, 6], cache=kv.CacheView.bhsd(k, v), queries=q)
    p = policy()
    with pytest.raises(kv.InvalidArgument, match=r"argument 'queries' has 4 dimensions, expected 3"):
        p.prefill_exact_greedy([6, 6, 6], cache=kv.CacheView.bhsd(k, v), queries=q[:, :, None])
    # A NaN key leaves its sequence unchanged, the rest of the batch is compressed.
    k[1, 0, 2, 0] = np.nan
    with pytest.raises(kv.NonFiniteError, match=r"sequence 1"):
        p.prefill_exact_greedy([8, 8, 8], cache=kv.CacheView.bhsd(k, v), queries=q, scale=SCALE)
    assert p.lengths[1] == 0 and p.counts[1].tolist() == [0, 0]
    assert p.lengths[0] == 8 and p.counts[0].tolist() == [BUDGET, BUDGET]


def test_torch_op_and_compile_route():
    torch = pytest.importorskip("torch")
    import kvevict.ops as ops

    rng = np.random.default_rng(8)
    k = torch.from_numpy(rng.standard_normal((B, H, CAP, D)).astype(np.float32))
    v = torch.from_numpy(rng.standard_normal((B, H, CAP, D)).astype(np.float32))
    q = torch.from_numpy(rng.standard_normal((B, HQ, D)).astype(np.float32))
    lengths = torch.tensor([7, 9, 4], dtype=torch.int32)
    eager = kv.BatchedPolicy(config(), B, H, CAP, num_q_heads=HQ, max_tokens=16, head_dim=D, device="cpu")
    ke, ve = k.clone(), v.clone()
    eager.prefill_exact_greedy(lengths, cache=kv.CacheView.bhsd(ke, ve), queries=q, scale=SCALE)
    by_op = kv.BatchedPolicy(config(), B, H, CAP, num_q_heads=HQ, max_tokens=16, head_dim=D, device="cpu")
    ko, vo = k.clone(), v.clone()
    reclaimable = ops.prefill_exact_greedy(by_op.state, list(by_op.descriptor), lengths, 9, q, None, SCALE, 0, ko, vo,
                                           None, None, 0)
    assert reclaimable.shape == (B,) and reclaimable.dtype == torch.int32
    assert torch.equal(eager.positions, by_op.positions) and torch.equal(eager.counts, by_op.counts)
    assert torch.equal(ke, ko) and torch.equal(ve, vo)
    fresh = kv.BatchedPolicy(config(), B, H, CAP, num_q_heads=HQ, max_tokens=16, head_dim=D, device="cpu")
    torch.library.opcheck(ops.prefill_exact_greedy,
                          (fresh.state, list(fresh.descriptor), lengths, 9, q, None, SCALE, 0, k.clone(), v.clone(),
                           None, None, 0))
