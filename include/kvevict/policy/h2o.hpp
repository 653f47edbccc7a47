#pragma once
// H2O, "Heavy-Hitter Oracle" (Zhang et al., NeurIPS 2023): keep the `heavy`
// tokens with the highest accumulated attention plus the `recent` newest.
//
// Decode: once a sequence holds sinks + heavy + recent + 1 tokens, the
// victim is the lowest (score, position) among tokens outside the sinks and
// the recent window. This is exactly the reference "real drop" (re-select
// top-heavy + last recent every step), because the recent window slides by
// one token per step.
//
// `decay` generalises the accumulation (updated_score): each step a score
// becomes decay * score + the step's attention. 1 is H2O; 0 is TOVA (Oren
// et al., 2024: keep the tokens the current query attends to most); values
// between are an exponential moving attention. At prefill the prompt row i
// of L weighs decay^(L - 1 - i), the same sum the decode steps would give
// (docs/semantics.md, "Scores").
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "kvevict/error.hpp"
#include "kvevict/order.hpp"
#include "kvevict/policy/key_diff.hpp"
#include "kvevict/policy/key_diff_anchor.hpp"
#include "kvevict/policy/policy_base.hpp"
#include "kvevict/policy/prefill_scores.hpp"
#include "kvevict/policy/snapkv.hpp"

namespace kvevict {

struct h2o_config {
  std::int32_t heavy = 0;   ///< tokens kept by accumulated score
  std::int32_t recent = 0;  ///< newest tokens always kept (the newest included)
  group_reduce reduce = group_reduce::sum;
  float decay = 1.0f;       ///< gamma in [0, 1]: 1 accumulates (H2O), 0 is TOVA
  std::int32_t sinks = 0;   ///< first positions always kept (attention sinks)

  /// sinks + heavy + recent, computed in 64 bits (the constructor rejects overflow).
  std::int64_t budget() const noexcept { return std::int64_t{sinks} + heavy + recent; }
};

/// TOVA (Oren et al., "Transformers are Multi-State RNNs", 2024): h2o with
/// decay 0, so the victim is the token the newest query attends to least.
inline h2o_config tova_config(std::int32_t heavy, std::int32_t recent = 0, std::int32_t sinks = 0,
                              group_reduce reduce = group_reduce::mean) noexcept {
  h2o_config c;
  c.heavy = heavy;
  c.recent = recent;
  c.sinks = sinks;
  c.reduce = reduce;
  c.decay = 0.0f;
  return c;
}

/// Key-norm (Devoto et al., "A Simple and Effective L2 Norm-Based Strategy
/// for KV Cache Compression", 2024): h2o with decay 0 that observes
/// key_norms instead of attention, so it keeps the `kept` keys of the
/// smallest L2 norm beside the sinks and the recent window.
inline h2o_config key_norm_config(std::int32_t kept, std::int32_t recent = 0, std::int32_t sinks = 0) noexcept {
  h2o_config c;
  c.heavy = kept;
  c.recent = recent;
  c.sinks = sinks;
  c.decay = 0.0f;
  return c;
}

class h2o_policy;

template <>
struct policy_traits<h2o_policy> {
  using config_type = h2o_config;
  static constexpr const char* name = "h2o_policy";
  static constexpr bool has_streams = false;
  static constexpr bool has_history = false;

  /// Validates `c` and returns h2o's decode rule: the lowest (score,
  /// position) outside the `recent` newest.
  static decode_rule rule(const h2o_config& c, const char* function = "constructor") {
    const detail::site w{name, function};
    if (c.heavy < 0) detail::fail<budget_error>(w, "config.heavy", "= ", c.heavy, " is negative");
    if (c.recent < 0) detail::fail<budget_error>(w, "config.recent", "= ", c.recent, " is negative");
    if (c.sinks < 0) detail::fail<budget_error>(w, "config.sinks", "= ", c.sinks, " is negative");
    detail::require_group_reduce(w, "config.reduce", c.reduce);
    detail::require_decay(w, "config.decay", c.decay);
    decode_rule r;
    r.victim = victim_rule::lowest_score;
    r.protect = {c.sinks, c.recent};
    const std::int32_t kept = detail::budget_sum(w, "config.heavy + config.recent", c.heavy, c.recent);
    r.budget = detail::budget_sum(w, "config.sinks + config.heavy + config.recent", c.sinks, kept);
    r.reduce = c.reduce;
    r.decay = c.decay;
    return r;
  }
};

class h2o_policy : public policy_base<h2o_policy> {
 public:
  h2o_policy(const policy_shape& shape, const h2o_config& config)
      : policy_base("h2o_policy", shape, policy_traits<h2o_policy>::rule(config)), config_(config) {}

  const h2o_config& config() const noexcept { return config_; }

  /// window: a SnapKV prefill's observation window, kept beside `recent`.
  void select_keep(std::int32_t, std::int32_t, std::int32_t length, const float* score, std::int32_t window,
                   std::int32_t* keep) const {
    keep_top_keys(length, config_.sinks, std::max(config_.recent, window),
                  [score](std::int32_t p) { return eviction_key(score[p], p); }, keep);
  }

  using policy_base::observe;
  using policy_base::prefill;

