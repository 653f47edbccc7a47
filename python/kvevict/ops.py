"""torch.library custom ops: ``torch.ops.kvevict.*``.

The ops are generated from the call table (:mod:`kvevict._calls`), which
describes every call once (its arguments, what it mutates, what it
returns); this module registers them and holds the descriptor cache their
kernels share. Nothing here restates a signature.

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

from typing import Any, Callable, Dict, Sequence, Tuple

import torch
from torch import Tensor
from torch.library import Library

from . import _ext
from ._calls import CALLS, register_ops

__all__ = [call.name for call in CALLS]

_entries: Dict[Tuple[int, ...], Tuple[_ext.Descriptor, int, int, int]] = {}


def _entry(desc: Sequence[int]) -> Tuple[_ext.Descriptor, int, int, int]:
    """(Descriptor, num_seqs, num_kv_heads, capacity) of the spec `desc`
    encodes, decoded and validated once per distinct desc."""
    key = tuple(desc)
    e = _entries.get(key)
    if e is None:
        d = _ext.Descriptor(_ext.PolicySpec.decode(list(key)))
        e = _entries[key] = (d, d.spec.num_seqs, d.spec.num_kv_heads, d.spec.capacity)
    return e


def _descriptor(desc: Sequence[int]) -> _ext.Descriptor:
    return _entry(desc)[0]


def _shape(desc: Sequence[int]) -> Tuple[int, int, int]:
    """(num_seqs, num_kv_heads, capacity) of the spec `desc` encodes."""
    return _entry(desc)[1:]


def _stream(state: Tensor) -> int:
    return torch.cuda.current_stream(state.device).cuda_stream if state.is_cuda else 0


_lib = Library("kvevict", "DEF")  # the ops live as long as this object
_ops, _kernels = register_ops(_lib, {"_entry": _entry, "_shape": _shape, "_stream": _stream})
"""The ops (OpOverloads) and their kernels by name (the benchmark registers the kernels as custom_op too)."""
globals().update(_ops)
