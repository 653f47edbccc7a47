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

#include "kvevict/dtype/convert.hpp"
#include "kvevict/error.hpp"
#include "kvevict/order.hpp"
#include "kvevict/policy/leave_one_out.hpp"
#include "kvevict/policy/policy_base.hpp"

namespace kvevict {

struct exact_greedy_config {
  std::int32_t budget = 0;
  std::int32_t recent = 0;  ///< newest positions never evicted
  std::int32_t sinks = 0;   ///< first positions never evicted
};

class exact_greedy_policy;

template <>
struct policy_traits<exact_greedy_policy> {
  using config_type = exact_greedy_config;
  static constexpr const char* name = "exact_greedy_policy";
  static constexpr bool has_streams = false;
  static constexpr bool has_history = true;

  /// Validates `c` and returns the rule: the lowest (error, position) among
  /// the unprotected, the error being the score an observe wrote.
  static decode_rule rule(const exact_greedy_config& c, const char* function = "constructor") {
    const detail::site w{name, function};
    if (c.recent < 0) detail::fail<budget_error>(w, "config.recent", "= ", c.recent, " is negative");
    if (c.sinks < 0) detail::fail<budget_error>(w, "config.sinks", "= ", c.sinks, " is negative");
    if (std::int64_t{c.sinks} + c.recent >= c.budget)
      detail::fail<budget_error>(w, "config.sinks + config.recent", "= ", std::int64_t{c.sinks} + c.recent,
                                 " leaves no evictable token within budget = ", c.budget);
    decode_rule r;
    r.victim = victim_rule::lowest_score;
    r.protect = {c.sinks, c.recent};
    r.budget = c.budget;
    return r;
  }
};

class exact_greedy_policy : public policy_base<exact_greedy_policy> {
 public:
  exact_greedy_policy(const policy_shape& shape, const exact_greedy_config& config)
      : policy_base("exact_greedy_policy", shape, policy_traits<exact_greedy_policy>::rule(config)),
        config_(config),
        hist_k_(std::size_t(shape.num_seqs) * shape.num_kv_heads),
        hist_v_(hist_k_.size()),
        scales_(std::size_t(shape.num_seqs), 1.0f),
        members_(std::size_t(shape.capacity)),
        member_slots_(std::size_t(shape.capacity)),
        errors_(std::size_t(shape.capacity)) {}

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
    detail::require_policy_view(w, this->shape(), view);
    require_head_dim(w, view.head_dim);
    detail::require_decode_queries(w, this->shape(), in, view.head_dim);
    const std::int32_t len = slots_.length(b);
    // Every token appended since the last observe joins the history now;
    // each is still cached, since the protocol refuses eviction before an
    // observe (and skip_observe does not exist here).
    for (std::int32_t h = 0; h < shape_.num_kv_heads; ++h)
      for (std::int32_t p = history_length(b, h); p < len; ++p)
        require_finite_row(w, view, b, h, slots_.slot_of(b, h, p));
    head_dim_ = view.head_dim;
    for (std::int32_t h = 0; h < shape_.num_kv_heads; ++h)
      for (std::int32_t p = history_length(b, h); p < len; ++p) record(view, b, h, p, slots_.slot_of(b, h, p));
    load_queries(b, in.q);
    scales_[std::size_t(b)] = in.scale;
    for (std::int32_t h = 0; h < shape_.num_kv_heads; ++h) evaluate(b, h);
    unobserved_[std::size_t(b)] = 0;
  }

  /// No opt-out: the oracle scores each step with that step's queries, and a
  /// skipped step would leave the new token unscored.
  void skip_observe(std::int32_t b) = delete;

