#pragma once
// Exact greedy: the oracle that bounds how good a one-token-per-step policy
// can be (DESIGN §6). Each step it evicts the token whose removal changes the
// attention output least, measured against attention over the whole history
// and summed over the query heads of the group; ties as in DESIGN §5 (the
// older token first). It keeps a float copy of every K/V row it has seen, so
// it saves no memory: it exists for tests and research, not for serving.
#include <algorithm>
#include <cstdint>
#include <limits>
#include <numeric>
#include <vector>

#include "kvevict/dtype/convert.hpp"
#include "kvevict/error.hpp"
#include "kvevict/policy/leave_one_out.hpp"
#include "kvevict/policy/policy_base.hpp"

namespace kvevict {

struct exact_greedy_config {
  std::int32_t budget = 0;
  std::int32_t recent = 0;  ///< newest positions never evicted
};

class exact_greedy_policy : public policy_base<exact_greedy_policy> {
 public:
  exact_greedy_policy(const policy_shape& shape, const exact_greedy_config& config)
      : policy_base("exact_greedy_policy", shape, checked(config).budget, group_reduce::sum),
        config_(config),
        hist_k_(std::size_t(shape.num_seqs) * shape.num_kv_heads),
        hist_v_(hist_k_.size()),
        errors_(std::size_t(shape.num_seqs) * shape.num_kv_heads * shape.capacity, 0.0),
        observed_(std::size_t(shape.num_seqs), 0) {}

  const exact_greedy_config& config() const noexcept { return config_; }

  /// Reads the newest token's K/V rows from `view` into the history and
  /// evaluates, for every cached token, the error its eviction would cause
  /// for the queries in.q (in.lse is not used). Call once per step, after
  /// append and before evict.
  template <class Q, class T, class Layout>
  void observe(std::int32_t b, const decode_queries<Q>& in, const kv_view<T, Layout>& view) {
    const detail::site w = where("observe");
    require_decoding(w, b);
    require_view(w, view);
    require_head_dim(w, view.head_dim);
    require_decode_queries(w, in, view.head_dim);
    const std::int32_t len = slots_.length(b);
    for (std::int32_t h = 0; h < shape_.num_kv_heads; ++h) {
      const std::int32_t rows = history_length(b, h);
      if (rows < len - 1)
        detail::fail_state<state_error>(w, "sequence ", b, " has ", len, " tokens but only ", rows,
                                        " were observed; observe must run every step");
      if (rows == len - 1) require_finite_row(w, view, b, h, slots_.slot_of(b, h, len - 1));
    }
    head_dim_ = view.head_dim;
    for (std::int32_t h = 0; h < shape_.num_kv_heads; ++h)
      if (history_length(b, h) == len - 1) record(view, b, h, len - 1, slots_.slot_of(b, h, len - 1));
    load_queries(in.q);
    scale_ = in.scale;
    for (std::int32_t h = 0; h < shape_.num_kv_heads; ++h) evaluate(b, h);
    observed_[std::size_t(b)] = len;
  }

  /// Compresses a prompt of `length` tokens (position p in slot p) by greedy
  /// removal, judged with the last prompt row's queries, then compacts.
  template <class Q, class T, class Layout>
  prefill_result prefill(std::int32_t b, std::int32_t length, const decode_queries<Q>& last_row,
                         const kv_view<T, Layout>& view) {
    const detail::site w = where("prefill");
    require_prefill(w, b, length);
    require_view(w, view);
    require_head_dim(w, view.head_dim);
    require_decode_queries(w, last_row, view.head_dim);
    for (std::int32_t h = 0; h < shape_.num_kv_heads; ++h)
      for (std::int32_t p = 0; p < length; ++p) require_finite_row(w, view, b, h, p);
    head_dim_ = view.head_dim;
    for (std::int32_t h = 0; h < shape_.num_kv_heads; ++h)
      for (std::int32_t p = 0; p < length; ++p) record(view, b, h, p, p);
    load_queries(last_row.q);
    scale_ = last_row.scale;
    std::fill(scratch_.begin(), scratch_.end(), 0.0f);
    const prefill_result result = commit_prefill(w, b, length, &view);
    observed_[std::size_t(b)] = length;
    return result;
  }

  /// policy_base::evict hook: the errors must be those of this step.
  void check_evict(const detail::site& w, std::int32_t b) const {
    if (observed_[std::size_t(b)] != slots_.length(b))
      detail::fail_state<state_error>(w, "sequence ", b, " was not observed since its last append");
  }

