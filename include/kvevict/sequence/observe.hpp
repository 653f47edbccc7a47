#pragma once
// The per-sequence observe calls (docs/semantics.md, "Scores"): after
// attention, before evict, sequence b's scores take the step's input. Each
// overload checks its arguments as the per-sequence API has always checked
// them (an input column for every occupied slot, finite LSE and queries,
// the rows it reads), then runs the batched backend's decision of every
// head (observe_evict_head over the input's score_source, the input as
// as_batch gives it) and commits them all (protocol.hpp). A refused value
// is named by sequence_errors.hpp.
#include <cstdint>

#include "kvevict/batch/host_backend.hpp"
#include "kvevict/batch/score_sources.hpp"
#include "kvevict/error.hpp"
#include "kvevict/kv_view.hpp"
#include "kvevict/policy/decode_rules.hpp"
#include "kvevict/sequence/protocol.hpp"
#include "kvevict/policy/input_checks.hpp"
#include "kvevict/sequence/checks.hpp"
#include "kvevict/sequence/errors.hpp"
#include "kvevict/score_inputs.hpp"

namespace kvevict {
namespace detail {

class sequence_observe : public sequence_protocol {
 public:
  /// Adds reduce over the group of probs(q, s) to every occupied slot.
  void observe(std::int32_t b, const decode_probs& in) {
    const site w = where("observe");
    require_observable(w, b);
    require_columns(w, "probs", in.probs, shape_.num_q_heads, b);
    const score_source<batch_probs> source{as_batch(in, shape_.num_seqs), shape_.group_size(), rule().reduce};
    observe_source(w, b, source, "probs", [&](std::int32_t, std::int32_t s, const slot_increment& inc) {
      fail_input(w, "probs", inc, in.probs(inc.query, s), s);
    });
  }

  /// Adds per-KV-head increments the engine reduced itself.
  void observe(std::int32_t b, const head_scores& in) {
    const site w = where("observe");
    require_observable(w, b);
    require_columns(w, "scores", in.scores, shape_.num_kv_heads, b);
    const score_source<batch_head_scores> source{as_batch(in, shape_.num_seqs), shape_.group_size(), rule().reduce};
    observe_source(w, b, source, "scores", [&](std::int32_t h, std::int32_t s, const slot_increment&) {
      require_finite(w, "scores", in.scores(h, s), h, s);
    });
  }

  /// Fused-attention path with logits: prob = exp(logits(q, s) * scale -
  /// lse(q)), computed as every backend computes it (probability_from_logit).
  void observe(std::int32_t b, const decode_logits& in) {
    const site w = where("observe");
    require_observable(w, b);
    require_columns(w, "logits", in.logits, shape_.num_q_heads, b);
    require_decode_lse(w, shape_, in.lse);
    require_scale(w, in.scale);
    require_lse_base(w, "base", in.base);
    const score_source<batch_logits> source{as_batch(in, shape_.num_seqs), shape_.group_size(), rule().reduce};
    observe_source(w, b, source, "probs from (logits, lse)", [&](std::int32_t, std::int32_t s, const slot_increment& inc) {
      const float logit = in.logits(inc.query, s);
      require_finite(w, "logits", logit, inc.query, s);
      fail_input(w, "probs from (logits, lse)", inc, probability_from_logit(logit, in.scale, in.lse(inc.query), in.base), s);
    });
  }

  /// Fused-attention path: recomputes prob = exp(q . k_s * scale - lse) from
  /// the cached keys, so no probability matrix is needed. q . k_s and the
  /// exp are computed as every backend computes them (attention_logit,
  /// probability_from_logit); a key whose logit is not finite is refused.
  template <class Q, class T, class Layout>
  void observe(std::int32_t b, const decode_queries<Q>& in, const kv_view<T, Layout>& view) {
    const site w = where("observe");
    require_observable(w, b);
    require_policy_view(w, shape_, view);
    require_decode_queries(w, shape_, in, view.head_dim);
    require_decode_lse(w, shape_, in.lse);
    require_lse_base(w, "base", in.base);
    require_rows(w, view, b, slots().occupied_width(b), occupied(b));
    const query_source<Q, T, Layout> source{as_batch(in, shape_.num_seqs), view, shape_.group_size(), rule().reduce};
    observe_source(w, b, source, "probs from (q, lse)", [&](std::int32_t h, std::int32_t s, const slot_increment& inc) {
      const float logit = attention_logit_rows(&in.q(inc.query, 0), in.q.strides[1], view.k_row(b, h, s),
                                               view.head_dim, view.k_scale(h));
      fail_input(w, "probs from (q, lse)", inc, logit_value(logit, in.scale, in.lse(inc.query), in.base), s);
    });
  }

  /// Key-norm path: every occupied slot's score becomes -||k|| (key_norms).
  template <class T, class Layout>
  void observe(std::int32_t b, const key_norms<T, Layout>& in) {
    const site w = where("observe");
    require_observable(w, b);
    require_policy_view(w, shape_, in.cache);
    require_replacing_decay(w, "key_norms", rule().victim == victim_rule::lowest_score, rule().decay);
    require_rows(w, in.cache, b, slots().occupied_width(b), occupied(b));
    const score_source<key_norms<T, Layout>> source{in, shape_.group_size(), rule().reduce};
    observe_source(w, b, source, "-||cache.k||", [&](std::int32_t h, std::int32_t s, const slot_increment& inc) {
      require_finite(w, "-||cache.k||", inc.value, h, s);
    });
  }

  /// Any other decode input the batched backend takes through a
  /// score_source (a rule registered there once: its score_source and its
  /// require_input; design.md, "Adding a scoring rule"): the batched
  /// argument checks, then the backend's step of every head. A refused
  /// slot is named by the status word's (sequence, head, slot, code).
  template <class Input, class = decltype(score_source<Input>::items)>
  void observe(std::int32_t b, const Input& in) {
    const site w = where("observe");
    require_observable(w, b);
    using detail::require_input;  // and the overload of a rule registered elsewhere, by ADL
    require_input(w, state(), in);
    const score_source<Input> source{in, shape_.group_size(), rule().reduce};
    observe_source(w, b, source, "in", [&](std::int32_t h, std::int32_t s, const slot_increment& inc) {
      throw_status(w, pack_status(b, h, s, inc.code), false);
    });
  }

 protected:
  using sequence_protocol::sequence_protocol;

  /// An input of `rows` rows with a column for every occupied slot of b.
  template <class V>
  void require_columns(const site& w, const char* arg, const V& view, std::int32_t rows, std::int32_t b) const {
    const std::int32_t expected[2] = {rows, slots().occupied_width(b)};
    const bool at_least[2] = {false, true};
    require_extents(w, arg, view, expected, at_least);
  }

  /// The step of every head by observe_evict_head over `source`, committed
  /// together; a refusal named by fail_decode_step.
  template <class Source, class FailElement>
  void observe_source(const site& w, std::int32_t b, const Source& source, const char* arg, FailElement fail_element) {
    observe_heads(
        b,
        [&](std::int32_t h, std::int32_t& victim, float* staged) {
          return observe_evict_head(state(), b, h, source, victim, staged);
        },
        [&](std::uint64_t word) { fail_decode_step(w, state(), b, source, arg, fail_element, word); });
  }
};

}  // namespace detail
}  // namespace kvevict
