#pragma once
// kv_view: a non-owning, trivially copyable view of an engine's K and V
// buffers for one layer, in any dtype and layout. kvevict never allocates or
// frees this memory; it only reads rows (scores from logits) and moves rows
// (scatter, compaction).
#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "kvevict/config.hpp"
#include "kvevict/error.hpp"
#include "kvevict/layout.hpp"

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

  KVEVICT_HOST_DEVICE T* k_row(std::int32_t b, std::int32_t h, std::int32_t s) const noexcept {
    return k + layout.row_offset(b, h, s);
  }
  KVEVICT_HOST_DEVICE T* v_row(std::int32_t b, std::int32_t h, std::int32_t s) const noexcept {
    return v + layout.row_offset(b, h, s);
  }
};

template <class T>
using strided_kv_view = kv_view<T, strided_layout>;
template <class T>
using paged_kv_view = kv_view<T, paged_layout>;

static_assert(std::is_trivially_copyable_v<kv_view<float, strided_layout>>, "views go to kernels by value");
static_assert(std::is_trivially_copyable_v<kv_view<float, paged_layout>>, "views go to kernels by value");

namespace detail {

// Rows of distinct (h, s) (and pages) must not overlap: with the dimensions
// sorted by stride, each stride must be at least the span of everything
// inside it. This is the usual sufficient test for an injective strided map.
template <class Where>
void require_disjoint_rows(const Where& where, const char* what, std::int32_t head_dim,
                                  std::int64_t stride_a, std::int32_t extent_a, const char* name_a,
                                  std::int64_t stride_b, std::int32_t extent_b, const char* name_b) {
  struct dim {
    std::int64_t stride;
    std::int32_t extent;
    const char* name;
  };
  dim dims[2] = {{stride_a, extent_a, name_a}, {stride_b, extent_b, name_b}};
  if (dims[0].stride > dims[1].stride) std::swap(dims[0], dims[1]);
  std::int64_t span = head_dim;
  for (const dim& d : dims) {
    if (d.extent > 1 && d.stride < span)
      fail<invalid_argument>(where, concat(what, ".", d.name), "= ", d.stride,
                             " makes rows overlap (needs at least ", span, " elements)");
    span = std::max(span, d.stride * (d.extent - 1) + span);
  }
}

template <class Where>
void require_layout(const Where& where, const strided_layout& l, std::int32_t num_seqs,
                           std::int32_t num_heads, std::int32_t capacity, std::int32_t head_dim) {
  if (l.stride_seq < 0 || l.stride_head < 0 || l.stride_slot < 0)
    fail<invalid_argument>(where, "layout", "has a negative stride");
  require_disjoint_rows(where, "layout", head_dim, l.stride_head, num_heads, "stride_head", l.stride_slot,
                        capacity, "stride_slot");
  const std::int64_t per_seq = std::max(l.stride_head * (num_heads - 1) + l.stride_slot * (capacity - 1) + head_dim,
                                        std::int64_t{head_dim});
  if (num_seqs > 1 && l.stride_seq < per_seq)
    fail<invalid_argument>(where, "layout.stride_seq", "= ", l.stride_seq,
                           " makes sequences overlap (needs at least ", per_seq, ")");
}

template <class Where>
void require_layout(const Where& where, const paged_layout& l, std::int32_t /*num_seqs*/,
                           std::int32_t num_heads, std::int32_t capacity, std::int32_t head_dim) {
  require_not_null(where, "layout.page_table", l.page_table);
  require_positive(where, "layout.page_size", l.page_size);
  require_positive(where, "layout.num_pages", l.num_pages);
  if (l.stride_page < 0 || l.stride_head < 0 || l.stride_slot < 0 || l.page_table_stride < 0)
    fail<invalid_argument>(where, "layout", "has a negative stride");
  if (std::int64_t{l.max_pages_per_seq} * l.page_size < capacity)
    fail<invalid_argument>(where, "capacity", "= ", capacity, " exceeds max_pages_per_seq * page_size = ",
                           std::int64_t{l.max_pages_per_seq} * l.page_size);
  require_disjoint_rows(where, "layout", head_dim, l.stride_head, num_heads, "stride_head", l.stride_slot,
                        l.page_size, "stride_slot");
  const std::int64_t per_page = l.stride_head * (num_heads - 1) + l.stride_slot * (l.page_size - 1) + head_dim;
  if (l.num_pages > 1 && l.stride_page < per_page)
    fail<invalid_argument>(where, "layout.stride_page", "= ", l.stride_page,
                           " makes pages overlap (needs at least ", per_page, ")");
}

/// Elements from a buffer's start to the end of its last row.
inline std::int64_t span_elements(const strided_layout& l, std::int32_t num_seqs, std::int32_t num_heads,
                                  std::int32_t capacity, std::int32_t head_dim) noexcept {
  return l.stride_seq * (num_seqs - 1) + l.stride_head * (num_heads - 1) + l.stride_slot * (capacity - 1) + head_dim;
}
inline std::int64_t span_elements(const paged_layout& l, std::int32_t, std::int32_t num_heads, std::int32_t,
                                  std::int32_t head_dim) noexcept {
  return l.stride_page * (l.num_pages - 1) + l.stride_head * (num_heads - 1) + l.stride_slot * (l.page_size - 1) +
         head_dim;
}

}  // namespace detail

/// Throws unless `view` is usable: non-null buffers, positive shape, strides
/// that keep rows disjoint. Page ids are checked where rows are touched
/// (require_row), since engines may leave unused page-table entries unset.
template <class Where, class T, class Layout>
void validate(const Where& where, const kv_view<T, Layout>& view) {
  detail::require_not_null(where, "view.k", view.k);
  detail::require_not_null(where, "view.v", view.v);
  detail::require_positive(where, "view.num_seqs", view.num_seqs);
  detail::require_positive(where, "view.num_heads", view.num_heads);
  detail::require_positive(where, "view.capacity", view.capacity);
  detail::require_positive(where, "view.head_dim", view.head_dim);
  detail::require_layout(where, view.layout, view.num_seqs, view.num_heads, view.capacity, view.head_dim);
  // K and V must not share memory, or moving one would corrupt the other.
  const auto bytes = static_cast<std::uintptr_t>(
      detail::span_elements(view.layout, view.num_seqs, view.num_heads, view.capacity, view.head_dim) * sizeof(T));
  const auto k = reinterpret_cast<std::uintptr_t>(view.k), v = reinterpret_cast<std::uintptr_t>(view.v);
  if (k < v + bytes && v < k + bytes)
    detail::fail<invalid_argument>(where, "view.v", "overlaps view.k (each spans ", bytes, " bytes)");
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

}  // namespace kvevict
