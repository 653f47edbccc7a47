#pragma once
// The O(1) argument checks of a segmented selection that the host
// (select/segmented_select.hpp) and the CUDA launcher both make.
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

}  // namespace detail
}  // namespace kvevict
