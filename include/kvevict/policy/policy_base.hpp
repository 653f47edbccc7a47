#pragma once
// policy_base: the decode cycle and prefill compression (docs/semantics.md)
// shared by every policy. A policy hands its decode decision to the base as
// a decode_rule (decode_rules.hpp, which the batched backends run too) and
// its prefill keep set through CRTP (select_keep(b, h, L, prefill_scores,
// window, keep): positions, ascending); the base does the rest: slot bookkeeping,
// validated score updates from every input of score_inputs.hpp, eviction
// with no K/V bytes moved, prefill compaction on any kv_view. Every public
// call validates first and commits after: a thrown kvevict::error leaves the
// policy and the cache unchanged. The protocol is enforced per sequence:
// append (once or more) -> observe once -> evict or evict_to; evict on stale
// scores or a second observe throws state_error; skip_observe opts out.
// All buffers are sized at construction: the decode path allocates nothing.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "kvevict/compaction.hpp"
#include "kvevict/error.hpp"
#include "kvevict/kv_view.hpp"
#include "kvevict/order.hpp"
#include "kvevict/policy/column_sums.hpp"
#include "kvevict/policy/decode_pass.hpp"
#include "kvevict/policy/decode_rules.hpp"
#include "kvevict/policy/evict_to.hpp"
#include "kvevict/policy/policy_shape.hpp"
#include "kvevict/policy/prefill_scores.hpp"
#include "kvevict/policy/score_increments.hpp"
#include "kvevict/policy/sequence_checks.hpp"
#include "kvevict/score_inputs.hpp"
#include "kvevict/slot_table.hpp"

namespace kvevict {

template <class Derived>
class policy_base {
 public:
  const policy_shape& shape() const noexcept { return shape_; }
  std::int32_t budget() const noexcept { return rule_.budget; }
  /// The decode decision as data: what the batched backends run.
  const decode_rule& rule() const noexcept { return rule_; }
  const slot_table& slots() const noexcept { return slots_; }

  /// Slot that sequence b's next token takes in KV head h (docs/semantics.md, step 1),
  /// or -1 while the sequence holds budget + 1 tokens (evict first).
  std::int32_t next_slot(std::int32_t b, std::int32_t h) const {
    detail::require_head(where("next_slot"), shape_, b, h);
    return slots_.next_slot(b, h);
  }
  /// Tokens sequence b has seen; the position its next token gets.
  std::int32_t length(std::int32_t b) const {
    detail::require_index(where("length"), "sequence", b, shape_.num_seqs);
    return slots_.length(b);
  }
  /// True between an append to sequence b and its observe (or skip_observe):
  /// evict and evict_to are refused then, observe is due.
  bool awaiting_observe(std::int32_t b) const {
    detail::require_index(where("awaiting_observe"), "sequence", b, shape_.num_seqs);
    return unobserved_[std::size_t(b)] != 0;
  }
  /// Accumulated score of slot s of (b, h); 0 for a free slot.
  float score(std::int32_t b, std::int32_t h, std::int32_t s) const {
    detail::require_head(where("score"), shape_, b, h);
    detail::require_index(where("score"), "slot", s, shape_.capacity);
    return scores_of(b, h)[s];
  }
  const float* scores_of(std::int32_t b, std::int32_t h) const noexcept {
    return scores_.data() + head_index(b, h) * shape_.capacity;
  }

  /// Records sequence b's next token (position length(b)) in next_slot(b, h)
  /// of every KV head and returns its position. The engine writes the K/V
  /// rows there (before or after this call) and runs attention over it.
  std::int32_t append(std::int32_t b) {
    const detail::site w = where("append");
    detail::require_index(w, "sequence", b, shape_.num_seqs);
    for (std::int32_t h = 0; h < shape_.num_kv_heads; ++h)
      if (slots_.next_slot(b, h) < 0)
        detail::fail_state<state_error>(w, "sequence ", b, " head ", h, " has no free slot (it holds budget + 1 = ",
                                        slots_.count(b, h), " tokens); call evict after observe");
    const std::int32_t position = slots_.length(b);
    for (std::int32_t h = 0; h < shape_.num_kv_heads; ++h) {
      const std::int32_t s = slots_.next_slot(b, h);
      slots_.positions_of(b, h)[s] = position;
      mutable_scores(b, h)[s] = 0.0f;
      // Decode never holds more than budget + 1 tokens: with the invariant
      // "no hole while filling", the next slot is `count` until then, and
      // after that only evict can free one. Slots beyond budget + 1 (a larger
      // capacity for prompts) stay unused, so paged engines may reclaim them.
      slots_.next_slot_ref(b, h) = next_slot_after_append(++slots_.count_ref(b, h), rule_.budget);
    }
    slots_.length_ref(b) = position + 1;
    unobserved_[std::size_t(b)] = 1;
    victims_found_[std::size_t(b)] = 0;
    derived().on_cached_change(b, cached_change::append);
    return position;
  }

