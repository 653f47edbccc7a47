#pragma once
// The argument checks of the per-sequence policies (protocol.hpp) that need
// only the policy's shape: the cache view, a step's or a prompt's queries
// and LSE, SnapKV's window inputs, a (sequence, head) index. Each throws a
// kvevict::error naming the argument before anything changes.
#include <cstdint>

#include "kvevict/error.hpp"
#include "kvevict/kv_view.hpp"
#include "kvevict/policy/policy_shape.hpp"
#include "kvevict/policy/input_checks.hpp"
#include "kvevict/score_inputs.hpp"
#include "kvevict/tensor_view.hpp"

namespace kvevict {
namespace detail {

/// A cache view the policy can use: valid, with the policy's sequences and
/// KV heads, and at least its capacity.
template <class T, class Layout>
void require_policy_view(const site& w, const policy_shape& shape, const kv_view<T, Layout>& view) {
  validate(w, view);
  if (view.num_seqs != shape.num_seqs)
    fail<invalid_argument>(w, "view.num_seqs", "= ", view.num_seqs, ", the policy has ", shape.num_seqs);
  if (view.num_heads != shape.num_kv_heads)
    fail<invalid_argument>(w, "view.num_heads", "= ", view.num_heads, ", the policy has ", shape.num_kv_heads,
                           " KV heads");
  if (view.capacity < shape.capacity)
    fail<invalid_argument>(w, "view.capacity", "= ", view.capacity, " is below the policy's capacity ",
                           shape.capacity);
}

/// A decode step's queries [num_q_heads][head_dim], finite, and its scale.
template <class Q>
void require_decode_queries(const site& w, const policy_shape& shape, const decode_queries<Q>& in,
                            std::int32_t head_dim) {
  const std::int32_t eq[2] = {shape.num_q_heads, head_dim};
  const bool exact[2] = {false, false};
  require_extents(w, "q", in.q, eq, exact);
  require_queries(w, "q", in.q);
  require_scale(w, in.scale);
}

/// A decode step's LSE [num_q_heads], finite.
inline void require_decode_lse(const site& w, const policy_shape& shape, const tensor_view<const float, 1>& lse) {
  const std::int32_t el[1] = {shape.num_q_heads};
  const bool exact[1] = {false};
  require_extents(w, "lse", lse, el, exact);
  for (std::int32_t q = 0; q < shape.num_q_heads; ++q) require_finite(w, "lse", lse(q), q);
}

/// A prompt's queries [num_q_heads][length][head_dim] and LSE
/// [num_q_heads][length], every element finite, its scale and LSE base.
template <class Q>
void require_prefill_queries(const site& w, const policy_shape& shape, const prefill_queries<Q>& in,
                             std::int32_t length, std::int32_t head_dim) {
  const std::int32_t eq[3] = {shape.num_q_heads, length, head_dim};
  const bool at_least[3] = {false, true, false};
  require_extents(w, "q", in.q, eq, at_least);
  const std::int32_t el[2] = {shape.num_q_heads, length};
  require_extents(w, "lse", in.lse, el, at_least);
  require_scale(w, in.scale);
  require_lse_base(w, "base", in.base);
  for (std::int32_t q = 0; q < shape.num_q_heads; ++q)
    for (std::int32_t i = 0; i < length; ++i) {
      require_finite(w, "lse", in.lse(q, i), q, i);
      for (std::int32_t d = 0; d < head_dim; ++d) require_finite(w, "q", to_float(in.q(q, i, d)), q, i, d);
    }
}

/// SnapKV: the prompt must hold the observation window.
inline void require_window_length(const site& w, std::int32_t length, const snap_window& snap) {
  if (length < snap.window)
    fail<out_of_range>(w, "length", "= ", length, " is below in.snap.window = ", snap.window,
                       ": the observation window is longer than the prompt");
}

/// SnapKV: a window input's extents [Hq][window][last] (at least `last`
/// when last_at_least).
template <class V>
void require_window_rows(const site& w, const char* arg, const V& view, const policy_shape& shape,
                         std::int32_t window, std::int32_t last, bool last_at_least) {
  const std::int32_t expected[3] = {shape.num_q_heads, window, last};
  const bool at_least[3] = {false, false, last_at_least};
  require_extents(w, arg, view, expected, at_least);
}

/// SnapKV: the window rows' LSE, [Hq][window], finite.
inline void require_window_lse(const site& w, const tensor_view<const float, 2>& lse, const policy_shape& shape,
                               std::int32_t window) {
  const std::int32_t expected[2] = {shape.num_q_heads, window};
  const bool exact[2] = {false, false};
  require_extents(w, "lse", lse, expected, exact);
  for (std::int32_t q = 0; q < shape.num_q_heads; ++q)
    for (std::int32_t r = 0; r < window; ++r) require_finite(w, "lse", lse(q, r), q, r);
}

/// A (sequence, KV head) index pair of the policy.
inline void require_head(const site& w, const policy_shape& shape, std::int32_t b, std::int32_t h) {
  require_index(w, "sequence", b, shape.num_seqs);
  require_index(w, "head", h, shape.num_kv_heads);
}

}  // namespace detail
}  // namespace kvevict
