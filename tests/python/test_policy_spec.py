"""The typed bindings (no torch): PolicySpec's named fields, its int[]
codec (the torch ops' ``desc``), and the enums that replace integer codes."""

from __future__ import annotations

import numpy as np
import pytest

import kvevict as kv
from kvevict import _ext


def test_spec_fields_by_name():
    spec = kv.config.policy_spec(kv.H2OConfig(5, 3, "max", 0.5, sinks=2), 4, 2, 8, 16, head_dim=32)
    assert spec.kind == _ext.PolicyKind.h2o
    assert (spec.num_seqs, spec.num_kv_heads, spec.num_q_heads, spec.capacity) == (4, 2, 8, 16)
    assert (spec.heavy, spec.recent, spec.sinks) == (5, 3, 2)
    assert spec.reduce == _ext.GroupReduce.max
    assert spec.decay == 0.5
    assert (spec.max_tokens, spec.head_dim) == (0, 32)
    assert (spec.window, spec.budget, spec.seed) == (0, 0, 0)  # not h2o's
    with pytest.raises(AttributeError):
        spec.heavy = 1  # read-only

    rnd = kv.config.policy_spec(kv.RandomConfig(6, sinks=1, recent=2, seed=2**64 - 1), 1, 1, 1, 8)
    assert rnd.kind == _ext.PolicyKind.random
    assert (rnd.budget, rnd.sinks, rnd.recent, rnd.seed) == (6, 1, 2, 2**64 - 1)
    win = kv.config.policy_spec(kv.RecentWindowConfig(2, 5), 1, 1, 1, 8)
    assert (win.kind, win.sinks, win.window) == (_ext.PolicyKind.recent_window, 2, 5)
    greedy = kv.config.policy_spec(kv.ExactGreedyConfig(4, recent=1, sinks=1), 1, 1, 1, 8, 64, 16)
    assert (greedy.kind, greedy.budget, greedy.recent, greedy.sinks) == (_ext.PolicyKind.exact_greedy, 4, 1, 1)
    assert (greedy.max_tokens, greedy.head_dim) == (64, 16)


@pytest.mark.parametrize(
    "config",
    [kv.H2OConfig(5, 3, "mean", 0.25, 2), kv.H2OConfig.tova(4), kv.RecentWindowConfig(1, 7),
     kv.RandomConfig(6, 1, 2, seed=2**63 + 5), kv.ExactGreedyConfig(4, 1, 1)],
)
def test_codec_round_trip(config):
    spec = kv.config.policy_spec(config, 3, 2, 4, 16, *((40, 8) if isinstance(config, kv.ExactGreedyConfig) else ()))
    values = spec.encode()
    assert all(isinstance(v, int) for v in values)
    assert len(values) == len(_ext.PolicySpec.fields)
    back = _ext.PolicySpec.decode(values)
    assert back == spec and hash(back) == hash(spec)
    for name in _ext.PolicySpec.fields:
        assert getattr(back, name) == getattr(spec, name), name
    # The policy's descriptor is the encoding, and a state made from the
    # decoded spec has the same layout.
    p = kv.BatchedPolicy(config, 3, 2, 16, num_q_heads=4,
                         **({"max_tokens": 40, "head_dim": 8} if isinstance(config, kv.ExactGreedyConfig) else {}))
    assert p.descriptor == tuple(values) and p.spec == spec
    assert _ext.Descriptor(back).state_bytes == p._desc.state_bytes