  /// Multi-token append (chunked prefill, speculative decoding): records
  /// positions length(b) .. length(b) + tokens - 1 in every KV head, token j
  /// in new_token_slot(count, next_slot, j) (evict_to.hpp), and returns the
  /// first position. Needs count + tokens <= capacity in every head, beyond
  /// budget + 1 if the capacity allows; evict_to brings it back to a
  /// budget. slots (optional, [num_kv_heads][tokens]): where each token went.
  std::int32_t append(std::int32_t b, std::int32_t tokens, std::int32_t* slots) {
    const detail::site w = where("append");
    detail::require_index(w, "sequence", b, shape_.num_seqs);
    if (tokens < 1) detail::fail<out_of_range>(w, "tokens", "= ", tokens, " is below 1");
    for (std::int32_t h = 0; h < shape_.num_kv_heads; ++h)
      if (std::int64_t{slots_.count(b, h)} + tokens > shape_.capacity)
        detail::fail<out_of_range>(w, "tokens", "= ", tokens, ": sequence ", b, " head ", h, " holds ",
                                   slots_.count(b, h), " of capacity ", shape_.capacity, " (evict_to first)");
    const std::int32_t first = slots_.length(b);
    for (std::int32_t h = 0; h < shape_.num_kv_heads; ++h) {
      const std::int32_t count = slots_.count(b, h), next = slots_.next_slot(b, h);
      for (std::int32_t j = 0; j < tokens; ++j) {
        const std::int32_t s = new_token_slot(count, next, j);
        slots_.positions_of(b, h)[s] = first + j;
        mutable_scores(b, h)[s] = 0.0f;
        if (slots) slots[std::int64_t{h} * tokens + j] = s;
      }
      slots_.count_ref(b, h) = count + tokens;
      slots_.next_slot_ref(b, h) = next_slot_after_append(count + tokens, rule_.budget);
    }
    slots_.length_ref(b) = first + tokens;
    unobserved_[std::size_t(b)] = 1;
    victims_found_[std::size_t(b)] = 0;
    derived().on_cached_change(b, cached_change::append);
    return first;
  }

  /// Multi-token eviction (evict_to.hpp): every KV head of sequence b that
  /// holds more than `target` tokens keeps `target` (its protected tokens
  /// plus the best of the rest) and kept rows move in `view` so the occupied
  /// slots are [0, target + 1) but one hole, the next slot (as after evict).
  /// Returns the tokens freed per head. With one token above target it is
  /// evict: the same victim, no row moved. target: in [sinks + recent,
  /// capacity].
  template <class T, class Layout>
  std::int32_t evict_to(std::int32_t b, std::int32_t target, const kv_view<T, Layout>& view) {
    const detail::site w = where("evict_to");
    require_evict_to(w, b, target);
    detail::require_policy_view(w, shape_, view);
    const std::int32_t span = std::max(target, slots_.occupied_width(b));
    require_rows(w, view, b, span, all_columns());
    require_distinct_pages(w, view, b, span);
    const std::int32_t freed = evict_surplus(b, target);
    for (std::int32_t h = 0; h < shape_.num_kv_heads; ++h)
      for (std::int32_t i = 0; i < move_counts_[std::size_t(h)]; ++i) {
        const slot_move m = moves_[std::size_t(h) * shape_.capacity + i];
        std::copy_n(view.k_row(b, h, m.from), view.head_dim, view.k_row(b, h, m.to));
        std::copy_n(view.v_row(b, h, m.from), view.head_dim, view.v_row(b, h, m.to));
      }
    return freed;
  }

  /// The same for engines that move rows themselves: moves[h * capacity +
  /// i] for i < move_counts[h] says which slot's rows go where (sources and
  /// destinations are distinct, so any order works).
  std::int32_t evict_to(std::int32_t b, std::int32_t target, slot_move* moves, std::int32_t* move_counts) {
    const detail::site w = where("evict_to");
    require_evict_to(w, b, target);
    detail::require_not_null(w, "moves", moves);
    detail::require_not_null(w, "move_counts", move_counts);
    const std::int32_t freed = evict_surplus(b, target);
    for (std::int32_t h = 0; h < shape_.num_kv_heads; ++h) {  // only the moves made, not the whole buffer
      const std::size_t row = std::size_t(h) * shape_.capacity;
      std::copy_n(moves_.data() + row, move_counts_[std::size_t(h)], moves + row);
      move_counts[h] = move_counts_[std::size_t(h)];
    }
    return freed;
  }

