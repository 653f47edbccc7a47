#pragma once
// Scatter: write one new token's K and V rows into the slot each KV head
// chose for it (docs/semantics.md, decode cycle step 2). Engines with their own append kernel do
// not need this; it exists so that a host engine or a test can run the whole
// decode cycle with kvevict alone, for every dtype and layout.
#include <algorithm>
#include <cstdint>

#include "kvevict/error.hpp"
#include "kvevict/kv_view.hpp"
#include "kvevict/tensor_checks.hpp"
#include "kvevict/tensor_view.hpp"

namespace kvevict {

/// For every KV head h of sequence b: K row -> k_new(h, :), V row -> v_new(h, :)
/// at slot slots[h]. k_new and v_new are [num_heads][head_dim] with any strides
/// (the last one must be 1). Validates everything before writing anything.
template <class T, class Layout>
void scatter(const kv_view<T, Layout>& view, std::int32_t b, const std::int32_t* slots,
             tensor_view<const T, 2> k_new, tensor_view<const T, 2> v_new) {
  constexpr const char* where = "scatter";
  validate(where, view);
  detail::require_index(where, "sequence", b, view.num_seqs);
  detail::require_not_null(where, "slots", slots);
  const tensor_view<const T, 2>* rows[2] = {&k_new, &v_new};
  const char* names[2] = {"k_new", "v_new"};
  for (int i = 0; i < 2; ++i) {
    detail::require_not_null(where, names[i], rows[i]->data);
    if (rows[i]->extents[0] != view.num_heads || rows[i]->extents[1] != view.head_dim)
      detail::fail<invalid_argument>(where, names[i], "has shape [", rows[i]->extents[0], "][", rows[i]->extents[1],
                                     "], expected [", view.num_heads, "][", view.head_dim, "]");
    if (rows[i]->strides[1] != 1)
      detail::fail<invalid_argument>(where, detail::concat(names[i], ".strides[1]"), "= ", rows[i]->strides[1],
                                     ", rows must be contiguous");
    detail::require_strides(where, names[i], *rows[i]);
  }
  for (std::int32_t h = 0; h < view.num_heads; ++h) {
    if (slots[h] < 0 || slots[h] >= view.capacity)  // the name is built only on failure
      detail::fail<out_of_range>(where, detail::concat("slots[", h, "]"), "= ", slots[h], " is outside [0, ",
                                 view.capacity, ")");
    require_row(where, view, b, h, slots[h]);
  }
  for (std::int32_t h = 0; h < view.num_heads; ++h) {
    std::copy_n(&k_new(h, 0), view.head_dim, view.k_row(b, h, slots[h]));
    std::copy_n(&v_new(h, 0), view.head_dim, view.v_row(b, h, slots[h]));
  }
}

}  // namespace kvevict