  /// policy_base::reset hook: forget the history too.
  void on_reset(std::int32_t b) noexcept {
    for (std::int32_t h = 0; h < shape_.num_kv_heads; ++h) {
      hist_k_[std::size_t(head_index(b, h))].clear();
      hist_v_[std::size_t(head_index(b, h))].clear();
    }
    observed_[std::size_t(b)] = 0;
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
  /// The error evicting slot s would cause, from the last observe.
  double eviction_error(std::int32_t b, std::int32_t h, std::int32_t s) const noexcept {
    return errors_[std::size_t(head_index(b, h) * shape_.capacity + s)];
  }

  std::int32_t choose_victim(std::int32_t b, std::int32_t h) const {
    const std::int32_t* pos = slots_.positions_of(b, h);
    const double* err = errors_.data() + head_index(b, h) * shape_.capacity;
    const std::int32_t end = slots_.length(b) - config_.recent;
    std::int32_t victim = -1;
    for (std::int32_t s = 0; s < shape_.capacity; ++s) {
      if (pos[s] < 0 || pos[s] >= end) continue;
      if (victim < 0 || err[s] < err[victim] || (err[s] == err[victim] && pos[s] < pos[victim])) victim = s;
    }
    return victim;
  }

  /// Greedy removal over the prompt: one leave-one-out evaluation per token
  /// removed, until `budget` remain.
  void select_keep(std::int32_t b, std::int32_t h, std::int32_t length, const float*, std::int32_t* keep) const {
    std::int32_t n = length;
    for (std::int32_t p = 0; p < n; ++p) keep[p] = p;
    if (length <= budget_) return;
    const std::int32_t g = shape_.group_size();
    targets(b, h, length, g);
    std::vector<double>& err = err_buf_;
    while (n > budget_) {
      std::fill_n(err.begin(), n, 0.0);
      for (std::int32_t j = 0; j < g; ++j)
        add_leave_one_out_errors(query(h * g + j), history_keys(b, h), history_values(b, h), head_dim_, scale_, keep,
                                 n, target_.data() + std::size_t(j) * head_dim_, err.data(), work_.data());
      std::int32_t victim = -1;
      for (std::int32_t i = 0; i < n && keep[i] < length - config_.recent; ++i)
        if (victim < 0 || err[i] < err[victim]) victim = i;  // ascending positions: strict < keeps the older
      std::copy(keep + victim + 1, keep + n, keep + victim);
      --n;
    }
  }

 private:
  static const exact_greedy_config& checked(const exact_greedy_config& c) {
    const detail::site w{"exact_greedy_policy", "constructor"};
    if (c.recent < 0) detail::fail<budget_error>(w, "config.recent", "= ", c.recent, " is negative");
    if (c.recent >= c.budget)
      detail::fail<budget_error>(w, "config.recent", "= ", c.recent, " leaves no evictable token within budget = ",
                                 c.budget);
    return c;
  }

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
  void load_queries(const tensor_view<const Q, 2>& q) {
    queries_.resize(std::size_t(shape_.num_q_heads) * head_dim_);
    for (std::int32_t i = 0; i < shape_.num_q_heads; ++i)
      for (std::int32_t d = 0; d < head_dim_; ++d) queries_[std::size_t(i) * head_dim_ + d] = to_float(q(i, d));
  }

  const float* query(std::int32_t q) const noexcept { return queries_.data() + std::size_t(q) * head_dim_; }

  /// Full-history attention output of each query head of group h, and
  /// scratch sized for `members` rows.
  void targets(std::int32_t b, std::int32_t h, std::int32_t members, std::int32_t g) const {
    const std::int32_t rows = history_length(b, h);
    all_rows_.resize(std::size_t(rows));
    std::iota(all_rows_.begin(), all_rows_.end(), 0);
    work_.resize(leave_one_out_work_size(std::max(rows, members), head_dim_));
    err_buf_.resize(std::size_t(std::max(members, shape_.capacity)));
    target_.resize(std::size_t(g) * head_dim_);
    for (std::int32_t j = 0; j < g; ++j)
      attention_output(query(h * g + j), history_keys(b, h), history_values(b, h), head_dim_, scale_,
                       all_rows_.data(), rows, target_.data() + std::size_t(j) * head_dim_, work_.data());
  }

  /// Leave-one-out errors of every occupied slot of (b, h).
  void evaluate(std::int32_t b, std::int32_t h) {
    const std::int32_t* pos = slots_.positions_of(b, h);
    std::int32_t n = 0;
    for (std::int32_t s = 0; s < shape_.capacity; ++s)
      if (pos[s] >= 0) {
        order_[std::size_t(n)] = s;
        member_pos_[std::size_t(n)] = pos[s];
        ++n;
      }
    const std::int32_t g = shape_.group_size();
    targets(b, h, n, g);
    std::fill_n(err_buf_.begin(), n, 0.0);
    for (std::int32_t j = 0; j < g; ++j)
      add_leave_one_out_errors(query(h * g + j), history_keys(b, h), history_values(b, h), head_dim_, scale_,
                               member_pos_.data(), n, target_.data() + std::size_t(j) * head_dim_, err_buf_.data(),
                               work_.data());
    double* err = errors_.data() + head_index(b, h) * shape_.capacity;
    float* score = mutable_scores(b, h);
    std::fill_n(err, shape_.capacity, 0.0);
    for (std::int32_t i = 0; i < n; ++i) {
      err[order_[std::size_t(i)]] = err_buf_[std::size_t(i)];
      score[order_[std::size_t(i)]] = static_cast<float>(err_buf_[std::size_t(i)]);
    }
  }

  exact_greedy_config config_;
  std::vector<std::vector<float>> hist_k_, hist_v_;  // [B * Hkv][position][head_dim]
  std::vector<double> errors_;                       // [B][Hkv][capacity]
  std::vector<std::int32_t> observed_;               // length at the last observe, per sequence
  std::vector<float> queries_;                       // [Hq][head_dim]
  std::vector<std::int32_t> member_pos_ = std::vector<std::int32_t>(std::size_t(shape_.capacity));
  mutable std::vector<std::int32_t> all_rows_;
  mutable std::vector<double> work_, target_, err_buf_;
  std::int32_t head_dim_ = 0;
  float scale_ = 1.0f;
};

}  // namespace kvevict