  /// Forgets sequence b (a finished request); its slots become free.
  void reset(std::int32_t b) {
    detail::require_index(where("reset"), "sequence", b, shape_.num_seqs);
    derived().on_reset(b);
    derived().on_cached_change(b, cached_change::other);
    slots_.clear(b);
    unobserved_[std::size_t(b)] = 0;
    victims_found_[std::size_t(b)] = 0;
    for (std::int32_t h = 0; h < shape_.num_kv_heads; ++h) std::fill_n(mutable_scores(b, h), shape_.capacity, 0.0f);
  }

  /// Decode step (step 6): when sequence b holds more than budget
  /// tokens, frees one victim slot per KV head; no K/V bytes move. Writes the
  /// victims' slots to victim_slots[h] (-1 when nothing was evicted) if given
  /// and returns the number of slots freed. One token a step: above the
  /// budget with a slot already freed (a multi-token append, or evict_to to
  /// a target above the budget) it is refused; evict_to frees the rest.
  std::int32_t evict(std::int32_t b, std::int32_t* victim_slots = nullptr) {
    const detail::site w = where("evict");
    require_observed(w, b);
    const std::int32_t heads = shape_.num_kv_heads;
    if (slots_.count(b, 0) <= rule_.budget) {
      if (victim_slots) std::fill_n(victim_slots, heads, -1);
      return 0;
    }
    // Decide every head before changing any, so a failure changes nothing.
    // observe found the victims in its pass over the scores, where it could.
    const bool found = victims_found_[std::size_t(b)] != 0;
    for (std::int32_t h = 0; h < heads; ++h) {
      // A free slot below count is the one hole a step may leave: a second
      // victim would make two, and append fills only one.
      const std::int32_t next = slots_.next_slot(b, h);
      if (next >= 0 && next < slots_.count(b, h))
        detail::fail_state<state_error>(w, "sequence ", b, " head ", h, " holds ", slots_.count(b, h),
                                        " tokens, above the budget ", rule_.budget,
                                        ", and already has a free slot; evict frees one token a step: "
                                        "call evict_to(b, budget) after a multi-token append");
      const std::int32_t s = found ? found_victims_[std::size_t(head_index(b, h))] : derived().choose_victim(b, h);
      if (s < 0) detail::fail_state<state_error>(w, "sequence ", b, " head ", h, " has no evictable token");
      victims_[std::size_t(h)] = s;
    }
    for (std::int32_t h = 0; h < heads; ++h) {
      const std::int32_t s = victims_[std::size_t(h)];
      slots_.positions_of(b, h)[s] = -1;
      mutable_scores(b, h)[s] = 0.0f;  // a freed slot's score is discarded
      --slots_.count_ref(b, h);
      slots_.next_slot_ref(b, h) = s;
      if (victim_slots) victim_slots[h] = s;
    }
    victims_found_[std::size_t(b)] = 0;
    derived().on_cached_change(b, found ? cached_change::found_victims_evicted : cached_change::other);
    return heads;
  }

  /// The protocol's opt-out: ends sequence b's step without adding scores,
  /// for engines that skip observation on purpose (no attention weights this
  /// step, or scoring every n-th step). The scores stay as they are, so the
  /// next evict decides on them (and a new token's score is 0). Like observe,
  /// it needs an append since the last observe.
  void skip_observe(std::int32_t b) {
    require_observable(where("skip_observe"), b);
    unobserved_[std::size_t(b)] = 0;
  }

  // ---- decode scores (docs/semantics.md, "Scores"); after attention, before evict ----

  /// Adds reduce over the group of probs(q, s) to every occupied slot.
  void observe(std::int32_t b, const decode_probs& in) {
    const detail::site w = where("observe");
    require_observable(w, b);
    const std::int32_t expected[2] = {shape_.num_q_heads, slots_.occupied_width(b)};
    const bool at_least[2] = {false, true};
    detail::require_extents(w, "probs", in.probs, expected, at_least);
    const std::int32_t g = shape_.group_size();
    // The fast path reads rows and writes the new scores in one pass per head.
    bool valid = in.probs.strides[1] == 1;
    for (std::int32_t h = 0; valid && h < shape_.num_kv_heads; ++h)
      valid = detail::fold_and_add_probability_rows([&](std::int32_t j) { return &in.probs(h * g + j, 0); }, g,
                                                    rule_.reduce, rule_.decay, scores_of(b, h), slots_.positions_of(b, h),
                                                    expected[1], next_of(h));
    if (!valid) {  // strided columns, or a bad element or overflow to name: the scalar rules
      detail::reduce_groups(
          w, "probs", group(), expected[1], occupied(b), [&](std::int32_t q, std::int32_t s) { return in.probs(q, s); },
          scratch_.data(), shape_.capacity);
      stage_next_scores(w, b, expected[1]);
    }
    commit_next_scores(b, expected[1]);
  }