  /// Compresses a prompt of `length` tokens (position p in slot p) by greedy
  /// removal, one token at a time, judged with the last prompt row's
  /// queries; then compacts.
  template <class Q, class T, class Layout>
  prefill_result prefill(std::int32_t b, std::int32_t length, const decode_queries<Q>& last_row,
                         const kv_view<T, Layout>& view) {
    const detail::site w = where("prefill");
    require_prefill(w, b, length);
    detail::require_policy_view(w, this->shape(), view);
    require_head_dim(w, view.head_dim);
    detail::require_decode_queries(w, this->shape(), last_row, view.head_dim);
    for (std::int32_t h = 0; h < shape_.num_kv_heads; ++h)
      for (std::int32_t p = 0; p < length; ++p) require_finite_row(w, view, b, h, p);
    require_distinct_pages(w, view, b, length);  // before the history changes: commit_prefill cannot fail after
    head_dim_ = view.head_dim;
    for (std::int32_t h = 0; h < shape_.num_kv_heads; ++h)
      for (std::int32_t p = 0; p < length; ++p) record(view, b, h, p, p);
    load_queries(b, last_row.q);
    scales_[std::size_t(b)] = last_row.scale;
    std::fill(scratch_.begin(), scratch_.end(), 0.0f);
    return commit_prefill(w, b, length, &view);
  }

  /// evict_to, greedily: one victim at a time, the leave-one-out errors of
  /// the tokens left recomputed (with the sequence's last observed queries
  /// and scale) before each victim, so an evict since the observe is
  /// accounted for. Right after an observe the first round re-scores the
  /// same set to the same bits: the first victim is evict's.
  std::int32_t free_surplus(std::int32_t b, std::int32_t h, std::int32_t target) {
    const std::int32_t surplus = slots_.count(b, h) - target;
    for (std::int32_t round = 0; round < surplus; ++round) {
      evaluate(b, h);
      const std::int32_t s = choose_victim(b, h);  // target >= sinks + recent: one exists
      slots_.positions_of(b, h)[s] = -1;
      mutable_scores(b, h)[s] = 0.0f;
    }
    return std::max(surplus, 0);
  }

  /// policy_base::reset hook: forget the history too.
  void on_reset(std::int32_t b) noexcept {
    for (std::int32_t h = 0; h < shape_.num_kv_heads; ++h) {
      hist_k_[std::size_t(head_index(b, h))].clear();
      hist_v_[std::size_t(head_index(b, h))].clear();
    }
  }

  /// Rows of (b, h)'s history: every position it has seen.
  std::int32_t history_length(std::int32_t b, std::int32_t h) const noexcept {
    return head_dim_ == 0 ? 0 : static_cast<std::int32_t>(hist_k_[std::size_t(head_index(b, h))].size() / head_dim_);
  }
  const float* history_keys(std::int32_t b, std::int32_t h) const noexcept {
    return hist_k_[std::size_t(head_index(b, h))].data();
  }
  const float* history_values(std::int32_t b, std::int32_t h) const noexcept {
    return hist_v_[std::size_t(head_index(b, h))].data();
  }

  /// Greedy removal over the prompt: evaluate every remaining token, drop the
  /// lowest (error, position) among the unprotected, until `budget` remain.
  void select_keep(std::int32_t b, std::int32_t h, std::int32_t length, const float*, std::int32_t,
                   std::int32_t* keep) const {
    std::int32_t n = length;
    for (std::int32_t p = 0; p < n; ++p) keep[p] = p;
    if (length <= rule_.budget) return;
    prepare(length);
    std::fill_n(cached_.begin(), length, static_cast<unsigned char>(1));
    while (n > rule_.budget) {
      group_errors(b, h, length, keep, n);
      std::int32_t victim = -1;
      std::uint64_t best = 0;
      for (std::int32_t i = 0; i < n; ++i) {
        const std::int32_t p = keep[i];
        if (p < config_.sinks || p >= length - config_.recent) continue;
        const std::uint64_t key = eviction_key(static_cast<float>(errors_[std::size_t(i)]), p);
        if (victim < 0 || key < best) {
          best = key;
          victim = i;
        }
      }
      cached_[std::size_t(keep[victim])] = 0;
      std::copy(keep + victim + 1, keep + n, keep + victim);
      --n;
    }
  }

 private:
  void require_head_dim(const detail::site& w, std::int32_t head_dim) const {
    if (head_dim_ != 0 && head_dim != head_dim_)
      detail::fail<invalid_argument>(w, "view.head_dim", "= ", head_dim, ", the history has ", head_dim_);
  }

