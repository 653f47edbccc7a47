"""The one-launch decode step through Python (BatchedPolicy.step, the
torch op kvevict::step): on NumPy and torch states it equals append +
observe_evict over the sequences that appended, bit for bit, refusals
included (the C++ tests hold that form to brute force); its refusals name
the argument; torch.compile traces it; on CUDA it equals the host's."""

from __future__ import annotations

import numpy as np
import pytest

import kvevict as kv

B, H, G = 3, 2, 2
HQ = H * G


def configs():
    return [
        kv.H2OConfig(heavy=2, recent=1, sinks=1),
        kv.H2OConfig(heavy=3, recent=1, reduce="max", decay=0.5),
        kv.RecentWindowConfig(sinks=1, window=3),
        kv.RandomConfig(budget=4, sinks=1, recent=1, seed=7),
    ]


def twin_arrays(p):
    return [np.asarray(x).copy() for x in (p.positions, p.counts, p.next_slots, p.lengths, p.scores)]


def inputs(rng, kind, capacity, bad):
    probs = rng.integers(0, 5, (B, HQ, capacity)).astype(np.float32) / 8
    head = rng.integers(-4, 5, (B, H, capacity)).astype(np.float32) / 4
    logits = -rng.integers(0, 9, (B, HQ, capacity)).astype(np.float32) / 2
    if bad:
        b, h, s = rng.integers(0, B), rng.integers(0, H), rng.integers(0, capacity)
        probs[b, h * G : (h + 1) * G, s] = np.nan
        head[b, h, s] = np.inf
        logits[b, h * G : (h + 1) * G, s] = np.nan
    lse = np.zeros((B, HQ), np.float32)
    return {"probs": dict(probs=probs), "head_scores": dict(head_scores=head),
            "logits": dict(logits=logits, lse=lse, scale=0.5)}[kind]  # fmt: skip


def step_or_status(call):
    """Runs a call; the StateError / NonFiniteError it raises after stepping is its status."""
    try:
        return call(), None
    except kv.Error as e:
        return None, type(e).__name__


@pytest.mark.parametrize("kind", ["probs", "head_scores", "logits"])
@pytest.mark.parametrize("config", configs(), ids=lambda c: type(c).__name__)
def test_step_equals_append_then_observe_evict(config, kind):
    rng = np.random.default_rng(3)
    capacity = 6
    one = kv.BatchedPolicy(config, B, H, capacity, num_q_heads=HQ)
    two = kv.BatchedPolicy(config, B, H, capacity, num_q_heads=HQ)
    refused = 0
    for step in range(60):
        x = inputs(rng, kind, capacity, bad=rng.random() < 0.15)
        active = (rng.random(B) < 0.8).astype(np.uint8)
        got, got_error = step_or_status(lambda: one.step(active=active, **x))
        before = np.asarray(two.lengths).copy()
        _, append_error = step_or_status(lambda: two.append(active=active))
        appended = np.flatnonzero(np.asarray(two.lengths) != before).astype(np.int32)
        refused += int(active.sum()) - len(appended)
        want, observe_error = np.full((B, H), -1, np.int32), None
        if len(appended):  # an empty list is no active set
            want, observe_error = step_or_status(lambda: two.observe_evict(active=appended, **x))
        assert (got_error is None) == (append_error is None and observe_error is None), step
        if got is not None:
            full = np.full((B, H), -1, np.int32)
            full[appended] = want[appended]
            np.testing.assert_array_equal(got, full)
        for a, b in zip(twin_arrays(one), twin_arrays(two)):
            np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))
        if got_error is not None and rng.random() < 0.3:  # the waiting heads catch up on both (others: not_appended)
            good = inputs(rng, kind, capacity, bad=False)
            for p in (one, two):
                step_or_status(lambda: p.observe_evict(active=np.arange(B, dtype=np.int32), **good))
    assert refused > 0


def test_step_refusals_name_the_argument():
    p = kv.BatchedPolicy(kv.H2OConfig(2, 1), B, H, 4, num_q_heads=HQ)
    probs = np.ones((B, HQ, 4), np.float32)
    with pytest.raises(kv.InvalidArgument, match=r"kvevict\.step: pass exactly one of 'probs', 'head_scores', 'logits'"):
        p.step(probs=probs, head_scores=np.ones((B, H, 4), np.float32))
    with pytest.raises(kv.InvalidArgument, match=r"kvevict\.step: argument 'lse' goes with 'logits'"):
        p.step(probs=probs, lse=np.zeros((B, HQ), np.float32))
    with pytest.raises(kv.InvalidArgument, match=r"step: argument 'probs\.extents\[1\]' = 3, expected 4"):
        p.step(probs=probs[:, :3])
    assert np.asarray(p.lengths).tolist() == [0, 0, 0]  # nothing stepped


