#pragma once
// Turning each score input (score_inputs.hpp) into one float per
// (KV head, slot): the GQA group reduction (decode_rules.hpp), with
// validation that names the offending element.
//
// Results go to a caller buffer first and are committed only when every value
// has been checked, which is how observe/prefill keep the strong guarantee.
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

struct group_info {
  std::int32_t num_kv_heads;
  std::int32_t group_size;
  group_reduce reduce;
};

/// Throws non_finite_error naming arg[i][j]... unless x is finite. The name
/// is built only on failure, so validation allocates nothing.
template <class Where, class... Index>
void require_finite(const Where& where, const char* arg, float x, Index... index) {
  if (std::isfinite(x)) return;
  std::string name = arg;
  ((name += concat("[", index, "]")), ...);
  fail<non_finite_error>(where, name, "is ", std::isnan(x) ? "NaN" : (x > 0 ? "inf" : "-inf"));
}

/// Key-norm increments of sequence b: key_norm_score of the cached key of
/// every wanted (h, s) into out[h * stride + s]; a norm that is not finite
/// (a NaN or infinite element, or squares that overflow) is named by its
/// (head, slot) as "-||cache.k||[h][s]".
template <class Where, class T, class Layout, class Wanted>
void key_norm_increments(const Where& where, const kv_view<T, Layout>& view, std::int32_t b, std::int32_t width,
                         Wanted wanted, float* out, std::int32_t stride) {
  for (std::int32_t h = 0; h < view.num_heads; ++h)
    for (std::int32_t s = 0; s < width; ++s)
      if (wanted(h, s)) {
        const float x = key_norm_score(view.k_row(b, h, s), view.head_dim);
        require_finite(where, "-||cache.k||", x, h, s);
        out[std::size_t(h) * stride + s] = x;
      }
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

/// out[h * out_stride + c] = reduce over the query heads q of group h of
/// value(q, c), for every column c with wanted(h, c), by fold_group (the
/// rule every backend shares). value() returns a probability mass; it is
/// validated there and reported under the name `arg`.
template <class Where, class Wanted, class Value>
void reduce_groups(const Where& where, const char* arg, const group_info& g, std::int32_t columns, Wanted wanted,
                   Value value, float* out, std::int64_t out_stride) {
  for (std::int32_t h = 0; h < g.num_kv_heads; ++h) {
    float* row = out + h * out_stride;
    for (std::int32_t c = 0; c < columns; ++c) {
      if (!wanted(h, c)) continue;
      const slot_increment inc =
          fold_group(h * g.group_size, g.group_size, g.reduce, true, [&](std::int32_t q) { return value(q, c); });
      if (inc.code != batch_code::ok) fail_input(where, arg, inc, value(inc.query, c), c);
      // Finite elements can still sum past FLT_MAX: refuse, as for the score.
      if (!std::isfinite(inc.value))
        fail<non_finite_error>(where, concat(arg, "[", h * g.group_size, "..", (h + 1) * g.group_size - 1, "][", c, "]"),
                               "overflows to ", inc.value, " when reduced over the query heads of KV head ", h);
      row[c] = inc.value;
    }
  }
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
