"""KeyDiff at decode time (``BatchedPolicy.observe_evict_key_diff``,
``SequencePolicy.observe_key_diff``, ``torch.ops.kvevict.observe_evict_key_diff``)
against a small pure-NumPy reference written here from the definition: each
step every cached key scores -cos(k, a), a the sum of the unit keys cached
now (the new one included), and above the budget the unprotected key of the
lowest (score, position) is evicted; the first ``sinks`` positions and the
``recent`` newest are protected. The reference works in float64; where the
library's victim differs it must be a near-tie of the reference's scores
(within 1e-5), and the reference follows the library."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import kvevict as kv
from kvevict import _ext
from reference import ragged_schedule
from test_key_norm import Keys

DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
LAYOUTS = ["bhsd", "bshd", "paged_nhd", "paged_hnd"]
B, H, D = 3, 2, 8
MARGIN = 1e-5


def reference_scores(keys):
    """-cos(k, sum of the unit keys) for each row of keys [n, D], in float64."""
    norms = np.linalg.norm(keys, axis=1)
    units = np.divide(keys, norms[:, None], out=np.zeros_like(keys), where=norms[:, None] > 0)
    anchor = units.sum(axis=0)
    alen = np.linalg.norm(anchor)
    dots = keys @ anchor
    ok = (norms > 0) & (alen > 0)
    return np.where(ok, -dots / np.where(ok, norms * alen, 1.0), 0.0)


def draw_keys(rng, bias, dtype):
    """[B, H, D] keys around a common direction, one row in 16 zero."""
    x = bias + rng.integers(-32, 33, (B, H, D)).astype(np.float32) / 64
    x[rng.random((B, H)) < 1 / 16] = 0
    return x.astype(dtype)


@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_decisions_equal_the_reference(dtype, layout, group):
    rng = np.random.default_rng(group * 10 + LAYOUTS.index(layout) + 100 * list(DTYPES).index(dtype))
    kept, recent, sinks = int(rng.integers(2, 6)), int(rng.integers(0, 3)), int(rng.integers(0, 3))
    config = kv.H2OConfig.key_norm(kept, recent, sinks)
    capacity = config.budget + 1 + int(rng.integers(0, 3))
    policy = kv.BatchedPolicy(config, B, H, capacity, num_q_heads=H * group, head_dim=D)
    single = kv.SequencePolicy(config, B, H, capacity, num_q_heads=H * group)
    keys = Keys(layout, DTYPES[dtype], capacity, rng)
    single_keys = Keys(layout, DTYPES[dtype], capacity, np.random.default_rng(7))
    bias = rng.integers(-32, 33, D).astype(np.float32) / 32
    tokens = [[[] for _ in range(H)] for _ in range(B)]  # (position, key as float64) per (b, h)
    evictions = near_ties = 0
    for step in range(40):
        active, stepped = ragged_schedule(step, rng, B)
        k_new = draw_keys(rng, bias, DTYPES[dtype])
        policy.append(active, cache=keys.view, k_new=k_new, v_new=k_new)
        before = policy.positions.copy()
        if step % 2:
            victims = policy.observe_evict_key_diff(keys.view, active=active)
        else:
            victims = policy.observe_evict_key_diff(keys.k, layout=layout, page_table=keys.table, active=active)
        for b in range(B):
            if b not in stepped:
                assert (victims[b] == -1).all()
                continue
            position = single.append(b)
            for h in range(H):
                (slot,) = np.flatnonzero(single.positions()[b, h] == position)
                single_keys.row(b, h, slot)[...] = k_new[b, h]
            single.observe_key_diff(b, single_keys.k, layout, single_keys.table)
            single_victims = single.evict(b)
            length = position + 1
            for h in range(H):
                row = tokens[b][h]
                row.append((position, np.asarray(k_new[b, h], np.float64)))
                assert single_victims[h] == victims[b, h]
                if len(row) <= config.budget:
                    assert victims[b, h] == -1
                    continue
                want = reference_scores(np.stack([k for _, k in row]))
                candidates = [i for i, (p, _) in enumerate(row) if sinks <= p < length - recent]
                victim = min(candidates, key=lambda i: (want[i], row[i][0]))
                got = before[b, h, victims[b, h]]
                dropped = next(i for i, (p, _) in enumerate(row) if p == got)
                assert dropped in candidates, (step, b, h)
                if dropped != victim:  # only a near-tie may go the other way
                    assert abs(want[dropped] - want[victim]) <= MARGIN, (step, b, h)
                    near_ties += 1
                evictions += 1
                del row[dropped]
        np.testing.assert_array_equal(single.positions(), policy.positions)
        np.testing.assert_array_equal(single.scores(), policy.scores)
    assert evictions > 20
    # bfloat16 rounds many keys to near-parallel ones (up to 15% near-ties in
    # one stream here); most decisions must still be clear ones.
    assert near_ties * 5 <= evictions


def test_torch_op_and_opcheck():
    torch = pytest.importorskip("torch")
    import kvevict.ops as ops

    config = kv.H2OConfig.key_norm(3, 1)
    rng = np.random.default_rng(3)
    eager = kv.BatchedPolicy(config, B, H, 6, head_dim=D, device="cpu")
    keys = torch.zeros(B, H, 6, D)
    view = kv.CacheView.bhsd(keys, torch.zeros_like(keys))
    bias = rng.integers(-32, 33, D).astype(np.float32) / 32
    for _ in range(6):
        k_new = torch.from_numpy(draw_keys(rng, bias, np.float32))
        eager.append(cache=view, k_new=k_new, v_new=k_new)
        state = eager.state.clone()
        by_op = ops.observe_evict_key_diff(state, list(eager.descriptor), keys, None, None, 0)
        victims = eager.observe_evict_key_diff(view)
        assert torch.equal(by_op, torch.as_tensor(victims))
        assert torch.equal(state, eager.state)
    eager.append(cache=view, k_new=k_new, v_new=k_new)
    torch.library.opcheck(ops.observe_evict_key_diff, (eager.state, list(eager.descriptor), keys, None, None, 0))


# ---- errors: the C++ messages, and nothing changes --------------------------------------------


def test_refusals_name_the_argument_and_change_nothing():
    keys = np.zeros((B, H, 6, D), np.float32)
    with pytest.raises(_ext.InvalidArgument, match="key_diff_extent"):
        policy = kv.BatchedPolicy(kv.H2OConfig.key_norm(3, 1), B, H, 6)
        policy.append()
        policy.observe_evict_key_diff(keys)
    with pytest.raises(_ext.InvalidArgument, match="decay"):
        policy = kv.BatchedPolicy(kv.H2OConfig(3, 1), B, H, 6, head_dim=D)
        policy.append()
        policy.observe_evict_key_diff(keys)
    with pytest.raises(_ext.InvalidArgument, match="evicts by score"):  # recent_window keeps no anchors
        policy = kv.BatchedPolicy(kv.RecentWindowConfig(2, 3), B, H, 6, head_dim=D)
        policy.append()
        policy.observe_evict_key_diff(keys)
    with pytest.raises(_ext.InvalidArgument, match="in.cache.head_dim"):
        policy = kv.BatchedPolicy(kv.H2OConfig.key_norm(3, 1), B, H, 6, head_dim=4)
        policy.append()
        policy.observe_evict_key_diff(keys)
    with pytest.raises(_ext.InvalidArgument, match="max_tokens"):
        kv.BatchedPolicy(kv.H2OConfig.key_norm(3, 1), B, H, 6, max_tokens=8, head_dim=D)
    with pytest.raises(_ext.InvalidArgument, match="does not take"):
        kv.SequencePolicy(kv.RecentWindowConfig(2, 3), B, H, 6).observe_key_diff(0, keys)

    rng = np.random.default_rng(4)
    policy = kv.BatchedPolicy(kv.H2OConfig.key_norm(3, 1), B, H, 6, head_dim=D)
    keys = (rng.integers(-32, 33, (B, H, 6, D)) / 32).astype(np.float32)
    for _ in range(5):
        policy.append()
        policy.observe_evict_key_diff(keys)
    policy.append()
    slot = int(policy.positions[1, 0].argmax())  # the key just appended
    keys[1, 0, slot, 2] = np.nan
    positions, scores = policy.positions.copy(), policy.scores.copy()
    with pytest.raises(kv.NonFiniteError, match=rf"at sequence 1, head 0, index {slot} \(the slot\): a K/V row is not finite"):
        policy.observe_evict_key_diff(keys)
    np.testing.assert_array_equal(policy.positions[1, 0], positions[1, 0])
    np.testing.assert_array_equal(policy.scores[1, 0], scores[1, 0])
    assert policy.counts[1, 0] == policy.budget + 1  # still waiting: nothing evicted
    assert policy.counts[0, 0] == policy.budget and policy.counts[1, 1] == policy.budget  # the rest stepped