def test_a_full_head_refuses_its_sequence_as_a_state_error():
    p = kv.BatchedPolicy(kv.H2OConfig(1, 1), 1, H, 3, num_q_heads=H)
    probs = np.full((1, H, 3), 0.25, np.float32)
    for _ in range(2):
        p.step(probs=probs)
    bad = probs.copy()
    bad[0, 1, 0] = np.nan
    with pytest.raises(kv.NonFiniteError):
        p.step(probs=bad)  # head 1 keeps budget + 1 tokens
    assert np.asarray(p.next_slots)[0, 1] == -1 and np.asarray(p.next_slots)[0, 0] >= 0
    with pytest.raises(kv.StateError, match="no free slot"):
        p.step(probs=probs)
    assert np.asarray(p.lengths).tolist() == [3]  # the refused step changed nothing


torch = pytest.importorskip("torch")


def test_opcheck_step():
    import kvevict.ops as ops

    p = kv.BatchedPolicy(kv.H2OConfig(3, 2), 2, H, 8, num_q_heads=HQ, device="cpu")
    d = list(p.descriptor)
    torch.library.opcheck(ops.step, (p.state, d, 0, torch.rand(2, HQ, 8), None, 1.0, 0, None))
    torch.library.opcheck(ops.step, (p.state, d, 1, torch.rand(2, H, 8), None, 1.0, 0, None))
    torch.library.opcheck(ops.step, (p.state, d, 2, torch.randn(2, HQ, 8), torch.full((2, HQ), 3.0), 0.5, 1, None))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_step_matches_eager(backend):
    torch._dynamo.reset()
    eager = kv.BatchedPolicy(kv.H2OConfig(3, 2), 2, H, 8, num_q_heads=HQ, device="cpu")
    compiled = kv.BatchedPolicy(kv.H2OConfig(3, 2), 2, H, 8, num_q_heads=HQ, device="cpu")
    step = torch.compile(lambda p, probs: p.step(probs=probs), backend=backend, fullgraph=True)
    g = torch.Generator().manual_seed(1)
    for _ in range(12):
        probs = torch.rand(2, HQ, 8, generator=g)
        assert torch.equal(eager.step(probs=probs), step(compiled, probs))
        assert torch.equal(eager.positions, compiled.positions)
        assert torch.equal(eager.scores, compiled.scores)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", ["probs", "head_scores", "logits"])
def test_cuda_step_equals_the_host(kind):
    rng = np.random.default_rng(11)
    config = kv.H2OConfig(heavy=2, recent=1, sinks=1)
    host = kv.BatchedPolicy(config, B, H, 6, num_q_heads=HQ, device="cpu")
    gpu = kv.BatchedPolicy(config, B, H, 6, num_q_heads=HQ, device="cuda")
    for _ in range(40):
        x = inputs(rng, kind, 6, bad=rng.random() < 0.1)
        hx = {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in x.items()}
        gx = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in hx.items()}
        h, h_error = step_or_status(lambda: host.step(**hx))
        g, g_error = step_or_status(lambda: gpu.step(**gx))
        assert h_error == g_error
        if h is not None:
            assert torch.equal(h, g.cpu())
        for a, b in zip((host.positions, host.counts, host.next_slots, host.lengths),
                        (gpu.positions, gpu.counts, gpu.next_slots, gpu.lengths)):  # fmt: skip
            assert torch.equal(a, b.cpu())
        if h_error is not None:
            good = {k: v for k, v in inputs(rng, kind, 6, bad=False).items()}
            step_or_status(lambda: host.observe_evict(active=torch.arange(B, dtype=torch.int32), **{
                k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in good.items()}))
            step_or_status(lambda: gpu.observe_evict(active=torch.arange(B, dtype=torch.int32, device="cuda"), **{
                k: torch.from_numpy(v).cuda() if isinstance(v, np.ndarray) else v for k, v in good.items()}))