  /// KeyDiff decode step (key_diff_anchor.hpp): every cached key's score
  /// becomes -cos(k, anchor), the anchor the running sum of the unit keys
  /// cached now (the new tokens added, O(head_dim) each; a fresh count
  /// after evict_to, prefill, reset or an evict on other scores), so the
  /// victim is the unprotected key most like the others. Needs decay 0
  /// (key_norm_config). Above the budget, the victims observe finds leave
  /// the anchor here: evict has no view to read their keys.
  template <class T, class Layout>
  void observe(std::int32_t b, const key_diff<T, Layout>& in) {
    const detail::site w = where("observe");
    require_observable(w, b);
    detail::require_policy_view(w, shape(), in.cache);
    detail::require_replacing_decay(w, "key_diff", true, rule().decay);
    const std::int32_t width = slots_.occupied_width(b), heads = shape().num_kv_heads, d = in.cache.head_dim;
    require_rows(w, in.cache, b, width, occupied(b));
    const key_anchor_view a = anchors_.sized(shape().num_seqs, heads, d);
    for (std::int32_t h = 0; h < heads; ++h) {
      const std::int32_t* pos = slots_.positions_of(b, h);
      const std::int32_t bad = detail::refresh_key_anchor(a, in.cache, b, h, pos, width, slots_.length(b));
      float* out = scratch_.data() + std::size_t(h) * shape().capacity;
      for (std::int32_t s = 0; s < width; ++s) {
        if (pos[s] < 0) continue;
        const float norm = key_length(in.cache.k_row(b, h, s), d);  // an old key too: the engine may overwrite it
        if (s == bad || !std::isfinite(norm))
          detail::fail_state<non_finite_error>(w, "||cache.k||[", h, "][", s, "] of sequence ", b,
                                               " is not finite: KeyDiff needs finite keys");
        out[s] = key_diff_score(in.cache.k_row(b, h, s), a.units_of(b, h), d, norm);
      }
    }
    commit_increments(w, b, width);
    if (slots_.count(b, 0) <= budget() || !victims_found_[std::size_t(b)]) return;
    for (std::int32_t h = 0; h < heads; ++h) {
      const std::int32_t victim = found_victims_[std::size_t(head_index(b, h))];
      if (victim >= 0) remove_from_key_anchor(a, in.cache, b, h, victim);
    }
    anchors_.expect_eviction(b);
  }

  void on_cached_change(std::int32_t b, cached_change c) noexcept { anchors_.changed(b, c); }

  /// KeyDiff prefill (key_diff.hpp): position p scores -cos(k_p, anchor),
  /// the anchor the sum of the unit prompt keys of its head; the least
  /// similar keys are kept beside the sinks and the recent tokens. No
  /// attention input. Every prompt key must be finite.
  template <class T, class Layout>
  prefill_result prefill(std::int32_t b, std::int32_t length, const key_diff<T, Layout>& in) {
    const detail::site w = where("prefill");
    require_prefill(w, b, length);
    detail::require_policy_view(w, shape(), in.cache);
    require_rows(w, in.cache, b, length, all_columns());
    std::vector<std::int64_t> sums(std::size_t(in.cache.head_dim));
    std::vector<float> unit(std::size_t(in.cache.head_dim));
    for (std::int32_t h = 0; h < shape().num_kv_heads; ++h) {
      const std::int32_t bad = detail::key_diff_scores(in.cache, b, h, length, sums.data(), unit.data(),
                                                       scratch_.data() + std::size_t(h) * shape().capacity);
      if (bad >= 0)
        detail::fail_state<non_finite_error>(w, "||cache.k||[", h, "][", bad, "] of sequence ", b,
                                             " is not finite: KeyDiff needs finite prompt keys");
    }
    return commit_prefill(w, b, length, &in.cache);
  }

  /// SnapKV prefill (snapkv.hpp): scores from the attention of the last
  /// in.snap.window prompt rows, pooled along positions; the window is kept
  /// beside the sinks and the recent tokens, the rest of the budget by score.
  template <class T, class Layout>
  prefill_result prefill(std::int32_t b, std::int32_t length, const window_probs& in, const kv_view<T, Layout>& view) {
    const detail::site w = snap_call(b, length, in.snap, view);
    detail::score_prefill(w, shape(), group(), rule().decay, length, in, scratch_.data(), shape().capacity);
    return commit_prefill(w, b, length, &view, in.snap.window);
  }

  /// The same from the window rows' logits and LSE.
  template <class T, class Layout>
  prefill_result prefill(std::int32_t b, std::int32_t length, const window_logits& in, const kv_view<T, Layout>& view) {
    const detail::site w = snap_call(b, length, in.snap, view);
    detail::score_prefill(w, shape(), group(), rule().decay, length, in, scratch_.data(), shape().capacity);
    return commit_prefill(w, b, length, &view, in.snap.window);
  }

  /// The same from the window rows' queries and LSE and the keys in slots
  /// [0, L) of `view` (O(window * L * head_dim) per query head).
  template <class Q, class T, class Layout>
  prefill_result prefill(std::int32_t b, std::int32_t length, const window_queries<Q>& in,
                         const kv_view<T, Layout>& view) {
    const detail::site w = snap_call(b, length, in.snap, view);
    require_rows(w, view, b, length, all_columns());
    detail::score_prefill(w, shape(), group(), rule().decay, b, length, in, view, scratch_.data(), shape().capacity);
    return commit_prefill(w, b, length, &view, in.snap.window);
  }

 private:
  /// The checks every SnapKV prefill starts with; its site.
  template <class T, class Layout>
  detail::site snap_call(std::int32_t b, std::int32_t length, const snap_window& snap,
                         const kv_view<T, Layout>& view) const {
    const detail::site w = where("prefill");
    require_prefill(w, b, length);
    detail::require_policy_view(w, shape(), view);
    detail::require_snap_window(w, "in.snap", snap, rule());
    return w;
  }

  h2o_config config_;
  key_anchor_store anchors_;  // KeyDiff's, sized by its first observe
};

}  // namespace kvevict
