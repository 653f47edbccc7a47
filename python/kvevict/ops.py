"""torch.library custom ops: ``torch.ops.kvevict.*``.

Every call of the batched API that takes tensors is a custom op with a fake
(meta) kernel, so ``torch.compile`` traces through it and CUDA graphs capture
it; :class:`kvevict.BatchedPolicy` routes through these ops while compiling.
Importing this module registers them.

Each op takes the policy's state tensor (mutated) and its descriptor
``desc`` (:attr:`BatchedPolicy.descriptor`: ``PolicySpec.encode()``, the
spec as the integers a schema can carry; only ``PolicySpec.decode`` reads
them), and runs on the state's device: the host backend for CPU
tensors, the CUDA launchers on torch's current stream for CUDA tensors.
Bad data raises on CPU when the op returns; on CUDA it is recorded in the
state and raised by :meth:`BatchedPolicy.check`.

The int arguments carry the extension's enums by value: ``layout`` a
``_ext.CacheLayout`` (0 bhsd, 1 bshd, 2 paged nhd, 3 paged hnd;
:class:`CacheView`); ``input`` of observe_evict a ``_ext.DecodeInput``
(probs, head_scores, logits: queries + LSE and key norms have their own
ops, which read the cache), of prefill a ``_ext.PrefillInput`` (probs,
sums, queries, none, key_norms: also its own op, prefill_key_norms);
prefill_key_diff takes none (the cached keys alone); prefill_snapkv's
``input`` is 0 window probs, 1 window logits + LSE, 2 window queries +
LSE. ``base``: a ``_ext.LseBase`` (0 natural, 1 base 2). ``pooling``: a
``_ext.SnapPooling`` (0 max, 1 mean).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor
from torch.library import Library, infer_schema, register_fake

from . import _ext
from ._arrays import for_ext as _a

__all__ = [
    "init",
    "reset",
    "append",
    "append_kv",
    "observe_evict",
    "observe_evict_queries",
    "observe_evict_key_norms",
    "observe_evict_key_diff",
    "prefill",
    "prefill_key_norms",
    "prefill_key_diff",
    "prefill_snapkv",
    "append_tokens",
    "evict_to",
    "evict_to_moves",
]

_descriptors: Dict[Tuple[int, ...], _ext.Descriptor] = {}
_shapes: Dict[Tuple[int, ...], Tuple[int, int, int]] = {}


def _descriptor(desc: Sequence[int]) -> _ext.Descriptor:
    key = tuple(desc)
    d = _descriptors.get(key)
    if d is None:
        d = _descriptors[key] = _ext.Descriptor(_ext.PolicySpec.decode(list(key)))
        _shapes[key] = (d.spec.num_seqs, d.spec.num_kv_heads, d.spec.capacity)
    return d


def _stream(state: Tensor) -> int:
    return torch.cuda.current_stream(state.device).cuda_stream if state.is_cuda else 0


def _shape(desc: Sequence[int]) -> Tuple[int, int, int]:
    """(num_seqs, num_kv_heads, capacity) of the spec `desc` encodes."""
    key = tuple(desc)
    s = _shapes.get(key)
    if s is None:
        _descriptor(key)
        s = _shapes[key]
    return s


def _heads(desc: Sequence[int]) -> Tuple[int, int]:
    s = _shape(desc)
    return s[0], s[1]  # num_seqs, num_kv_heads


_SNAP_INPUTS = (_ext.PrefillInput.window_probs, _ext.PrefillInput.window_logits, _ext.PrefillInput.window_queries)

_lib = Library("kvevict", "DEF")  # the ops live as long as this object
_kernels: Dict[str, Callable[..., Any]] = {}  # by op name (the benchmark registers them as custom_op too)


def _op(*mutates_args: str):
    """Defines ``torch.ops.kvevict.<name of the function>``, with the schema
    its annotations give and the function as its CPU and CUDA kernel, and
    returns the op (an ``OpOverload``: what opcheck, torch.compile and CUDA
    graphs see). torch.library's define + impl rather than its ``custom_op``
    decorator, whose Python autograd, ADInplaceOrView and dynamo-disable
    wrappers cost about 10 us a call before the kernel runs: these ops have
    no gradient (torch's C++ autograd fallback passes them through) and a
    dynamo trace never enters their kernels (their fake kernels stand in)."""

    def define(fn):
        name = fn.__name__
        _lib.define(name + infer_schema(fn, mutates_args=mutates_args))
        _lib.impl(name, fn, "CPU")
        _lib.impl(name, fn, "CUDA")
        _kernels[name] = fn
        op = getattr(torch.ops.kvevict, name).default
        op.__doc__ = fn.__doc__
        return op

    return define


@_op("state")
def init(state: Tensor, desc: List[int]) -> None:
    """Initialises a state tensor of ``Descriptor(desc).state_bytes`` bytes."""
    _ext.init(_descriptor(desc), _a(state), _stream(state))


@register_fake(init)
def _(state, desc):
    return None


@_op("state")
def reset(state: Tensor, desc: List[int], active: Optional[Tensor] = None, streams: Optional[Tensor] = None) -> None:
    """Forgets the active sequences; ``streams`` (int64): random's new request streams."""
    _ext.reset(_descriptor(desc), _a(state), _a(active), _a(streams), _stream(state))


@register_fake(reset)
def _(state, desc, active=None, streams=None):
    return None


@_op("state")
def append(state: Tensor, desc: List[int], active: Optional[Tensor] = None) -> None:
    """Append without K/V: the caller writes each head's row to its next slot."""
    _ext.append(_descriptor(desc), _a(state), _a(active), _stream(state))


@register_fake(append)
def _(state, desc, active=None):
    return None


@_op("state", "k_cache", "v_cache")
def append_kv(
    state: Tensor,
    desc: List[int],
    k_cache: Tensor,
    v_cache: Tensor,
    page_table: Optional[Tensor],
    layout: int,
    k_new: Tensor,
    v_new: Tensor,
    active: Optional[Tensor] = None,
) -> None:
    """Append fused with the scatter of k_new/v_new [B, Hkv, D] into each head's next slot."""
    _ext.append_kv(
        _descriptor(desc), _a(state), layout, _a(k_cache), _a(v_cache), _a(page_table), _a(k_new), _a(v_new),
        _a(active), _stream(state),
    )  # fmt: skip


@register_fake(append_kv)
def _(state, desc, k_cache, v_cache, page_table, layout, k_new, v_new, active=None):
    return None


@_op("state")
def observe_evict(
    state: Tensor,
    desc: List[int],
    input: int,
    x: Tensor,
    lse: Optional[Tensor],
    scale: float,
    base: int,
    active: Optional[Tensor] = None,
) -> Tensor:
    """Observe + evict from probabilities, per-KV-head increments or logits + LSE;
    returns the freed slot per (sequence, head), int32 [B, Hkv], -1 for none."""
    victims = torch.full(_heads(desc), -1, dtype=torch.int32, device=state.device)
    _ext.observe_evict(
        _descriptor(desc), _a(state), input, _a(x), _a(lse), scale, base, _a(victims), _a(active), _stream(state)
    )
    return victims


@register_fake(observe_evict)
def _(state, desc, input, x, lse, scale, base, active=None):
    return state.new_empty(_heads(desc), dtype=torch.int32)


@_op("state")
def observe_evict_queries(
    state: Tensor,
    desc: List[int],
    queries: Tensor,
    lse: Tensor,
    scale: float,
    base: int,
    k_cache: Tensor,
    v_cache: Tensor,
    page_table: Optional[Tensor],
    layout: int,
    active: Optional[Tensor] = None,
) -> Tensor:
    """Observe + evict from queries + LSE (logits recomputed from the cached
    keys), and exact_greedy's step; returns the freed slots, int32 [B, Hkv]."""
    victims = torch.full(_heads(desc), -1, dtype=torch.int32, device=state.device)
    _ext.observe_evict_queries(
        _descriptor(desc), _a(state), _a(queries), _a(lse), scale, base, layout, _a(k_cache), _a(v_cache),
        _a(page_table), _a(victims), _a(active), _stream(state),
    )  # fmt: skip
    return victims


@register_fake(observe_evict_queries)
def _(state, desc, queries, lse, scale, base, k_cache, v_cache, page_table, layout, active=None):
    return state.new_empty(_heads(desc), dtype=torch.int32)


@_op("state")
def observe_evict_key_norms(
    state: Tensor,
    desc: List[int],
    k_cache: Tensor,
    page_table: Optional[Tensor],
    layout: int,
    active: Optional[Tensor] = None,
) -> Tensor:
    """Observe + evict from the key cache alone: each occupied slot's score
    becomes -||k||_2 of its cached key (h2o: with decay 0, ``H2OConfig.key_norm``);
    returns the freed slots, int32 [B, Hkv]."""
    victims = torch.full(_heads(desc), -1, dtype=torch.int32, device=state.device)
    _ext.observe_evict_key_norms(
        _descriptor(desc), _a(state), layout, _a(k_cache), _a(page_table), _a(victims), _a(active), _stream(state)
    )
    return victims


@register_fake(observe_evict_key_norms)
def _(state, desc, k_cache, page_table, layout, active=None):
    return state.new_empty(_heads(desc), dtype=torch.int32)


@_op("state")
def observe_evict_key_diff(
    state: Tensor,
    desc: List[int],
    k_cache: Tensor,
    page_table: Optional[Tensor],
    layout: int,
    active: Optional[Tensor] = None,
) -> Tensor:
    """Observe + evict by KeyDiff from the key cache alone: each occupied
    slot's score becomes -cos(k, the running anchor of the cached keys) (h2o
    with decay 0, a state made with head_dim); returns the freed slots, int32
    [B, Hkv]."""
    victims = torch.full(_heads(desc), -1, dtype=torch.int32, device=state.device)
    _ext.observe_evict_key_diff(
        _descriptor(desc), _a(state), layout, _a(k_cache), _a(page_table), _a(victims), _a(active), _stream(state)
    )
    return victims


@register_fake(observe_evict_key_diff)
def _(state, desc, k_cache, page_table, layout, active=None):
    return state.new_empty(_heads(desc), dtype=torch.int32)


@_op("state", "k_cache", "v_cache")
def prefill(
    state: Tensor,
    desc: List[int],
    lengths: Tensor,
    max_length: int,
    input: int,
    x: Optional[Tensor],
    lse: Optional[Tensor],
    scale: float,
    base: int,
    k_cache: Tensor,
    v_cache: Tensor,
    page_table: Optional[Tensor],
    layout: int,
    active: Optional[Tensor] = None,
) -> Tensor:
    """Batched prefill compression; returns the reclaimable trailing pages per sequence, int32 [B]."""
    return _prefill(state, desc, lengths, max_length, input, x, lse, scale, base, k_cache, v_cache, page_table,
                    layout, active)


def _prefill(state, desc, lengths, max_length, input, x, lse, scale, base, k_cache, v_cache, page_table, layout,
             active, snap=None):
    """snap None: _ext.prefill; else (pool_width, pooling): _ext.prefill_snapkv."""
    d = _descriptor(desc)
    reclaimable = torch.zeros(_shape(desc)[0], dtype=torch.int32, device=state.device)
    call = _ext.prefill if snap is None else _ext.prefill_snapkv
    if snap is not None:
        if not 0 <= input <= 2:
            raise _ext.InvalidArgument(
                f"kvevict::python::prefill: argument 'input' = {input} is not 0 (window probs), 1 (window logits) "
                "or 2 (window queries)"
            )
        input = _SNAP_INPUTS[input]
    params = () if snap is None else tuple(snap)

    def args():  # DLPack capsules are used once: fresh ones per call
        return (d, _a(state), _a(lengths), max_length, input, _a(x), _a(lse), scale, base, *params, layout,
                _a(k_cache), _a(v_cache), _a(page_table), _a(reclaimable), _a(active))

    _with_workspace(state, call, args)
    return reclaimable


def _with_workspace(state, call, args):
    """call(*args(), workspace, stream): on CUDA the launcher's workspace,
    sized by a query first (a call with workspace None runs nothing)."""
    workspace = None
    if state.is_cuda:
        nbytes = call(*args(), None, _stream(state))
        workspace = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=state.device)
    call(*args(), _a(workspace), _stream(state))


