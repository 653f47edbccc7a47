"""An evicting KV cache for Hugging Face transformers 5.x.

``KVEvictCache`` keeps ``budget + 1`` slots per (sequence, KV head) in every
layer, and the attention implementation ``"kvevict"`` (registered with
transformers when this module is imported, with its mask function) runs
attention over those slots and feeds the probabilities to each layer's
:class:`kvevict.BatchedPolicy`, which frees one slot per head each decode
step, every decision made by the C++ library. The freed slot is where the
next token's K/V row goes, so no K/V bytes move.

::

    import kvevict, kvevict.hf
    model.set_attn_implementation("kvevict")
    cache = kvevict.hf.KVEvictCache(kvevict.H2OConfig.from_ratios(total_tokens, 0.1, 0.1))
    out = model.generate(input_ids, max_new_tokens=128, **kvevict.hf.generate_kwargs(cache))
    print(cache.kv_bytes(), "bytes instead of", cache.dynamic_kv_bytes())

Prompts: the first forward of a sequence (the prompt) attends causally over
the whole prompt (sdpa, or blocked eager attention when the compression
reads every probability); then the prompt is compressed to the budget, in
place in the model's own K/V tensors (``prompt_compression``):

- ``"prefill"`` (default; h2o, recent_window, random): kvevict's batched
  prefill, scored from the column sums of the prompt's attention (H2O's
  prompt rule), the kept rows moved in place;
- ``"snapkv"`` (h2o): the same prefill scored by the attention of the
  prompt's last ``snap.window`` rows, pooled (SnapKV; ``snap``, default
  :meth:`kvevict.SnapKV.paper`);
- ``"key_norms"``, ``"key_diff"`` (h2o; key_norms with decay 0): scored
  from the prompt's keys alone (key-norm, KeyDiff);
- ``"evict_to"`` (every policy; the only one for exact_greedy): the prompt
  as one multi-token append, scored by its last query, then ``evict_to``.

Decode steps feed the policy the step's attention probabilities, or, with
``scores="key_norms"`` / ``"key_diff"`` (h2o with decay 0,
:meth:`kvevict.H2OConfig.key_norm`), nothing but the cached keys.

After the prompt, ``after_prompt="evict"`` (default) holds the budget:
each new token enters and one token per head leaves. ``after_prompt="grow"``
is kvpress's protocol: the prompt (a context) is compressed, then later
tokens (a question and the answer) join the kept rows without eviction, any
number per forward, so the cache grows by their own tokens::

    cache = kvevict.hf.KVEvictCache(config, after_prompt="grow")
    model(context_ids, **kvevict.hf.generate_kwargs(cache))                  # compressed
    model.generate(torch.cat([context_ids, question_ids], 1), max_new_tokens=32,
                   **kvevict.hf.generate_kwargs(cache))                        # the question and answer grow it

fp8 K/V (``kv_dtype=torch.float8_e4m3fn`` or ``torch.float8_e5m2``, with
``k_scale`` / ``v_scale``, one each per layer as vLLM's): the slots hold
codes, ``x / scale`` rounded to the format and saturated, half the bytes of
bf16; the policies read them as code x scale, and attention reads them
dequantized to the model's dtype. The prompt's own attention runs in the
model's dtype, as an engine's prefill does::

    cache = kvevict.hf.KVEvictCache(config, kv_dtype=torch.float8_e4m3fn, k_scale=0.05, v_scale=0.05)

Beam search and several sequences per prompt (``num_beams``,
``num_return_sequences``) work: the cache's ``reorder_cache``,
``batch_repeat_interleave`` and ``batch_select_indices`` fork each layer's
policy state (:meth:`kvevict.BatchedPolicy.fork`, ``fork_from``) and select
the K/V slots to match.

Limits: one prompt forward then one token per forward (``generate`` with
greedy, sampling or beam search decoding, batch 1 or unpadded batches);
padded batches, assisted decoding and ``torch.compile`` of the model are
refused with an error.
"""

from __future__ import annotations

import inspect
import math
from typing import Any, Dict, List, Literal, Optional

import torch
from torch import nn
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward

try:  # transformers >= 5.0
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
except ImportError as e:  # pragma: no cover - the package requires 5.x
    raise ImportError("kvevict.hf needs transformers 5.x") from e

from . import _ext
from .cache import CacheView
from .config import ExactGreedyConfig, PolicyConfig, SnapKV
from .policy import BatchedPolicy

ATTENTION = "kvevict"
PromptCompression = Literal["prefill", "snapkv", "key_norms", "key_diff", "evict_to"]
DecodeScores = Literal["attention", "key_norms", "key_diff"]
AfterPrompt = Literal["evict", "grow"]
_AFTER_PROMPT = ("evict", "grow")
_PROMPT_MODES = ("prefill", "snapkv", "key_norms", "key_diff", "evict_to")
_SCORES = ("attention", "key_norms", "key_diff")
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)

