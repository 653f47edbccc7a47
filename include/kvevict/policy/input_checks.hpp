#pragma once
// The checks of a score input (score_inputs.hpp) that name what they
// refuse: an extent, a NaN or infinite element, a negative probability, a
// scale. Every call checks before it commits, which is how the strong
// guarantee holds; a name is built only when a check fails, so checking
// allocates nothing.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>

#include "kvevict/dtype/convert.hpp"
#include "kvevict/error.hpp"
#include "kvevict/kv_view.hpp"
#include "kvevict/policy/decode_rules.hpp"
#include "kvevict/score_inputs.hpp"
#include "kvevict/tensor_checks.hpp"
#include "kvevict/tensor_view.hpp"

namespace kvevict {
namespace detail {

/// Throws non_finite_error naming arg[i][j]... unless x is finite. The name
/// is built only on failure, so validation allocates nothing.
template <class Where, class... Index>
void require_finite(const Where& where, const char* arg, float x, Index... index) {
  if (std::isfinite(x)) return;
  std::string name = arg;
  ((name += concat("[", index, "]")), ...);
  fail<non_finite_error>(where, name, "is ", std::isnan(x) ? "NaN" : (x > 0 ? "inf" : "-inf"));
}

/// Throws for a probability that is not finite or is negative (out of line:
/// the prefill loops call require_probability per element).
template <class Where, class... Index>
KVEVICT_NOINLINE void fail_probability(const Where& where, const char* arg, float x, Index... index) {
  require_finite(where, arg, x, index...);
  std::string name = arg;
  ((name += concat("[", index, "]")), ...);
  fail<invalid_argument>(where, name, "= ", x, " is negative");
}

/// A probability (or a sum of them) must be finite and not negative.
template <class Where, class... Index>
inline void require_probability(const Where& where, const char* arg, float x, Index... index) {
  if (x >= 0.0f && x <= std::numeric_limits<float>::max()) return;  // NaN fails the first test
  fail_probability(where, arg, x, index...);
}

/// Throws for the bad input a fold_group reported at query head q, column c.
template <class Where>
[[noreturn]] void fail_input(const Where& where, const char* arg, const slot_increment& inc, float x, std::int32_t c) {
  if (inc.code == batch_code::negative_probability) {
    fail<invalid_argument>(where, concat(arg, "[", inc.query, "][", c, "]"), "= ", x, " is negative");
  }
  require_finite(where, arg, x, inc.query, c);
  fail<invalid_argument>(where, concat(arg, "[", inc.query, "][", c, "]"), "= ", x, " is not a valid input");
}

/// A data pointer, the extents expected (exactly, or at least where
/// at_least[d]) and strides as require_strides wants.
template <class Where, class V>
void require_extents(const Where& where, const char* arg, const V& view, const std::int32_t* expected,
                     const bool* at_least) {
  require_not_null(where, arg, view.data);
  for (int d = 0; d < V::rank; ++d) {
    const bool ok = at_least[d] ? view.extents[d] >= expected[d] : view.extents[d] == expected[d];
    if (!ok)
      fail<invalid_argument>(where, concat(arg, ".extents[", d, "]"), "= ", view.extents[d], ", expected ",
                             at_least[d] ? "at least " : "", expected[d]);
  }
  require_strides(where, arg, view);
}

template <class Where, class Q>
void require_queries(const Where& where, const char* arg, const tensor_view<const Q, 2>& q) {
  for (std::int32_t i = 0; i < q.extents[0]; ++i)
    for (std::int32_t d = 0; d < q.extents[1]; ++d)
      require_finite(where, arg, to_float(q(i, d)), i, d);
}

template <class Where>
void require_scale(const Where& where, float scale) {
  if (!std::isfinite(scale) || scale <= 0.0f)
    fail<invalid_argument>(where, "scale", "= ", scale, " must be finite and positive");
}

}  // namespace detail
}  // namespace kvevict