def test_codec_refuses_what_it_cannot_decode():
    values = kv.config.policy_spec(kv.H2OConfig(2, 2), 1, 1, 1, 8).encode()
    with pytest.raises(kv.InvalidArgument, match=r"PolicySpec.decode: argument 'values' has 3 entries, expected "
                                                 r"\d+ \(kind, num_seqs, "):
        _ext.PolicySpec.decode(values[:3])
    fields = list(_ext.PolicySpec.fields)
    bad = list(values)
    bad[fields.index("kind")] = 7
    with pytest.raises(kv.OutOfRange, match=r"argument 'values.kind' = 7 is outside \[0, 3\]"):
        _ext.PolicySpec.decode(bad)
    bad = list(values)
    bad[fields.index("capacity")] = 2**31
    with pytest.raises(kv.OutOfRange, match=r"argument 'values.capacity' = 2147483648 is outside"):
        _ext.PolicySpec.decode(bad)
    bad = list(values)
    bad[fields.index("reduce")] = 3
    with pytest.raises(kv.OutOfRange, match=r"argument 'values.reduce' = 3 is outside \[0, 2\]"):
        _ext.PolicySpec.decode(bad)
    # The constructor checks the same ranges, naming the field.
    with pytest.raises(kv.OutOfRange, match=r"argument 'heavy' = 4294967296 is outside"):
        kv.config.policy_spec(kv.H2OConfig(2**32, 2), 1, 1, 1, 8)


def test_config_messages_are_the_configs():
    with pytest.raises(kv.InvalidArgument, match=r"kvevict.H2OConfig: argument 'reduce' = 'median'"):
        kv.config.policy_spec(kv.H2OConfig(2, 2, "median"), 1, 1, 1, 8)
    with pytest.raises(kv.OutOfRange, match=r"kvevict.RandomConfig: argument 'seed' = -1 is outside \[0, 2\^64\)"):
        kv.config.policy_spec(kv.RandomConfig(4, seed=-1), 1, 1, 1, 8)
    with pytest.raises(kv.InvalidArgument, match=r"argument 'config' is a SnapKV, expected H2OConfig"):
        kv.config.policy_spec(kv.SnapKV(), 1, 1, 1, 8)
    # The library validates the values and names the config field.
    with pytest.raises(kv.BudgetError, match=r"'config.heavy' = -1 is negative"):
        _ext.Descriptor(kv.config.policy_spec(kv.H2OConfig(-1, 2), 1, 1, 1, 8))
    with pytest.raises(kv.OutOfRange, match=r"'config.decay'"):
        _ext.Descriptor(kv.config.policy_spec(kv.H2OConfig(2, 2, decay=1e300), 1, 1, 1, 8))


def test_sequence_policy_takes_its_kind_only():
    spec = kv.config.policy_spec(kv.RecentWindowConfig(1, 3), 1, 1, 1, 8)
    with pytest.raises(kv.InvalidArgument, match=r"argument 'spec.kind' is recent_window_policy, this class is "
                                                 r"h2o_policy"):
        _ext.SequenceH2O(spec)
    assert _ext.SequenceRecentWindow(spec).budget == 4


def test_enums_replace_the_codes():
    assert [m.name for m in _ext.CacheLayout] == ["bhsd", "bshd", "paged_nhd", "paged_hnd"]
    assert kv.cache.LAYOUT_CODES["paged_hnd"] is _ext.CacheLayout.paged_hnd
    assert kv.CacheView.bshd(np.zeros((1, 4, 1, 2), np.float32), np.zeros((1, 4, 1, 2), np.float32))._code == 1
    assert [m.name for m in _ext.DecodeInput][:3] == ["probs", "head_scores", "logits"]
    assert {m.name for m in _ext.PrefillInput} >= {"probs", "sums", "queries", "none", "key_norms", "window_probs",
                                                   "window_logits", "window_queries", "key_diff"}
    assert [m.name for m in _ext.Elem] == ["float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"]
    assert [m.name for m in _ext.GroupReduce] == ["sum", "mean", "max"]
    assert kv.H2OConfig.kind == _ext.PolicyKind.h2o and kv.ExactGreedyConfig.kind == _ext.PolicyKind.exact_greedy
    # observe_evict takes a decode input it handles itself, not one that reads the cache.
    p = kv.BatchedPolicy(kv.H2OConfig(2, 2), 1, 1, 8)
    with pytest.raises(kv.InvalidArgument, match=r"argument 'input' = key_norms is not probs, head_scores or logits"):
        _ext.observe_evict(p._desc, p.state, _ext.DecodeInput.key_norms, np.zeros((1, 1, 8), np.float32), None,
                           1.0, _ext.LseBase.natural, None)  # fmt: skip