  /// Adds per-KV-head increments the engine reduced itself.
  void observe(std::int32_t b, const head_scores& in) {
    const detail::site w = where("observe");
    require_observable(w, b);
    const std::int32_t expected[2] = {shape_.num_kv_heads, slots_.occupied_width(b)};
    const bool at_least[2] = {false, true};
    detail::require_extents(w, "scores", in.scores, expected, at_least);
    bool valid = in.scores.strides[1] == 1;
    for (std::int32_t h = 0; valid && h < shape_.num_kv_heads; ++h)
      valid = detail::next_scores(rule_.decay, scores_of(b, h), &in.scores(h, 0), slots_.positions_of(b, h),
                                  expected[1], next_of(h));
    if (!valid) {  // strided columns, or a bad element or overflow to name
      const auto wanted = occupied(b);
      for (std::int32_t h = 0; h < shape_.num_kv_heads; ++h)
        for (std::int32_t s = 0; s < expected[1]; ++s)
          if (wanted(h, s)) {
            const float x = in.scores(h, s);
            detail::require_finite(w, "scores", x, h, s);
            scratch_[std::size_t(h) * shape_.capacity + s] = x;
          }
      stage_next_scores(w, b, expected[1]);
    }
    commit_next_scores(b, expected[1]);
  }

  /// Fused-attention path with logits: prob = exp(logits(q, s) * scale -
  /// lse(q)), computed as every backend computes it (probability_from_logit).
  void observe(std::int32_t b, const decode_logits& in) {
    const detail::site w = where("observe");
    require_observable(w, b);
    const std::int32_t expected[2] = {shape_.num_q_heads, slots_.occupied_width(b)};
    const bool at_least[2] = {false, true};
    detail::require_extents(w, "logits", in.logits, expected, at_least);
    detail::require_decode_lse(w, shape_, in.lse);
    detail::require_scale(w, in.scale);
    detail::require_lse_base(w, "base", in.base);
    const auto wanted = occupied(b);
    for (std::int32_t q = 0; q < shape_.num_q_heads; ++q)
      for (std::int32_t s = 0; s < expected[1]; ++s)
        if (wanted(q / shape_.group_size(), s)) detail::require_finite(w, "logits", in.logits(q, s), q, s);
    detail::reduce_groups(
        w, "probs from (logits, lse)", group(), expected[1], wanted,
        [&](std::int32_t q, std::int32_t s) { return probability_from_logit(in.logits(q, s), in.scale, in.lse(q), in.base); },
        scratch_.data(), shape_.capacity);
    commit_increments(w, b, expected[1]);
  }

  /// Fused-attention path: recomputes prob = exp(q . k_s * scale - lse) from
  /// the cached keys, so no probability matrix is needed. q . k_s and the
  /// exp are computed as every backend computes them (attention_logit,
  /// probability_from_logit).
  template <class Q, class T, class Layout>
  void observe(std::int32_t b, const decode_queries<Q>& in, const kv_view<T, Layout>& view) {
    const detail::site w = where("observe");
    require_observable(w, b);
    detail::require_policy_view(w, shape_, view);
    detail::require_decode_queries(w, shape_, in, view.head_dim);
    detail::require_decode_lse(w, shape_, in.lse);
    detail::require_lse_base(w, "base", in.base);
    const auto wanted = occupied(b);
    const std::int32_t width = slots_.occupied_width(b);
    require_rows(w, view, b, width, wanted);
    const std::int32_t g = shape_.group_size();
    detail::reduce_groups(
        w, "probs from (q, lse)", group(), width, wanted,
        [&](std::int32_t q, std::int32_t s) {
          const float logit = attention_logit(&in.q(q, 0), in.q.strides[1], view.k_row(b, q / g, s), view.head_dim);
          return probability_from_logit(logit, in.scale, in.lse(q), in.base);
        },
        scratch_.data(), shape_.capacity);
    commit_increments(w, b, width);
  }

