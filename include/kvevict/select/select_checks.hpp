#pragma once
// The O(1) argument checks of a segmented selection that the host
// (select/segmented_select.hpp) and the CUDA launcher both make: the end,
// and strides whose segment offsets fit in the address range. That the
// buffers hold num_segments rows of that stride cannot be checked.
#include <cstddef>
#include <cstdint>

#include "kvevict/error.hpp"
#include "kvevict/select/segments.hpp"

namespace kvevict {
namespace detail {

/// An end outside the enum was read as bottom.
template <class Where>
void require_select_end(const Where& where, select_end end) {
  if (end != select_end::top && end != select_end::bottom)
    fail<invalid_argument>(where, "end", "= ", static_cast<int>(end), " is not a select_end (top or bottom)");
}

/// Row i of `segments` rows starts at i * stride elements of `bytes` each
/// and holds `extent` of them: the stride must not be negative, and the
/// last row must end within PTRDIFF_MAX bytes (beyond it the offset wraps,
/// and a segment is read from another's memory).
template <class Where>
void require_row_stride(const Where& where, const char* arg, std::int64_t stride, std::int32_t segments,
                        std::int64_t extent, std::size_t bytes) {
  if (stride < 0) fail<invalid_argument>(where, arg, "= ", stride, " is negative");
  if (segments <= 1) return;
  const std::int64_t limit = PTRDIFF_MAX / static_cast<std::int64_t>(bytes);
  if (extent > limit || stride > (limit - extent) / (segments - 1))
    fail<invalid_argument>(where, arg, "= ", stride, ": segment ", segments - 1,
                           " would reach beyond the address range");
}

/// The strides of the keys and of the output; largest_k bounds every
/// segment's k (the host knows it, CUDA passes count.k or max_length).
template <class Where>
void require_select_strides(const Where& where, const segment_set& keys, std::int32_t largest_k,
                            const selection_output& out) {
  require_row_stride(where, "keys.stride", keys.stride, keys.num_segments, keys.max_length, sizeof(float));
  if (out.indices)
    require_row_stride(where, "out.index_stride", out.index_stride, keys.num_segments, largest_k,
                       sizeof(std::int32_t));
  if (out.mask) require_row_stride(where, "out.mask_stride", out.mask_stride, keys.num_segments, keys.max_length, 1);
}

}  // namespace detail
}  // namespace kvevict
