#pragma once
// Compaction: move the kept rows of one (sequence, KV head) to slots
// [0, n) in the given order (docs/semantics.md, "Decode cycle": prefill
// compression).
//
// When the sources are strictly increasing (the prefill case: positions were
// written in slot order and keep sets are sorted by position) row i comes from
// a slot >= i, so a forward pass is safe in place. Any other order goes
// through caller-provided workspace; kvevict allocates nothing here.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "kvevict/error.hpp"
#include "kvevict/kv_view.hpp"

namespace kvevict {

/// Elements of T the workspace of a compaction of n rows needs when its
/// sources are not increasing (K and V rows of n slots).
inline std::size_t compaction_workspace_elements(std::int32_t n, std::int32_t head_dim) noexcept {
  return std::size_t(2) * std::size_t(n) * std::size_t(head_dim);
}

namespace detail {

inline bool strictly_increasing(const std::int32_t* v, std::int32_t n) noexcept {
  for (std::int32_t i = 1; i < n; ++i)
    if (v[i] <= v[i - 1]) return false;
  return true;
}

// The unchecked move, for callers that validated already (the policies).
template <class T, class Layout>
void compact_rows(const kv_view<T, Layout>& view, std::int32_t b, std::int32_t h, const std::int32_t* src,
                  std::int32_t n, T* workspace) {
  const std::int32_t d = view.head_dim;
  if (strictly_increasing(src, n)) {
    for (std::int32_t i = 0; i < n; ++i) {
      if (src[i] == i) continue;
      std::copy_n(view.k_row(b, h, src[i]), d, view.k_row(b, h, i));
      std::copy_n(view.v_row(b, h, src[i]), d, view.v_row(b, h, i));
    }
    return;
  }
  for (std::int32_t i = 0; i < n; ++i) {
    std::copy_n(view.k_row(b, h, src[i]), d, workspace + 2 * std::size_t(i) * d);
    std::copy_n(view.v_row(b, h, src[i]), d, workspace + (2 * std::size_t(i) + 1) * d);
  }
  for (std::int32_t i = 0; i < n; ++i) {
    std::copy_n(workspace + 2 * std::size_t(i) * d, d, view.k_row(b, h, i));
    std::copy_n(workspace + (2 * std::size_t(i) + 1) * d, d, view.v_row(b, h, i));
  }
}

}  // namespace detail

/// Moves rows src[0..n) of (b, h) to slots [0, n), keeping their order.
/// Sources must be distinct slots. If they are not strictly increasing,
/// `workspace` must hold compaction_workspace_elements(n, head_dim) elements.
/// Validates everything before moving anything.
template <class T, class Layout>
void compact(const kv_view<T, Layout>& view, std::int32_t b, std::int32_t h, const std::int32_t* src,
             std::int32_t n, T* workspace = nullptr) {
  constexpr const char* where = "compact";
  validate(where, view);
  detail::require_index(where, "sequence", b, view.num_seqs);
  detail::require_index(where, "head", h, view.num_heads);
  if (n < 0 || n > view.capacity)
    detail::fail<out_of_range>(where, "n", "= ", n, " is outside [0, ", view.capacity, "]");
  if (n > 0) detail::require_not_null(where, "src", src);
  std::vector<bool> used(std::size_t(view.capacity), false);  // validation only, not the policies' path
  for (std::int32_t i = 0; i < n; ++i) {
    if (src[i] < 0 || src[i] >= view.capacity)
      detail::fail<out_of_range>(where, detail::concat("src[", i, "]"), "= ", src[i], " is outside [0, ",
                                 view.capacity, ")");
    require_row(where, view, b, h, src[i]);
    require_row(where, view, b, h, i);
    if (used[std::size_t(src[i])])
      detail::fail<invalid_argument>(where, detail::concat("src[", i, "]"), "= ", src[i], " is repeated");
    used[std::size_t(src[i])] = true;
  }
  if (!detail::strictly_increasing(src, n)) detail::require_not_null(where, "workspace", workspace);
  std::int32_t highest = n - 1;
  for (std::int32_t i = 0; i < n; ++i) highest = std::max(highest, src[i]);
  require_distinct_pages(where, view, b, highest + 1);
  detail::compact_rows(view, b, h, src, n, workspace);
}

}  // namespace kvevict
