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

#include "kvevict/batch/host_backend.hpp"
#include "kvevict/batch/prefill_key_diff.hpp"
#include "kvevict/batch/prefill_window.hpp"
#include "kvevict/batch/score_sources.hpp"
#include "kvevict/error.hpp"
#include "kvevict/policy/key_diff.hpp"
#include "kvevict/policy/key_diff_anchor.hpp"
#include "kvevict/policy/configs.hpp"
#include "kvevict/policy/policy_base.hpp"
#include "kvevict/sequence/checks.hpp"
#include "kvevict/sequence/errors.hpp"
#include "kvevict/policy/snapkv.hpp"

namespace kvevict {

class h2o_policy : public policy_base<h2o_policy> {
 public:
  h2o_policy(const policy_shape& shape, const h2o_config& config)
      : policy_base(shape, policy_traits<h2o_policy>::rule(config)), config_(config) {}

  const h2o_config& config() const noexcept { return config_; }

  using policy_base::observe;
  using policy_base::prefill;

  /// KeyDiff decode step (key_diff_anchor.hpp): every cached key's score
  /// becomes -cos(k, anchor), the anchor the running sum of the unit keys
  /// cached now (the new tokens added, O(head_dim) each; a fresh count
  /// after evict_to, prefill, reset or an evict on other scores), so the
  /// victim is the unprotected key most like the others. Needs decay 0
  /// (key_norm_config). Above the budget the victims observe finds leave
  /// the anchor here: evict has no view to read their keys.
  template <class T, class Layout>
  void observe(std::int32_t b, const key_diff<T, Layout>& in) {
    const detail::site w = where("observe");
    require_observable(w, b);
    detail::require_policy_view(w, shape(), in.cache);
    detail::require_replacing_decay(w, "key_diff", true, rule().decay);
    require_rows(w, in.cache, b, slots().occupied_width(b), occupied(b));
    state_.require_anchors(in.cache.head_dim);
    const score_source<key_diff<T, Layout>> source{in, state().anchors};
    observe_heads(
        b,
        [&](std::int32_t h, std::int32_t& victim, float* staged) {
          return detail::key_diff_head(state(), b, h, source, victim, staged);
        },
        [&](std::uint64_t word) {
          detail::fail_decode_step(
              w, state(), b, source, "||cache.k||",
              [&](std::int32_t h, std::int32_t s, const slot_increment&) {
                detail::fail_state<non_finite_error>(w, "||cache.k||[", h, "][", s, "] of sequence ", b,
                                                     " is not finite: KeyDiff needs finite keys");
              },
              word);
        });
    if (slots().count(b, 0) <= budget()) return;
    for (std::int32_t h = 0; h < shape().num_kv_heads; ++h) {
      const std::int32_t victim = found_victims_[std::size_t(state().head_index(b, h))];
      if (victim >= 0) remove_from_key_anchor(state().anchors, in.cache, b, h, victim);
    }
    anchor_follows_[std::size_t(b)] = 1;
  }

  /// KeyDiff prefill (key_diff.hpp): position p scores -cos(k_p, anchor),
  /// the anchor the sum of the unit prompt keys of its head; the least
  /// similar keys are kept beside the sinks and the recent tokens. No
  /// attention input. Every prompt key must be finite.
  template <class T, class Layout>
  prefill_result prefill(std::int32_t b, std::int32_t length, const key_diff<T, Layout>& in) {
    const detail::site w = where("prefill");
    require_prompt(w, b, length, in.cache);
    return run_one(
        w, b, length,
        [&](const prompt_lengths& prompts, std::int32_t* pages, std::uint64_t* status) {
          detail::run_prefill(state(), active_set::of_list(&b, 1), prompts, in, pages, status);
        },
        [&](std::int32_t h, std::int32_t p) {
          detail::fail_state<non_finite_error>(w, "||cache.k||[", h, "][", p, "] of sequence ", b,
                                               " is not finite: KeyDiff needs finite prompt keys");
        });
  }