@register_fake(prefill)
def _(state, desc, lengths, max_length, input, x, lse, scale, base, k_cache, v_cache, page_table, layout, active=None):
    return state.new_empty((_shape(desc)[0],), dtype=torch.int32)


@_op("state", "k_cache", "v_cache")
def prefill_key_norms(
    state: Tensor,
    desc: List[int],
    lengths: Tensor,
    max_length: int,
    k_cache: Tensor,
    v_cache: Tensor,
    page_table: Optional[Tensor],
    layout: int,
    active: Optional[Tensor] = None,
) -> Tensor:
    """Batched prefill compression scored by the norms of the prompt's cached
    keys (position p scores -||k|| of slot p; h2o: with decay 0,
    ``H2OConfig.key_norm``); returns the reclaimable trailing pages per
    sequence, int32 [B]. The same as ``prefill`` with input 4."""
    return _prefill(state, desc, lengths, max_length, _ext.PrefillInput.key_norms, None, None, 1.0, 0, k_cache,
                    v_cache, page_table, layout, active)


@register_fake(prefill_key_norms)
def _(state, desc, lengths, max_length, k_cache, v_cache, page_table, layout, active=None):
    return state.new_empty((_shape(desc)[0],), dtype=torch.int32)


@_op("state", "k_cache", "v_cache")
def prefill_key_diff(
    state: Tensor,
    desc: List[int],
    lengths: Tensor,
    max_length: int,
    k_cache: Tensor,
    v_cache: Tensor,
    page_table: Optional[Tensor],
    layout: int,
    active: Optional[Tensor] = None,
) -> Tensor:
    """Batched KeyDiff prefill compression (prompts only; no attention
    input): position p of (sequence, head) scores -cos(k_p, anchor), the
    anchor the sum of that head's unit prompt keys, so the keys least like
    the others are kept beside the sinks and the recent window. Any h2o
    config; returns the reclaimable trailing pages per sequence, int32 [B]."""
    d = _descriptor(desc)
    reclaimable = torch.zeros(_shape(desc)[0], dtype=torch.int32, device=state.device)

    def args():  # DLPack capsules are used once: fresh ones per call
        return (d, _a(state), _a(lengths), max_length, layout, _a(k_cache), _a(v_cache), _a(page_table),
                _a(reclaimable), _a(active))

    _with_workspace(state, _ext.prefill_key_diff, args)
    return reclaimable


