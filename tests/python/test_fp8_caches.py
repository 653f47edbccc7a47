"""fp8 K/V caches through the Python API (``CacheView(..., k_scale=,
v_scale=)`` over torch ``float8_e4m3fn`` / ``float8_e5m2`` tensors and
ml_dtypes' NumPy arrays): every call that reads keys (queries + LSE, key
norms and KeyDiff, at decode and in prefill; exact greedy) must decide what
it decides on a float32 cache holding code x scale, bit for bit in the
state. Codes, scales and queries lie on grids where every product and
partial sum is exact, so the two caches' orders give the same bits
(KeyDiff's anchor is not on a grid: head_dim 4, one chunk either way); the
float32 paths are held to references in the other tests, and the C++ suite
(test_fp8_keys) holds the fp8 paths to the same rule. Then the refusals:
missing, misplaced or misshapen scales, fp8 queries, and a bad scale value
(a status naming the scale, the state unchanged)."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

import kvevict as kv
from kvevict import _ext

torch = pytest.importorskip("torch")

B, H, G = 2, 2, 2
HQ = H * G
GRID = np.array([0.0, 0.25, -0.25, 0.5, -0.5, 0.75, -0.75, 1.0, -1.0, 1.5, -1.5, 2.0, -2.0], np.float32)
FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
NUMPY_FORMATS = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}


def scales_for(per_head):
    if per_head:
        return torch.tensor([0.75, 1.5]), torch.tensor([1.25, 2.5])
    return torch.tensor([2.25]), torch.tensor([1.25])


class Twin:
    """An fp8 cache with its scales and a float32 cache of code x scale, bhsd."""

    def __init__(self, fmt, capacity, d, per_head, rng):
        self.k_scale, self.v_scale = scales_for(per_head)
        self.fmt = FORMATS[fmt]
        values = lambda: torch.from_numpy(rng.choice(GRID, size=(B, H, capacity, d)))  # noqa: E731
        self.k_grid, self.v_grid = values(), values()
        self.k8, self.v8 = self.k_grid.to(self.fmt), self.v_grid.to(self.fmt)
        self.kf, self.vf = self.k_grid * self.per_head(self.k_scale), self.v_grid * self.per_head(self.v_scale)
        self.fp8 = kv.CacheView(self.k8, self.v8, "bhsd", k_scale=self.k_scale, v_scale=self.v_scale)
        self.f32 = kv.CacheView(self.kf, self.vf, "bhsd")

    @staticmethod
    def per_head(scale):
        return scale.reshape(1, -1, 1, 1) if scale.numel() > 1 else scale.reshape(1, 1, 1, 1)

    def new_rows(self, rng, d):
        k, v = (torch.from_numpy(rng.choice(GRID, size=(B, H, d))) for _ in range(2))
        ks, vs = (self.per_head(s).reshape(1, -1, 1) for s in (self.k_scale, self.v_scale))
        return (k.to(self.fmt), v.to(self.fmt)), (k * ks, v * vs)


def grid_queries(rng, *shape):
    return torch.from_numpy((rng.integers(-16, 17, size=shape) / 16.0).astype(np.float32))


def same_state(a, b):
    for name in ("positions", "counts", "lengths"):
        assert np.array_equal(np.asarray(getattr(a, name)), np.asarray(getattr(b, name))), name
    assert np.asarray(a.scores).tobytes() == np.asarray(b.scores).tobytes()


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("scoring", ["queries", "key_norms", "key_diff", "exact_greedy"])
def test_fp8_cache_decides_as_a_float_cache_of_code_times_scale(fmt, per_head, scoring):
    rng = np.random.default_rng(hash((fmt, per_head, scoring)) % 2**32)
    d = 4 if scoring == "key_diff" else 16
    capacity, steps, prompt = 12, 10, 8
    if scoring == "exact_greedy":
        make = lambda: kv.BatchedPolicy(kv.ExactGreedyConfig(budget=5, recent=1), B, H, capacity,  # noqa: E731
                                        num_q_heads=HQ, max_tokens=prompt + steps + 1, head_dim=d, device="cpu")
    elif scoring == "queries":
        make = lambda: kv.BatchedPolicy(kv.H2OConfig(heavy=3, recent=2), B, H, capacity, num_q_heads=HQ,  # noqa: E731
                                        device="cpu")
    else:
        make = lambda: kv.BatchedPolicy(kv.H2OConfig.key_norm(3, recent=2, sinks=1), B, H, capacity,  # noqa: E731
                                        num_q_heads=HQ, head_dim=d if scoring == "key_diff" else None, device="cpu")
    as_fp8, as_f32 = make(), make()
    twin = Twin(fmt, capacity, d, per_head, rng)
    lengths = torch.tensor([prompt, prompt - 3], dtype=torch.int32)
    q = grid_queries(rng, B, HQ, prompt, d)
    lse = torch.full((B, HQ, prompt), 2.0)
    for policy, cache in ((as_fp8, twin.fp8), (as_f32, twin.f32)):
        if scoring == "queries":
            policy.prefill(lengths, cache=cache, queries=q, lse=lse, scale=0.25)
        elif scoring == "key_norms":
            policy.prefill_key_norms(lengths, cache=cache)
        elif scoring == "key_diff":
            policy.prefill_key_diff(lengths, cache=cache)
        else:
            policy.prefill_exact_greedy(lengths, cache=cache, queries=q[:, :, -1], scale=0.25)
    same_state(as_fp8, as_f32)
    for _ in range(steps):
        (k8, v8), (kf, vf) = twin.new_rows(rng, d)
        as_fp8.append(cache=twin.fp8, k_new=k8, v_new=v8)
        as_f32.append(cache=twin.f32, k_new=kf, v_new=vf)
        q1, lse1 = grid_queries(rng, B, HQ, d), torch.full((B, HQ), 2.5)
        victims = []
        for policy, cache in ((as_fp8, twin.fp8), (as_f32, twin.f32)):
            if scoring in ("queries", "exact_greedy"):
                victims.append(policy.observe_evict(queries=q1, lse=lse1, scale=0.25, cache=cache))
            elif scoring == "key_norms":
                victims.append(policy.observe_evict_key_norms(cache))
            else:
                victims.append(policy.observe_evict_key_diff(cache))
        assert torch.equal(victims[0], victims[1])
        same_state(as_fp8, as_f32)
    assert int((as_fp8.counts > 0).sum()) == B * H
    # The codes moved with the decisions: each row is still worth its twin's.
    scaled = twin.k8.float() * Twin.per_head(twin.k_scale)
    assert torch.equal(scaled, twin.kf)


def test_numpy_fp8_cache_with_ml_dtypes():
    rng = np.random.default_rng(5)
    capacity, d = 8, 8
    grid = rng.choice(GRID, size=(B, H, capacity, d))
    k8, v8 = grid.astype(ml_dtypes.float8_e5m2), grid.astype(ml_dtypes.float8_e5m2)
    fp8 = kv.CacheView(k8, v8, "bhsd", k_scale=1.5, v_scale=0.75)
    f32 = kv.CacheView(grid * np.float32(1.5), grid * np.float32(0.75), "bhsd")
    a, b = (kv.BatchedPolicy(kv.H2OConfig.key_norm(3, recent=1), B, H, capacity) for _ in range(2))
    lengths = np.array([capacity, capacity - 2], np.int32)
    a.prefill_key_norms(lengths, cache=fp8)
    b.prefill_key_norms(lengths, cache=f32)
    same_state(a, b)
    assert np.array_equal(k8.astype(np.float32) * 1.5, f32.k)  # the kept rows moved alike


def test_sequence_policy_reads_an_fp8_cache_view():
    rng = np.random.default_rng(6)
    twin = Twin("e4m3", 10, 8, True, rng)
    make = lambda: kv.SequencePolicy(kv.H2OConfig.key_norm(3, recent=1), B, H, 10)  # noqa: E731
    a, b = make(), make()
    for p, cache in ((a, twin.fp8), (b, twin.f32)):
        p.prefill_key_norms(0, 9, cache)
    assert np.array_equal(a.positions(), b.positions())
    assert np.asarray(a.scores()).tobytes() == np.asarray(b.scores()).tobytes()


def test_scale_arrays_are_required_well_formed_and_only_for_fp8():
    k8 = torch.zeros(B, H, 8, 8, dtype=torch.float8_e4m3fn)
    p = kv.BatchedPolicy(kv.H2OConfig.key_norm(3), B, H, 8, device="cpu")
    lengths = torch.tensor([4, 4], dtype=torch.int32)
    with pytest.raises(_ext.InvalidArgument, match="'scales' are required for an float8_e4m3fn cache"):
        p.prefill_key_norms(lengths, cache=kv.CacheView(k8, k8.clone()))
    with pytest.raises(_ext.InvalidArgument, match="'v_scale' is required"):
        kv.CacheView(k8, k8.clone(), k_scale=1.0)
    with pytest.raises(_ext.InvalidArgument, match="has 3 values, k_scale 2"):
        kv.CacheView(k8, k8.clone(), k_scale=[1.0, 2.0], v_scale=[1.0, 2.0, 3.0])
    with pytest.raises(_ext.InvalidArgument, match=r"expected \[2\]\[1\] or \[2\]\[2\]"):
        p.prefill_key_norms(lengths, cache=kv.CacheView(k8, k8.clone(), k_scale=[1.0] * 3, v_scale=[1.0] * 3))
    f32 = torch.zeros(B, H, 8, 8)
    with pytest.raises(_ext.InvalidArgument, match="scales belong to fp8 caches"):
        p.prefill_key_norms(lengths, cache=kv.CacheView(f32, f32.clone(), k_scale=1.0, v_scale=1.0))
    assert int(p.lengths.sum()) == 0  # nothing ran


def test_fp8_queries_are_refused():
    k8 = torch.zeros(B, H, 8, 8, dtype=torch.float8_e5m2)
    cache = kv.CacheView(k8, k8.clone(), k_scale=1.0, v_scale=1.0)
    p = kv.BatchedPolicy(kv.H2OConfig(heavy=3, recent=1), B, H, 8, device="cpu")
    p.append()
    with pytest.raises(_ext.InvalidArgument, match="expected float32 .an float8_e5m2 cache's queries are numbers"):
        p.observe_evict(queries=torch.zeros(B, H, 8, dtype=torch.float8_e5m2), lse=torch.zeros(B, H), cache=cache)


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf])
@pytest.mark.parametrize("which", ["k", "v"])
def test_a_bad_scale_is_refused_and_changes_nothing(bad, which):
    k8 = torch.ones(B, H, 8, 8, dtype=torch.float8_e4m3fn)
    good = torch.tensor([1.0, 1.0])
    bad_row = torch.tensor([1.0, bad])
    scales = (bad_row, good) if which == "k" else (good, bad_row)
    cache = kv.CacheView(k8, k8.clone(), k_scale=scales[0], v_scale=scales[1])
    p = kv.BatchedPolicy(kv.H2OConfig.key_norm(3), B, H, 8, device="cpu")
    before = np.asarray(p.positions).copy()
    with pytest.raises(_ext.InvalidArgument, match=f"head 1, index {0 if which == 'k' else 1}.*K or V scale"):
        p.prefill_key_norms(torch.tensor([6, 6], dtype=torch.int32), cache=cache)
    assert np.array_equal(np.asarray(p.positions), before)
    assert int(p.lengths.sum()) == 0
