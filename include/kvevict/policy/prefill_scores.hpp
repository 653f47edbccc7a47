#pragma once
// The per-sequence prefill scores (docs/semantics.md, "Scores": prefill):
// out[h * stride + p] for every KV head h and prompt position p in [0, L),
// from each prefill input, validated element by element (a bad element
// throws, naming it, before anything is committed). The policies'
// prefill overloads (policy_base.hpp, h2o.hpp) call these, then select
// and compact. The sums follow the canonical orders of column_sums.hpp and
// snapkv.hpp, and the group fold is fold_group, as on every backend.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "kvevict/error.hpp"
#include "kvevict/kv_view.hpp"
#include "kvevict/policy/column_sums.hpp"
#include "kvevict/policy/decode_rules.hpp"
#include "kvevict/policy/policy_shape.hpp"
#include "kvevict/policy/score_increments.hpp"
#include "kvevict/policy/sequence_checks.hpp"
#include "kvevict/policy/snapkv.hpp"
#include "kvevict/score_inputs.hpp"

namespace kvevict {
namespace detail {

inline auto every_column() noexcept {
  return [](std::int32_t, std::int32_t) { return true; };
}

/// From the causal probability matrix [Hq][>= L][>= L].
template <class Where>
void score_prefill(const Where& w, const group_info& g, float decay, std::int32_t length, const prefill_probs& in,
                   float* out, std::int64_t stride) {
  const std::int32_t expected[3] = {g.num_kv_heads * g.group_size, length, length};
  const bool at_least[3] = {false, true, true};
  require_extents(w, "probs", in.probs, expected, at_least);
  reduce_groups(
      w, "column sums of probs", g, length, every_column(),
      [&](std::int32_t q, std::int32_t p) {
        return prefill_column_sum(p, length, [&](std::int32_t i) {
          const float x = in.probs(q, i, p);
          require_probability(w, "probs", x, q, i, p);
          return decayed_row(decay, length, i, x);
        });
      },
      out, stride);
}

/// From column sums the engine computed, [Hq][>= L].
template <class Where>
void score_prefill(const Where& w, const group_info& g, std::int32_t length, const prefill_column_sums& in,
                   float* out, std::int64_t stride) {
  const std::int32_t expected[2] = {g.num_kv_heads * g.group_size, length};
  const bool at_least[2] = {false, true};
  require_extents(w, "sums", in.sums, expected, at_least);
  reduce_groups(
      w, "sums", g, length, every_column(), [&](std::int32_t q, std::int32_t p) { return in.sums(q, p); }, out, stride);
}

/// From every prompt row's query and LSE and the keys in slots [0, L) of
/// sequence b (O(L^2 * head_dim) per query head). The caller checked the
/// queries (require_prefill_queries) and the rows.
template <class Where, class Q, class T, class Layout>
void score_prefill(const Where& w, const group_info& g, float decay, std::int32_t b, std::int32_t length,
                   const prefill_queries<Q>& in, const kv_view<T, Layout>& view, float* out, std::int64_t stride) {
  reduce_groups(
      w, "column sums from (q, lse)", g, length, every_column(),
      [&](std::int32_t q, std::int32_t p) {
        const auto* key = view.k_row(b, q / g.group_size, p);
        return prefill_column_sum(p, length, [&](std::int32_t i) {
          const float logit = attention_logit(&in.q(q, i, 0), in.q.strides[2], key, view.head_dim);
          return decayed_row(decay, length, i, probability_from_logit(logit, in.scale, in.lse(q, i), in.base));
        });
      },
      out, stride);
}

// ---- SnapKV (snapkv.hpp) ----

/// The prompt must hold the observation window.
template <class Where>
void require_window_length(const Where& w, std::int32_t length, const snap_window& snap) {
  if (length < snap.window)
    fail<out_of_range>(w, "length", "= ", length, " is below in.snap.window = ", snap.window,
                       ": the observation window is longer than the prompt");
}

/// A window input's extents [Hq][window][...] and LSE [Hq][window], finite.
template <class Where, class V>
void require_window_rows(const Where& w, const char* arg, const V& view, const policy_shape& shape,
                         std::int32_t window, std::int32_t last, bool last_at_least) {
  const std::int32_t expected[3] = {shape.num_q_heads, window, last};
  const bool at_least[3] = {false, false, last_at_least};
  require_extents(w, arg, view, expected, at_least);
}

template <class Where>
void require_window_lse(const Where& w, const tensor_view<const float, 2>& lse, const policy_shape& shape,
                        std::int32_t window) {
  const std::int32_t expected[2] = {shape.num_q_heads, window};
  const bool exact[2] = {false, false};
  require_extents(w, "lse", lse, expected, exact);
  for (std::int32_t q = 0; q < shape.num_q_heads; ++q)
    for (std::int32_t r = 0; r < window; ++r) require_finite(w, "lse", lse(q, r), q, r);
}

/// SnapKV scores from element(q, r, p), the probability of window row r
/// (prompt row L - window + r) on position p, validated by the caller; the
/// sums a row at a time (add_window_row: snap_column_sum's order).
template <class Where, class Element>
void score_snap(const Where& w, const group_info& g, float decay, std::int32_t length, const snap_window& snap,
                Element element, float* out, std::int64_t stride) {
  const std::int32_t heads = g.num_kv_heads * g.group_size, first = length - snap.window;
  std::vector<float> sums(std::size_t(heads) * std::size_t(length));  // prefill allocates: not the decode path
  for (std::int32_t q = 0; q < heads; ++q)
    for (std::int32_t i = first; i < length; ++i)
      add_window_row(sums.data() + std::size_t(q) * length, i, first, row_decay(decay, length, i),
                     [&](std::int32_t p) { return element(q, i - first, p); });
  reduce_groups(
      w, "pooled window sums", g, length, every_column(),
      [&](std::int32_t q, std::int32_t p) {
        const float* row = sums.data() + std::size_t(q) * length;
        return snap_pool(snap, p, length, [row](std::int32_t j) { return row[j]; });
      },
      out, stride);
}

template <class Where>
void score_prefill(const Where& w, const policy_shape& shape, const group_info& g, float decay, std::int32_t length,
                   const window_probs& in, float* out, std::int64_t stride) {
  require_window_length(w, length, in.snap);
  require_window_rows(w, "probs", in.probs, shape, in.snap.window, length, true);
  score_snap(
      w, g, decay, length, in.snap,
      [&](std::int32_t q, std::int32_t r, std::int32_t p) {
        const float x = in.probs(q, r, p);
        require_probability(w, "probs", x, q, r, p);
        return x;
      },
      out, stride);
}

template <class Where>
void score_prefill(const Where& w, const policy_shape& shape, const group_info& g, float decay, std::int32_t length,
                   const window_logits& in, float* out, std::int64_t stride) {
  require_window_length(w, length, in.snap);
  require_window_rows(w, "logits", in.logits, shape, in.snap.window, length, true);
  require_window_lse(w, in.lse, shape, in.snap.window);
  require_scale(w, in.scale);
  require_lse_base(w, "base", in.base);
  score_snap(
      w, g, decay, length, in.snap,
      [&](std::int32_t q, std::int32_t r, std::int32_t p) {
        const float logit = in.logits(q, r, p);
        require_finite(w, "logits", logit, q, r, p);
        const float x = probability_from_logit(logit, in.scale, in.lse(q, r), in.base);
        require_probability(w, "probs from (logits, lse)", x, q, r, p);
        return x;
      },
      out, stride);
}

/// The keys of sequence b, slots [0, L): the caller checked the rows.
template <class Where, class Q, class T, class Layout>
void score_prefill(const Where& w, const policy_shape& shape, const group_info& g, float decay, std::int32_t b,
                   std::int32_t length, const window_queries<Q>& in, const kv_view<T, Layout>& view, float* out,
                   std::int64_t stride) {
  require_window_length(w, length, in.snap);
  require_window_rows(w, "q", in.q, shape, in.snap.window, view.head_dim, false);
  require_window_lse(w, in.lse, shape, in.snap.window);
  require_scale(w, in.scale);
  require_lse_base(w, "base", in.base);
  for (std::int32_t q = 0; q < shape.num_q_heads; ++q)
    for (std::int32_t r = 0; r < in.snap.window; ++r)
      for (std::int32_t d = 0; d < view.head_dim; ++d) require_finite(w, "q", to_float(in.q(q, r, d)), q, r, d);
  score_snap(
      w, g, decay, length, in.snap,
      [&](std::int32_t q, std::int32_t r, std::int32_t p) {
        const float logit =
            attention_logit(&in.q(q, r, 0), in.q.strides[2], view.k_row(b, q / g.group_size, p), view.head_dim);
        const float x = probability_from_logit(logit, in.scale, in.lse(q, r), in.base);
        require_probability(w, "probs from (q, lse)", x, q, r, p);
        return x;
      },
      out, stride);
}

}  // namespace detail
}  // namespace kvevict