  /// Key-norm path: every occupied slot's score becomes -||k|| (key_norms).
  template <class T, class Layout>
  void observe(std::int32_t b, const key_norms<T, Layout>& in) {
    const detail::site w = where("observe");
    require_observable(w, b);
    detail::require_policy_view(w, shape_, in.cache);
    detail::require_replacing_decay(w, "key_norms", rule_.victim == victim_rule::lowest_score, rule_.decay);
    const std::int32_t width = slots_.occupied_width(b);
    require_rows(w, in.cache, b, width, occupied(b));
    detail::key_norm_increments(w, in.cache, b, width, occupied(b), scratch_.data(), shape_.capacity);
    commit_increments(w, b, width);
  }

  // ---- prefill compression: prompt position p sits in slot p ----

  /// Scores the prompt from its causal probability matrix, keeps budget
  /// tokens per KV head and compacts them into slots [0, kept) of `view`.
  template <class T, class Layout>
  prefill_result prefill(std::int32_t b, std::int32_t length, const prefill_probs& in,
                         const kv_view<T, Layout>& view) {
    const detail::site w = where("prefill");
    require_prefill(w, b, length);
    detail::require_policy_view(w, shape_, view);
    detail::score_prefill(w, group(), rule_.decay, length, in, scratch_.data(), shape_.capacity);
    return commit_prefill(w, b, length, &view);
  }

  /// Scores the prompt from column sums the engine computed.
  template <class T, class Layout>
  prefill_result prefill(std::int32_t b, std::int32_t length, const prefill_column_sums& in,
                         const kv_view<T, Layout>& view) {
    const detail::site w = where("prefill");
    require_prefill(w, b, length);
    detail::require_policy_view(w, shape_, view);
    detail::score_prefill(w, group(), length, in, scratch_.data(), shape_.capacity);
    return commit_prefill(w, b, length, &view);
  }

  /// Same as above for engines that compact their own buffers: updates only
  /// the slot table; afterwards slot s must hold prompt position
  /// slots().position(b, h, s), i.e. move row slots().position(b, h, s) to s.
  prefill_result prefill(std::int32_t b, std::int32_t length, const prefill_column_sums& in) {
    const detail::site w = where("prefill");
    require_prefill(w, b, length);
    detail::score_prefill(w, group(), length, in, scratch_.data(), shape_.capacity);
    return commit_prefill<float, strided_layout>(w, b, length, nullptr);
  }

  /// Fused-attention prefill: column sums recomputed from every prompt row's
  /// query and LSE and the cached keys (O(L^2 * head_dim) per query head).
  template <class Q, class T, class Layout>
  prefill_result prefill(std::int32_t b, std::int32_t length, const prefill_queries<Q>& in,
                         const kv_view<T, Layout>& view) {
    const detail::site w = where("prefill");
    require_prefill(w, b, length);
    detail::require_policy_view(w, shape_, view);
    detail::require_prefill_queries(w, shape_, in, length, view.head_dim);
    require_rows(w, view, b, length, all_columns());
    detail::score_prefill(w, group(), rule_.decay, b, length, in, view, scratch_.data(), shape_.capacity);
    return commit_prefill(w, b, length, &view);
  }

  /// Key-norm prefill (key_norms): position p scores -||k|| of its key in slot p.
  template <class T, class Layout>
  prefill_result prefill(std::int32_t b, std::int32_t length, const key_norms<T, Layout>& in) {
    const detail::site w = where("prefill");
    require_prefill(w, b, length);
    detail::require_policy_view(w, shape_, in.cache);
    detail::require_replacing_decay(w, "key_norms", rule_.victim == victim_rule::lowest_score, rule_.decay);
    require_rows(w, in.cache, b, length, all_columns());
    detail::key_norm_increments(w, in.cache, b, length, all_columns(), scratch_.data(), shape_.capacity);
    return commit_prefill(w, b, length, &in.cache);
  }

 protected:
  policy_base(const char* name, const policy_shape& shape, const decode_rule& rule)
      : name_(name), shape_(shape), rule_(rule) {
    detail::validate_shape(where("constructor"), shape, rule.budget);
    slots_ = slot_table(shape.num_seqs, shape.num_kv_heads, shape.capacity);
    scores_.assign(std::size_t(shape.num_seqs) * shape.num_kv_heads * shape.capacity, 0.0f);
    scratch_.assign(std::size_t(shape.num_kv_heads) * shape.capacity, 0.0f);
    next_.assign(std::size_t(shape.num_kv_heads) * shape.capacity, 0.0f);
    keep_.assign(std::size_t(shape.num_kv_heads) * shape.capacity, 0);
    order_.assign(std::size_t(shape.capacity), 0);
    victims_.assign(std::size_t(shape.num_kv_heads), -1);
    moves_.assign(std::size_t(shape.num_kv_heads) * shape.capacity, slot_move{});
    move_counts_.assign(std::size_t(shape.num_kv_heads), 0);
    unobserved_.assign(std::size_t(shape.num_seqs), 0);
    found_victims_.assign(std::size_t(shape.num_seqs) * shape.num_kv_heads, -1);
    victims_found_.assign(std::size_t(shape.num_seqs), 0);
  }