@register_fake(prefill_key_diff)
def _(state, desc, lengths, max_length, k_cache, v_cache, page_table, layout, active=None):
    return state.new_empty((_shape(desc)[0],), dtype=torch.int32)


@_op("state", "k_cache", "v_cache")
def prefill_snapkv(
    state: Tensor,
    desc: List[int],
    lengths: Tensor,
    max_length: int,
    input: int,
    x: Tensor,
    lse: Optional[Tensor],
    scale: float,
    base: int,
    pool_width: int,
    pooling: int,
    k_cache: Tensor,
    v_cache: Tensor,
    page_table: Optional[Tensor],
    layout: int,
    active: Optional[Tensor] = None,
) -> Tensor:
    """Batched SnapKV prefill compression (h2o): each prompt scored by the
    attention of its last ``window`` rows, ``window = x.shape[2]``; input 0
    window probs [B, Hq, window, >= max_length], 1 window logits (same
    shape) with ``lse`` [B, Hq, window], 2 window queries [B, Hq, window,
    head_dim] with ``lse``; pooling 0 max, 1 mean over ``pool_width``
    (odd) positions. Returns the reclaimable trailing pages per sequence,
    int32 [B]."""
    return _prefill(state, desc, lengths, max_length, input, x, lse, scale, base, k_cache, v_cache, page_table,
                    layout, active, (pool_width, pooling))


