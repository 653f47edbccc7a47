"""CacheView: one layer's K and V buffers as kvevict sees them.

kvevict never owns or copies K/V: a CacheView names the caller's two
arrays (NumPy or torch, on the state's device) and their layout. Rows
(head_dim) must be contiguous; every other stride may be anything that keeps
rows apart (padded, sliced or interleaved buffers), which the C++ library
checks.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Tuple

from . import _ext
from ._arrays import for_ext, is_torch

Layout = Literal["bhsd", "bshd", "paged_nhd", "paged_hnd"]
LAYOUT_CODES = {name: getattr(_ext.CacheLayout, name) for name in ("bhsd", "bshd", "paged_nhd", "paged_hnd")}
"""The layouts by name: :class:`kvevict._ext.CacheLayout` members (ints, for the torch ops)."""


class CacheView:
    """K and V of one layer.

    ========== ========================================== ===========
    layout     K and V shape                              page_table
    ========== ========================================== ===========
    bhsd       [num_seqs, num_kv_heads, capacity, head_dim]  --
    bshd       [num_seqs, capacity, num_kv_heads, head_dim]  --
    paged_nhd  [num_pages, page_size, num_kv_heads, head_dim] int32 [num_seqs, max_pages]
    paged_hnd  [num_pages, num_kv_heads, page_size, head_dim] int32 [num_seqs, max_pages]
    ========== ========================================== ===========

    Element types: float32, float16, bfloat16, float8_e4m3fn and float8_e5m2
    (torch, or NumPy with ml_dtypes' types). Slot ``s`` of sequence ``b`` in a
    paged cache is in page ``page_table[b, s // page_size]``.

    An fp8 cache holds codes: an element's value is code x scale, with one
    K and one V scale per layer or per KV head, as vLLM's ``k_scale`` /
    ``v_scale`` (``k_scale`` and ``v_scale``: floats, or arrays of 1 or
    ``num_kv_heads`` values; positive and finite, which the calls that read
    keys check). The scales hold for the cache's life: its codes were
    quantized with them. Other caches take no scales.
    """

    __slots__ = ("k", "v", "layout", "page_table", "k_scale", "v_scale", "_code", "_k", "_v", "_scales")

    def __init__(
        self,
        k: Any,
        v: Any,
        layout: Layout = "bhsd",
        page_table: Optional[Any] = None,
        k_scale: Any = None,
        v_scale: Any = None,
    ) -> None:
        if layout not in LAYOUT_CODES:
            raise _ext.InvalidArgument(
                f"kvevict.CacheView: argument 'layout' = {layout!r} is not one of {', '.join(LAYOUT_CODES)}"
            )
        self.k = k
        self.v = v
        self.layout = layout
        self.page_table = page_table
        self.k_scale = k_scale
        self.v_scale = v_scale
        self._scales = _scales_of(k, k_scale, v_scale)
        self._code = LAYOUT_CODES[layout]
        # NumPy arrays (bfloat16 views included) convert once; torch tensors
        # go as a fresh DLPack capsule per call (a capsule is used once).
        self._k = k if is_torch(k) else for_ext(k)
        self._v = v if is_torch(v) else for_ext(v)

    @classmethod
    def bhsd(cls, k: Any, v: Any) -> "CacheView":
        """[num_seqs, num_kv_heads, capacity, head_dim] (HND per sequence)."""
        return cls(k, v, "bhsd")

    @classmethod
    def bshd(cls, k: Any, v: Any) -> "CacheView":
        """[num_seqs, capacity, num_kv_heads, head_dim] (NHD per sequence)."""
        return cls(k, v, "bshd")

    @classmethod
    def paged(
        cls,
        k_pool: Any,
        v_pool: Any,
        page_table: Any,
        order: Literal["nhd", "hnd"] = "nhd",
        k_scale: Any = None,
        v_scale: Any = None,
    ) -> "CacheView":
        """Page pools [num_pages, page_size, heads, head_dim] (``order="nhd"``,
        vLLM / FlashInfer NHD) or [num_pages, heads, page_size, head_dim]
        (``"hnd"``), with an int32 page table [num_seqs, max_pages]."""
        return cls(k_pool, v_pool, "paged_" + order, page_table, k_scale, v_scale)

    @property
    def _moved(self) -> Tuple[Any, Any, Any, Any, int]:
        """The call table's cache arguments, in its order: K, V, page table, scales, layout code."""
        return self._k, self._v, self.page_table, self._scales, self._code

    def _ext_k(self) -> Any:
        return for_ext(self._k)

    def _ext_v(self) -> Any:
        return for_ext(self._v)

    def __repr__(self) -> str:
        shape = tuple(getattr(self.k, "shape", ()))
        return f"CacheView(layout={self.layout!r}, k.shape={shape}, dtype={getattr(self.k, 'dtype', None)})"


def _scales_of(k: Any, k_scale: Any, v_scale: Any) -> Any:
    """The extension's scales array, float32 [2, n] (K's row, then V's) on K's
    device, or None for a cache without scales."""
    if k_scale is None and v_scale is None:
        return None
    if k_scale is None or v_scale is None:
        missing = "k_scale" if k_scale is None else "v_scale"
        raise _ext.InvalidArgument(f"kvevict.CacheView: argument '{missing}' is required with the other scale")
    if is_torch(k):
        import torch

        rows = [torch.as_tensor(x, dtype=torch.float32, device=k.device).reshape(-1) for x in (k_scale, v_scale)]
        if rows[0].numel() != rows[1].numel():
            raise _ext.InvalidArgument(
                f"kvevict.CacheView: argument 'v_scale' has {rows[1].numel()} values, k_scale {rows[0].numel()}"
            )
        return torch.stack(rows).contiguous()
    import numpy as np

    rows_np = [np.asarray(x, dtype=np.float32).reshape(-1) for x in (k_scale, v_scale)]
    if rows_np[0].size != rows_np[1].size:
        raise _ext.InvalidArgument(
            f"kvevict.CacheView: argument 'v_scale' has {rows_np[1].size} values, k_scale {rows_np[0].size}"
        )
    return np.ascontiguousarray(np.stack(rows_np))