  // Optional hooks; a policy with state of its own hides them.
  /// Frees head h's surplus over `target` (evict_to), by the decode rule.
  std::int32_t free_surplus(std::int32_t b, std::int32_t h, std::int32_t target) {
    return detail::free_surplus(rule_, slots_.positions_of(b, h), mutable_scores(b, h), shape_.capacity,
                                slots_.count(b, h), slots_.length(b), target, derived().stream_of(b), h,
                                order_.data());
  }
  void on_reset(std::int32_t) noexcept {}
  void on_cached_change(std::int32_t, cached_change) noexcept {}
  std::uint64_t stream_of(std::int32_t b) const noexcept { return std::uint64_t(b); }  // random's draws

 public:
  /// The victim slot of (b, h) by the policy's decode_rule, or -1 when every
  /// occupied token is protected.
  std::int32_t choose_victim(std::int32_t b, std::int32_t h) const {
    return pick_victim(rule_, slots_.positions_of(b, h), scores_of(b, h), shape_.capacity, slots_.length(b),
                       derived().stream_of(b), h);
  }

 protected:

  Derived& derived() noexcept { return static_cast<Derived&>(*this); }
  const Derived& derived() const noexcept { return static_cast<const Derived&>(*this); }

  /// "policy::function", for messages.
  detail::site where(const char* function) const noexcept { return {name_, function}; }

  std::int64_t head_index(std::int32_t b, std::int32_t h) const noexcept {
    return std::int64_t{b} * shape_.num_kv_heads + h;
  }
  float* mutable_scores(std::int32_t b, std::int32_t h) noexcept {
    return scores_.data() + head_index(b, h) * shape_.capacity;
  }

  /// Prefill keep set of positions [0, L): the first `sinks` and the last
  /// `recent` positions, plus the budget - sinks - recent candidates in
  /// between with the highest key(p); written ascending to keep[0, budget).
  /// When L <= budget every position is kept.
  template <class Key>
  void keep_top_keys(std::int32_t length, std::int32_t sinks, std::int32_t recent, Key key,
                     std::int32_t* keep) const {
    if (length <= rule_.budget) {
      for (std::int32_t p = 0; p < length; ++p) keep[p] = p;
      return;
    }
    const std::int32_t lo = std::min(sinks, length), hi = std::max(lo, length - recent);
    const std::int32_t take = rule_.budget - lo - (length - hi);
    std::int32_t n = 0;
    for (std::int32_t p = 0; p < lo; ++p) keep[n++] = p;
    std::int32_t* cand = order_.data();
    for (std::int32_t p = lo; p < hi; ++p) cand[p - lo] = p;
    const auto higher = [&](std::int32_t a, std::int32_t c) { return key(a) > key(c); };
    std::nth_element(cand, cand + take, cand + (hi - lo), higher);
    std::sort(cand, cand + take);
    for (std::int32_t i = 0; i < take; ++i) keep[n++] = cand[i];
    for (std::int32_t p = hi; p < length; ++p) keep[n++] = p;
  }

  /// Prefill for policies that need no scores (recent window, random).
  template <class T, class Layout>
  prefill_result prefill_without_scores(std::int32_t b, std::int32_t length, const kv_view<T, Layout>& view) {
    const detail::site w = where("prefill");
    require_prefill(w, b, length);
    detail::require_policy_view(w, shape_, view);
    std::fill(scratch_.begin(), scratch_.end(), 0.0f);
    return commit_prefill(w, b, length, &view);
  }

  /// Prefill scores of (h, p) written by the prefill overloads.
  const float* prefill_scores(std::int32_t h) const noexcept { return scratch_.data() + h * std::size_t(shape_.capacity); }

  template <class T, class Layout, class Wanted>
  void require_rows(const detail::site& w, const kv_view<T, Layout>& view, std::int32_t b, std::int32_t width,
                    Wanted wanted) const {
    for (std::int32_t h = 0; h < shape_.num_kv_heads; ++h)
      for (std::int32_t s = 0; s < width; ++s)
        if (wanted(h, s)) require_row(w, view, b, h, s);
  }