  /// SnapKV prefill (snapkv.hpp): scores from the attention of the last
  /// in.snap.window prompt rows, pooled along positions; the window is kept
  /// beside the sinks and the recent tokens, the rest of the budget by score.
  template <class T, class Layout>
  prefill_result prefill(std::int32_t b, std::int32_t length, const window_probs& in, const kv_view<T, Layout>& view) {
    const detail::site w = snap_call(b, length, in.snap, view);
    detail::require_window_rows(w, "probs", in.probs, shape(), in.snap.window, length, true);
    return snap_prefill(w, b, length, in, view, "probs", [&](std::int32_t q, std::int32_t r, std::int32_t p) {
      return in.probs(q, r, p);
    });
  }

  /// The same from the window rows' logits and LSE.
  template <class T, class Layout>
  prefill_result prefill(std::int32_t b, std::int32_t length, const window_logits& in, const kv_view<T, Layout>& view) {
    const detail::site w = snap_call(b, length, in.snap, view);
    detail::require_window_rows(w, "logits", in.logits, shape(), in.snap.window, length, true);
    detail::require_window_lse(w, in.lse, shape(), in.snap.window);
    detail::require_scale(w, in.scale);
    detail::require_lse_base(w, "base", in.base);
    return snap_prefill(w, b, length, in, view, "probs from (logits, lse)",
                        [&](std::int32_t q, std::int32_t r, std::int32_t p) {
                          const float logit = in.logits(q, r, p);
                          detail::require_finite(w, "logits", logit, q, r, p);
                          return probability_from_logit(logit, in.scale, in.lse(q, r), in.base);
                        });
  }

  /// The same from the window rows' queries and LSE and the keys in slots
  /// [0, L) of `view` (O(window * L * head_dim) per query head).
  template <class Q, class T, class Layout>
  prefill_result prefill(std::int32_t b, std::int32_t length, const window_queries<Q>& in,
                         const kv_view<T, Layout>& view) {
    const detail::site w = snap_call(b, length, in.snap, view);
    detail::require_window_rows(w, "q", in.q, shape(), in.snap.window, view.head_dim, false);
    detail::require_window_lse(w, in.lse, shape(), in.snap.window);
    detail::require_scale(w, in.scale);
    detail::require_lse_base(w, "base", in.base);
    for (std::int32_t q = 0; q < shape().num_q_heads; ++q)
      for (std::int32_t r = 0; r < in.snap.window; ++r)
        for (std::int32_t d = 0; d < view.head_dim; ++d) detail::require_finite(w, "q", to_float(in.q(q, r, d)), q, r, d);
    return snap_prefill(w, b, length, in, view, "probs from (q, lse)",
                        [&](std::int32_t q, std::int32_t r, std::int32_t p) {
                          const std::int32_t h = q / shape().group_size();
                          return detail::prefill_query_value(&in.q(q, r, 0), in.q.strides[2], view.k_row(b, h, p),
                                                             view.k_scale(h), view.head_dim, in.scale, in.lse(q, r),
                                                             in.base);
                        });
  }

 private:
  /// The checks every SnapKV prefill starts with; its site.
  template <class T, class Layout>
  detail::site snap_call(std::int32_t b, std::int32_t length, const snap_window& snap,
                         const kv_view<T, Layout>& view) const {
    const detail::site w = where("prefill");
    require_prompt(w, b, length, view);
    detail::require_snap_window(w, "in.snap", snap, rule());
    detail::require_window_length(w, length, snap);
    return w;
  }

  /// The backend's SnapKV prefill of b; a refused column named from
  /// element(q, r, p), the probability of window row r (named arg[q][r][p]).
  template <class In, class T, class Layout, class Element>
  prefill_result snap_prefill(const detail::site& w, std::int32_t b, std::int32_t length, const In& in,
                              const kv_view<T, Layout>& view, const char* arg, Element element) {
    return run_one(
        w, b, length,
        [&](const prompt_lengths& prompts, std::int32_t* pages, std::uint64_t* status) {
          detail::run_prefill(state(), active_set::of_list(&b, 1), prompts, as_batch(in, shape().num_seqs), view,
                              pages, status);
        },
        [&](std::int32_t h, std::int32_t p) {
          const std::int32_t first = length - in.snap.window;  // window row 0's prompt row
          detail::fail_prefill_column(w, arg, "pooled window sums", shape().group_size(), h, p,
                                      p > first ? p - first : 0, in.snap.window,
                                      [&](std::int32_t q, std::int32_t r) { return element(q, r, p); });
        });
  }

  h2o_config config_;
};

}  // namespace kvevict