@register_fake(prefill_snapkv)
def _(state, desc, lengths, max_length, input, x, lse, scale, base, pool_width, pooling, k_cache, v_cache, page_table,
      layout, active=None):
    return state.new_empty((_shape(desc)[0],), dtype=torch.int32)


@_op("state")
def append_tokens(state: Tensor, desc: List[int], tokens: int, active: Optional[Tensor] = None) -> None:
    """Appends ``tokens`` positions to every active sequence (multi-token step)."""
    _ext.append_tokens(_descriptor(desc), _a(state), tokens, _a(active), _stream(state))


@register_fake(append_tokens)
def _(state, desc, tokens, active=None):
    return None


@_op("state", "k_cache", "v_cache")
def evict_to(
    state: Tensor,
    desc: List[int],
    target: int,
    k_cache: Tensor,
    v_cache: Tensor,
    page_table: Optional[Tensor],
    layout: int,
    queries: Optional[Tensor] = None,
    lse: Optional[Tensor] = None,
    scale: float = 1.0,
    base: int = 0,
    active: Optional[Tensor] = None,
) -> Tensor:
    """evict_to(target) with the kept rows compacted in the cache (exact_greedy:
    with the step's queries and LSE); returns the tokens freed, int32 [B, Hkv]."""
    freed = torch.zeros(_heads(desc), dtype=torch.int32, device=state.device)
    _ext.evict_to(
        _descriptor(desc), _a(state), target, layout, _a(k_cache), _a(v_cache), _a(page_table), _a(queries), _a(lse),
        scale, base, _a(freed), _a(active), _stream(state),
    )  # fmt: skip
    return freed


@register_fake(evict_to)
def _(state, desc, target, k_cache, v_cache, page_table, layout, queries=None, lse=None, scale=1.0, base=0, active=None):
    return state.new_empty(_heads(desc), dtype=torch.int32)


@_op("state")
def evict_to_moves(state: Tensor, desc: List[int], target: int, active: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """evict_to(target) reporting the row moves instead of making them:
    (moves int32 [B, Hkv, capacity, 2] of (from, to), move_counts int32 [B, Hkv])."""
    B, H, C = _shape(desc)
    moves = torch.full((B, H, C, 2), -1, dtype=torch.int32, device=state.device)
    counts = torch.zeros((B, H), dtype=torch.int32, device=state.device)
    _ext.evict_to_moves(_descriptor(desc), _a(state), target, _a(moves), _a(counts), _a(active), _stream(state))
    return moves, counts


@register_fake(evict_to_moves)
def _(state, desc, target, active=None):
    B, H, C = _shape(desc)
    return state.new_empty((B, H, C, 2), dtype=torch.int32), state.new_empty((B, H), dtype=torch.int32)