  void require_evict_to(const detail::site& w, std::int32_t b, std::int32_t target) const {
    require_observed(w, b);
    const std::int64_t protected_max = std::int64_t{rule_.protect.sinks} + rule_.protect.recent;
    if (target < protected_max || target > shape_.capacity)
      detail::fail<budget_error>(w, "target", "= ", target, " is outside [sinks + recent = ", protected_max,
                                 ", capacity = ", shape_.capacity, "]");
  }

  /// evict_to's decisions and slot-table changes for every head of b; the
  /// moves land in moves_ / move_counts_. Nothing here can fail.
  std::int32_t evict_surplus(std::int32_t b, std::int32_t target) {
    victims_found_[std::size_t(b)] = 0;  // slots move: a later evict decides afresh
    derived().on_cached_change(b, cached_change::other);
    std::int32_t freed = 0;
    for (std::int32_t h = 0; h < shape_.num_kv_heads; ++h) {
      freed = derived().free_surplus(b, h, target);
      move_counts_[std::size_t(h)] = 0;
      if (freed == 0) continue;  // nothing above target: the slots stay as they are
      const std::int32_t count = slots_.count(b, h) - freed;
      const std::int32_t end = detail::occupied_end(slots_.count(b, h), slots_.next_slot(b, h));
      slot_move* moves = moves_.data() + std::size_t(h) * shape_.capacity;
      move_counts_[std::size_t(h)] =
          detail::refill_holes(slots_.positions_of(b, h), mutable_scores(b, h), nullptr, count, rule_.budget, end,
                               order_.data(), slots_.next_slot_ref(b, h),
                               [&](std::int32_t i, std::int32_t from, std::int32_t to) { moves[i] = slot_move{from, to}; });
      slots_.count_ref(b, h) = count;
    }
    return freed;
  }

  /// observe (and skip_observe) needs an append since the last observe.
  void require_observable(const detail::site& w, std::int32_t b) const {
    detail::require_index(w, "sequence", b, shape_.num_seqs);
    if (slots_.length(b) == 0) detail::fail_state<state_error>(w, "sequence ", b, " holds no token; call append first");
    if (!unobserved_[std::size_t(b)])
      detail::fail_state<state_error>(w, "sequence ", b, " was already observed since its last append; ",
                                      "observe once per step (append, observe, evict)");
  }

  /// evict and evict_to need this step's scores: no append since the last observe.
  void require_observed(const detail::site& w, std::int32_t b) const {
    detail::require_index(w, "sequence", b, shape_.num_seqs);
    if (unobserved_[std::size_t(b)])
      detail::fail_state<state_error>(w, "sequence ", b, " was appended but not observed; ",
                                      "call observe (or skip_observe) before evicting");
  }

  void require_prefill(const detail::site& w, std::int32_t b, std::int32_t length) const {
    detail::require_index(w, "sequence", b, shape_.num_seqs);
    if (length < 1 || length > shape_.capacity)
      detail::fail<out_of_range>(w, "length", "= ", length, " is outside [1, capacity = ", shape_.capacity, "]");
    if (slots_.length(b) != 0)
      detail::fail_state<state_error>(w, "sequence ", b, " already holds ", slots_.length(b),
                                      " tokens; prefill starts a sequence (reset it first)");
  }

  auto occupied(std::int32_t b) const noexcept {
    return [this, b](std::int32_t h, std::int32_t s) { return slots_.positions_of(b, h)[s] >= 0; };
  }
  static auto all_columns() noexcept {
    return [](std::int32_t, std::int32_t) { return true; };
  }
  detail::group_info group() const noexcept { return {shape_.num_kv_heads, shape_.group_size(), rule_.reduce}; }

  /// Adds the validated increments in scratch_ (columns [0, width)) to the
  /// occupied slots of b and commits them (commit_next_scores). Ends the
  /// step's observation.
  void commit_increments(const detail::site& w, std::int32_t b, std::int32_t width) {
    stage_next_scores(w, b, width);
    commit_next_scores(b, width);
  }

  float* next_of(std::int32_t h) noexcept { return next_.data() + std::size_t(h) * shape_.capacity; }

  /// next_ = the scores of b plus the increments in scratch_, for every head,
  /// after checking that no occupied score would become non-finite (a
  /// reduction in the same pass; the slot is named only when it fails).
  /// Nothing is committed.
  void stage_next_scores(const detail::site& w, std::int32_t b, std::int32_t width) {
    for (std::int32_t h = 0; h < shape_.num_kv_heads; ++h) {
      const std::int32_t* pos = slots_.positions_of(b, h);
      const float* inc = scratch_.data() + std::size_t(h) * shape_.capacity;
      const float* score = scores_of(b, h);
      if (detail::next_scores(rule_.decay, score, inc, pos, width, next_of(h))) continue;
      for (std::int32_t s = 0; s < width; ++s)
        if (pos[s] >= 0 && !std::isfinite(updated_score(rule_.decay, score[s], inc[s])))
          detail::fail_state<non_finite_error>(w, "sequence ", b, " head ", h, " slot ", s, ": score ", score[s],
                                               " updated by increment ", inc[s], " overflows");
    }
  }

