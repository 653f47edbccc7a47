"""BatchedPolicy: one layer's eviction policy for a ragged batch.

A thin object over the C++ batched API (``kvevict/batch/*.hpp`` on the host,
``kvevict/cuda/*.cuh`` on CUDA). It owns one state array, a NumPy array or a
torch tensor on the policy's device, and every call hands that array and
the caller's tensors (zero-copy, by DLPack) to the extension; the slot table
and counts are views of the state array. Nothing here decides anything.

The decode cycle, per layer and step::

    policy.append(cache=cache, k_new=k, v_new=v)   # each head's new row goes to its next slot
    ...  # attention over slots [0, policy.counts[b, h]) of every (b, h)
    victims = policy.observe_evict(probs=p)        # add this step's attention, free one slot per head

Errors: arguments (shapes, dtypes, strides, devices) raise before anything
changes. Bad data (NaN, a negative probability, a score that would
overflow) leaves the (sequence, head) it belongs to unchanged; the rest of
the batch steps, and on the host the call then raises the lowest offender
(:class:`kvevict.NonFiniteError` and friends). On CUDA the calls do not
wait for the GPU: the status is kept on the device and :meth:`check` raises it.
"""

from __future__ import annotations

import sys
from typing import Any, Literal, Optional, Sequence, Tuple, Union

import numpy as np

from . import _ext
from ._arrays import for_ext, is_torch
from ._calls import direct as _call
from .cache import LAYOUT_CODES, CacheView, Layout
from .config import ExactGreedyConfig, PolicyConfig, SnapKV, policy_spec

LseBase = Literal["natural", "base2"]
_BASES = {"natural": _ext.LseBase.natural, "base2": _ext.LseBase.base2}
_DecodeInput = _ext.DecodeInput
_PrefillInput = _ext.PrefillInput


def _base_code(base: LseBase) -> "_ext.LseBase":
    try:
        return _BASES[base]
    except KeyError:
        raise _ext.InvalidArgument(
            f"kvevict: argument 'base' = {base!r} is not 'natural' (FlashAttention) or 'base2' (FlashInfer)"
        ) from None


# The decode inputs observe_evict takes, looked up once (a call passes one).
_PROBS, _HEAD_SCORES, _LOGITS = _DecodeInput.probs, _DecodeInput.head_scores, _DecodeInput.logits
_SNAP_INPUTS = (_PrefillInput.window_probs, _PrefillInput.window_logits, _PrefillInput.window_queries)


def _score_input(call: str, probs: Any, head_scores: Any, logits: Any, queries: Any, lse: Any, cache: Any):
    """The one decode input of a call as (an _ext.DecodeInput, the array); queries: (None, queries)."""
    named = (("probs", probs), ("head_scores", head_scores), ("logits", logits))
    if call == "observe_evict":
        named += (("queries", queries),)
    given = [n for n, x in named if x is not None]
    if len(given) != 1:
        raise _ext.InvalidArgument(
            f"kvevict.{call}: pass exactly one of " + ", ".join(f"'{n}'" for n, _ in named)
            + f" (got {', '.join(given) or 'none'})"
        )
    if queries is not None:
        if cache is None or lse is None:
            raise _ext.InvalidArgument(f"kvevict.{call}: argument 'queries' needs 'lse' and 'cache'")
        return None, queries
    if logits is not None and lse is None:
        raise _ext.InvalidArgument(f"kvevict.{call}: argument 'lse' is required with 'logits'")
    if logits is None and lse is not None:
        goes = "'logits' or 'queries'" if call == "observe_evict" else "'logits'"
        raise _ext.InvalidArgument(f"kvevict.{call}: argument 'lse' goes with {goes}")
    if probs is not None:
        return _PROBS, probs
    return (_HEAD_SCORES, head_scores) if head_scores is not None else (_LOGITS, logits)


