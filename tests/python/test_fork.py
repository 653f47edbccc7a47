"""BatchedPolicy.fork and fork_from through the extension, on a NumPy state,
a torch CPU state and (with a GPU) a CUDA state: every destination holds
what its source held before the call (slot table, scores, length; random's
stream), a permutation included, sequences that are no destination are
unchanged, and bad entries raise by name with nothing changed. The C++
test_fork holds the copies to a replay of their sources' lives."""

from __future__ import annotations

import numpy as np
import pytest

import kvevict as kv

B, H, HQ, C = 5, 2, 4, 8


def _devices():
    out = [None]
    try:
        import torch
    except ImportError:
        return out
    out.append("cpu")
    if kv.cuda_available and torch.cuda.is_available():
        out.append("cuda")
    return out


def host(x):
    return np.asarray(x.cpu()) if hasattr(x, "cpu") else np.asarray(x)


def as_input(policy, x):
    if policy.device == "cpu" and policy._torch is None:
        return x
    return policy._torch.as_tensor(x, device=policy.device)


def drive(policy, steps, seed):
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        policy.append()
        probs = rng.integers(0, 8, (B, HQ, C)).astype(np.float32) / 8  # with ties
        policy.observe_evict(probs=as_input(policy, probs))
    policy.check()


def snapshot(policy):
    return host(policy.positions).copy(), host(policy.scores).copy(), host(policy.lengths).copy()


@pytest.mark.parametrize("device", _devices())
def test_fork_copies_each_source_as_it_was_before_the_call(device):
    policy = kv.BatchedPolicy(kv.H2OConfig(3, 2), B, H, C, num_q_heads=HQ, device=device)
    drive(policy, 9, 1)
    positions, scores, lengths = snapshot(policy)
    policy.fork(as_input(policy, np.array([2, 0, 2, 2], np.int32)),
                destinations=as_input(policy, np.array([0, 2, 3, 4], np.int32)))  # fmt: skip
    policy.check()
    got = snapshot(policy)
    for d, s in zip([0, 2, 3, 4, 1], [2, 0, 2, 2, 1]):
        for before, after in zip((positions, scores, lengths), got):
            np.testing.assert_array_equal(after[d], before[s])
    # destinations None: sequence b becomes a copy of sources[b] (a beam reorder)
    positions, scores, lengths = got
    policy.fork(as_input(policy, np.array([4, 3, 2, 1, 0], np.int32)))
    policy.check()
    np.testing.assert_array_equal(host(policy.positions), positions[::-1])
    np.testing.assert_array_equal(host(policy.scores), scores[::-1])
    drive(policy, 3, 2)  # and steps on


@pytest.mark.parametrize("device", _devices())
def test_fork_from_grows_and_shrinks_a_batch(device):
    config = kv.RandomConfig(4, 1, 1, seed=3)
    policy = kv.BatchedPolicy(config, B, H, C, num_q_heads=HQ, device=device)
    drive(policy, 7, 3)
    positions, scores, lengths = snapshot(policy)
    grown = kv.BatchedPolicy(config, 2 * B, H, C, num_q_heads=HQ, device=device)
    rows = np.arange(2 * B, dtype=np.int32) // 2
    grown.fork_from(policy, as_input(grown, rows), streams=as_input(grown, np.arange(2 * B, dtype=np.int64) + 100))
    grown.check()
    np.testing.assert_array_equal(host(grown.positions), positions[rows])
    np.testing.assert_array_equal(host(grown.scores), scores[rows])
    np.testing.assert_array_equal(host(grown.lengths), lengths[rows])
    np.testing.assert_array_equal(host(grown.streams), np.arange(2 * B) + 100)
    small = kv.BatchedPolicy(config, 2, H, C, num_q_heads=HQ, device=device)
    small.fork_from(policy, as_input(small, np.array([3, 0], np.int32)))
    small.check()
    np.testing.assert_array_equal(host(small.positions), positions[[3, 0]])
    np.testing.assert_array_equal(host(small.streams), [0, 1])  # by default, the destination index
    other = kv.BatchedPolicy(config, 2, H, C + 1, num_q_heads=HQ, device=device)
    with pytest.raises(kv.InvalidArgument, match="argument 'capacity' = 9 in dst, 8 in src"):
        other.fork_from(policy, as_input(other, np.array([3, 0], np.int32)))


def test_bad_forks_raise_by_name_and_change_nothing():
    policy = kv.BatchedPolicy(kv.RandomConfig(4, 0, 1, seed=5), B, H, C, num_q_heads=HQ)
    drive(policy, 6, 4)
    before = snapshot(policy)
    cases = [
        (dict(sources=[1, 7], destinations=[0, 2]), kv.OutOfRange, r"argument 'sources\[1\]' = 7 is outside \[0, num_seqs = 5\)"),
        (dict(sources=[1, 2], destinations=[0, 0]), kv.InvalidArgument, r"argument 'destinations.list\[1\]' = 0 repeats"),
        (dict(sources=[1, 2], destinations=[0, 9]), kv.OutOfRange, r"argument 'destinations.list\[1\]' = 9"),
        (dict(sources=[1, 2], destinations=[0, 3], streams=[1, 2**63]), kv.OutOfRange, r"argument 'streams\[1\]'"),
        (dict(sources=[1], destinations=[0, 3]), kv.InvalidArgument, r"argument 'sources' has 1 entries, expected one per destination entry \(2\)"),
        (dict(sources=np.array([1.0, 2.0]), destinations=[0, 3]), kv.InvalidArgument, r"argument 'sources' has dtype float64, expected int32"),
    ]  # fmt: skip
    for kwargs, error, message in cases:
        with pytest.raises(error, match=message):
            policy.fork(**kwargs)
        for a, b in zip(before, snapshot(policy)):
            np.testing.assert_array_equal(a, b)