# The prompt's attention probabilities are computed in blocks of this many
# query rows, so a long prompt never materialises an [L, L] matrix per head.
_PROMPT_ROWS_PER_BLOCK = 64


class KVEvictLayer(CacheLayerMixin):
    """One layer of :class:`KVEvictCache`: its policy and its K/V slots.

    ``keys`` / ``values`` are [batch, kv_heads, budget + 1, head_dim] once
    the prompt is compressed (slot order, not position order: the slot
    table is ``policy.positions``)."""

    is_compileable = False
    is_sliding = False
    is_croppable = False

    def __init__(self, cache: "KVEvictCache", layer_idx: int) -> None:
        super().__init__()
        self.cache = cache
        self.layer_idx = layer_idx
        self.policy: Optional[BatchedPolicy] = None
        self.seen = 0  # tokens of each sequence so far (every sequence has the same length)
        self.records: List[Dict[str, Any]] = []
        self._table: Optional[torch.Tensor] = None
        self._view: Optional[CacheView] = None
        self._prompt_pending = False
        self._prompt_keys: Optional[torch.Tensor] = None  # recorded: the prompt's keys, then each step's new row
        self._k_new: Optional[torch.Tensor] = None
        self._dtype: Optional[torch.dtype] = None  # the model's K/V dtype (what attention reads)
        self._rows: Optional[tuple] = None  # (b [B, 1], h [1, H]): the indices of each head's new row, made once

    # ---- transformers' layer interface -----------------------------------------

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self._dtype = key_states.dtype
        self.is_initialized = True

    # ---- what the slots hold: the model's rows, or fp8 codes ---------------------------

    def _store(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        """Rows as the slots hold them: fp8 codes of x / scale (saturated), or x."""
        fmt = self.cache.kv_dtype
        if fmt is None:
            return x
        top = torch.finfo(fmt).max
        return (x.float() / scale).clamp(-top, top).to(fmt)

    def _load(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        """Slots as attention reads them: code x scale in the model's dtype, or x."""
        if self.cache.kv_dtype is None:
            return x
        return (x.float() * scale).to(self._dtype)

    def _view_of(self, keys: torch.Tensor, values: torch.Tensor, table: torch.Tensor) -> CacheView:
        """HND pages [pages, heads, budget + 1, head_dim] with their table."""
        return self._scaled_view(keys, values, "paged_hnd", table)

    def _scaled_view(self, keys: torch.Tensor, values: torch.Tensor, layout: str, table: Any = None) -> CacheView:
        c = self.cache
        if c.kv_dtype is None:
            return CacheView(keys, values, layout, table)
        return CacheView(keys, values, layout, table, k_scale=c.k_scale, v_scale=c.v_scale)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        B, H, q_len, D = key_states.shape
        if self._prompt_pending:
            raise RuntimeError(
                "kvevict.hf: the prompt's attention did not run through the 'kvevict' attention implementation; "
                "call model.set_attn_implementation('kvevict') (or load the model with attn_implementation='kvevict')"
            )
        if self.policy is None:
            return self._start_prompt(key_states, value_states)
        if self.cache.after_prompt == "grow":
            return self._grow(key_states, value_states)
        if q_len != 1:
            raise NotImplementedError(
                f"kvevict.hf: layer {self.layer_idx} got {q_len} new tokens after the prompt; the cache takes one "
                "prompt forward and then one token per forward (no assisted decoding or chunked prefill)"
            )
        if B != self.policy.num_seqs:
            raise NotImplementedError(
                f"kvevict.hf: layer {self.layer_idx} got a batch of {B} after one of {self.policy.num_seqs}; change "
                "the batch through the cache (reorder_cache, batch_repeat_interleave, batch_select_indices)"
            )
        if self.layer_idx == 0 and self.policy._cuda:
            self.cache.check()  # the last step's refusals: a CUDA call does not wait to raise them
        c = self.cache
        k_new, v_new = self._store(key_states[:, :, 0], c.k_scale), self._store(value_states[:, :, 0], c.v_scale)
        if c._one_launch:
            self._write_next_rows(k_new, v_new)  # the step (_observe) appends, observes and evicts in one call
        else:
            self.policy.append(cache=self._view, k_new=k_new, v_new=v_new)
        if self.cache.record:
            self._k_new = key_states[:, :, 0].cpu()
        self.seen += 1
        n = min(self.seen, self.policy.budget + 1)  # occupied: exactly slots [0, n) of every head
        keys, values = self._load(self.keys[:, :, :n], c.k_scale), self._load(self.values[:, :, :n], c.v_scale)
        keys._kvevict_layer = self  # how the attention function finds the policy
        return keys, values

    def _write_next_rows(self, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        """The engine's half of the one-launch step: each head's new K/V row
        goes to its next slot (the policy's next_slots, vLLM's slot mapping),
        before the attention reads it. A head with no free slot (-1) writes
        nothing: its sequence's step is refused and the slots stay as they were."""
        B, H = k_new.shape[:2]
        if self._rows is None or self._rows[0].shape[0] != B:  # a batch reshaped by the cache's calls
            self._rows = (torch.arange(B, device=k_new.device).view(B, 1),
                          torch.arange(H, device=k_new.device).view(1, H))
        b, h = self._rows
        next_slots = self.policy.next_slots.long()
        free = (next_slots >= 0).unsqueeze(-1)
        slot = next_slots.clamp(min=0)
        for cached, new in ((self.keys, k_new), (self.values, v_new)):
            bits = _bits(cached)
            bits[b, h, slot] = torch.where(free, _bits(new), bits[b, h, slot])

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query: Any) -> tuple:
        q_len = query.shape[0] if isinstance(query, torch.Tensor) else int(query)
        if self.policy is None:
            return q_len, 0
        if self.cache.after_prompt == "grow":
            return self.keys.shape[2] + q_len, 0
        return min(self.seen + q_len, self.policy.budget + 1), 0

    def get_max_length(self) -> int:
        return -1

    def get_max_cache_shape(self) -> int:  # transformers < 5.2 names it so
        return -1

    def reset(self) -> None:
        self.policy = None
        self.seen = 0
        self.keys = self.values = None
        self._table = self._view = None
        self._prompt_keys = self._k_new = None
        self._prompt_pending = False
        self.records = []

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: sequence b continues beam ``beam_idx[b]``."""
        self._select(beam_idx, "beam_idx")

    def crop(self, *args: Any) -> None:
        raise NotImplementedError("kvevict.hf: cropping an evicting cache is not supported")

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Each sequence becomes ``repeats`` copies of itself, side by side."""
        if self.policy is not None:
            B = self.policy.num_seqs
            self._select(torch.arange(B, device=self.keys.device).repeat_interleave(repeats), "repeats")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keeps sequences ``indices`` (in that order)."""
        self._select(indices, "indices")

    def _select(self, indices: Any, arg: str) -> None:
        """Sequence b becomes a copy of sequence ``indices[b]``: the policy's
        state by kvevict's fork (into a policy of the new batch size when it
        changes), the K/V slots by index_select. Nothing moves within a
        sequence, so the slot table stays valid for the copied rows."""
        if self.policy is None:
            return  # nothing cached yet: generate expands the prompt before its forward
        if self._prompt_pending:
            raise RuntimeError("kvevict.hf: the cache was reordered in the middle of the prompt's forward")
        B, device = self.policy.num_seqs, self.keys.device
        idx = torch.as_tensor(indices, device=device).long().reshape(-1)
        if idx.numel() == 0 or bool(((idx < 0) | (idx >= B)).any()):
            raise _ext.OutOfRange(
                f"kvevict.hf: argument '{arg}' names sequences outside [0, {B}) or none: {idx.tolist()}"
            )
        sources = idx.to(torch.int32)
        if idx.numel() == B:
            self.policy.fork(sources)
        else:
            p = self.policy
            grown = self.cache._make_policy(idx.numel(), p.num_kv_heads, p.num_q_heads, self.keys.shape[-1],
                                            p.capacity, device)
            grown.fork_from(p, sources)
            self.policy = grown
        self.keys = _bits(self.keys).index_select(0, idx).view(self.keys.dtype)
        self.values = _bits(self.values).index_select(0, idx).view(self.values.dtype)
        table = torch.full((idx.numel(), self._table.shape[1]), -1, dtype=torch.int32, device=self._table.device)
        table[:, 0] = torch.arange(idx.numel(), dtype=torch.int32, device=table.device)
        self._table = table
        grow = self.cache.after_prompt == "grow"
        self._view = None if grow else self._view_of(self.keys, self.values, table)
        if self.cache.record:
            self.records.append({"kind": "select", "indices": idx.cpu()})

    def _grow(self, key_states: torch.Tensor, value_states: torch.Tensor):
        """after_prompt="grow": the tokens after the prompt join the kept
        rows, none evicted (kvpress's protocol); any number per forward,
        causal among themselves (the attention function masks them)."""
        c = self.cache
        self.keys = _cat(self.keys, self._store(key_states, c.k_scale))
        self.values = _cat(self.values, self._store(value_states, c.v_scale))
        self.seen += key_states.shape[2]
        keys, values = self._load(self.keys, c.k_scale), self._load(self.values, c.v_scale)
        keys._kvevict_layer = self
        return keys, values

    # ---- the prompt -------------------------------------------------------------------

    def _start_prompt(self, key_states: torch.Tensor, value_states: torch.Tensor):
        """The prompt's forward: attention runs over the prompt as given; the
        attention function then calls _compress_prompt."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.policy = None
        self.seen = key_states.shape[2]
        self._prompt_pending = True
        key_states._kvevict_layer = self
        return key_states, value_states

    def _compress_prompt(self, key: torch.Tensor, value: torch.Tensor, num_q_heads: int, stats: "_PromptStats",
                         last_query: torch.Tensor, scale: float) -> None:
        """After the prompt's attention: builds the policy (the query heads are
        known now), compresses the prompt's K/V in place to the budget, and
        keeps the first budget + 1 slots of each head as the layer's slots.

        A prompt longer than budget + 1 is compressed in the model's own K/V
        tensors (fp8: in the codes of them), viewed as a BHSD cache of L slots,
        so the layer never holds more rows than the prompt has; a shorter one
        goes to slots of its own. Either way the slots are then HND pages
        [batch, heads, budget + 1, head_dim], page b for sequence b, and the
        page table names no other page."""
        B, H, L, D = key.shape
        c = self.cache
        P = c.config.budget + 1
        capacity = max(L, P)
        self.policy = policy = c._make_policy(B, H, num_q_heads, D, capacity, key.device)
        if c.record:
            self._prompt_keys = key.to("cpu", copy=True)  # a copy: the compression moves rows within key
        stored_k, stored_v = self._store(key, c.k_scale), self._store(value, c.v_scale)
        if L > P:
            buf_k, buf_v = stored_k, stored_v  # the model's tensors (or their codes), compressed in place
            view = self._scaled_view(buf_k, buf_v, "bhsd")
        else:
            buf_k, buf_v = stored_k.new_zeros((B, H, P, D)), stored_v.new_zeros((B, H, P, D))
            _bits(buf_k)[:, :, :L] = _bits(stored_k)
            _bits(buf_v)[:, :, :L] = _bits(stored_v)
            view = self._view_of(buf_k, buf_v, torch.arange(B, dtype=torch.int32, device=key.device).view(B, 1))
        c._note_held(self, buf_k.nbytes + buf_v.nbytes)
        lengths = torch.full((B,), L, dtype=torch.int32, device=key.device)
        mode = c.prompt_compression
        if mode == "prefill":
            if c._h2o:
                policy.prefill(lengths, column_sums=stats.column_sums, cache=view, max_length=L)
            else:
                policy.prefill(lengths, cache=view, max_length=L)
        elif mode == "snapkv":
            policy.prefill_snapkv(lengths, cache=view, snap=c.snap, probs=stats.window_probs, max_length=L)
        elif mode == "key_norms":
            policy.prefill_key_norms(lengths, cache=view, max_length=L)
        elif mode == "key_diff":
            policy.prefill_key_diff(lengths, cache=view, max_length=L)
        else:
            policy.append_tokens(L)
            if c._greedy:
                policy.observe_evict(queries=last_query, lse=stats.last_lse, scale=scale, cache=view)
                policy.evict_to(policy.budget, cache=view, queries=last_query, lse=stats.last_lse, scale=scale)
            else:
                policy.observe_evict(probs=stats.last_probs)
                policy.evict_to(policy.budget, cache=view)
        if c.record:
            self.records.append({"kind": "prompt", "length": L,
                                 "column_sums": None if stats.column_sums is None else stats.column_sums.cpu(),
                                 "last_probs": stats.last_probs.cpu(), "keys": self._prompt_keys})
        self._prompt_keys = None
        # Every kept token is now in slots [0, budget + 1) of each head: those
        # slots are the cache from here on (a copy, so the prompt's rows go).
        kept = min(L, policy.budget) if c.after_prompt == "grow" else P
        self.keys = _bits(buf_k)[:, :, :kept].contiguous().view(buf_k.dtype)
        self.values = _bits(buf_v)[:, :, :kept].contiguous().view(buf_v.dtype)
        c._note_held(self, buf_k.nbytes + buf_v.nbytes + self.keys.nbytes + self.values.nbytes)
        table = torch.full((B, -(-capacity // P)), -1, dtype=torch.int32, device=key.device)
        table[:, 0] = torch.arange(B, dtype=torch.int32, device=table.device)
        self._table = table
        self._view = None if c.after_prompt == "grow" else self._view_of(self.keys, self.values, table)
        self._prompt_pending = False
        c._note_held(self, self.keys.nbytes + self.values.nbytes)

    # ---- a decode step, from the attention function ------------------------------------

    def _observe(self, probs: torch.Tensor, query: torch.Tensor, lse: torch.Tensor, scale: float) -> None:
        scores = self.cache.scores
        if self.cache._greedy:
            self.policy.observe_evict(queries=query, lse=lse, scale=scale, cache=self._view)
        elif scores == "key_norms":
            self.policy.observe_evict_key_norms(self._view)
        elif scores == "key_diff":
            self.policy.observe_evict_key_diff(self._view)
        else:
            # The real attention width: the library takes an input as narrow
            # as each head's count (docs/semantics.md, "Input width"), which
            # is what the cache attended over while it fills. One call (one
            # kernel on CUDA): the append, then the observation and eviction.
            self.policy.step(probs=probs)
        if self.cache.record:
            self.records.append({"kind": "decode", "probs": probs.cpu(), "k_new": self._k_new})


class KVEvictCache(Cache):
    """A transformers ``Cache`` whose layers keep ``budget + 1`` slots per
    (sequence, KV head), evicted by a kvevict policy each decode step.

    Args:
        config: the policy (:class:`kvevict.H2OConfig`, ...), the same for
            every layer, each layer with its own scores.
        prompt_compression: ``"prefill"``, ``"snapkv"``, ``"key_norms"``,
            ``"key_diff"`` or ``"evict_to"`` (see the module). Default:
            ``"evict_to"`` for exact_greedy, the decode ``scores`` when they
            come from the keys, else ``"prefill"``.
        scores: what each decode step feeds the policy: ``"attention"``
            (the step's probabilities), ``"key_norms"`` or ``"key_diff"``
            (the cached keys alone; h2o with decay 0).
        snap: SnapKV's parameters for ``prompt_compression="snapkv"``
            (default :meth:`kvevict.SnapKV.paper`).
        max_length: exact_greedy only: the longest a sequence grows (prompt +
            new tokens); its history holds that many rows.
        record: keep, per layer, what each policy was fed (the prompt's
            column sums and keys, each step's probabilities and new key row,
            on the CPU), for tests and analysis.
        after_prompt: ``"evict"`` (default) holds the budget: every later
            token enters the cache and one token per head leaves, by the
            policy. ``"grow"`` is kvpress's protocol: the prompt is
            compressed to the budget, then later tokens (a question, the
            answer) join the kept rows and none is evicted, any number per
            forward.
        kv_dtype: ``None`` keeps the model's dtype; ``torch.float8_e4m3fn``
            or ``torch.float8_e5m2`` keeps fp8 codes of ``x / k_scale`` and
            ``x / v_scale`` (saturated), which the policies read as code x
            scale and attention reads dequantized.
        k_scale, v_scale: the fp8 scales, one each for every layer
            (positive, finite); 1.0 by default.
    """

    def __init__(
        self,
        config: PolicyConfig,
        *,
        prompt_compression: Optional[PromptCompression] = None,
        scores: DecodeScores = "attention",
        snap: Optional[SnapKV] = None,
        max_length: Optional[int] = None,
        record: bool = False,
        after_prompt: AfterPrompt = "evict",
        kv_dtype: Optional[torch.dtype] = None,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> None:
        super().__init__(layers=[])
        if kv_dtype is not None and kv_dtype not in _FP8:
            raise _ext.InvalidArgument(
                f"kvevict.hf: argument 'kv_dtype' = {kv_dtype} is not None (the model's dtype), torch.float8_e4m3fn "
                "or torch.float8_e5m2"
            )
        for name, x in (("k_scale", k_scale), ("v_scale", v_scale)):
            if not (isinstance(x, (int, float)) and math.isfinite(x) and x > 0):
                raise _ext.InvalidArgument(f"kvevict.hf: argument '{name}' = {x!r} is not a positive finite number")
            if kv_dtype is None and x != 1.0:
                raise _ext.InvalidArgument(f"kvevict.hf: argument '{name}' applies to an fp8 kv_dtype only")
        self.kv_dtype = kv_dtype
        self.k_scale, self.v_scale = float(k_scale), float(v_scale)
        self._peak_kv_bytes = 0
        self.config = config
        self._greedy = isinstance(config, ExactGreedyConfig)
        self._h2o = type(config).__name__ == "H2OConfig"
        if scores not in _SCORES:
            raise _ext.InvalidArgument(f"kvevict.hf: argument 'scores' = {scores!r} is not one of {', '.join(_SCORES)}")
        if prompt_compression is None:
            prompt_compression = "evict_to" if self._greedy else scores if scores != "attention" else "prefill"
        if prompt_compression not in _PROMPT_MODES:
            raise _ext.InvalidArgument(
                f"kvevict.hf: argument 'prompt_compression' = {prompt_compression!r} is not one of "
                f"{', '.join(_PROMPT_MODES)}"
            )
        by_score = {scores, prompt_compression} & {"snapkv", "key_norms", "key_diff"}
        if by_score and not self._h2o:
            raise _ext.InvalidArgument(
                f"kvevict.hf: {' and '.join(sorted(by_score))} scoring needs an h2o config (H2OConfig), "
                f"not {type(config).__name__}"
            )
        if (scores != "attention" or prompt_compression == "key_norms") and self._h2o and config.decay != 0.0:
            raise _ext.InvalidArgument(
                "kvevict.hf: scores from the keys replace the old ones each step: the h2o config's decay must be 0 "
                f"(H2OConfig.key_norm), it is {config.decay}"
            )
        if snap is not None and prompt_compression != "snapkv":
            raise _ext.InvalidArgument("kvevict.hf: argument 'snap' applies to prompt_compression='snapkv' only")
        self.scores = scores
        # Attention scores take the one-launch step; the key scores and
        # exact_greedy read the cache in their own calls, after an append.
        self._one_launch = scores == "attention" and not self._greedy
        self.snap = (snap or SnapKV.paper()) if prompt_compression == "snapkv" else None
        if self._greedy and prompt_compression == "prefill":
            raise _ext.InvalidArgument(
                "kvevict.hf: exact_greedy compresses a prompt by its greedy removal; use "
                "prompt_compression='evict_to'"
            )
        if self._greedy and max_length is None:
            raise _ext.InvalidArgument("kvevict.hf: exact_greedy needs 'max_length' (prompt + new tokens)")
        self.prompt_compression = prompt_compression
        self.max_length = max_length
        self.record = record
        if after_prompt not in _AFTER_PROMPT:
            raise _ext.InvalidArgument(
                f"kvevict.hf: argument 'after_prompt' = {after_prompt!r} is not one of {', '.join(_AFTER_PROMPT)}"
            )
        if after_prompt == "grow" and scores != "attention":
            raise _ext.InvalidArgument(
                f"kvevict.hf: after_prompt='grow' evicts nothing after the prompt, so decode-time scores ({scores!r}) "
                "do not apply; choose the prompt's rule with prompt_compression"
            )
        self.after_prompt = after_prompt

    def _make_policy(self, B: int, H: int, Hq: int, D: int, capacity: int, device: torch.device) -> BatchedPolicy:
        extra = dict(max_tokens=max(self.max_length, capacity), head_dim=D) if self._greedy else {}
        if self.scores == "key_diff":
            extra = dict(head_dim=D)  # KeyDiff's running anchors
        return BatchedPolicy(self.config, B, H, capacity, num_q_heads=Hq, device=device, **extra)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any):
        while len(self.layers) <= layer_idx:
            self.layers.append(KVEvictLayer(self, len(self.layers)))
        return self.layers[layer_idx].update(key_states, value_states)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        if layer_idx >= len(self.layers):
            return 0
        return self.layers[layer_idx].get_seq_length()

    def get_mask_sizes(self, query: Any, layer_idx: int = 0) -> tuple:
        if layer_idx >= len(self.layers):
            q_len = query.shape[0] if isinstance(query, torch.Tensor) else int(query)
            return q_len, 0
        return self.layers[layer_idx].get_mask_sizes(query)

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return -1

    @property
    def is_compileable(self) -> bool:
        return False

    def check(self) -> None:
        """Raises the first refusal (bad data: a NaN in the attention, a
        non-finite key) any layer's policy recorded since the last check.
        On the CPU the policies raise as they run; on CUDA they record it on
        the device, and each decode step checks the previous one's at its
        start: call this after ``generate`` for the last step."""
        for layer in self.layers:
            if getattr(layer, "policy", None) is not None:
                layer.policy.check()

    # ---- reporting ------------------------------------------------------------------------

    def kv_bytes(self) -> int:
        """Bytes of K and V the cache holds now, all layers."""
        return sum(l.keys.nbytes + l.values.nbytes for l in self.layers if l.keys is not None)

    def peak_kv_bytes(self) -> int:
        """The most bytes of K and V the cache held at once, all layers: while a
        layer compresses its prompt it holds the prompt's rows (the model's
        own K/V, or their fp8 codes) and, for the copy, its new slots; every
        other layer holds its slots."""
        return max(self._peak_kv_bytes, self.kv_bytes())

    def _note_held(self, layer: KVEvictLayer, layer_bytes: int) -> None:
        others = sum(l.keys.nbytes + l.values.nbytes for l in self.layers if l is not layer and l.keys is not None)
        self._peak_kv_bytes = max(self._peak_kv_bytes, others + layer_bytes)

    def dynamic_kv_bytes(self) -> int:
        """Bytes a DynamicCache would hold for the same tokens."""
        total = 0
        for l in self.layers:
            if l.keys is not None:
                B, H, _, D = l.keys.shape
                total += 2 * B * H * l.seen * D * torch.empty((), dtype=l._dtype).element_size()  # the model's dtype
        return total


def _bits(x: torch.Tensor) -> torch.Tensor:
    """x, or an fp8 tensor's bytes (uint8, the same memory): indexing and
    copies of fp8 tensors go through their bytes, which every torch build has."""
    return x.view(torch.uint8) if x.dtype in _FP8 else x


def _cat(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a and b joined along the slots (dimension 2)."""
    return torch.cat([_bits(a), _bits(b)], dim=2).view(a.dtype)


# ---- the attention implementation -----------------------------------------------------------


def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, Hkv, S, D] -> [B, Hkv * groups, S, D], as transformers' repeat_kv."""
    if groups == 1:
        return x
    B, H, S, D = x.shape
    return x[:, :, None, :, :].expand(B, H, groups, S, D).reshape(B, H * groups, S, D)


class _PromptStats:
    """What a prompt's compression reads of its attention: the column sums
    of the causal probabilities (h2o's prefill), the last ``window`` rows'
    probabilities (SnapKV), the last row's probabilities and LSE (evict_to)."""

    __slots__ = ("column_sums", "window_probs", "last_probs", "last_lse")

    def __init__(self) -> None:
        self.column_sums: Optional[torch.Tensor] = None
        self.window_probs: Optional[torch.Tensor] = None
        self.last_probs: Optional[torch.Tensor] = None
        self.last_lse: Optional[torch.Tensor] = None


def _prompt_attention(cache: "KVEvictCache", module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, scaling: float, dropout: float):
    """The prompt's causal attention output [B, L, Hq, D] and what its
    compression reads of the probabilities (_PromptStats).

    H2O's column sums read every probability: the output comes from the
    same blocks (eager attention's arithmetic: logits in the model's dtype
    times ``scaling``, softmax in float32, probabilities in the model's
    dtype times V). Every other mode reads at most the last ``window`` rows:
    the output is transformers' sdpa, what the dynamic cache computes, and
    only those rows are computed again. Blocks of query rows meet the keys
    up to the block's last row only (the rest is masked), so a long prompt
    never materialises an [L, L] matrix per head; a group's query heads
    share their KV head's keys (no repeated K or V)."""
    B, Hq, L, D = query.shape
    H = key.shape[1]
    g = Hq // H
    stats = _PromptStats()
    need_sums = cache._h2o and cache.prompt_compression == "prefill"
    window = cache.snap.window if cache.snap is not None else 0
    out = None
    if need_sums:
        stats.column_sums = torch.zeros((B, Hq, L), dtype=torch.float32, device=query.device)
        out = query.new_empty((B, L, Hq, D))
    else:
        out, _ = sdpa_attention_forward(module, query, key, value, None, dropout=dropout, scaling=scaling,
                                        is_causal=True)
    first_read = 0 if need_sums else L - max(window, 1)
    windows = []
    q = query.reshape(B, H, g, L, D)  # query head h * g + j is row j of KV head h's group
    # A power-of-two scaling (head_dim 64, 256, ...) scales every product and
    # sum exactly in float32 and bfloat16 (unless a value is subnormal, far
    # below anything attention adds up): applied to the few query rows of a
    # block instead of its [rows, L] logits, it saves a pass over them.
    # float16's narrow exponent makes small rows subnormal: it keeps eager's order.
    prescale = math.frexp(scaling)[0] == 0.5 and query.dtype in (torch.float32, torch.bfloat16)
    if prescale:
        q = q * scaling
    step = _PROMPT_ROWS_PER_BLOCK
    # made once: row r of a block sees columns <= r of its own rows; the sums are a product with ones
    causal_block = torch.ones((step, step), dtype=torch.bool, device=query.device).triu(1)
    ones = torch.ones((1, step), dtype=torch.float32, device=query.device)
    for lo in range(first_read - first_read % step, L, step):
        hi = min(lo + step, L)
        rows = hi - lo
        w = torch.matmul(q[:, :, :, lo:hi].reshape(B, H, g * rows, D), key[:, :, :hi].transpose(2, 3))
        if not prescale:
            w = w.mul_(scaling)  # in place: eager's product, no second [rows, hi] tensor
        w = w.view(B, H, g, rows, hi)
        w[..., lo:hi].masked_fill_(causal_block[:rows, :rows], torch.finfo(w.dtype).min)
        p32 = nn.functional.softmax(w, dim=-1, dtype=torch.float32)
        if need_sums:
            probs = nn.functional.dropout(p32.to(query.dtype), p=dropout, training=module.training)
            block = torch.matmul(probs.view(B, H, g * rows, hi), value[:, :, :hi])  # [B, H, g * rows, D]
            out[:, lo:hi] = block.view(B, Hq, rows, D).transpose(1, 2)
        p32 = p32.view(B, Hq, rows, hi)
        if need_sums:  # a product with ones: BLAS reads the block once, faster than a reduction across rows
            stats.column_sums[:, :, :hi] += torch.matmul(ones[:, :rows], p32).squeeze(2)
        if window and hi > L - window:
            part = p32[:, :, max(L - window, lo) - lo:]
            windows.append(nn.functional.pad(part, (0, L - hi)))  # zeros right of the causal edge
        if hi == L:
            stats.last_probs = p32[:, :, -1, :]
            stats.last_lse = torch.logsumexp(w.view(B, Hq, rows, hi)[:, :, -1].float(), dim=-1)
    if windows:
        stats.window_probs = torch.cat(windows, dim=2).contiguous()
    return out, stats


def _eager(module: nn.Module, query, key, value, attention_mask, scaling, dropout=0.0):
    """transformers' eager attention, line for line: the numbers the
    DynamicCache baseline computes, and the fallback without a kvevict layer."""
    groups = query.shape[1] // key.shape[1]
    k, v = _repeat_kv(key, groups), _repeat_kv(value, groups)
    weights = torch.matmul(query, k.transpose(2, 3)) * scaling
    if attention_mask is not None:
        weights = weights + attention_mask
    p32 = nn.functional.softmax(weights, dim=-1, dtype=torch.float32)
    probs = nn.functional.dropout(p32.to(query.dtype), p=dropout, training=module.training)
    out = torch.matmul(probs, v).transpose(1, 2).contiguous()
    return out, probs, weights, p32


def kvevict_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: Optional[torch.Tensor], dropout: float = 0.0, scaling: Optional[float] = None,
                      **kwargs: Any):
    """Attention over a KVEvictCache layer's slots, feeding its policy.

    Without a kvevict cache (no cache, or another one) it is eager attention.

    The signature is transformers' attention interface as its sdpa and
    flash functions spell it: the models pass ``dropout`` and ``scaling``
    by keyword, and patches that wrap every registered function (kvpress
    forwards ``dropout`` as the sixth positional argument, ``scaling`` in
    its keywords) reach the same parameters. ``scaling`` None is
    ``1 / sqrt(head_dim)``, as in sdpa."""
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    layer: Optional[KVEvictLayer] = getattr(key, "_kvevict_layer", None)
    if layer is None:
        out, probs, _, _ = _eager(module, query, key, value, attention_mask, scaling, dropout)
        return out, probs
    B, Hq, q_len, D = query.shape
    scale = float(scaling)
    if layer._prompt_pending:
        L = key.shape[2]
        if q_len != L:
            raise NotImplementedError("kvevict.hf: the prompt forward must hold the whole prompt")
        snap = layer.cache.snap
        if snap is not None and L < snap.window:
            raise _ext.OutOfRange(
                f"kvevict.hf: the prompt has {L} tokens, fewer than the SnapKV window of {snap.window} rows"
            )
        out, stats = _prompt_attention(layer.cache, module, query, key, value, scaling, dropout)
        layer._compress_prompt(key, value, Hq, stats, query[:, :, -1], scale)
        return out, None
    if layer.cache.after_prompt == "grow":
        # The new rows are the last q_len: row i sees the kept rows and new rows [0, i].
        S = key.shape[2]
        mask = None
        if q_len > 1:
            mask = torch.full((q_len, S), torch.finfo(query.dtype).min, dtype=query.dtype, device=query.device)
            mask = mask.triu(S - q_len + 1)
        out, probs, _, _ = _eager(module, query, key, value, mask, scaling, dropout)
        return out, probs
    if q_len != 1:
        raise NotImplementedError("kvevict.hf: one token per forward after the prompt")
    out, probs, w, p32 = _eager(module, query, key, value, None, scaling, dropout)
    lse = torch.logsumexp(w.float(), dim=-1)[:, :, 0] if layer.cache._greedy else None
    layer._observe(p32[:, :, 0, :], query[:, :, 0], lse, scale)
    return out, probs


def kvevict_mask(*args: Any, attention_mask: Optional[torch.Tensor] = None, **kwargs: Any):
    """The mask function of the 'kvevict' attention: none is needed (the
    prompt is causal, a decode step sees every slot), but a padded batch is
    refused here, where transformers hands over the padding mask."""
    if attention_mask is not None and attention_mask.ndim == 2 and not bool(attention_mask.all()):
        raise NotImplementedError(
            "kvevict.hf: padded batches are not supported (the attention mask has padding); generate the "
            "sequences separately or as a batch of equal lengths"
        )
    return None


def generate_kwargs(cache: Cache) -> Dict[str, Cache]:
    """The keyword that hands a cache to ``model.generate``: ``cache`` from
    transformers 5.24 on (``past_key_values`` is deprecated there), else
    ``past_key_values``: ``model.generate(ids, **generate_kwargs(cache))``."""
    from transformers.masking_utils import create_causal_mask

    return {"cache" if "cache" in inspect.signature(create_causal_mask).parameters else "past_key_values": cache}


AttentionInterface.register(ATTENTION, kvevict_attention)
AttentionMaskInterface.register(ATTENTION, kvevict_mask)