class BatchedPolicy:
    """One layer's batched policy over ``num_seqs`` sequences.

    Args:
        config: an :class:`H2OConfig`, :class:`RecentWindowConfig`,
            :class:`RandomConfig` or :class:`ExactGreedyConfig`.
        num_seqs, num_kv_heads: the batch and the KV heads of the layer.
        capacity: slots per (sequence, KV head); at least ``budget + 1``, and
            at least the longest prompt :meth:`prefill` compresses.
        num_q_heads: query heads (a multiple of ``num_kv_heads``; GQA group
            ``num_q_heads // num_kv_heads``). Default: ``num_kv_heads``.
        max_tokens, head_dim: exact_greedy: the longest a sequence may grow,
            and the head dimension (its history of K/V rows). h2o: head_dim
            alone sizes KeyDiff's running anchors, which
            :meth:`observe_evict_key_diff` needs.
        first_kv_head: tensor parallelism: the layer-wide index of this
            shard's first KV head (its query heads are that head's group
            onward). Random keys its draws by the layer-wide head, so the
            shards of a layer decide as the unsharded layer does.
        device: ``None`` keeps the state in a NumPy array (no torch needed);
            otherwise a torch device (``"cpu"``, ``"cuda"``, ``"cuda:1"``, a
            ``torch.device``) for a torch state tensor there. Inputs must be on
            the state's device; host arrays of either kind mix freely.
    """

    def __init__(
        self,
        config: PolicyConfig,
        num_seqs: int,
        num_kv_heads: int,
        capacity: int,
        *,
        num_q_heads: Optional[int] = None,
        max_tokens: Optional[int] = None,
        head_dim: Optional[int] = None,
        first_kv_head: int = 0,
        device: Any = None,
    ) -> None:
        if num_q_heads is None:
            num_q_heads = num_kv_heads
        greedy = isinstance(config, ExactGreedyConfig)
        if greedy and (max_tokens is None or head_dim is None):
            raise _ext.InvalidArgument(
                "kvevict.BatchedPolicy: argument 'max_tokens' and 'head_dim' are required for exact_greedy "
                "(its history holds every K/V row a sequence sees)"
            )
        if not greedy and max_tokens is not None:
            raise _ext.InvalidArgument("kvevict.BatchedPolicy: argument 'max_tokens' applies to exact_greedy only")
        self.config = config
        self.num_seqs = num_seqs
        self.num_kv_heads = num_kv_heads
        self.num_q_heads = num_q_heads
        self.capacity = capacity
        self.spec: _ext.PolicySpec = policy_spec(
            config, num_seqs, num_kv_heads, num_q_heads, capacity, max_tokens or 0, head_dim or 0, first_kv_head
        )
        """The typed spec: kind, shape and config fields by name."""
        self.descriptor: Tuple[int, ...] = tuple(self.spec.encode())
        """``spec.encode()``: the ``desc`` argument of the ``torch.ops.kvevict`` ops."""
        self._desc = _ext.Descriptor(self.spec)  # validates the shape and config
        self.budget: int = self._desc.budget
        if device is None:
            self._torch = None
            self.device = "cpu"
            self.state = np.empty(self._desc.state_bytes, dtype=np.uint8)
        else:
            import torch

            self._torch = torch
            self.device = torch.device(device)
            if self.device.type == "cuda" and not _ext.CUDA:
                raise _ext.InvalidArgument(
                    "kvevict.BatchedPolicy: argument 'device' is CUDA, but this kvevict was built without CUDA "
                    "(nvcc was not found when it was installed)"
                )
            self.state = torch.empty(self._desc.state_bytes, dtype=torch.uint8, device=self.device)
        self._cuda = self._torch is not None and self.device.type == "cuda"
        # Whether torch.compile is tracing (the direct route then calls the op); None for a NumPy state.
        self._is_compiling = None if self._torch is None else self._torch.compiler.is_compiling
        # CUDA calls since the last check(): the call its refusal came from, by name.
        self._unchecked: set = set()
        _call.init(self)
        self._offsets = _ext.state_offsets(self._desc, for_ext(self.state))
        B, H, C = num_seqs, num_kv_heads, capacity
        self.positions = self._int32_view("positions", (B, H, C))
        """int32 [num_seqs, num_kv_heads, capacity]: the position each slot holds, -1 when free (a view)."""
        self.counts = self._int32_view("counts", (B, H))
        """int32 [num_seqs, num_kv_heads]: occupied slots; between append and observe_evict they are [0, count)."""
        self.next_slots = self._int32_view("next_slots", (B, H))
        """int32 [num_seqs, num_kv_heads]: where each head's next token goes (-1: none, evict first)."""
        self.lengths = self._int32_view("lengths", (B,))
        """int32 [num_seqs]: tokens each sequence has seen (the next position)."""

    # ---- views of the state -------------------------------------------------

    def _bytes(self, name: str, nbytes: int) -> Any:
        off = self._offsets[name]
        return self.state[off : off + nbytes]

    def _int32_view(self, name: str, shape: Tuple[int, ...]) -> Any:
        n = int(np.prod(shape))
        raw = self._bytes(name, 4 * n)
        if self._torch is None:
            return raw.view(np.int32).reshape(shape)
        return raw.view(self._torch.int32).view(shape)

    @property
    def scores(self) -> Any:
        """float32 [num_seqs, num_kv_heads, capacity]: each slot's score (0 when
        free). A copy: the state double-buffers scores per head."""
        B, H, C = self.num_seqs, self.num_kv_heads, self.capacity
        raw = self._bytes("scores", 2 * B * H * C * 4)
        which = self._bytes("score_buffer", B * H)
        if self._torch is None:
            both = raw.view(np.float32).reshape(2, B, H, C)
            return np.where(which.reshape(B, H, 1) == 0, both[0], both[1])
        both = raw.view(self._torch.float32).view(2, B, H, C)
        return self._torch.where(which.view(B, H, 1) == 0, both[0], both[1])

    @property
    def streams(self) -> Any:
        """random only: each sequence's request stream (uint64 NumPy / int64 torch view)."""
        off = self._offsets["streams"]
        if off is None:
            return None
        raw = self._bytes("streams", 8 * self.num_seqs)
        return raw.view(np.uint64) if self._torch is None else raw.view(self._torch.int64)

    def status(self, stream: Any = None) -> int:
        """The raw 64-bit status word (``kvevict._ext.STATUS_CLEAR`` when clear);
        on CUDA it waits for ``stream``."""
        return _call.status_word(self, stream=stream)

    def check(self, stream: Any = None) -> None:
        """Raises the first bad input recorded since the last check, and clears
        it. Host calls already raise when they return; on CUDA this waits for
        ``stream`` (default: torch's current stream)."""
        # A refusal names the call it came from, as the host's exception
        # does, when one kind of call ran since the last check.
        call = next(iter(self._unchecked)) if len(self._unchecked) == 1 else "check"
        self._unchecked = set()
        _call.check(self, call, stream=stream)

    # ---- the calls ------------------------------------------------------------

    def reset(self, active: Any = None, streams: Any = None, stream: Any = None) -> None:
        """Forgets the active sequences (all by default): every slot free,
        scores 0, length 0. ``streams`` (random): one request stream per active
        entry, else the sequence index."""
        _call.reset(self, self._active(active), self._array(streams, np.uint64), stream=stream)

    def fork(self, sources: Any, destinations: Any = None, streams: Any = None, stream: Any = None) -> None:
        """Sequence ``destinations[i]`` becomes a copy of sequence ``sources[i]``
        (int32), every source read as it was before the call: its slots,
        scores, KeyDiff anchors, exact_greedy history and length. With
        ``destinations`` None, sequence ``b`` becomes a copy of ``sources[b]``:
        beam search's reorder, where a sequence may be a source and a
        destination at once. ``destinations`` may also be one flag per
        sequence. ``streams`` (random): the copies' new request streams, else
        the destination index. The caller copies (or shares) the K/V rows;
        see docs/semantics.md, "Forking sequences"."""
        _call.fork(self, self._array(sources, np.int32), self._active(destinations), self._array(streams, np.uint64),
                   stream=stream)

    def fork_from(
        self, source: "BatchedPolicy", sources: Any, destinations: Any = None, streams: Any = None, stream: Any = None
    ) -> None:
        """:meth:`fork` with the sources taken from another policy ``source``:
        one of the same config, heads and capacity, with any number of
        sequences, on the same device. A batch grows or shrinks this way
        (``kvevict.hf``'s ``batch_repeat_interleave`` and
        ``batch_select_indices``). ``source`` is unchanged. An eager call
        (not a torch op)."""
        if not isinstance(source, BatchedPolicy):
            raise _ext.InvalidArgument(
                f"kvevict.BatchedPolicy.fork_from: argument 'source' is a {type(source).__name__}, expected a "
                "BatchedPolicy"
            )
        if self._cuda:
            self._unchecked.add("fork")
        s = self._stream(stream)
        sources, destinations = self._array(sources, np.int32), self._active(destinations)
        streams = self._array(streams, np.uint64)

        def call(workspace: Any) -> int:  # the extension's arguments anew each call (a DLPack capsule is used once)
            return _ext.fork_from(self._desc, for_ext(self.state), source._desc, for_ext(source.state),
                                  for_ext(sources), for_ext(destinations), for_ext(streams), for_ext(workspace), s)

        workspace = None
        if self._cuda:  # the size query, then the call with its workspace
            workspace = self._torch.empty(max(call(None), 1), dtype=self._torch.uint8, device=self.device)
        call(workspace)

    def append(
        self,
        active: Any = None,
        *,
        cache: Optional[CacheView] = None,
        k_new: Any = None,
        v_new: Any = None,
        stream: Any = None,
    ) -> None:
        """Step 1 of the decode cycle: each active sequence's next position goes
        to every head's next slot (:attr:`next_slots`). With ``cache``,
        ``k_new``/``v_new`` [num_seqs, num_kv_heads, head_dim] are written there
        too (fused scatter); without, the caller writes them. A sequence with a
        head at budget + 1 tokens is not appended (:class:`StateError`)."""
        active = self._active(active)
        if cache is None:
            if k_new is not None or v_new is not None:
                raise _ext.InvalidArgument("kvevict.append: argument 'k_new'/'v_new' need 'cache'")
            return _call.append(self, active, stream=stream)
        if k_new is None or v_new is None:
            raise _ext.InvalidArgument("kvevict.append: argument 'k_new' and 'v_new' are required with 'cache'")
        _call.append_kv(self, *cache._moved, k_new, v_new, active, stream=stream)

    def observe_evict(
        self,
        probs: Any = None,
        *,
        head_scores: Any = None,
        logits: Any = None,
        queries: Any = None,
        lse: Any = None,
        scale: float = 1.0,
        base: LseBase = "natural",
        cache: Optional[CacheView] = None,
        active: Any = None,
        out: Any = None,
        stream: Any = None,
    ) -> Any:
        """Steps 5 and 6, fused: adds this step's attention to every occupied
        slot's score and, above the budget, frees one victim slot per head.
        Exactly one input:

        - ``probs`` float32 [num_seqs, num_q_heads, >= budget + 1]: softmax weights per slot;
        - ``head_scores`` float32 [num_seqs, num_kv_heads, >= budget + 1]: increments you reduced;
        - ``logits`` float32 [num_seqs, num_q_heads, >= budget + 1] with ``lse``
          float32 [num_seqs, num_q_heads]: probability ``exp(logit * scale - lse)``;
        - ``queries`` [num_seqs, num_q_heads, head_dim] (float32 or the cache's
          dtype) with ``lse`` and ``cache``: the logits recomputed from the
          cached keys. exact_greedy takes only this one.

        ``base``: ``"natural"`` LSE (FlashAttention) or ``"base2"`` (FlashInfer).
        Returns the freed slot per (sequence, head), int32 [num_seqs,
        num_kv_heads], -1 where nothing was freed (written into ``out`` if given).
        Key-norm scoring, from the keys alone: :meth:`observe_evict_key_norms`;
        KeyDiff: :meth:`observe_evict_key_diff`.
        """
        kind, x = _score_input("observe_evict", probs, head_scores, logits, queries, lse, cache)
        active = self._active(active)
        base_code = _base_code(base)
        if queries is not None:
            return _call.observe_evict_queries(
                self, queries, lse, float(scale), base_code, *cache._moved, active,
                out=out, stream=stream,
            )  # fmt: skip
        return _call.observe_evict(self, kind, x, lse, float(scale), base_code, active, out=out, stream=stream)

    def step(
        self,
        probs: Any = None,
        *,
        head_scores: Any = None,
        logits: Any = None,
        lse: Any = None,
        scale: float = 1.0,
        base: LseBase = "natural",
        active: Any = None,
        out: Any = None,
        stream: Any = None,
    ) -> Any:
        """The decode step in one call (one kernel on CUDA): :meth:`append`
        and :meth:`observe_evict` of every active sequence. Before it, the
        engine reads :attr:`next_slots`, writes the new token's K/V rows
        there and runs its attention over slots ``[0, count + 1)``; the input
        (``probs``, ``head_scores`` or ``logits`` with ``lse``, as for
        :meth:`observe_evict`) covers those slots. A sequence with a head at
        budget + 1 tokens steps no head (:class:`StateError`, as append's);
        bad input leaves its head appended but not observed. Returns the
        freed slots, int32 [num_seqs, num_kv_heads], -1 for none. Queries and
        the key scores keep the two calls."""
        kind, x = _score_input("step", probs, head_scores, logits, None, lse, None)
        return _call.step(self, kind, x, lse, float(scale), _base_code(base), self._active(active), out=out,
                          stream=stream)

    def observe_evict_key_norms(
        self,
        k_cache: Any,
        *,
        layout: Optional[Layout] = None,
        page_table: Any = None,
        active: Any = None,
        out: Any = None,
        stream: Any = None,
    ) -> Any:
        """Steps 5 and 6 from the keys alone (key-norm scoring): every occupied
        slot's score becomes ``-||k||_2`` of its cached key, replacing the old
        score, and, above the budget, one victim slot per head is freed: the
        unprotected key of the largest norm (the older on a tie). h2o takes it
        only with decay 0 (:meth:`H2OConfig.key_norm`); recent_window and
        random accept it (their victims do not depend on scores); exact_greedy
        refuses it.

        ``k_cache``: the K buffer in ``layout`` (``"bhsd"`` by default,
        ``"bshd"``, ``"paged_nhd"``, ``"paged_hnd"``; paged with an int32
        ``page_table``; shapes as in :class:`CacheView`), or a
        :class:`CacheView`, whose K, layout and page table are used. V is not
        read. A key whose norm is not finite (NaN, infinity, or squares
        that overflow float32) leaves its head unchanged and raises
        :class:`NonFiniteError` (on CUDA, at :meth:`check`). Returns the freed
        slot per (sequence, head), int32 [num_seqs, num_kv_heads], -1 where
        nothing was freed (written into ``out`` if given)."""
        return self._observe_evict_keys("observe_evict_key_norms", k_cache, layout, page_table, active, out, stream)

    def observe_evict_key_diff(
        self,
        k_cache: Any,
        *,
        layout: Optional[Layout] = None,
        page_table: Any = None,
        active: Any = None,
        out: Any = None,
        stream: Any = None,
    ) -> Any:
        """Steps 5 and 6 by KeyDiff, from the keys alone: every occupied
        slot's score becomes ``-cos(k, anchor)``, the anchor the sum of the
        unit keys cached now (kept running: the new keys are added and the
        victim's subtracted, exactly), and, above the budget, the unprotected
        key most like the others is freed. h2o with decay 0
        (:meth:`H2OConfig.key_norm`) made with ``head_dim`` (the anchors).
        Arguments, errors and result as :meth:`observe_evict_key_norms`."""
        return self._observe_evict_keys("observe_evict_key_diff", k_cache, layout, page_table, active, out, stream)

    def _observe_evict_keys(self, name, k_cache, layout, page_table, active, out, stream):
        if isinstance(k_cache, CacheView):
            if page_table is not None or layout is not None:
                raise _ext.InvalidArgument(f"kvevict.{name}: argument 'layout'/'page_table' come from the CacheView")
            k, code, page_table, scales = k_cache._k, k_cache._code, k_cache.page_table, k_cache._scales
        else:
            layout = "bhsd" if layout is None else layout
            if layout not in LAYOUT_CODES:
                raise _ext.InvalidArgument(
                    f"kvevict.{name}: argument 'layout' = {layout!r} is not one of {', '.join(LAYOUT_CODES)}"
                )
            k, code, scales = k_cache, LAYOUT_CODES[layout], None  # raw fp8 keys: refused, a CacheView has the scales
        return getattr(_call, name)(self, k, page_table, scales, code, self._active(active), out=out, stream=stream)

    def prefill(
        self,
        lengths: Any,
        *,
        cache: CacheView,
        probs: Any = None,
        column_sums: Any = None,
        queries: Any = None,
        lse: Any = None,
        scale: float = 1.0,
        base: LseBase = "natural",
        max_length: Optional[int] = None,
        active: Any = None,
        stream: Any = None,
    ) -> Any:
        """Prompt compression of every active sequence in one call. Before it,
        prompt ``b`` of ``lengths[b]`` tokens sits in slots ``[0, lengths[b])``
        of ``cache`` (position ``p`` in slot ``p``) and the sequence holds no
        token in the policy (fresh or reset). Scores (h2o) come from one of:

        - ``probs`` float32 [num_seqs, num_q_heads, M, M]: the causal attention matrix;
        - ``column_sums`` float32 [num_seqs, num_q_heads, M]: its column sums;
        - ``queries`` [num_seqs, num_q_heads, M, head_dim] with ``lse``
          [num_seqs, num_q_heads, M]: recomputed from the cached keys;

        or none (recent_window, random). The kept ``min(L, budget)`` rows move,
        in position order, to slots ``[0, kept)``. ``M = max_length`` (default:
        the largest length; give it for CUDA lengths to avoid a sync).
        Returns int32 [num_seqs]: trailing pages of a paged prompt no longer
        needed. exact_greedy's prefill: :meth:`prefill_exact_greedy`. Scored
        by the norms of the prompt's cached keys instead: :meth:`prefill_key_norms`; by
        their cosine to their head's mean direction (KeyDiff):
        :meth:`prefill_key_diff`; by the attention of the prompt's last rows
        (SnapKV): :meth:`prefill_snapkv`.
        """
        given = [n for n, x in (("probs", probs), ("column_sums", column_sums), ("queries", queries)) if x is not None]
        if len(given) > 1:
            raise _ext.InvalidArgument(
                f"kvevict.prefill: pass at most one of 'probs', 'column_sums', 'queries' (got {', '.join(given)})"
            )
        lengths = self._array(lengths, np.int32)
        if max_length is None:
            max_length = int(lengths.max()) if len(lengths) else 0
        kind, x = (
            (_PrefillInput.probs, probs) if probs is not None
            else (_PrefillInput.sums, column_sums) if column_sums is not None
            else (_PrefillInput.queries, queries) if queries is not None
            else (_PrefillInput.none, None)
        )  # fmt: skip
        if kind == _PrefillInput.queries and lse is None:
            raise _ext.InvalidArgument("kvevict.prefill: argument 'lse' is required with 'queries'")
        base_code = _base_code(base)
        active = self._active(active)
        return _call.prefill(
            self, lengths, int(max_length), kind, x, lse, float(scale), base_code, *cache._moved, active,
            stream=stream,
        )  # fmt: skip

    def prefill_key_norms(
        self,
        lengths: Any,
        *,
        cache: CacheView,
        max_length: Optional[int] = None,
        active: Any = None,
    ) -> Any:
        """:meth:`prefill` scored by the prompt's own cached keys (key-norm,
        no attention input): position ``p`` of (sequence, head) scores
        ``-||k||_2`` of the key in slot ``p`` of ``cache``, so h2o keeps the
        first ``sinks``, the ``recent`` newest and the ``kept`` keys of the
        smallest norm between them (the newer on a tie); it takes this only
        with decay 0 (:meth:`H2OConfig.key_norm`; another decay raises
        :class:`InvalidArgument` naming it, nothing changed). recent_window
        and random accept it as they accept no scores; exact_greedy
        compresses with :meth:`prefill_exact_greedy`. The kept K and V rows move, in position order, to
        slots ``[0, kept)``. A key whose norm is not finite (NaN, infinity,
        squares that overflow float32) anywhere in a prompt leaves that
        sequence unchanged and raises :class:`NonFiniteError` at (sequence,
        head, slot) (on CUDA, at :meth:`check`). ``max_length`` as in
        :meth:`prefill`. Returns int32 [num_seqs]: trailing pages of a paged
        prompt no longer needed. On CUDA it runs on torch's current stream.
        """
        return self._prefill_from_keys("prefill_key_norms", lengths, cache, max_length, active)

    def prefill_key_diff(
        self,
        lengths: Any,
        *,
        cache: CacheView,
        max_length: Optional[int] = None,
        active: Any = None,
    ) -> Any:
        """:meth:`prefill` scored by KeyDiff (Park et al., 2025; the C++
        ``key_diff{cache}``), from the prompt's own cached keys (no attention
        input). For the keys ``k_p``, ``p`` in ``[0, L)``, of one (sequence,
        KV head), the anchor is the sum of the unit keys ``k_p / ||k_p||``
        and position ``p`` scores ``-cos(k_p, anchor)`` (0 for a zero key,
        and for every key when the anchor is 0), so h2o keeps the first
        ``sinks``, the ``recent`` newest and the ``heavy`` keys least similar
        to the others between them (the highest (score, position): the newer
        on a tie). KeyDiff here compresses prompts only: afterwards the
        policy goes on by its own rule (attention, or key norms with
        :meth:`H2OConfig.key_norm`) from the KeyDiff scores it kept. Any h2o
        config takes it (every decay); recent_window and random accept it
        as they accept no scores; exact_greedy compresses with
        :meth:`prefill_exact_greedy`.

        The kept K and V rows move, in position order, to slots ``[0,
        kept)``. A key whose norm is not finite (NaN, infinity, squares that
        overflow float32) anywhere in a prompt leaves that sequence
        unchanged (state and K/V) and raises :class:`NonFiniteError` at the
        first such (sequence, head, slot) (on CUDA, at :meth:`check`), the
        rest of the batch compressed. ``max_length`` as in :meth:`prefill`.
        Returns int32 [num_seqs]: trailing pages of a paged prompt no longer
        needed. On CUDA it runs on torch's current stream; the C++ library
        computes every score (the anchor summed exactly, so the host and
        CUDA give the same bits).
        """
        return self._prefill_from_keys("prefill_key_diff", lengths, cache, max_length, active)

    def _prefill_from_keys(self, call: str, lengths: Any, cache: Any, max_length: Optional[int], active: Any) -> Any:
        """The prefills scored from the cached keys alone (key norms,
        KeyDiff): checks the cache view, derives max_length, then calls."""
        if not isinstance(cache, CacheView):
            raise _ext.InvalidArgument(
                f"kvevict.{call}: argument 'cache' must be a CacheView (K and V: the kept rows move)"
            )
        lengths = self._array(lengths, np.int32)
        if max_length is None:
            max_length = int(lengths.max()) if len(lengths) else 0
        return getattr(_call, call)(self, lengths, int(max_length), *cache._moved,
                                    self._active(active))

    def prefill_snapkv(
        self,
        lengths: Any,
        *,
        cache: CacheView,
        snap: SnapKV,
        probs: Any = None,
        logits: Any = None,
        queries: Any = None,
        lse: Any = None,
        scale: float = 1.0,
        base: LseBase = "natural",
        max_length: Optional[int] = None,
        active: Any = None,
    ) -> Any:
        """:meth:`prefill` scored by SnapKV (:class:`SnapKV`): each prompt by
        the attention of its last ``snap.window`` rows only (window row ``r``
        of sequence ``b`` is prompt row ``lengths[b] - window + r``), pooled
        along positions; h2o keeps the first ``sinks``, the last
        ``max(recent, window)`` positions and the top of the rest by
        (score, position) (the newer on a tie), and the kept K and V rows
        move in position order to slots ``[0, kept)``. Exactly one input:

        - ``probs`` float32 [num_seqs, num_q_heads, window, >= M]: the window
          rows' attention probabilities (columns past a row's own position
          are not read);
        - ``logits`` float32 [num_seqs, num_q_heads, window, >= M] with
          ``lse`` float32 [num_seqs, num_q_heads, window]: probability
          ``exp(logit * scale - lse)``;
        - ``queries`` [num_seqs, num_q_heads, window, head_dim] (float32 or
          the cache's dtype) with ``lse``: the logits recomputed from the
          cached keys.

        ``base``: ``"natural"`` LSE (FlashAttention) or ``"base2"``
        (FlashInfer). ``M = max_length`` as in :meth:`prefill`. Only a
        policy that keeps by score (h2o, its TOVA and key-norm configs
        included) accepts it; the others raise :class:`InvalidArgument`.
        Parameters are checked first (``in.snap.window`` within the budget
        beside the sinks and at most ``M``, ``in.snap.pool_width`` odd and
        positive): nothing changes when one is refused. A prompt shorter
        than the window (:class:`OutOfRange`) or a NaN / infinite / negative
        input leaves its sequence unchanged while the rest of the batch is
        compressed, and raises the lowest offender (on CUDA, at
        :meth:`check`). Returns int32 [num_seqs]: trailing pages of a paged
        prompt no longer needed. On CUDA it runs on torch's current stream.
        """
        given = [n for n, x in (("probs", probs), ("logits", logits), ("queries", queries)) if x is not None]
        if len(given) != 1:
            raise _ext.InvalidArgument(
                "kvevict.prefill_snapkv: pass exactly one of 'probs', 'logits', 'queries' "
                f"(got {', '.join(given) or 'none'})"
            )
        if not isinstance(snap, SnapKV):
            raise _ext.InvalidArgument(
                f"kvevict.prefill_snapkv: argument 'snap' is a {type(snap).__name__}, expected SnapKV"
            )
        if not isinstance(cache, CacheView):
            raise _ext.InvalidArgument(
                "kvevict.prefill_snapkv: argument 'cache' must be a CacheView (K and V: the kept rows move)"
            )
        # the op's input code (0 probs, 1 logits, 2 queries) and the extension's
        kind, x = (0, probs) if probs is not None else (1, logits) if logits is not None else (2, queries)
        if kind and lse is None:
            raise _ext.InvalidArgument(f"kvevict.prefill_snapkv: argument 'lse' is required with '{given[0]}'")
        if kind == 0 and lse is not None:
            raise _ext.InvalidArgument("kvevict.prefill_snapkv: argument 'lse' goes with 'logits' or 'queries'")
        snap._require_rows("prefill_snapkv", given[0], x, 2)
        pool_width, pooling = snap._codes()
        base_code = _base_code(base)
        lengths = self._array(lengths, np.int32)
        if max_length is None:
            max_length = int(lengths.max()) if len(lengths) else 0
        return _call.prefill_snapkv(
            self, lengths, int(max_length), kind, x, lse, float(scale), base_code, pool_width, pooling,
            *cache._moved, self._active(active),
        )  # fmt: skip

    def prefill_exact_greedy(
        self,
        lengths: Any,
        *,
        cache: CacheView,
        queries: Any,
        lse: Any = None,
        scale: float = 1.0,
        base: LseBase = "natural",
        max_length: Optional[int] = None,
        active: Any = None,
    ) -> Any:
        """exact_greedy's prompt compression (the C++ ``batched_prefill``
        with ``batch_queries``; on the host, CUDA has none): prompt ``b`` of
        ``lengths[b]`` tokens in slots ``[0, lengths[b])`` of ``cache``
        joins the history, then per KV head the greedy removal of
        :meth:`evict_to` runs until ``min(L, budget)`` tokens remain: every
        cached token is scored with the leave-one-out error its eviction
        would cause for ``queries`` [num_seqs, num_q_heads, head_dim]
        (float32 or the cache's dtype: the queries of each prompt's last
        row; ``lse`` [num_seqs, num_q_heads] may be given but is not read),
        and the unprotected token of the lowest (error, position) goes. The
        kept K and V rows move, in position order, to slots ``[0, kept)``;
        kept tokens score 0 (the next observe scores them all). The same
        tokens as ``append_tokens(L)``, ``observe_evict(queries=...)`` and
        ``evict_to(budget, ...)``, in one call and without a capacity of L
        + 1. A prompt longer than the history (``max_tokens``) or a
        non-finite query, key or value leaves its sequence unchanged (the
        rest of the batch is compressed) and raises the lowest offender.
        ``max_length`` as in :meth:`prefill`. Returns int32 [num_seqs]:
        trailing pages of a paged prompt no longer needed."""
        if not isinstance(cache, CacheView):
            raise _ext.InvalidArgument(
                "kvevict.prefill_exact_greedy: argument 'cache' must be a CacheView (K and V: the kept rows move)"
            )
        base_code = _base_code(base)
        lengths = self._array(lengths, np.int32)
        if max_length is None:
            max_length = int(lengths.max()) if len(lengths) else 0
        return _call.prefill_exact_greedy(
            self, lengths, int(max_length), queries, lse, float(scale), base_code, *cache._moved,
            self._active(active),
        )  # fmt: skip

    def append_tokens(self, tokens: int, active: Any = None, stream: Any = None) -> None:
        """Appends ``tokens`` positions to every active sequence at once
        (chunked prefill, speculative decoding): token ``j`` of head (b, h) goes
        to its next slot for ``j = 0`` (when there is one), then to slots
        ``count, count + 1, ...``; the caller writes their rows. Needs
        ``count + tokens <= capacity``. Then observe_evict, then :meth:`evict_to`."""
        _call.append_tokens(self, int(tokens), self._active(active), stream=stream)

    def evict_to(
        self,
        target: int,
        *,
        cache: Optional[CacheView] = None,
        queries: Any = None,
        lse: Any = None,
        scale: float = 1.0,
        base: LseBase = "natural",
        active: Any = None,
        stream: Any = None,
    ) -> Any:
        """Frees every token above ``target`` of each active (sequence, head)
        at once, by the policy's order, after observe_evict; the kept rows are
        compacted in ``cache`` so the occupied slots are again
        ``[0, target + 1)`` but one hole (the next slot). exact_greedy also
        takes the step's ``queries`` and ``lse`` (it re-scores before each
        victim). Returns int32 [num_seqs, num_kv_heads]: tokens freed.

        Without ``cache`` the rows are not moved: returns ``(moves,
        move_counts)``, moves int32 [num_seqs, num_kv_heads, capacity, 2] of
        (from slot, to slot), the first ``move_counts[b, h]`` valid, for the
        caller to apply."""
        active = self._active(active)
        base_code = _base_code(base)
        if (queries is None) != (lse is None):
            raise _ext.InvalidArgument("kvevict.evict_to: argument 'queries' and 'lse' go together")
        if cache is None:
            if queries is not None:
                raise _ext.InvalidArgument(
                    "kvevict.evict_to: exact_greedy's evict_to needs 'cache' (it reads the keys and values)"
                )
            return _call.evict_to_moves(self, int(target), active, stream=stream)
        return _call.evict_to(
            self, int(target), *cache._moved, queries, lse, float(scale),
            base_code, active, stream=stream,
        )  # fmt: skip

    # ---- helpers ----------------------------------------------------------------

    # Every call goes through kvevict._calls.direct, generated from the
    # call table: eagerly the extension itself (the least a call costs),
    # under torch.compile the torch.ops.kvevict op (which has a fake
    # kernel). It reads _desc, state, descriptor, _torch, _cuda,
    # _unchecked (eager CUDA calls, whose refusal check() raises later),
    # and the helpers below.

    def _ops(self) -> Any:
        from . import ops

        return ops

    def _stream(self, stream: Any) -> int:
        if not self._cuda:
            return 0
        if stream is None:
            return self._torch.cuda.current_stream(self.device).cuda_stream
        return int(getattr(stream, "cuda_stream", stream))

    def _array(self, x: Any, dtype: Any) -> Any:
        """Lists become arrays of the state's kind and device; arrays pass
        through unchanged (the extension checks their dtype)."""
        if x is None or is_torch(x) or isinstance(x, np.ndarray):
            return x
        if self._torch is None:
            return np.asarray(x, dtype=dtype)
        # torch has no general uint64: request streams go as int64 (below 2^63).
        tdt = self._torch.int32 if dtype is np.int32 else self._torch.int64
        return self._torch.as_tensor(x, dtype=tdt, device=self.device)

    def _active(self, active: Any) -> Any:
        if active is None or is_torch(active) or isinstance(active, np.ndarray):
            return active
        return self._array(list(active), np.int32)

    def _new_int32(self, shape: Tuple[int, ...], fill: int) -> Any:
        if self._torch is None:
            return np.full(shape, fill, dtype=np.int32)
        return self._torch.full(shape, fill, dtype=self._torch.int32, device=self.device)

    def __repr__(self) -> str:
        return (
            f"BatchedPolicy({self.config}, num_seqs={self.num_seqs}, num_kv_heads={self.num_kv_heads}, "
            f"num_q_heads={self.num_q_heads}, capacity={self.capacity}, device={str(self.device)!r})"
        )
