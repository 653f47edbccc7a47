#pragma once
// Exact greedy: the oracle that bounds how good a one-token-per-step policy
// can be (docs/policies.md). Each step it evicts the token whose removal
// changes the attention output least, measured against attention over the
// whole history and summed over the query heads of the group
// (leave_one_out.hpp). The error, rounded to float, is the token's score, and
// the victim is the lowest (score, position) among the unprotected, as for
// every policy. It keeps a float copy of every K/V row it has seen, so it
// saves no memory: it exists for tests and research, not for serving.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "kvevict/batch/evict_to.hpp"
#include "kvevict/batch/host_backend.hpp"
#include "kvevict/batch/prefill_exact_greedy.hpp"
#include "kvevict/dtype/convert.hpp"
#include "kvevict/error.hpp"
#include "kvevict/order.hpp"
#include "kvevict/policy/leave_one_out.hpp"
#include "kvevict/policy/configs.hpp"
#include "kvevict/policy/policy_base.hpp"

namespace kvevict {

class exact_greedy_policy : public policy_base<exact_greedy_policy> {
 public:
  exact_greedy_policy(const policy_shape& shape, const exact_greedy_config& config)
      : policy_base(shape, policy_traits<exact_greedy_policy>::rule(config)),
        config_(config),
        scales_(std::size_t(shape.num_seqs), 1.0f) {}

  const exact_greedy_config& config() const noexcept { return config_; }

  /// Reads the K/V rows of the tokens appended since the last observe (one,
  /// or several after a multi-token append) from `view` into the history and
  /// scores every cached token with the error its eviction would cause for
  /// the queries in.q (in.lse is not used). Call once per step, after append
  /// and before evict.
  template <class Q, class T, class Layout>
  void observe(std::int32_t b, const decode_queries<Q>& in, const kv_view<T, Layout>& view) {
    const detail::site w = where("observe");
    require_observable(w, b);
    detail::require_policy_view(w, shape(), view);
    require_head_dim(w, view.head_dim);
    detail::require_decode_queries(w, shape(), in, view.head_dim);
    // Every token appended since the last observe joins the history now;
    // each is still cached, since the protocol refuses eviction before an
    // observe (and skip_observe does not exist here).
    const std::int32_t len = slots().length(b);
    for (std::int32_t h = 0; h < shape().num_kv_heads; ++h)
      for (std::int32_t p = history_length(b, h); p < len; ++p)
        require_finite_row(w, view, b, h, slots().slot_of(b, h, p));
    state_.require_history(w, view.head_dim, len);
    const batch_queries<Q> queries = as_batch(in, shape().num_seqs);
    observe_heads(
        b,
        [&](std::int32_t h, std::int32_t& victim, float* staged) {
          return detail::exact_greedy_head(state(), b, h, queries, view, victim, staged);
        },
        [&](std::uint64_t word) { detail::throw_status(w, word, false); });
    for (std::int32_t h = 0; h < shape().num_kv_heads; ++h) detail::commit_history(state(), b, h);
    keep_queries(b, in);
  }

  /// No opt-out: the oracle scores each step with that step's queries, and a
  /// skipped step would leave the new token unscored.
  void skip_observe(std::int32_t b) = delete;

  /// Compresses a prompt of `length` tokens (position p in slot p) by greedy
  /// removal, one token at a time, judged with the last prompt row's
  /// queries; then compacts. The batched twin is batched_prefill with
  /// batch_queries (batch/prefill_exact_greedy.hpp), which this runs.
  template <class Q, class T, class Layout>
  prefill_result prefill(std::int32_t b, std::int32_t length, const decode_queries<Q>& last_row,
                         const kv_view<T, Layout>& view) {
    const detail::site w = where("prefill");
    require_prefill(w, b, length);
    detail::require_policy_view(w, shape(), view);
    require_head_dim(w, view.head_dim);
    detail::require_decode_queries(w, shape(), last_row, view.head_dim);
    for (std::int32_t h = 0; h < shape().num_kv_heads; ++h)
      for (std::int32_t p = 0; p < length; ++p) require_finite_row(w, view, b, h, p);
    require_distinct_pages(w, view, b, length);
    state_.require_history(w, view.head_dim, length);
    const batch_queries<Q> queries = as_batch(last_row, shape().num_seqs);
    const prefill_result r = run_one(
        w, b, length,
        [&](const prompt_lengths& prompts, std::int32_t* pages, std::uint64_t* status) {
          detail::run_prefill(state(), active_set::of_list(&b, 1), prompts, queries, view, pages, status);
        },
        [](std::int32_t, std::int32_t) {});
    keep_queries(b, last_row);
    return r;
  }

