#pragma once
// The O(1) check of a tensor_view argument (an engine's input array) that
// does not depend on what the call expects: its strides. The extents are
// compared by each caller (require_extents in policy/input_checks.hpp,
// scatter), which then calls this.
#include <cstddef>
#include <cstdint>

#include "kvevict/error.hpp"
#include "kvevict/tensor_view.hpp"

namespace kvevict {
namespace detail {

/// Strides that step through memory, as a kv_view layout's must: none
/// negative (it would read before the data pointer), none 0 on a dimension
/// of extent above 1 (its elements would alias), and the last element's
/// offset within PTRDIFF_MAX bytes. That the buffer holds that many
/// elements cannot be checked.
template <class Where, class V>
void require_strides(const Where& where, const char* arg, const V& view) {
  constexpr std::int64_t limit = PTRDIFF_MAX / std::int64_t{sizeof(typename V::element_type)};
  std::int64_t reach = 0;  // the last element's offset, in elements
  for (int d = 0; d < V::rank; ++d) {
    const std::int64_t stride = view.strides[d], steps = std::int64_t{view.extents[d]} - 1;
    if (stride < 0) fail<invalid_argument>(where, concat(arg, ".strides[", d, "]"), "= ", stride, " is negative");
    if (steps <= 0) continue;
    if (stride == 0)
      fail<invalid_argument>(where, concat(arg, ".strides[", d, "]"), "= 0 on a dimension of extent ",
                             view.extents[d], " (its elements would alias)");
    if (stride > (limit - reach) / steps)
      fail<invalid_argument>(where, concat(arg, ".strides[", d, "]"), "= ", stride, " over extent ",
                             view.extents[d], " puts elements beyond the address range");
    reach += stride * steps;
  }
}

}  // namespace detail
}  // namespace kvevict
