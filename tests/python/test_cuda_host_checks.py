"""The CUDA path's argument checks, which run on the host before anything is
launched, exercised without a GPU: the state and inputs are arrays that
DLPack reports on cuda:0 (fake_dlpack.py) with no memory behind them, so a
call either stops at a check or reaches the CUDA runtime.

What this does not cover: the kernels themselves (they need a GPU; the C++
suite's gpu tests and scripts/gpu-check.sh run them there)."""

from __future__ import annotations

import numpy as np
import pytest

import kvevict as kv
from kvevict import _ext
from fake_dlpack import FakeCudaArray

pytestmark = pytest.mark.skipif(not kv.cuda_available, reason="this kvevict was built without CUDA (no nvcc)")

B, H, G, C, D = 2, 2, 2, 8, 16
HQ = H * G


def fake_state(config, **history):
    desc = _ext.Descriptor(kv.config.policy_spec(config, B, H, HQ, C, *history.values()))
    return desc, FakeCudaArray((desc.state_bytes,), "uint8")


def fake_cache(dtype="bfloat16"):
    return FakeCudaArray((B, H, C, D), dtype), FakeCudaArray((B, H, C, D), dtype)


def test_inputs_are_checked_before_a_launch():
    desc, state = fake_state(kv.H2OConfig(3, 2))
    with pytest.raises(kv.InvalidArgument, match=r"kvevict::cuda::observe_evict: argument 'probs.extents\[1\]' = 3, expected 4"):
        _ext.observe_evict(desc, state, 0, FakeCudaArray((B, 3, C)), None, 1.0, 0, None)
    # a narrower input is checked per (b, h) against the head's count, on the device (semantics, "Input width")
    with pytest.raises(kv.InvalidArgument, match=r"argument 'probs.extents\[2\]' = 0, expected at least 1"):
        _ext.observe_evict(desc, state, 0, FakeCudaArray((B, HQ, 0)), None, 1.0, 0, None)
    with pytest.raises(kv.InvalidArgument, match=r"argument 'scale' = -1 must be finite and positive"):
        _ext.observe_evict(desc, state, 2, FakeCudaArray((B, HQ, C)), FakeCudaArray((B, HQ)), -1.0, 0, None)
    k, v = fake_cache()
    with pytest.raises(kv.InvalidArgument, match=r"argument 'k_new.extents\[2\]' = 8, expected 16"):
        _ext.append_kv(desc, state, 0, k, v, None, None, FakeCudaArray((B, H, 8), "bfloat16"), FakeCudaArray((B, H, 8), "bfloat16"))
    with pytest.raises(kv.BudgetError, match=r"kvevict::cuda::evict_to: argument 'target' = 1 is outside"):
        _ext.evict_to(desc, state, 1, 0, k, v, None, None, None, None, 1.0, 0, None)
    with pytest.raises(kv.OutOfRange, match=r"argument 'tokens' = 9 is outside \[1, capacity = 8\]"):
        _ext.append_tokens(desc, state, 9)


def test_device_mismatches_are_refused():
    desc, state = fake_state(kv.H2OConfig(3, 2))
    with pytest.raises(kv.InvalidArgument, match=r"'probs' is on cpu, the state is on cuda:0"):
        _ext.observe_evict(desc, state, 0, np.zeros((B, HQ, C), np.float32), None, 1.0, 0, None)
    with pytest.raises(kv.InvalidArgument, match=r"'active' is on cpu, the state is on cuda:0"):
        _ext.append(desc, state, np.array([0], np.int32))
    k, v = fake_cache()
    with pytest.raises(kv.InvalidArgument, match=r"'k_new' is on cpu"):
        _ext.append_kv(desc, state, 0, k, v, None, None, np.zeros((B, H, D), np.float32), FakeCudaArray((B, H, D), "bfloat16"))


def test_policy_specific_checks():
    desc, state = fake_state(kv.ExactGreedyConfig(4, 1, 1), max_tokens=32, head_dim=D)
    with pytest.raises(kv.InvalidArgument, match="is not queries \\+ LSE, which exact_greedy needs"):
        _ext.observe_evict(desc, state, 0, FakeCudaArray((B, HQ, C)), None, 1.0, 0, None)
    k, v = fake_cache("float32")
    with pytest.raises(kv.InvalidArgument, match="exact_greedy's: its greedy evict_to re-scores"):
        _ext.evict_to(desc, state, 4, 0, k, v, None, None, None, None, 1.0, 0, None)
    desc, state = fake_state(kv.H2OConfig(3, 2))
    with pytest.raises(kv.InvalidArgument, match="belongs to h2o, whose prefill needs scores"):
        _ext.prefill(desc, state, FakeCudaArray((B,), "int32"), 8, 3, None, None, 1.0, 0, 0, k, v, None, None, None)


def test_a_valid_call_reaches_the_cuda_runtime():
    """With every argument right, the call launches, which fails without a GPU
    driver: the error is kvevict.CudaError naming the call."""
    try:
        import torch

        if torch.cuda.is_available():
            pytest.skip("a GPU is present: the fake arrays must not reach a real launch")
    except ImportError:
        pass
    desc, state = fake_state(kv.H2OConfig(3, 2))
    with pytest.raises(kv.CudaError, match=r"kvevict::cuda: append failed: cuda"):
        _ext.append(desc, state)
