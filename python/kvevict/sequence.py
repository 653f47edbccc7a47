"""SequencePolicy: the per-sequence host API (``h2o_policy`` and friends).

One call per sequence, each checked before it changes anything, over the
slot table only (the caller moves K/V rows), but for ``prefill_key_norms``,
``prefill_key_diff`` and ``prefill_snapkv``, which compact the kept K/V rows
themselves. Engines that step sequences one
at a time on the CPU use it; the tests use it as the reference the batched
paths and the transformers cache are checked against.
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple, Union

import numpy as np

from . import _ext
from ._arrays import for_ext
from .cache import LAYOUT_CODES, CacheView
from .config import ExactGreedyConfig, H2OConfig, RandomConfig, RecentWindowConfig, SnapKV, policy_spec
from .policy import _SNAP_INPUTS, _base_code


class SequencePolicy:
    """A per-sequence policy (host): ``append(b)``, ``observe_*(b, ...)``
    (``observe_key_norms`` and ``observe_key_diff`` read the caller's K buffer),
    ``evict(b)``, ``prefill_column_sums(b, L, sums)``,
    ``prefill_key_norms(b, L, k_cache, v_cache)``,
    ``prefill_key_diff(b, L, k_cache, v_cache)`` (h2o) and
    ``prefill_snapkv(b, L, k_cache, v_cache, snap=, probs=|logits=|queries=)``
    (h2o; all three compact the K/V rows), ``reset(b)``, and copies
    of the slot table (``positions()``, ``counts()``, ``scores()``).

    exact_greedy is not offered here: its per-sequence API needs the cache
    (use :class:`BatchedPolicy`).
    """

    def __init__(
        self,
        config: Union[H2OConfig, RecentWindowConfig, RandomConfig],
        num_seqs: int,
        num_kv_heads: int,
        capacity: int,
        *,
        num_q_heads: Optional[int] = None,
    ) -> None:
        q = num_kv_heads if num_q_heads is None else num_q_heads
        shape = (num_seqs, num_kv_heads, q, capacity)
        if isinstance(config, H2OConfig):
            self._p = _ext.SequenceH2O(policy_spec(config, *shape))
        elif isinstance(config, RecentWindowConfig):
            self._p = _ext.SequenceRecentWindow(policy_spec(config, *shape))
        elif isinstance(config, RandomConfig):
            self._p = _ext.SequenceRandom(policy_spec(config, *shape))
        elif isinstance(config, ExactGreedyConfig):
            raise _ext.InvalidArgument(
                "kvevict.SequencePolicy: argument 'config' is exact_greedy, whose per-sequence API needs the "
                "cache; use BatchedPolicy"
            )
        else:
            raise _ext.InvalidArgument(f"kvevict.SequencePolicy: argument 'config' is a {type(config).__name__}")
        self.config = config
        self.budget: int = self._p.budget

    def append(self, b: int) -> int:
        """Records sequence b's next token in every head's next slot; returns its position."""
        return self._p.append(b)

    def observe_probs(self, b: int, probs: Any) -> None:
        """float32 [num_q_heads, >= occupied width]: this step's softmax weights per slot."""
        self._p.observe_probs(b, probs)

    def observe_head_scores(self, b: int, scores: Any) -> None:
        self._p.observe_head_scores(b, scores)

    def observe_logits(self, b: int, logits: Any, lse: Any, scale: float = 1.0, base: str = "natural") -> None:
        self._p.observe_logits(b, logits, lse, scale, _base_code(base))

    def observe_key_norms(self, b: int, k_cache: Any, layout: str = "bhsd", page_table: Any = None) -> None:
        """Key-norm scoring of sequence b: each occupied slot's score becomes
        ``-||k||_2`` of its key in ``k_cache`` (the whole batch's K buffer in
        ``layout``, as :class:`CacheView` describes it; V is not read). h2o
        takes it only with decay 0 (:meth:`H2OConfig.key_norm`)."""
        self._p.observe_key_norms(b, *self._key_args(k_cache, layout, page_table))

    def observe_key_diff(self, b: int, k_cache: Any, layout: str = "bhsd", page_table: Any = None) -> None:
        """KeyDiff scoring of sequence b (h2o with decay 0): each occupied
        slot's score becomes ``-cos(k, anchor)``, the anchor the running sum
        of the unit keys cached now; ``k_cache`` as for :meth:`observe_key_norms`.
        Above the budget the victims leave the anchor here (``evict`` has no
        keys), so call ``evict`` next."""
        self._p.observe_key_diff(b, *self._key_args(k_cache, layout, page_table))

    def skip_observe(self, b: int) -> None:
        self._p.skip_observe(b)

    def evict(self, b: int) -> List[int]:
        """Frees one slot per KV head when above the budget; returns the freed slots (-1: none)."""
        return self._p.evict(b)

    def prefill_column_sums(self, b: int, length: int, column_sums: Any) -> int:
        """Compresses a prompt of ``length`` tokens (in slots [0, length)) in the
        slot table, from column sums float32 [num_q_heads, length]; returns the
        tokens kept per head. Slot ``s`` then holds position ``positions()[b, h, s]``."""
        return self._p.prefill_column_sums(b, length, column_sums)

    def prefill_key_norms(
        self, b: int, length: int, k_cache: Any, v_cache: Any = None, layout: Optional[str] = None,
        page_table: Any = None,
    ) -> Tuple[int, int]:
        """Key-norm prompt compression of sequence b: its prompt of ``length``
        tokens sits in slots [0, length) of the cache (the whole batch's K and
        V buffers in ``layout``, default ``"bhsd"``, or a :class:`CacheView`
        in place of ``k_cache``); position ``p`` scores ``-||k||_2`` of its key,
        the first ``sinks``, the ``recent`` newest and the ``kept`` smallest
        norms between stay (the newer on a tie), and their K and V rows move
        in position order to slots [0, kept). h2o takes it only with decay 0
        (:meth:`H2OConfig.key_norm`). Returns ``(kept, reclaimable_pages)``."""
        return tuple(self._p.prefill_key_norms(b, length, *self._cache_args(k_cache, v_cache, layout, page_table)))

    def prefill_key_diff(
        self, b: int, length: int, k_cache: Any, v_cache: Any = None, layout: Optional[str] = None,
        page_table: Any = None,
    ) -> Tuple[int, int]:
        """KeyDiff prompt compression of sequence b (h2o; the C++
        ``h2o_policy::prefill`` with ``key_diff{cache}``): its prompt of
        ``length`` tokens sits in slots [0, length) of the cache (the whole
        batch's K and V buffers in ``layout``, default ``"bhsd"``, or a
        :class:`CacheView` in place of ``k_cache``); position ``p`` scores
        ``-cos(k_p, anchor)``, the anchor the sum of its head's unit prompt
        keys (0 for a zero key or a zero anchor), the first ``sinks``, the
        ``recent`` newest and the ``heavy`` least similar keys between stay
        (the newer on a tie), and their K and V rows move in position order
        to slots [0, kept). Prompts only; any h2o config (every decay). A
        key whose norm is not finite raises :class:`NonFiniteError` naming
        ``||cache.k||[h][p]``, nothing changed; recent_window and random
        raise :class:`InvalidArgument` (the library's per-sequence policies
        of those kinds take no KeyDiff input). Returns ``(kept,
        reclaimable_pages)``, the same bits as
        :meth:`BatchedPolicy.prefill_key_diff`."""
        return tuple(self._p.prefill_key_diff(b, length, *self._cache_args(k_cache, v_cache, layout, page_table)))

    def prefill_snapkv(
        self,
        b: int,
        length: int,
        k_cache: Any,
        v_cache: Any = None,
        layout: Optional[str] = None,
        page_table: Any = None,
        *,
        snap: SnapKV,
        probs: Any = None,
        logits: Any = None,
        queries: Any = None,
        lse: Any = None,
        scale: float = 1.0,
        base: str = "natural",
    ) -> Tuple[int, int]:
        """SnapKV prompt compression of sequence b (h2o; the C++
        ``h2o_policy::prefill`` with ``window_probs`` / ``window_logits`` /
        ``window_queries``): its prompt of ``length`` tokens sits in slots
        [0, length) of the cache (the whole batch's K and V buffers in
        ``layout``, default ``"bhsd"``, or a :class:`CacheView` in place of
        ``k_cache``) and is scored by its last ``snap.window`` rows'
        attention, pooled (:class:`SnapKV`); the first ``sinks``, the last
        ``max(recent, window)`` and the top of the rest by (score, position)
        stay, their K and V rows moved in position order to slots [0, kept).
        Exactly one input: ``probs`` float32 [num_q_heads, window, >=
        length]; ``logits`` float32 [num_q_heads, window, >= length] with
        ``lse`` float32 [num_q_heads, window]; ``queries`` [num_q_heads,
        window, head_dim] (float32 or the cache's dtype) with ``lse``.
        Checked before anything changes (a prompt shorter than the window is
        :class:`OutOfRange`). Returns ``(kept, reclaimable_pages)``."""
        given = [n for n, x in (("probs", probs), ("logits", logits), ("queries", queries)) if x is not None]
        if len(given) != 1:
            raise _ext.InvalidArgument(
                "kvevict.SequencePolicy.prefill_snapkv: pass exactly one of 'probs', 'logits', 'queries' "
                f"(got {', '.join(given) or 'none'})"
            )
        if not isinstance(snap, SnapKV):
            raise _ext.InvalidArgument(
                f"kvevict.SequencePolicy.prefill_snapkv: argument 'snap' is a {type(snap).__name__}, expected SnapKV"
            )
        kind, x = (0, probs) if probs is not None else (1, logits) if logits is not None else (2, queries)
        if kind and lse is None:
            raise _ext.InvalidArgument(
                f"kvevict.SequencePolicy.prefill_snapkv: argument 'lse' is required with '{given[0]}'"
            )
        if kind == 0 and lse is not None:
            raise _ext.InvalidArgument(
                "kvevict.SequencePolicy.prefill_snapkv: argument 'lse' goes with 'logits' or 'queries'"
            )
        snap._require_rows("SequencePolicy.prefill_snapkv", given[0], x, 1)
        pool_width, pooling = snap._codes()
        base_code = _base_code(base)
        code, k, v, table, scales = self._cache_args(k_cache, v_cache, layout, page_table)
        return tuple(self._p.prefill_snapkv(b, length, _SNAP_INPUTS[kind], for_ext(x), for_ext(lse), float(scale), base_code,
                                            pool_width, pooling, code, k, v, table, scales))  # fmt: skip

    def _key_args(self, k_cache: Any, layout: str, page_table: Any) -> Tuple[int, Any, Any, Any]:
        """(layout code, K, page table, scales) for the extension: a CacheView (an fp8 one with its scales) or K."""
        if isinstance(k_cache, CacheView):
            return k_cache._code, k_cache._ext_k(), for_ext(k_cache.page_table), for_ext(k_cache._scales)
        return _layout_code(layout), for_ext(k_cache), for_ext(page_table), None

    def _cache_args(
        self, k_cache: Any, v_cache: Any, layout: Optional[str], page_table: Any
    ) -> Tuple[int, Any, Any, Any, Any]:
        """(layout code, K, V, page table, scales) for the extension, from a CacheView (an fp8 one with its
        scales) or the arrays."""
        if isinstance(k_cache, CacheView):
            if v_cache is not None or layout is not None or page_table is not None:
                raise _ext.InvalidArgument(
                    "kvevict.SequencePolicy: argument 'v_cache'/'layout'/'page_table' come from the CacheView"
                )
            return (k_cache._code, k_cache._ext_k(), k_cache._ext_v(), for_ext(k_cache.page_table),
                    for_ext(k_cache._scales))
        if v_cache is None:
            raise _ext.InvalidArgument("kvevict.SequencePolicy: argument 'v_cache' is required (the kept rows move)")
        return (_layout_code("bhsd" if layout is None else layout), for_ext(k_cache), for_ext(v_cache),
                for_ext(page_table), None)

    def reset(self, b: int) -> None:
        self._p.reset(b)

    def length(self, b: int) -> int:
        return self._p.length(b)

    def positions(self) -> np.ndarray:
        return self._p.positions()

    def counts(self) -> np.ndarray:
        return self._p.counts()

    def scores(self) -> np.ndarray:
        return self._p.scores()


def _layout_code(layout: str) -> "_ext.CacheLayout":
    if layout not in LAYOUT_CODES:
        raise _ext.InvalidArgument(
            f"kvevict.SequencePolicy: argument 'layout' = {layout!r} is not one of {', '.join(LAYOUT_CODES)}"
        )
    return LAYOUT_CODES[layout]
