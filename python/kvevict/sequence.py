"""SequencePolicy: the per-sequence host API (``h2o_policy`` and friends).

One call per sequence, each checked before it changes anything, over the
slot table only (the caller moves K/V rows). Engines that step sequences one
at a time on the CPU use it; the tests use it as the reference the batched
paths and the transformers cache are checked against.
"""

from __future__ import annotations

from typing import Any, List, Optional, Union

import numpy as np

from . import _ext
from ._arrays import for_ext
from .cache import LAYOUT_CODES
from .config import ExactGreedyConfig, H2OConfig, RandomConfig, RecentWindowConfig

_REDUCE = {"sum": 0, "mean": 1, "max": 2}


class SequencePolicy:
    """A per-sequence policy (host): ``append(b)``, ``observe_*(b, ...)``
    (``observe_key_norms`` reads the caller's K buffer),
    ``evict(b)``, ``prefill_column_sums(b, L, sums)``, ``reset(b)``, and copies
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
            self._p = _ext.SequenceH2O(
                *shape, config.heavy, config.recent, _REDUCE.get(config.reduce, -1), d=config.sinks, decay=config.decay
            )
        elif isinstance(config, RecentWindowConfig):
            self._p = _ext.SequenceRecentWindow(*shape, config.sinks, config.window)
        elif isinstance(config, RandomConfig):
            self._p = _ext.SequenceRandom(*shape, config.budget, config.sinks, config.recent, config.seed)
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
        self._p.observe_logits(b, logits, lse, scale, 0 if base == "natural" else 1)

    def observe_key_norms(self, b: int, k_cache: Any, layout: str = "bhsd", page_table: Any = None) -> None:
        """Key-norm scoring of sequence b: each occupied slot's score becomes
        ``-||k||_2`` of its key in ``k_cache`` (the whole batch's K buffer in
        ``layout``, as :class:`CacheView` describes it; V is not read). h2o
        takes it only with decay 0 (:meth:`H2OConfig.key_norm`)."""
        if layout not in LAYOUT_CODES:
            raise _ext.InvalidArgument(
                f"kvevict.SequencePolicy: argument 'layout' = {layout!r} is not one of {', '.join(LAYOUT_CODES)}"
            )
        self._p.observe_key_norms(b, LAYOUT_CODES[layout], for_ext(k_cache), for_ext(page_table))

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
