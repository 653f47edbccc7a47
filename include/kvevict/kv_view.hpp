#pragma once
// kv_view: a non-owning, trivially copyable view of an engine's K and V
// buffers for one layer, in any dtype and layout (fp8 with its scales).
// kvevict never allocates or frees this memory; it only reads rows (scores
// from keys) and moves rows (scatter, compaction).
#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "kvevict/config.hpp"
#include "kvevict/dtype/fp8.hpp"
#include "kvevict/error.hpp"
#include "kvevict/kv_scales.hpp"
#include "kvevict/layout.hpp"
#include "kvevict/status_code.hpp"

namespace kvevict {

template <class T, class Layout>
struct kv_view {
  using element_type = T;
  using layout_type = Layout;

  T* k = nullptr;
  T* v = nullptr;
  Layout layout{};
  std::int32_t num_seqs = 0;
  std::int32_t num_heads = 0;  ///< KV heads
  std::int32_t capacity = 0;   ///< slots per (sequence, head)
  std::int32_t head_dim = 0;
  kv_scales scales{};  ///< fp8 caches only (required there): what a code is worth

  KVEVICT_HOST_DEVICE T* k_row(std::int32_t b, std::int32_t h, std::int32_t s) const noexcept {
    return k + layout.row_offset(b, h, s);
  }
  KVEVICT_HOST_DEVICE T* v_row(std::int32_t b, std::int32_t h, std::int32_t s) const noexcept {
    return v + layout.row_offset(b, h, s);
  }
  /// The scale of head h's keys (values): its fp8 scale, 1 for a float cache.
  KVEVICT_HOST_DEVICE float k_scale(std::int32_t h) const noexcept { return scale_in(scales.k, h); }
  KVEVICT_HOST_DEVICE float v_scale(std::int32_t h) const noexcept { return scale_in(scales.v, h); }
  KVEVICT_HOST_DEVICE float scale_in(const float* array, std::int32_t h) const noexcept {
    if constexpr (is_fp8_v<std::remove_cv_t<T>>) {
      return array[scales.index(h)];
    } else {
      (void)array, (void)h;
      return 1.0f;
    }
  }
};

template <class T>
using strided_kv_view = kv_view<T, strided_layout>;
template <class T>
using paged_kv_view = kv_view<T, paged_layout>;

static_assert(std::is_trivially_copyable_v<kv_view<float, strided_layout>>, "views go to kernels by value");
static_assert(std::is_trivially_copyable_v<kv_view<float, paged_layout>>, "views go to kernels by value");

namespace detail {

struct stride_dim {
  std::int64_t stride;  // elements
  std::int32_t extent;
  const char* name;
};

// Rows of distinct indices never overlap if, with the dimensions sorted by
// stride, each stride is at least the span of everything inside it: the
// usual sufficient test for an injective strided map. Sorting all of them
// (not assuming an order) accepts SBHD, NHD and HND alike, and a K-to-V
// offset as one more dimension of extent 2 accepts interleaved K/V buffers.
// Returns the index of the first offending dimension (or -1), and the span
// in elements of one buffer.
template <std::size_t N>
int first_overlap(stride_dim (&dims)[N], std::int32_t head_dim, std::int64_t& span) {
  std::sort(dims, dims + N, [](const stride_dim& x, const stride_dim& y) { return x.stride < y.stride; });
  span = head_dim;
  for (std::size_t i = 0; i < N; ++i) {
    if (dims[i].extent <= 1) continue;
    if (dims[i].stride < span) return int(i);
    if (dims[i].stride > (std::numeric_limits<std::int64_t>::max() / 2 - span) / (dims[i].extent - 1)) return int(i);
    span += dims[i].stride * (dims[i].extent - 1);
  }
  return -1;
}

template <class Where, std::size_t N>
std::int64_t require_disjoint_rows(const Where& where, stride_dim (&dims)[N], std::int32_t head_dim) {
  for (const stride_dim& d : dims)
    if (d.stride < 0) fail<invalid_argument>(where, concat("layout.", d.name), "= ", d.stride, " is negative");
  std::int64_t span = 0;
  const int bad = first_overlap(dims, head_dim, span);
  if (bad >= 0)
    fail<invalid_argument>(where, concat("layout.", dims[bad].name), "= ", dims[bad].stride,
                           " makes rows overlap or overflow (needs at least ", span, " elements)");
  return span;
}

/// Validates a layout; returns the span of one buffer in elements.
template <class Where>
std::int64_t require_layout(const Where& where, const strided_layout& l, std::int32_t num_seqs,
                            std::int32_t num_heads, std::int32_t capacity, std::int32_t head_dim) {
  stride_dim dims[3] = {{l.stride_seq, num_seqs, "stride_seq"},
                        {l.stride_head, num_heads, "stride_head"},
                        {l.stride_slot, capacity, "stride_slot"}};
  return require_disjoint_rows(where, dims, head_dim);
}

template <class Where>
std::int64_t require_layout(const Where& where, const paged_layout& l, std::int32_t num_seqs,
                            std::int32_t num_heads, std::int32_t capacity, std::int32_t head_dim) {
  require_not_null(where, "layout.page_table", l.page_table);
  require_positive(where, "layout.page_size", l.page_size);
  require_positive(where, "layout.num_pages", l.num_pages);
  if (std::int64_t{l.max_pages_per_seq} * l.page_size < capacity)
    fail<invalid_argument>(where, "capacity", "= ", capacity, " exceeds max_pages_per_seq * page_size = ",
                           std::int64_t{l.max_pages_per_seq} * l.page_size);
  if (num_seqs > 1 && l.page_table_stride < l.max_pages_per_seq)
    fail<invalid_argument>(where, "layout.page_table_stride", "= ", l.page_table_stride,
                           " makes page-table rows overlap (max_pages_per_seq = ", l.max_pages_per_seq, ")");
  stride_dim dims[3] = {{l.stride_page, l.num_pages, "stride_page"},
                        {l.stride_head, num_heads, "stride_head"},
                        {l.stride_slot, l.page_size, "stride_slot"}};
  return require_disjoint_rows(where, dims, head_dim);
}

// K and V may share one allocation (interleaved [..][2][..] buffers) as long
// as no K row overlaps a V row: then v - k is one more disjoint dimension.
template <class Where, class T, class Layout>
void require_disjoint_kv(const Where& where, const kv_view<T, Layout>& view, std::int64_t span) {
  const auto k = reinterpret_cast<std::uintptr_t>(view.k), v = reinterpret_cast<std::uintptr_t>(view.v);
  const std::uintptr_t bytes = static_cast<std::uintptr_t>(span) * sizeof(T);
  if (k + bytes <= v || v + bytes <= k) return;  // separate ranges
  const std::uintptr_t gap = k < v ? v - k : k - v;
  bool ok = gap % sizeof(T) == 0 && gap != 0;
  if (ok) {
    const auto& l = view.layout;
    std::int64_t unused = 0;
    if constexpr (std::is_same_v<Layout, paged_layout>) {
      stride_dim dims[4] = {{l.stride_page, l.num_pages, ""}, {l.stride_head, view.num_heads, ""},
                            {l.stride_slot, l.page_size, ""}, {std::int64_t(gap / sizeof(T)), 2, ""}};
      ok = first_overlap(dims, view.head_dim, unused) < 0;
    } else {
      stride_dim dims[4] = {{l.stride_seq, view.num_seqs, ""}, {l.stride_head, view.num_heads, ""},
                            {l.stride_slot, view.capacity, ""}, {std::int64_t(gap / sizeof(T)), 2, ""}};
      ok = first_overlap(dims, view.head_dim, unused) < 0;
    }
  }
  if (!ok) fail<invalid_argument>(where, "view.v", "overlaps view.k (rows of one would alias rows of the other)");
}

// An fp8 cache comes with both scale arrays, a float cache with neither:
// their values are checked where keys are read (bad_kv_scale), since on a
// GPU they live in device memory.
template <class Where, class T, class Layout>
void require_scale_pointers(const Where& where, const kv_view<T, Layout>& view) {
  const kv_scales& s = view.scales;
  if constexpr (is_fp8_v<std::remove_cv_t<T>>) {
    require_not_null(where, "view.scales.k", s.k);
    require_not_null(where, "view.scales.v", s.v);
    if (s.per_head != 0 && s.per_head != 1)
      fail<invalid_argument>(where, "view.scales.per_head", "= ", s.per_head,
                             " is neither 0 (one scale per layer) nor 1 (one per KV head)");
  } else if (s.k || s.v || s.per_head) {
    fail<invalid_argument>(where, "view.scales", "are set for a float cache: scales belong to fp8 caches");
  }
}

}  // namespace detail

/// Throws unless `view` is usable: non-null buffers, positive shape, strides
/// that keep rows disjoint (K and V rows included), scale arrays exactly
/// for fp8 caches. Page ids are checked where
/// rows are touched (require_row), since engines may leave unused page-table
/// entries unset.
template <class Where, class T, class Layout>
void validate(const Where& where, const kv_view<T, Layout>& view) {
  detail::require_not_null(where, "view.k", view.k);
  detail::require_not_null(where, "view.v", view.v);
  detail::require_positive(where, "view.num_seqs", view.num_seqs);
  detail::require_positive(where, "view.num_heads", view.num_heads);
  detail::require_positive(where, "view.capacity", view.capacity);
  detail::require_positive(where, "view.head_dim", view.head_dim);
  const std::int64_t span =
      detail::require_layout(where, view.layout, view.num_seqs, view.num_heads, view.capacity, view.head_dim);
  detail::require_disjoint_kv(where, view, span);
  detail::require_scale_pointers(where, view);
}

/// Throws unless (b, h, s) is inside the view and, for a paged view, its page
/// id is inside the pool.
template <class Where, class T, class Layout>
void require_row(const Where& where, const kv_view<T, Layout>& view, std::int32_t b, std::int32_t h,
                 std::int32_t s) {
  detail::require_index(where, "sequence", b, view.num_seqs);
  detail::require_index(where, "head", h, view.num_heads);
  detail::require_index(where, "slot", s, view.capacity);
  if constexpr (std::is_same_v<Layout, paged_layout>) {
    const std::int32_t page = view.layout.page_id(b, s);
    if (page < 0 || page >= view.layout.num_pages)
      detail::fail<out_of_range>(where, detail::concat("page_table[", b, "][", s / view.layout.page_size, "]"),
                                 "= ", page, " is outside [0, ", view.layout.num_pages, ")");
  }
}

/// Whether slot s of sequence b maps to memory of the view: always for a
/// strided view; for a paged one, when its page id is inside the pool. The
/// unchecked form for kernels, which report instead of throwing.
template <class T, class Layout>
KVEVICT_HOST_DEVICE bool row_is_mapped(const kv_view<T, Layout>& view, std::int32_t b, std::int32_t s) noexcept {
  if constexpr (std::is_same_v<Layout, paged_layout>) {
    const std::int32_t page = view.layout.page_id(b, s);
    return page >= 0 && page < view.layout.num_pages;
  } else {
    (void)view, (void)b, (void)s;
    return true;
  }
}

/// Which scale of head h makes its keys and values unreadable as numbers:
/// 0 when an fp8 cache's K scale is not positive and finite, 1 for its V
/// scale, else -1 (always for a float cache). Every path that reads keys
/// or values checks it per head before reading one.
template <class T, class Layout>
KVEVICT_HOST_DEVICE std::int32_t bad_kv_scale(const kv_view<T, Layout>& view, std::int32_t h) noexcept {
  if (!is_valid_kv_scale(view.k_scale(h))) return 0;  // a float cache's scales are 1
  if (!is_valid_kv_scale(view.v_scale(h))) return 1;
  return -1;
}

/// The same as sequence b's status word: bad_kv_scale with index 0 (K) or 1
/// (V), or batch_status_clear.
template <class T, class Layout>
KVEVICT_HOST_DEVICE std::uint64_t kv_scale_problem(const kv_view<T, Layout>& view, std::int32_t b,
                                                   std::int32_t h) noexcept {
  const std::int32_t bad = bad_kv_scale(view, h);
  return bad < 0 ? batch_status_clear : pack_status(b, h, bad, batch_code::bad_kv_scale);
}

/// Throws invalid_argument naming view.scales.k[h] (or .v) unless head h's
/// fp8 scales are positive and finite: the per-sequence API's check, where
/// the scales are host memory.
template <class Where, class T, class Layout>
void require_kv_scales(const Where& where, const kv_view<T, Layout>& view, std::int32_t h) {
  const std::int32_t bad = bad_kv_scale(view, h);
  if (bad < 0) return;
  const std::int32_t i = view.scales.index(h);
  detail::fail<invalid_argument>(where, detail::concat(bad == 0 ? "view.scales.k[" : "view.scales.v[", i, "]"), "= ",
                                 bad == 0 ? view.scales.k[i] : view.scales.v[i],
                                 " is not a positive finite scale (an fp8 code's value is code x scale)");
}

/// For a paged view: throws unless the pages holding slots [0, slots) of
/// sequence b are distinct, since moving rows between two slots that share a
/// page id would overwrite one with the other. Strided views always pass.
template <class Where, class T, class Layout>
void require_distinct_pages(const Where& where, const kv_view<T, Layout>& view, std::int32_t b, std::int32_t slots) {
  if constexpr (std::is_same_v<Layout, paged_layout>) {
    const std::int32_t n = pages_for(slots, view.layout.page_size);
    std::vector<std::int32_t> ids(static_cast<std::size_t>(n));  // validation of prefill/compaction, not decode
    for (std::int32_t i = 0; i < n; ++i) ids[std::size_t(i)] = view.layout.page_table[b * view.layout.page_table_stride + i];
    std::sort(ids.begin(), ids.end());
    const auto dup = std::adjacent_find(ids.begin(), ids.end());
    if (dup != ids.end())
      detail::fail<invalid_argument>(where, detail::concat("page_table[", b, "]"), "holds page id ", *dup,
                                     " twice among its first ", n, " pages");
  } else {
    (void)where, (void)view, (void)b, (void)slots;
  }
}

}  // namespace kvevict
