"""Key-norm scoring (``BatchedPolicy.observe_evict_key_norms``,
``SequencePolicy.observe_key_norms``, ``torch.ops.kvevict.observe_evict_key_norms``,
``H2OConfig.key_norm``) against a small pure-NumPy reference written here from
the definition: above the budget, evict the unprotected key of the largest L2
norm among the occupied slots, the lower position on a tie; the first
``sinks`` positions and the ``recent`` newest are protected. Keys lie on a
coarse grid ({-1, 0, 1}, or multiples of 1/32), so every square and sum is
exact in every dtype, the norms compare exactly and ties happen."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import kvevict as kv
from kvevict import _ext
from fake_dlpack import FakeCudaArray
from reference import ragged_schedule

DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
LAYOUTS = ["bhsd", "bshd", "paged_nhd", "paged_hnd"]
B, H, D, PAGE = 3, 2, 8, 4


class Keys:
    """One layer's K buffer (and a V of the same shape for append's scatter) in
    a layout, and the row of logical slot (b, h, s)."""

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

    def row(self, b, h, s):
        if self.layout == "bhsd":
            return self.k[b, h, s]
        if self.layout == "bshd":
            return self.k[b, s, h]
        page = self.table[b, s // PAGE]
        return self.k[page, s % PAGE, h] if self.layout == "paged_nhd" else self.k[page, h, s % PAGE]


class RefKeyNorm:
    """The reference: per (b, h) the kept (position, squared norm) pairs."""

    def __init__(self, kept, recent, sinks):
        self.budget, self.recent, self.sinks = kept + recent + sinks, recent, sinks
        self.tokens = [[[] for _ in range(H)] for _ in range(B)]
        self.lengths = [0] * B

    def step(self, b, squares):
        """Appends position lengths[b] with squares[h] per head, then evicts;
        returns the evicted position per head (None: nothing)."""
        position = self.lengths[b]
        self.lengths[b] += 1
        evicted = []
        for h in range(H):
            tokens = self.tokens[b][h]
            tokens.append((position, squares[h]))
            victim = None
            if len(tokens) > self.budget:
                for p, sq in tokens:
                    if p < self.sinks or p >= self.lengths[b] - self.recent:
                        continue
                    if victim is None or sq > victim[1] or (sq == victim[1] and p < victim[0]):
                        victim = (p, sq)
                assert victim is not None, "every token protected: the budget does not fit"
                tokens.remove(victim)
            evicted.append(None if victim is None else victim[0])
        return evicted


def grid_keys(rng, seed, dtype):
    """[B, H, D] keys: {-1, 0, 1} on even seeds (norms tie often), multiples
    of 1/32 in [-2, 2] on odd ones; exact in every dtype."""
    if seed % 2 == 0:
        x = rng.integers(-1, 2, (B, H, D)).astype(np.float32)
    else:
        x = rng.integers(-64, 65, (B, H, D)).astype(np.float32) / 32
    return x.astype(dtype)


def squares_of(rows):
    return [float(np.sum(np.asarray(r, np.float64) ** 2)) for r in rows]


def schedule(step, rng):
    """A ragged schedule: every sequence, an index list, or flags."""
    return ragged_schedule(step, rng, B)


@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_decisions_equal_the_reference(dtype, layout, group, seed):
    rng = np.random.default_rng(seed * 1000 + group * 10 + LAYOUTS.index(layout))
    kept, recent, sinks = int(rng.integers(2, 6)), int(rng.integers(0, 3)), int(rng.integers(0, 3))
    config = kv.H2OConfig.key_norm(kept, recent, sinks)
    assert config == kv.H2OConfig(kept, recent, "sum", 0.0, sinks) and config.budget == kept + recent + sinks
    capacity = config.budget + 1 + int(rng.integers(0, 3))
    policy = kv.BatchedPolicy(config, B, H, capacity, num_q_heads=H * group)
    single = kv.SequencePolicy(config, B, H, capacity, num_q_heads=H * group)
    keys = Keys(layout, DTYPES[dtype], capacity, rng)
    single_keys = Keys(layout, DTYPES[dtype], capacity, np.random.default_rng(7))  # its own slots, its own pages
    ref = RefKeyNorm(kept, recent, sinks)
    evictions = 0
    for step in range(36):
        active, stepped = schedule(step, rng)
        k_new = grid_keys(rng, seed, DTYPES[dtype])
        policy.append(active, cache=keys.view, k_new=k_new, v_new=k_new)
        before = policy.positions.copy()
        if step % 2:
            victims = policy.observe_evict_key_norms(keys.view, active=active)
        else:
            victims = policy.observe_evict_key_norms(keys.k, layout=layout, page_table=keys.table, active=active)
        for b in range(B):
            if b not in stepped:
                assert (victims[b] == -1).all()
                continue
            evicted = ref.step(b, squares_of(k_new[b]))
            # The per-sequence API, with the rows written where its slot table puts them.
            position = single.append(b)
            for h in range(H):
                (slot,) = np.flatnonzero(single.positions()[b, h] == position)
                single_keys.row(b, h, slot)[...] = k_new[b, h]
            single.observe_key_norms(b, single_keys.k, layout, single_keys.table)
            single_victims = single.evict(b)
            for h in range(H):
                if evicted[h] is None:
                    assert victims[b, h] == -1 and single_victims[h] == -1
                else:
                    evictions += 1
                    assert before[b, h, victims[b, h]] == evicted[h], (step, b, h)
                    assert single_victims[h] == victims[b, h]
        np.testing.assert_array_equal(single.positions(), policy.positions)
        np.testing.assert_array_equal(single.scores(), policy.scores)
        for b in range(B):
            for h in range(H):
                want = dict(ref.tokens[b][h])
                got = {int(p): s for s, p in enumerate(policy.positions[b, h]) if p >= 0}
                assert set(got) == set(want), (step, b, h)
                for p, s in got.items():
                    # -||k||: the exact square root of an exact sum, rounded once to float32.
                    assert policy.scores[b, h, s] == -np.sqrt(np.float32(want[p])), (step, b, h, p)
                    np.testing.assert_array_equal(
                        np.asarray(keys.row(b, h, s), np.float64) ** 2 @ np.ones(D), want[p]
                    )
    assert evictions > 0


@pytest.mark.parametrize("config", [kv.RecentWindowConfig(2, 3), kv.RandomConfig(5, 1, 1, seed=11)],
                         ids=["recent_window", "random"])
def test_policies_that_ignore_scores_take_key_norms_as_any_input(config):
    rng = np.random.default_rng(5)
    a, b = kv.BatchedPolicy(config, B, H, 8), kv.BatchedPolicy(config, B, H, 8)
    keys = Keys("bhsd", np.float16, 8, rng)
    for step in range(20):
        k_new = grid_keys(rng, 1, np.float16)
        a.append(cache=keys.view, k_new=k_new, v_new=k_new)
        b.append()
        va = a.observe_evict_key_norms(keys.k)
        vb = b.observe_evict(probs=rng.random((B, H, 8)).astype(np.float32))
        np.testing.assert_array_equal(va, vb)
        np.testing.assert_array_equal(a.positions, b.positions)


def test_read_only_keys_and_out():
    rng = np.random.default_rng(2)
    policy = kv.BatchedPolicy(kv.H2OConfig.key_norm(3, 1), B, H, 6)
    keys = Keys("bshd", np.float32, 6, rng)
    out = np.full((B, H), 7, np.int32)
    for _ in range(6):
        k_new = grid_keys(rng, 0, np.float32)
        policy.append(cache=keys.view, k_new=k_new, v_new=k_new)
        frozen = keys.k.view()
        frozen.setflags(write=False)  # K is only read
        assert policy.observe_evict_key_norms(frozen, layout="bshd", out=out) is out
    assert (out >= 0).all()


# ---- errors: the C++ messages, and nothing changes --------------------------------------------


def warmed(config, rng, steps=7):
    policy = kv.BatchedPolicy(config, B, H, 6)
    keys = Keys("bhsd", np.float32, 6, rng)
    for _ in range(steps):
        k_new = grid_keys(rng, 1, np.float32)
        policy.append(cache=keys.view, k_new=k_new, v_new=k_new)
        if config.decay == 0.0:
            policy.observe_evict_key_norms(keys.k)
        else:
            policy.observe_evict(probs=rng.random((B, H, 6)).astype(np.float32))
    k_new = grid_keys(rng, 1, np.float32)
    policy.append(cache=keys.view, k_new=k_new, v_new=k_new)
    return policy, keys


def test_a_decay_that_accumulates_is_refused_and_nothing_changes():
    policy, keys = warmed(kv.H2OConfig(3, 2), np.random.default_rng(0))
    state = policy.state.copy()
    with pytest.raises(kv.InvalidArgument, match=r"kvevict::batch::observe_evict: argument 'in' is key_norms.*decay must be 0"):
        policy.observe_evict_key_norms(keys.k)
    np.testing.assert_array_equal(policy.state, state)
    policy.observe_evict(probs=np.ones((B, H, 6), np.float32))  # the step is still due
    with pytest.raises(kv.InvalidArgument, match="decay"):
        kv.BatchedPolicy(kv.H2OConfig(3, 2, decay=0.5), B, H, 6).observe_evict_key_norms(keys.k)
    single = kv.SequencePolicy(kv.H2OConfig(3, 2), B, H, 6)
    single.append(0)
    with pytest.raises(kv.InvalidArgument, match=r"kvevict::h2o_policy::observe: argument 'in' is key_norms.*decay"):
        single.observe_key_norms(0, keys.k)
    single.observe_probs(0, np.ones((H, 6), np.float32))  # still due


@pytest.mark.parametrize("bad", [np.nan, np.inf, 3e19])  # 3e19: finite, but its square overflows float32
def test_a_non_finite_key_leaves_its_head_unchanged(bad):
    rng = np.random.default_rng(4)
    policy, keys = warmed(kv.H2OConfig.key_norm(2, 1, 1), rng)
    slot = 3
    before = (policy.positions.copy(), policy.counts.copy(), policy.scores.copy())
    keys.k[1, 1, slot, 2] = bad
    with pytest.raises(kv.NonFiniteError, match=rf"at sequence 1, head 1, index {slot} \(the slot\): a K/V row is not finite \(that head was left unchanged\)"):
        policy.observe_evict_key_norms(keys.k)
    positions, counts, scores = policy.positions, policy.counts, policy.scores
    np.testing.assert_array_equal(positions[1, 1], before[0][1, 1])
    np.testing.assert_array_equal(scores[1, 1], before[2][1, 1])
    assert counts[1, 1] == before[1][1, 1]
    assert counts[1, 0] == policy.budget and counts[0, 1] == policy.budget  # the rest of the batch stepped
    assert policy.status() == _ext.STATUS_CLEAR  # raised, then cleared
    single = kv.SequencePolicy(kv.H2OConfig.key_norm(2, 1, 1), B, H, 6)
    for _ in range(slot + 1):
        single.append(1)
        single.skip_observe(1)
    single.append(1)
    with pytest.raises(kv.NonFiniteError, match=rf"kvevict::h2o_policy::observe: argument '-\|\|cache.k\|\|\[1\]\[{slot}\]'"):
        single.observe_key_norms(1, keys.k)


def test_argument_errors():
    policy, keys = warmed(kv.H2OConfig.key_norm(3, 2), np.random.default_rng(1))
    state = policy.state.copy()
    with pytest.raises(kv.InvalidArgument, match=r"argument 'layout' = 'hnd' is not one of"):
        policy.observe_evict_key_norms(keys.k, layout="hnd")
    with pytest.raises(kv.InvalidArgument, match=r"'layout'/'page_table' come from the CacheView"):
        policy.observe_evict_key_norms(keys.view, layout="bshd")
    with pytest.raises(kv.InvalidArgument, match=r"argument 'k_cache' has dtype int32, expected float32, float16, bfloat16, float8_e4m3fn or float8_e5m2"):
        policy.observe_evict_key_norms(keys.k.astype(np.int32))
    with pytest.raises(kv.InvalidArgument, match=r"argument 'k_cache' has 3 dimensions, expected 4"):
        policy.observe_evict_key_norms(keys.k[0])
    with pytest.raises(kv.InvalidArgument, match=r"argument 'k_cache' has stride 2 in its last dimension"):
        policy.observe_evict_key_norms(np.zeros((B, H, 6, 2 * D), np.float32)[..., ::2])
    with pytest.raises(kv.InvalidArgument, match=r"argument 'cache.num_heads' = 3, the state has 2"):
        policy.observe_evict_key_norms(np.zeros((B, 3, 6, D), np.float32))
    with pytest.raises(kv.InvalidArgument, match=r"argument 'page_table' is required for a paged cache"):
        policy.observe_evict_key_norms(keys.k, layout="paged_nhd")
    with pytest.raises(kv.InvalidArgument, match=r"argument 'k_cache' is on cuda:0, the state is on cpu"):
        policy.observe_evict_key_norms(FakeCudaArray(keys.k.shape))
    np.testing.assert_array_equal(policy.state, state)
    greedy = kv.BatchedPolicy(kv.ExactGreedyConfig(4, 1, 1), B, H, 6, max_tokens=16, head_dim=D)
    greedy.append(cache=keys.view, k_new=np.zeros((B, H, D), np.float32), v_new=np.zeros((B, H, D), np.float32))
    state = greedy.state.copy()
    with pytest.raises(kv.InvalidArgument, match=r"kvevict::batch::observe_evict: argument 'in' is "):
        greedy.observe_evict_key_norms(keys.k)  # refused (the C++ check that fires first names the decay)
    np.testing.assert_array_equal(greedy.state, state)


# ---- torch: the op, CPU tensors, torch.compile ------------------------------------------------


def test_torch_op_opcheck_and_cpu_tensors():
    torch = pytest.importorskip("torch")
    import kvevict.ops as ops

    rng = np.random.default_rng(3)
    config = kv.H2OConfig.key_norm(3, 1, 1)
    tp = kv.BatchedPolicy(config, B, H, 8, num_q_heads=2 * H, device="cpu")
    npol = kv.BatchedPolicy(config, B, H, 8, num_q_heads=2 * H)
    nkeys = Keys("paged_hnd", ml_dtypes.bfloat16, 8, rng)
    tk = torch.zeros(nkeys.k.shape, dtype=torch.bfloat16)
    tv = torch.zeros_like(tk)
    table = torch.from_numpy(nkeys.table)
    tview = kv.CacheView.paged(tk, tv, table, "hnd")
    for step in range(14):
        rows = grid_keys(rng, step, np.float32)
        npol.append(cache=nkeys.view, k_new=rows.astype(ml_dtypes.bfloat16), v_new=rows.astype(ml_dtypes.bfloat16))
        trows = torch.from_numpy(rows).to(torch.bfloat16)
        tp.append(cache=tview, k_new=trows, v_new=trows)
        if step == 13:  # the op itself, on a state mid-stream (paged, then strided)
            d = list(tp.descriptor)
            torch.library.opcheck(ops.observe_evict_key_norms, (tp.state, d, tk, table, None, 3, None))
            torch.library.opcheck(ops.observe_evict_key_norms,
                                  (tp.state, d, torch.randn(B, H, 8, D).half(), None, None, 0,
                                   torch.tensor([1, 0], dtype=torch.int32)))
            break
        tvict = tp.observe_evict_key_norms(tview)
        nvict = npol.observe_evict_key_norms(nkeys.view)
        np.testing.assert_array_equal(tvict.numpy(), nvict)
        np.testing.assert_array_equal(tp.positions.numpy(), npol.positions)
        np.testing.assert_array_equal(tp.scores.numpy(), npol.scores)
    bad = torch.zeros(B, H, 8, D)
    bad[2, 0, 1, 0] = float("nan")
    with pytest.raises(kv.NonFiniteError, match=r"at sequence 2, head 0, index 1 \(the slot\): a K/V row is not finite"):
        torch.ops.kvevict.observe_evict_key_norms(tp.state, list(tp.descriptor), bad, None, None, 0)
    decay = kv.BatchedPolicy(kv.H2OConfig(3, 1), B, H, 8, device="cpu")
    decay.append()
    with pytest.raises(kv.InvalidArgument, match="decay"):
        torch.ops.kvevict.observe_evict_key_norms(decay.state, list(decay.descriptor), bad, None, None, 0)


def test_torch_compile_traces_the_key_norm_step():
    torch = pytest.importorskip("torch")
    torch._dynamo.reset()
    config = kv.H2OConfig.key_norm(3, 2)
    eager = kv.BatchedPolicy(config, B, H, 8, device="cpu")
    compiled = kv.BatchedPolicy(config, B, H, 8, device="cpu")
    ke, ve = torch.zeros(B, H, 8, D), torch.zeros(B, H, 8, D)
    kc, vc = ke.clone(), ve.clone()

    def step(p, k, v, rows):
        p.append(cache=kv.CacheView.bhsd(k, v), k_new=rows, v_new=rows)
        return p.observe_evict_key_norms(k)

    fn = torch.compile(step, backend="aot_eager", fullgraph=True)
    g = torch.Generator().manual_seed(2)
    for _ in range(10):
        rows = torch.randint(-1, 2, (B, H, D), generator=g).float()
        assert torch.equal(step(eager, ke, ve, rows), fn(compiled, kc, vc, rows))
        assert torch.equal(eager.positions, compiled.positions)


# ---- CUDA: the host-side checks (no GPU needed), and the kernels when there is one ------------


@pytest.mark.skipif(not kv.cuda_available, reason="this kvevict was built without CUDA (no nvcc)")
def test_cuda_checks_before_a_launch():
    def fake_state(config):
        desc = _ext.Descriptor(kv.config.policy_spec(config, B, H, H, 8))
        return desc, FakeCudaArray((desc.state_bytes,), "uint8")

    desc, state = fake_state(kv.H2OConfig(3, 2))
    with pytest.raises(kv.InvalidArgument, match=r"kvevict::cuda::observe_evict: argument 'in' is key_norms.*decay"):
        _ext.observe_evict_key_norms(desc, state, 0, FakeCudaArray((B, H, 8, D), "float16"), None, None, None)
    desc, state = fake_state(kv.H2OConfig.key_norm(3, 2))
    with pytest.raises(kv.InvalidArgument, match=r"argument 'cache.num_seqs' = 1, the state has 3"):
        _ext.observe_evict_key_norms(desc, state, 0, FakeCudaArray((1, H, 8, D), "bfloat16"), None, None, None)
    with pytest.raises(kv.InvalidArgument, match=r"'k_cache' is on cpu, the state is on cuda:0"):
        _ext.observe_evict_key_norms(desc, state, 0, np.zeros((B, H, 8, D), np.float32), None, None, None)
    try:
        import torch

        if torch.cuda.is_available():
            return  # the fake arrays must not reach a real launch
    except ImportError:
        pass
    with pytest.raises(kv.CudaError, match=r"kvevict::cuda: observe_evict failed: cuda"):
        _ext.observe_evict_key_norms(desc, state, 0, FakeCudaArray((B, H, 8, D), "float32"), None, None, None)


@pytest.mark.parametrize("layout", ["bhsd", "paged_nhd"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_cuda_equals_the_host(dtype, layout, cuda_torch):
    torch = cuda_torch
    tdt = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
    rng = np.random.default_rng(11)
    config = kv.H2OConfig.key_norm(3, 1, 1)
    host = kv.BatchedPolicy(config, B, H, 8, num_q_heads=4 * H, device="cpu")
    gpu = kv.BatchedPolicy(config, B, H, 8, num_q_heads=4 * H, device="cuda")
    keys = Keys(layout, np.float32, 8, rng)
    hk = torch.from_numpy(keys.k).to(tdt)
    table = None if keys.table is None else torch.from_numpy(keys.table)
    hview = kv.CacheView(hk, hk.clone(), layout, table)
    gk = hk.cuda()
    gview = kv.CacheView(gk, gk.clone(), layout, None if table is None else table.cuda())
    for step in range(30):
        rows = torch.from_numpy(grid_keys(rng, step, np.float32)).to(tdt)
        active, _ = schedule(step, rng)
        ha = None if active is None else torch.from_numpy(active)
        host.append(ha, cache=hview, k_new=rows, v_new=rows)
        gpu.append(None if ha is None else ha.cuda(), cache=gview, k_new=rows.cuda(), v_new=rows.cuda())
        hv = host.observe_evict_key_norms(hview, active=ha)
        gv = gpu.observe_evict_key_norms(gview, active=None if ha is None else ha.cuda())
        gpu.check()
        assert torch.equal(hv, gv.cpu()), step
        assert torch.equal(host.positions, gpu.positions.cpu()), step
        assert torch.equal(host.scores, gpu.scores.cpu()), step
    if layout == "bhsd":  # a NaN key: recorded on the device, raised by check
        gk[1, 0, 0, 0] = float("nan")
        gpu.append(cache=gview, k_new=rows.cuda(), v_new=rows.cuda())
        gpu.observe_evict_key_norms(gview)
        with pytest.raises(kv.NonFiniteError, match=r"at sequence 1, head 0, index 0 \(the slot\): a K/V row is not finite"):
            gpu.check()
