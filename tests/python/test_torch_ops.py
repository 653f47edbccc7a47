"""PyTorch: the torch.library ops pass opcheck on CPU, torch CPU tensors give
the NumPy path's decisions, and torch.compile traces a decode step through
BatchedPolicy (which routes through the ops while compiling)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import kvevict as kv  # noqa: E402
import kvevict.ops as ops  # noqa: E402
from fake_dlpack import FakeCudaArray  # noqa: E402

B, H, G, C, D = 2, 2, 2, 8, 8
HQ = H * G


def policy(config=None, capacity=C, **kw):
    return kv.BatchedPolicy(config or kv.H2OConfig(3, 2), B, H, capacity, num_q_heads=HQ, device="cpu", **kw)


def cache(dtype=torch.bfloat16, capacity=C):
    return torch.randn(B, H, capacity, D).to(dtype), torch.randn(B, H, capacity, D).to(dtype)


def stepped(p, steps, k=None, v=None):
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        if k is None:
            p.append()
        else:
            rows = torch.randn(B, H, D, generator=g).to(k.dtype)
            p.append(cache=kv.CacheView.bhsd(k, v), k_new=rows, v_new=rows)
        p.observe_evict(probs=torch.rand(B, HQ, p.capacity, generator=g))
    return p


# ---- opcheck: schema (mutations declared), fake kernels, autograd registration, aot dispatch ----


def opcheck(op, args):
    torch.library.opcheck(op, args)


def test_opcheck_init_reset_append():
    p = policy(kv.RandomConfig(5, 1, 1, seed=3))
    d = list(p.descriptor)
    opcheck(ops.init, (torch.empty_like(p.state), d))
    opcheck(ops.reset, (p.state, d, torch.tensor([1], dtype=torch.int32), torch.tensor([77], dtype=torch.int64)))
    opcheck(ops.append, (p.state, d, None))
    opcheck(ops.append, (p.state, d, torch.tensor([1, 0, 0, 1], dtype=torch.uint8)[:B]))


def test_opcheck_append_kv_and_observe_evict():
    p = stepped(policy(), 9)
    k, v = cache()
    rows = torch.randn(B, H, D).to(torch.bfloat16)
    d = list(p.descriptor)
    opcheck(ops.append_kv, (p.state, d, k, v, None, None, 0, rows, rows, None))
    p.append(cache=kv.CacheView.bhsd(k, v), k_new=rows, v_new=rows)
    opcheck(ops.observe_evict, (p.state, d, 0, torch.rand(B, HQ, C), None, 1.0, 0, None))
    opcheck(ops.observe_evict, (p.state, d, 1, torch.rand(B, H, C), None, 1.0, 0, None))
    opcheck(ops.observe_evict, (p.state, d, 2, torch.randn(B, HQ, C), torch.full((B, HQ), 3.0), 0.5, 1, None))
    q = torch.randn(B, HQ, D).to(torch.bfloat16)
    opcheck(ops.observe_evict_queries, (p.state, d, q, torch.full((B, HQ), 2.0), 0.3, 0, k, v, None, None, 0, None))


def test_opcheck_exact_greedy_and_paged():
    p = policy(kv.ExactGreedyConfig(4, 1, 1), max_tokens=32, head_dim=D)
    pool = torch.randn(5, H, 4, D)
    pool_v = torch.randn(5, H, 4, D)
    table = torch.tensor([[3, 0], [1, 4]], dtype=torch.int32)
    view = kv.CacheView.paged(pool, pool_v, table, order="hnd")
    q = torch.randn(B, HQ, D)
    lse = torch.zeros(B, HQ)
    for _ in range(6):
        p.append(cache=view, k_new=torch.randn(B, H, D), v_new=torch.randn(B, H, D))
        p.observe_evict(queries=q, lse=lse, cache=view)
    p.append(cache=view, k_new=torch.randn(B, H, D), v_new=torch.randn(B, H, D))
    opcheck(ops.observe_evict_queries, (p.state, list(p.descriptor), q, lse, 0.3, 0, pool, pool_v, table, None, 3, None))


@pytest.mark.parametrize("kind", [0, 1, 2, 3])
def test_opcheck_prefill(kind):
    config = kv.H2OConfig(3, 2) if kind < 3 else kv.RecentWindowConfig(1, 4)
    p = policy(config, capacity=16)
    k, v = cache(torch.float16, 16)
    lengths = torch.tensor([12, 5], dtype=torch.int32)
    M = 12
    x = lse = None
    if kind == 0:
        x = torch.rand(B, HQ, M, M).tril()
    elif kind == 1:
        x = torch.rand(B, HQ, M)
    elif kind == 2:
        x, lse = torch.randn(B, HQ, M, D).to(torch.float16), torch.full((B, HQ, M), 4.0)
    opcheck(ops.prefill, (p.state, list(p.descriptor), lengths, M, kind, x, lse, 0.25, 0, k, v, None, None, 0, None))


def test_opcheck_multi_token():
    p = stepped(policy(capacity=16), 6)
    k, v = cache(torch.float32, 16)
    d = list(p.descriptor)
    opcheck(ops.append_tokens, (p.state, d, 4, None))
    p.append_tokens(4)
    p.observe_evict(probs=torch.rand(B, HQ, 16))
    opcheck(ops.evict_to, (p.state, d, 5, k, v, None, None, 0, None, None, 1.0, 0, None))
    opcheck(ops.evict_to_moves, (p.state, d, 5, None))


# ---- torch CPU tensors: the NumPy path's decisions -------------------------------------------


@pytest.mark.parametrize("config", [kv.H2OConfig(3, 2), kv.RecentWindowConfig(2, 3), kv.RandomConfig(5, 1, 1, seed=9)],
                         ids=["h2o", "recent_window", "random"])
def test_torch_cpu_tensors_match_numpy(config):
    rng = np.random.default_rng(0)
    tp = kv.BatchedPolicy(config, B, H, C, num_q_heads=HQ, device="cpu")
    npol = kv.BatchedPolicy(config, B, H, C, num_q_heads=HQ)
    tk, tv = torch.zeros(B, H, C, D, dtype=torch.bfloat16), torch.zeros(B, H, C, D, dtype=torch.bfloat16)
    nk, nv = np.zeros((B, H, C, D), ml_dtypes.bfloat16), np.zeros((B, H, C, D), ml_dtypes.bfloat16)
    for step in range(20):
        rows = rng.standard_normal((B, H, D)).astype(np.float32)
        trows = torch.from_numpy(rows).to(torch.bfloat16)
        tp.append(cache=kv.CacheView.bhsd(tk, tv), k_new=trows, v_new=trows)
        npol.append(cache=kv.CacheView.bhsd(nk, nv), k_new=rows.astype(ml_dtypes.bfloat16), v_new=rows.astype(ml_dtypes.bfloat16))
        q = rng.standard_normal((B, HQ, D)).astype(np.float32)
        lse = np.full((B, HQ), 2.0, np.float32)
        tvict = tp.observe_evict(queries=torch.from_numpy(q), lse=torch.from_numpy(lse), cache=kv.CacheView.bhsd(tk, tv))
        nvict = npol.observe_evict(queries=q, lse=lse, cache=kv.CacheView.bhsd(nk, nv))
        np.testing.assert_array_equal(tvict.numpy(), nvict)
        np.testing.assert_array_equal(tp.positions.numpy(), npol.positions)
        np.testing.assert_array_equal(tp.scores.numpy(), npol.scores)
        np.testing.assert_array_equal(tk.view(torch.int16).numpy(), nk.view(np.int16))
    assert isinstance(tp.positions, torch.Tensor) and tp.positions.dtype == torch.int32


def test_torch_errors_name_the_argument():
    p = stepped(policy(), 9)
    p.append()
    state = p.state.clone()
    with pytest.raises(kv.InvalidArgument, match=r"'probs' has dtype float16, expected float32"):
        p.observe_evict(probs=torch.rand(B, HQ, C, dtype=torch.float16))
    with pytest.raises(kv.InvalidArgument, match=r"'probs' is on cuda:0, the state is on cpu"):
        p.observe_evict(probs=FakeCudaArray((B, HQ, C)))
    bad = torch.rand(B, HQ, C)
    bad[0, 0, 0] = float("nan")
    assert torch.equal(p.state, state)
    with pytest.raises(kv.NonFiniteError, match=r"at sequence 0, head 0, index 0 \(the slot\): an input is NaN"):
        torch.ops.kvevict.observe_evict(p.state, list(p.descriptor), 0, bad, None, 1.0, 0)


def test_inputs_that_require_grad_give_the_same_decisions_and_no_graph():
    # Attention probabilities from a forward run with grad on reach the ops
    # as leaves of a graph; the ops are not differentiable (no autograd
    # kernel: torch's fallback passes them through).
    with_grad, without = stepped(policy(), 9), stepped(policy(), 9)
    g = torch.Generator().manual_seed(2)
    for _ in range(6):
        probs = torch.rand(B, HQ, C, generator=g)
        for p in (with_grad, without):
            torch.ops.kvevict.append(p.state, list(p.descriptor))
        victims = torch.ops.kvevict.observe_evict(with_grad.state, list(with_grad.descriptor), 0,
                                                  probs.clone().requires_grad_(), None, 1.0, 0)
        assert not victims.requires_grad and victims.grad_fn is None
        assert torch.equal(victims, torch.ops.kvevict.observe_evict(without.state, list(without.descriptor), 0, probs,
                                                                    None, 1.0, 0))
        assert torch.equal(with_grad.positions, without.positions)
        assert torch.equal(with_grad.scores, without.scores)


# ---- torch.compile --------------------------------------------------------------------------


def decode_step(p, view, rows, probs):
    p.append(cache=view, k_new=rows, v_new=rows)
    return p.observe_evict(probs=probs)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_decode_step_matches_eager(backend):
    torch._dynamo.reset()
    eager, compiled = policy(), policy()
    ke, ve = cache(torch.float32)
    kc, vc = ke.clone(), ve.clone()
    step = torch.compile(decode_step, backend=backend, fullgraph=True)
    g = torch.Generator().manual_seed(1)
    for _ in range(12):
        rows, probs = torch.randn(B, H, D, generator=g), torch.rand(B, HQ, C, generator=g)
        v1 = decode_step(eager, kv.CacheView.bhsd(ke, ve), rows, probs)
        v2 = step(compiled, kv.CacheView.bhsd(kc, vc), rows, probs)
        assert torch.equal(v1, v2)
        assert torch.equal(eager.positions, compiled.positions)
        assert torch.equal(ke, kc) and torch.equal(ve, vc)


def test_a_copy_of_the_state_is_the_state_wherever_it_lies():
    """torch copies state tensors (clone, functionalization, opcheck): a copy
    at any 8-byte alignment must step exactly like the original."""
    p = stepped(policy(), 9)
    n, d = p.state.numel(), list(p.descriptor)
    probs = torch.rand(B, HQ, C)
    reference = p.state.clone()
    ops.append(reference, d)
    expected_victims = ops.observe_evict(reference, d, 0, probs, None, 1.0, 0)
    for offset in (8, 16, 40, 64, 136, 200):
        buffer = torch.zeros(n + 256, dtype=torch.uint8)
        state = buffer[offset : offset + n]
        state.copy_(p.state)
        ops.append(state, d)
        assert torch.equal(ops.observe_evict(state, d, 0, probs, None, 1.0, 0), expected_victims)
        assert torch.equal(state, reference)


# ---- the call table: the ops are generated from it, the direct route too ----------------------


def test_ops_come_from_the_call_table():
    from kvevict import _calls

    assert set(ops.__all__) == {call.name for call in _calls.CALLS}
    for call in _calls.CALLS:
        schema = getattr(torch.ops.kvevict, call.name).default._schema
        assert [a.name for a in schema.arguments] == ["state", "desc"] + [a.name for a in call.args], call.name
        written = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
        assert written == {"state"} | {a.name for a in call.args if a.mutated}, call.name
        optional = {a.name for a in schema.arguments if str(a.type).startswith("Optional")}
        assert optional == {a.name for a in call.args if a.type == "Tensor?"}, call.name
        assert len(schema.returns) == len(_calls._OUTPUTS[call.out]), call.name
        # The direct route takes the op's arguments after (state, desc).
        assert callable(getattr(_calls.direct, call.name))
        assert ops._kernels[call.name].__name__ == call.name


def test_direct_route_and_op_agree():
    # The same table row, two routes: the eager BatchedPolicy (direct) and the op.
    eager, by_op = stepped(policy(), 5), stepped(policy(), 5)
    g = torch.Generator().manual_seed(5)
    probs = torch.rand(B, HQ, C, generator=g)
    by_op.append()
    d = list(by_op.descriptor)
    eager.append()
    assert torch.equal(ops.observe_evict(by_op.state, d, kv._ext.DecodeInput.probs, probs, None, 1.0, 0),
                       eager.observe_evict(probs=probs))
    same = lambda: all(torch.equal(getattr(by_op, a), getattr(eager, a))  # noqa: E731
                       for a in ("positions", "counts", "next_slots", "lengths", "scores"))
    assert same()
    moves, counts = ops.evict_to_moves(by_op.state, d, 2)
    m2, c2 = eager.evict_to(2)
    assert torch.equal(moves, m2) and torch.equal(counts, c2) and same()