  /// evict_to, greedily: one victim at a time, the leave-one-out errors of
  /// the tokens left recomputed (with the sequence's last observed queries
  /// and scale) before each victim, so an evict since the observe is
  /// accounted for. Right after an observe the first round re-scores the
  /// same set to the same bits: the first victim is evict's.
  template <class T, class Layout>
  std::int32_t evict_to(std::int32_t b, std::int32_t target, const kv_view<T, Layout>& view) {
    const batch_queries<float> queries = kept_queries(where("evict_to"), b);
    return evict_to_rows(b, target, view, [&](std::int32_t seq, std::int32_t h) {
      return detail::greedy_victims(state(), seq, h, target, queries);
    });
  }
  std::int32_t evict_to(std::int32_t b, std::int32_t target, slot_move* moves, std::int32_t* move_counts) {
    const batch_queries<float> queries = kept_queries(where("evict_to"), b);
    return evict_to_moves(b, target, moves, move_counts, [&](std::int32_t seq, std::int32_t h) {
      return detail::greedy_victims(state(), seq, h, target, queries);
    });
  }

  /// Rows of (b, h)'s history: every position it has seen.
  std::int32_t history_length(std::int32_t b, std::int32_t h) const noexcept {
    const history_view& hv = state().history;
    return hv.rows ? hv.rows[state().head_index(b, h)] : 0;
  }
  const float* history_keys(std::int32_t b, std::int32_t h) const noexcept {
    const history_view& hv = state().history;
    return hv.keys ? hv.keys + state().head_index(b, h) * hv.max_tokens * hv.head_dim : nullptr;
  }
  const float* history_values(std::int32_t b, std::int32_t h) const noexcept {
    const history_view& hv = state().history;
    return hv.values ? hv.values + state().head_index(b, h) * hv.max_tokens * hv.head_dim : nullptr;
  }

 private:
  void require_head_dim(const detail::site& w, std::int32_t head_dim) const {
    const std::int32_t have = state().history.head_dim;
    if (state().history.keys && head_dim != have)
      detail::fail<invalid_argument>(w, "view.head_dim", "= ", head_dim, ", the history has ", have);
  }

  /// The row exists and holds finite K and V: a non-finite value would turn
  /// every error into NaN and the choice into noise.
  template <class T, class Layout>
  void require_finite_row(const detail::site& w, const kv_view<T, Layout>& view, std::int32_t b, std::int32_t h,
                          std::int32_t s) const {
    require_row(w, view, b, h, s);
    require_kv_scales(w, view, h);
    const float k_scale = view.k_scale(h), v_scale = view.v_scale(h);
    for (std::int32_t d = 0; d < view.head_dim; ++d) {
      detail::require_finite(w, "view.k", kv_value(view.k_row(b, h, s)[d], k_scale), b, h, s, d);
      detail::require_finite(w, "view.v", kv_value(view.v_row(b, h, s)[d], v_scale), b, h, s, d);
    }
  }

  /// Sequence b's queries and scale, for evict_to's re-scoring.
  template <class Q>
  void keep_queries(std::int32_t b, const decode_queries<Q>& in) {
    const std::int32_t d = in.q.extents[1], hq = shape().num_q_heads;
    queries_.resize(std::size_t(shape().num_seqs) * hq * d);
    for (std::int32_t q = 0; q < hq; ++q)
      for (std::int32_t i = 0; i < d; ++i) queries_[(std::size_t(b) * hq + q) * d + i] = to_float(in.q(q, i));
    scales_[std::size_t(b)] = in.scale;
  }
  batch_queries<float> kept_queries(const detail::site& w, std::int32_t b) const {
    detail::require_index(w, "sequence", b, shape().num_seqs);  // before reading b's scale
    const std::int32_t d = state().history.head_dim;
    batch_queries<float> in;
    in.q = make_tensor_view<const float>(queries_.data(), shape().num_seqs, shape().num_q_heads, d);
    in.scale = scales_[std::size_t(b)];
    return in;
  }

  exact_greedy_config config_;
  std::vector<float> queries_;  // [B][Hq][head_dim]: each sequence's last queries, for evict_to
  std::vector<float> scales_;   // [B]: the softmax scale they came with
};

}  // namespace kvevict
