#pragma once
// The O(1) checks every batched call makes on the host before it touches
// anything (on CUDA: before the launch): pointers, shapes, strides and
// configuration. They throw the library's exceptions naming the argument.
// What only the data can tell (NaN, page ids, a head with no free slot) is
// checked per (b, h) by the call itself and reported in the status word.
#include <cstdint>

#include "kvevict/batch/inputs.hpp"
#include "kvevict/batch/state.hpp"
#include "kvevict/error.hpp"
#include "kvevict/kv_view.hpp"
#include "kvevict/policy/policy_shape.hpp"
#include "kvevict/policy/input_checks.hpp"

namespace kvevict {
namespace detail {

/// The rule a state view carries, which a caller may have edited: enum
/// values in range (one outside them was read as a default, differently on
/// different paths), a budget within the capacity, and protected ends
/// within the budget (prefill plans its keep ranges from them).
inline void require_rule(const site& w, const batch_state_view& st) {
  const decode_rule& r = st.rule;
  if (r.victim != victim_rule::lowest_score && r.victim != victim_rule::oldest && r.victim != victim_rule::random_priority)
    fail<invalid_argument>(w, "state.rule.victim", "= ", static_cast<int>(r.victim),
                           " is not a victim_rule (lowest_score, oldest or random_priority)");
  require_group_reduce(w, "state.rule.reduce", r.reduce);
  require_decay(w, "state.rule.decay", r.decay);
  if (r.budget < 1 || st.slots.capacity < std::int64_t{r.budget} + 1)
    fail<budget_error>(w, "state.rule.budget", "= ", r.budget, " does not fit capacity ", st.slots.capacity);
  if (r.protect.sinks < 0)
    fail<budget_error>(w, "state.rule.protect.sinks", "= ", r.protect.sinks, " is negative");
  if (r.protect.recent < 0)
    fail<budget_error>(w, "state.rule.protect.recent", "= ", r.protect.recent, " is negative");
  if (std::int64_t{r.protect.sinks} + r.protect.recent > r.budget)
    fail<budget_error>(w, "state.rule.protect", "sinks + recent = ", std::int64_t{r.protect.sinks} + r.protect.recent,
                       " exceeds the budget ", r.budget);
}

inline void require_state(const site& w, const batch_state_view& st) {
  require_not_null(w, "state.slots.positions", st.slots.positions);
  require_not_null(w, "state.slots.counts", st.slots.counts);
  require_not_null(w, "state.slots.next_slots", st.slots.next_slots);
  require_not_null(w, "state.slots.lengths", st.slots.lengths);
  require_not_null(w, "state.scores", st.scores);
  require_not_null(w, "state.score_buffer", st.score_buffer);
  require_not_null(w, "state.appended", st.appended);
  require_not_null(w, "state.marks.lengths", st.marks.lengths);
  require_not_null(w, "state.marks.full", st.marks.full);
  require_positive(w, "state.num_seqs", st.slots.num_seqs);
  require_positive(w, "state.num_heads", st.slots.num_heads);
  require_positive(w, "state.num_q_heads", st.num_q_heads);
  if (st.num_q_heads % st.slots.num_heads != 0)
    fail<invalid_argument>(w, "state.num_q_heads", "= ", st.num_q_heads, " is not a multiple of num_heads = ",
                           st.slots.num_heads);
  if (st.marks.words != row_marks::words_for(st.slots.num_heads))
    fail<invalid_argument>(w, "state.marks.words", "= ", st.marks.words, ", ", st.slots.num_heads, " heads need ",
                           row_marks::words_for(st.slots.num_heads));
  require_rule(w, st);
  if (st.rule.victim == victim_rule::random_priority) require_not_null(w, "state.streams", st.streams);
  // Anchor rows are indexed by the state's (sequence, head): another head count reads other memory.
  const key_anchor_view& a = st.anchors;
  if ((a.sums || a.units || a.upto) && a.num_heads != st.slots.num_heads)
    fail<invalid_argument>(w, "state.anchors.num_heads", "= ", a.num_heads, ", the state has ", st.slots.num_heads,
                           " heads");
}

inline void require_history(const site& w, const batch_state_view& st) {
  const history_view& hv = st.history;
  require_not_null(w, "state.history.keys", hv.keys);
  require_not_null(w, "state.history.values", hv.values);
  require_not_null(w, "state.history.rows", hv.rows);
  require_not_null(w, "state.history.cached", hv.cached);
  require_not_null(w, "state.history.work", hv.work);
  require_positive(w, "state.history.head_dim", hv.head_dim);
  if (hv.max_tokens < st.slots.capacity || hv.capacity != st.slots.capacity)
    fail<invalid_argument>(w, "state.history.max_tokens", "= ", hv.max_tokens, " does not match capacity ",
                           st.slots.capacity);
}

/// `accepts_retry`: the call is observe + evict, the one a retry set means something to.
inline void require_active(const site& w, const active_set& active, std::int32_t num_seqs,
                           bool accepts_retry = false) {
  if (active.retry && !accepts_retry)
    fail<invalid_argument>(w, "active.retry", "is set: only observe + evict takes a retry set");
  switch (active.mode) {
    case active_set::kind::all: return;
    case active_set::kind::flags: return require_not_null(w, "active.flags", active.flags);
    case active_set::kind::list:
      if (active.count < 0 || active.count > num_seqs)
        fail<out_of_range>(w, "active.count", "= ", active.count, " is outside [0, num_seqs = ", num_seqs, "]");
      if (active.count > 0) require_not_null(w, "active.list", active.list);
      return;
  }
  fail<invalid_argument>(w, "active.mode", "= ", static_cast<int>(active.mode), " is not an active_set kind");
}

/// A [B][heads][>= width] (or exactly `width` when !at_least) view.
template <class V>
void require_batch_extents(const site& w, const char* arg, const V& view, const std::int32_t (&expected)[V::rank],
                           bool last_at_least) {
  bool at_least[V::rank] = {};
  at_least[V::rank - 1] = last_at_least;
  require_extents(w, arg, view, expected, at_least);
}

/// The columns a decode input must have before the call: one. The rule is
/// the per-sequence API's: a column for every occupied slot, which a call
/// checks per (sequence, head) against its count (narrow_input), since the
/// counts live with the state (on CUDA, in device memory).
inline std::int32_t decode_width(const batch_state_view&) { return 1; }

inline void require_input(const site& w, const batch_state_view& st, const batch_probs& in) {
  require_batch_extents(w, "probs", in.probs, {st.num_seqs(), st.num_q_heads, decode_width(st)}, true);
}
inline void require_input(const site& w, const batch_state_view& st, const batch_head_scores& in) {
  require_batch_extents(w, "scores", in.scores, {st.num_seqs(), st.num_heads(), decode_width(st)}, true);
}
inline void require_input(const site& w, const batch_state_view& st, const batch_logits& in) {
  require_batch_extents(w, "logits", in.logits, {st.num_seqs(), st.num_q_heads, decode_width(st)}, true);
  require_batch_extents(w, "lse", in.lse, {st.num_seqs(), st.num_q_heads}, false);
  require_scale(w, in.scale);
  require_lse_base(w, "base", in.base);
}

/// A cache view that matches the state: same sequences and heads, at least
/// its capacity, valid strides.
template <class T, class Layout>
void require_cache(const site& w, const batch_state_view& st, const kv_view<T, Layout>& cache) {
  validate(w, cache);
  if (cache.num_seqs != st.num_seqs())
    fail<invalid_argument>(w, "cache.num_seqs", "= ", cache.num_seqs, ", the state has ", st.num_seqs());
  if (cache.num_heads != st.num_heads())
    fail<invalid_argument>(w, "cache.num_heads", "= ", cache.num_heads, ", the state has ", st.num_heads());
  if (cache.capacity < st.capacity())
    fail<invalid_argument>(w, "cache.capacity", "= ", cache.capacity, " is below the state's ", st.capacity());
}

template <class T, class Layout>
void require_input(const site& w, const batch_state_view& st, const key_norms<T, Layout>& in) {
  require_cache(w, st, in.cache);
  require_replacing_decay(w, "key_norms", st.rule.victim == victim_rule::lowest_score, st.rule.decay);
}

/// KeyDiff at decode time: an h2o state (decay 0) sized with key_diff_extent.
template <class T, class Layout>
void require_input(const site& w, const batch_state_view& st, const key_diff<T, Layout>& in) {
  require_cache(w, st, in.cache);
  if (st.rule.victim != victim_rule::lowest_score)
    fail<invalid_argument>(w, "in", "is key_diff, whose scores need a rule that evicts by score (h2o)");
  require_replacing_decay(w, "key_diff", true, st.rule.decay);
  if (!st.anchors.upto && !st.anchors.sums && !st.anchors.units)
    fail<invalid_argument>(w, "state", "has no KeyDiff anchors: size it with key_diff_extent(head_dim)");
  require_not_null(w, "state.anchors.sums", st.anchors.sums);
  require_not_null(w, "state.anchors.units", st.anchors.units);
  require_not_null(w, "state.anchors.upto", st.anchors.upto);
  if (st.anchors.head_dim != in.cache.head_dim)
    fail<invalid_argument>(w, "in.cache.head_dim", "= ", in.cache.head_dim, ", the state's KeyDiff anchors have ",
                           st.anchors.head_dim);
}

/// The LSE of a queries input. exact_greedy (the state with a history)
/// scores with its own softmax over the history and never reads it: there
/// it may be absent, as in the per-sequence call.
template <class Q>
void require_query_lse(const site& w, const batch_state_view& st, const batch_queries<Q>& in) {
  if (st.history.keys != nullptr && in.lse.data == nullptr) return;
  require_batch_extents(w, "lse", in.lse, {st.num_seqs(), st.num_q_heads}, false);
}

template <class Q, class T, class Layout>
void require_input(const site& w, const batch_state_view& st, const batch_queries<Q>& in,
                   const kv_view<T, Layout>& cache) {
  require_cache(w, st, cache);
  require_batch_extents(w, "q", in.q, {st.num_seqs(), st.num_q_heads, cache.head_dim}, false);
  require_query_lse(w, st, in);
  require_scale(w, in.scale);
  require_lse_base(w, "base", in.base);
}

/// The checks of an input scored without the cache (batch_probs,
/// batch_head_scores, batch_logits, key_norms, or a rule registered
/// elsewhere, whose require_input argument-dependent lookup finds): an
/// exact_greedy state refuses every one first, whatever its own checks
/// would say, then the input's own.
template <class Input>
void require_score_input(const site& w, const batch_state_view& st, const Input& in) {
  if (st.history.keys)
    fail<invalid_argument>(w, "in", "is not queries + LSE, which exact_greedy needs (with the cache)");
  require_input(w, st, in);
}

template <class T, class Layout>
void require_rows(const site& w, const char* arg, const batch_state_view& st, const batch_rows<T>& rows,
                  const kv_view<T, Layout>& cache) {
  require_batch_extents(w, arg, rows.rows, {st.num_seqs(), st.num_heads(), cache.head_dim}, false);
  if (rows.rows.strides[2] != 1)
    fail<invalid_argument>(w, concat(arg, ".strides[2]"), "= ", rows.rows.strides[2], ", rows must be contiguous");
}

}  // namespace detail
}  // namespace kvevict