  /// The row exists and holds finite K and V: a non-finite value would turn
  /// every error into NaN and the choice into noise.
  template <class T, class Layout>
  void require_finite_row(const detail::site& w, const kv_view<T, Layout>& view, std::int32_t b, std::int32_t h,
                          std::int32_t s) const {
    require_row(w, view, b, h, s);
    for (std::int32_t d = 0; d < view.head_dim; ++d) {
      detail::require_finite(w, "view.k", to_float(view.k_row(b, h, s)[d]), b, h, s, d);
      detail::require_finite(w, "view.v", to_float(view.v_row(b, h, s)[d]), b, h, s, d);
    }
  }

  template <class T, class Layout>
  void record(const kv_view<T, Layout>& view, std::int32_t b, std::int32_t h, std::int32_t position,
              std::int32_t slot) {
    std::vector<float>& k = hist_k_[std::size_t(head_index(b, h))];
    std::vector<float>& v = hist_v_[std::size_t(head_index(b, h))];
    k.resize(std::size_t(position + 1) * head_dim_);
    v.resize(k.size());
    const T* kr = view.k_row(b, h, slot);
    const T* vr = view.v_row(b, h, slot);
    for (std::int32_t d = 0; d < head_dim_; ++d) {
      k[std::size_t(position) * head_dim_ + d] = to_float(kr[d]);
      v[std::size_t(position) * head_dim_ + d] = to_float(vr[d]);
    }
  }

  template <class Q>
  void load_queries(std::int32_t b, const tensor_view<const Q, 2>& q) {
    queries_.resize(std::size_t(shape_.num_seqs) * shape_.num_q_heads * head_dim_);
    for (std::int32_t i = 0; i < shape_.num_q_heads; ++i)
      for (std::int32_t d = 0; d < head_dim_; ++d) queries_[query_offset(b, i) + d] = to_float(q(i, d));
  }
  std::size_t query_offset(std::int32_t b, std::int32_t q) const noexcept {
    return (std::size_t(b) * shape_.num_q_heads + q) * head_dim_;
  }

  /// Scratch for a history of `rows` rows (the oracle allocates as it grows).
  void prepare(std::int32_t rows) const {
    cached_.assign(std::size_t(rows), 0);
    work_.resize(leave_one_out_work_size(rows, head_dim_));
  }

  /// errors_[i] = E(members[i]) summed over the query heads of KV head h, in
  /// ascending query-head order; cached_ marks the members.
  void group_errors(std::int32_t b, std::int32_t h, std::int32_t rows, const std::int32_t* members,
                    std::int32_t n) const {
    const std::int32_t g = shape_.group_size();
    std::fill_n(errors_.begin(), n, 0.0);
    for (std::int32_t j = 0; j < g; ++j)
      leave_one_out_errors(queries_.data() + query_offset(b, h * g + j), 1, history_keys(b, h),
                           history_values(b, h), head_dim_, scales_[std::size_t(b)], rows, cached_.data(), members,
                           n, errors_.data(), work_.data());
  }

  /// Scores every cached slot of (b, h) with its eviction error.
  void evaluate(std::int32_t b, std::int32_t h) {
    const std::int32_t rows = history_length(b, h);
    prepare(rows);
    const std::int32_t* pos = slots_.positions_of(b, h);
    std::int32_t n = 0;
    for (std::int32_t s = 0; s < shape_.capacity; ++s)
      if (pos[s] >= 0) {
        members_[std::size_t(n)] = pos[s];
        member_slots_[std::size_t(n)] = s;
        cached_[std::size_t(pos[s])] = 1;
        ++n;
      }
    group_errors(b, h, rows, members_.data(), n);
    float* score = mutable_scores(b, h);
    for (std::int32_t i = 0; i < n; ++i)
      score[member_slots_[std::size_t(i)]] = static_cast<float>(errors_[std::size_t(i)]);
  }

  exact_greedy_config config_;
  std::vector<std::vector<float>> hist_k_, hist_v_;  // [B * Hkv][position][head_dim]
  std::vector<float> queries_;                       // [B][Hq][head_dim]: each sequence's last query rows
  std::vector<float> scales_;                        // [B]: the softmax scale they came with (evict_to re-scores)
  std::vector<std::int32_t> members_, member_slots_;  // cached positions of one (b, h) and their slots
  mutable std::vector<double> errors_, work_;         // [capacity] errors, leave-one-out scratch
  mutable std::vector<unsigned char> cached_;         // [history rows] 1 for the cached positions
  std::int32_t head_dim_ = 0;
};

}  // namespace kvevict