  /// Makes the staged scores in next_ current for every head of b and finds
  /// each head's victim in the same pass, so evict only reads it. Ends the
  /// step's observation; nothing here can fail.
  void commit_next_scores(std::int32_t b, std::int32_t width) {
    const bool find = rule_.victim != victim_rule::random_priority;
    for (std::int32_t h = 0; h < shape_.num_kv_heads; ++h) {
      const std::int32_t* pos = slots_.positions_of(b, h);
      const float* next = next_of(h);
      float* score = mutable_scores(b, h);
      if (find)
        found_victims_[std::size_t(head_index(b, h))] =
            detail::commit_and_find_victim(rule_, next, score, pos, width, slots_.length(b));
      else
        std::copy_n(next, width, score);
    }
    victims_found_[std::size_t(b)] = find ? 1 : 0;
    unobserved_[std::size_t(b)] = 0;
  }

  /// Selects every head's keep set from the prefill scores in scratch_, then
  /// moves the kept rows (if a view is given) and rewrites the slot table.
  /// `window`: the last `window` positions are kept beside the rule's
  /// protection (SnapKV's observation window), passed to select_keep.
  template <class T, class Layout>
  prefill_result commit_prefill(const detail::site& w, std::int32_t b, std::int32_t length,
                                const kv_view<T, Layout>* view, std::int32_t window = 0) {
    if (view) {
      require_rows(w, *view, b, length, all_columns());
      require_distinct_pages(w, *view, b, length);
    }
    const std::int32_t kept = std::min(length, rule_.budget);
    for (std::int32_t h = 0; h < shape_.num_kv_heads; ++h)
      derived().select_keep(b, h, length, prefill_scores(h), window,
                            keep_.data() + std::size_t(h) * shape_.capacity);
    for (std::int32_t h = 0; h < shape_.num_kv_heads; ++h) {
      const std::int32_t* keep = keep_.data() + std::size_t(h) * shape_.capacity;
      if (view) detail::compact_rows(*view, b, h, keep, kept, static_cast<T*>(nullptr));
      std::int32_t* pos = slots_.positions_of(b, h);
      float* score = mutable_scores(b, h);
      const float* prefill = prefill_scores(h);
      for (std::int32_t s = 0; s < shape_.capacity; ++s) {
        pos[s] = s < kept ? keep[s] : -1;
        score[s] = s < kept ? prefill[keep[s]] : 0.0f;  // keep[s] >= s: read before overwritten
      }
      slots_.count_ref(b, h) = kept;
      slots_.next_slot_ref(b, h) = kept;  // kept <= budget < capacity
    }
    slots_.length_ref(b) = length;
    derived().on_cached_change(b, cached_change::other);
    prefill_result result;
    result.kept = kept;
    if constexpr (std::is_same_v<Layout, paged_layout>) {
      if (view) {
        const std::int32_t page = view->layout.page_size;
        const std::int32_t needed = pages_for(std::min(rule_.budget + 1, shape_.capacity), page);
        result.reclaimable_pages = std::max(0, pages_for(length, page) - needed);
      }
    }
    return result;
  }

  const char* name_;
  policy_shape shape_;
  decode_rule rule_;
  slot_table slots_;
  std::vector<float> scores_;    // [B][Hkv][capacity]
  std::vector<float> scratch_;   // [Hkv][capacity] increments / prefill scores
  std::vector<float> next_;      // [Hkv][capacity] observe's new scores until committed
  std::vector<std::int32_t> keep_;     // [Hkv][capacity] prefill keep sets
  mutable std::vector<std::int32_t> order_;  // [capacity] candidates during selection (scratch)
  std::vector<std::int32_t> victims_;  // [Hkv]
  std::vector<slot_move> moves_;       // [Hkv][capacity] evict_to's row moves
  std::vector<std::int32_t> move_counts_;  // [Hkv]
  std::vector<std::uint8_t> unobserved_;   // [B]: 1 from an append until its observe
  std::vector<std::int32_t> found_victims_;  // [B][Hkv]: the victims observe found
  std::vector<std::uint8_t> victims_found_;  // [B]: 1 while found_victims_ of b is current
};

}  // namespace kvevict
