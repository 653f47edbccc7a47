#pragma once
// The batched calls on the host: the same calls, state and semantics as the
// CUDA launchers (kvevict/cuda/), over host memory. Engines that run on the
// CPU use them directly; tests use them as the oracle the kernels must match
// bit for bit. They loop over (sequence, head) and call the same
// KVEVICT_HOST_DEVICE rules the kernels call (decode_rules.hpp, step.hpp,
// score_sources.hpp, leave_one_out.hpp).
//
// Semantics (docs/semantics.md, "Batched steps"): arguments are checked
// first and throw; data problems leave the (b, h) concerned unchanged, let
// the rest of the batch step, and set the status word (status.hpp).
#include <cstdint>
#include <cstring>

#include "kvevict/batch/inputs.hpp"
#include "kvevict/batch/row_partial.hpp"
#include "kvevict/batch/score_sources.hpp"
#include "kvevict/batch/state.hpp"
#include "kvevict/batch/status.hpp"
#include "kvevict/batch/step.hpp"
#include "kvevict/batch/validate.hpp"
#include "kvevict/kv_view.hpp"
#include "kvevict/policy/decode_pass.hpp"
#include "kvevict/policy/decode_rules.hpp"
#include "kvevict/policy/evict_to.hpp"
#include "kvevict/policy/key_diff_anchor.hpp"
#include "kvevict/policy/leave_one_out.hpp"

namespace kvevict {
namespace detail {

inline void record_status(std::uint64_t* status, std::uint64_t word) noexcept {
  if (word < *status) *status = word;
}

/// Calls f(b) for every active sequence; reports list entries that are not
/// sequence indices, or that repeat a sequence (check_entry).
template <class F>
void for_each_active(const batch_state_view& st, const active_set& active, std::uint64_t* status, F f) {
  const std::int32_t entries = active.entries(st.num_seqs());
  for (std::int32_t i = 0; i < entries; ++i) {
    const checked_entry e = check_entry(active, i, st.num_seqs());
    record_status(status, e.word);
    if (e.sequence >= 0) f(e.sequence);
  }
}

/// The new scores of (b, h)'s slots [0, count) into next, a row at a time
/// in one pass (decode_pass.hpp), for the inputs whose slot dimension has
/// unit stride. False when the input has no such rows, holds a bad value or
/// a score would overflow: the per-slot path then runs and names it.
inline bool row_scores(const score_source<batch_probs>& source, std::int32_t b, std::int32_t h, float decay,
                       const float* score, const std::int32_t* positions, std::int32_t count, float* next) noexcept {
  if (source.in.probs.strides[2] != 1) return false;
  const std::int32_t g = source.group_size;
  return fold_and_add_probability_rows([&](std::int32_t j) { return &source.in.probs(b, h * g + j, 0); }, g,
                                       source.reduce, decay, score, positions, count, next);
}
inline bool row_scores(const score_source<batch_head_scores>& source, std::int32_t b, std::int32_t h, float decay,
                       const float* score, const std::int32_t* positions, std::int32_t count, float* next) noexcept {
  if (source.in.scores.strides[2] != 1) return false;
  return next_scores(decay, score, &source.in.scores(b, h, 0), positions, count, next);
}
template <class Source>
bool row_scores(const Source&, std::int32_t, std::int32_t, float, const float*, const std::int32_t*, std::int32_t,
                float*) noexcept {
  return false;  // logits and queries: an exponential per slot, the per-slot path
}

/// What observe_evict_head reports for a row whose victim the commit finds
/// while it copies the staged scores back (commit_and_find_victim).
inline constexpr std::int32_t victim_at_commit = -2;

/// Observe + evict of one (b, h) for the score-based policies: the updated
/// scores of slots [0, count) into the spare buffer, which the commit makes
/// current, and the victim (-1: none). The per-sequence policies pass
/// `staged`, a hot scratch row of theirs, instead; a row the vectorised
/// path scored then reports victim_at_commit (for the rules whose key is
/// the score or the position), and their commit copies the row back and
/// finds its victim in one pass.
template <class Source>
std::uint64_t observe_evict_head(const batch_state_view& st, std::int32_t b, std::int32_t h, const Source& source,
                                 std::int32_t& victim, float* staged = nullptr) {
  const std::uint64_t head = check_observe_head(st, source, b, h);
  if (head != batch_status_clear) return head;
  const std::int64_t bh = st.head_index(b, h);
  const std::int32_t count = st.slots.counts[bh], length = st.slots.lengths[b];  // occupied: exactly [0, count)
  const std::int32_t* positions = st.slots.positions_of(b, h);
  const float* current = st.scores_of(b, h);
  float* updated = staged ? staged : st.spare_scores_of(b, h);
  // The hot path: whole rows, checked by reductions, bit for bit the per-slot rules.
  if (row_scores(source, b, h, st.rule.decay, current, positions, count, updated)) {
    if (count <= st.rule.budget) victim = -1;
    else if (st.rule.victim == victim_rule::random_priority)
      victim = pick_victim(st.rule, positions, updated, count, length, st.stream_of(b), h);
    else victim = staged ? victim_at_commit : find_victim(st.rule, updated, positions, count, length);
    return batch_status_clear;
  }
  // Slot by slot, as the kernels do: the first problem is the lowest slot's.
  const victim_order order = st.order_of(b, h);
  row_partial part;
  for (std::int32_t s = 0; s < count && part.problem == batch_status_clear; ++s)
    observe_slot(st.rule, order, b, h, s, positions[s], length, current[s], source.increment(b, h, s), updated, part);
  if (part.problem != batch_status_clear) return part.problem;
  victim = count > st.rule.budget ? part.slot : -1;
  return batch_status_clear;
}

/// exact_greedy's scores of (b, h): errors[i] = the leave-one-out error of
/// cached position members[i] (i < n; the members are exactly the cached
/// positions) summed over the query heads of group h in ascending order, as
/// exact_greedy_policy sums, against history rows [0, length). Scratch: the
/// history's cached flags and the front of its work.
template <class Q>
void group_leave_one_out(const batch_state_view& st, std::int32_t b, std::int32_t h, const batch_queries<Q>& in,
                         const std::int32_t* members, std::int32_t n, std::int32_t length, double* errors) {
  const history_view& hv = st.history;
  const std::int64_t bh = st.head_index(b, h);
  const std::int32_t g = st.group_size();
  std::uint8_t* cached = hv.cached + bh * hv.max_tokens;
  for (std::int32_t p = 0; p < length; ++p) cached[p] = 0;
  for (std::int32_t i = 0; i < n; ++i) {
    cached[members[i]] = 1;
    errors[i] = 0.0;
  }
  const float* keys = hv.keys + bh * hv.max_tokens * hv.head_dim;
  const float* values = hv.values + bh * hv.max_tokens * hv.head_dim;
  for (std::int32_t q = h * g; q < (h + 1) * g; ++q)
    leave_one_out_errors(&in.q(b, q, 0), in.q.strides[2], keys, values, hv.head_dim, in.scale, length, cached,
                         members, n, errors, hv.work + bh * hv.work_doubles());
}

/// Where group_leave_one_out's errors go: the last `capacity` doubles of
/// (b, h)'s work (leave_one_out_errors uses the front).
inline double* leave_one_out_slot_errors(const batch_state_view& st, std::int64_t bh) noexcept {
  const history_view& hv = st.history;
  return hv.work + (bh + 1) * hv.work_doubles() - hv.capacity;
}

/// exact_greedy: the first problem of group h's query rows (non_finite_query
/// of the lowest query head), or batch_status_clear.
template <class Q>
std::uint64_t query_problem(const batch_state_view& st, std::int32_t b, std::int32_t h, const batch_queries<Q>& in) {
  const std::int32_t g = st.group_size();
  for (std::int32_t q = h * g; q < (h + 1) * g; ++q)
    for (std::int32_t i = 0; i < st.history.head_dim; ++i)
      if (classify_input(to_float(in.q(b, q, i)), false) != batch_code::ok)
        return pack_status(b, h, q, batch_code::non_finite_query);
  return batch_status_clear;
}

/// Observe + evict of one (b, h) for exact_greedy: record every position not
/// yet in the history (the tokens of the last append, one or several; each
/// must still be cached) from the cache, score every cached slot with its
/// leave-one-out error, evict the lowest (score, position). Checks, in the
/// kernel's order: history, queries, pages of the new rows, their values.
template <class Q, class T, class Layout>
std::uint64_t exact_greedy_head(const batch_state_view& st, std::int32_t b, std::int32_t h,
                                const batch_queries<Q>& in, const kv_view<T, Layout>& cache, std::int32_t& victim,
                                float* staged = nullptr) {
  const history_view& hv = st.history;
  const std::int64_t bh = st.head_index(b, h);
  const std::int32_t d = hv.head_dim, length = st.slots.lengths[b];
  if (!st.appended[bh]) return pack_status(b, h, 0, batch_code::not_appended);
  if (length > hv.max_tokens) return pack_status(b, h, 0, batch_code::history_full);
  const std::int32_t first = hv.rows[bh];  // the oldest position not recorded yet
  const std::int32_t count = st.slots.counts[bh];
  const std::int32_t* positions = st.slots.positions_of(b, h);  // occupied: exactly [0, count) after an append
  std::int32_t unrecorded = 0;
  for (std::int32_t s = 0; s < count; ++s) unrecorded += positions[s] >= first;
  // Positions are distinct and below length: all of [first, length) is cached
  // exactly when that many cached positions are >= first.
  if (first >= length || unrecorded != length - first) return pack_status(b, h, 0, batch_code::history_gap);
  const std::uint64_t queries = query_problem(st, b, h, in);
  if (queries != batch_status_clear) return queries;
  const std::uint64_t scales = kv_scale_problem(cache, b, h);
  if (scales != batch_status_clear) return scales;
  for (std::int32_t s = 0; s < count; ++s)
    if (positions[s] >= first && !row_is_mapped(cache, b, s)) return pack_status(b, h, s, batch_code::bad_page);
  float* keys = hv.keys + bh * hv.max_tokens * d;
  float* values = hv.values + bh * hv.max_tokens * d;
  const float k_scale = cache.k_scale(h), v_scale = cache.v_scale(h);
  std::int32_t non_finite = -1;  // the lowest slot with a non-finite row; every row is written either way
  for (std::int32_t s = 0; s < count; ++s) {
    const std::int32_t p = positions[s];
    if (p < first) continue;
    for (std::int32_t i = 0; i < d; ++i) {
      const float k = kv_value(cache.k_row(b, h, s)[i], k_scale), v = kv_value(cache.v_row(b, h, s)[i], v_scale);
      if ((classify_input(k, false) != batch_code::ok || classify_input(v, false) != batch_code::ok) &&
          non_finite < 0)
        non_finite = s;
      keys[std::int64_t{p} * d + i] = k;  // beyond rows: not part of the state until the commit
      values[std::int64_t{p} * d + i] = v;
    }
  }
  if (non_finite >= 0) return pack_status(b, h, non_finite, batch_code::non_finite_kv);
  double* errors = leave_one_out_slot_errors(st, bh);
  group_leave_one_out(st, b, h, in, positions, count, length, errors);  // a prefix: member i is slot i
  float* updated = staged ? staged : st.spare_scores_of(b, h);  // as observe_evict_head
  for (std::int32_t s = 0; s < count; ++s) updated[s] = static_cast<float>(errors[s]);
  victim = count > st.rule.budget
               ? pick_victim(st.rule, positions, updated, count, length, std::uint64_t(b), h)
               : -1;
  return batch_status_clear;  // the rows join the history when the head commits (commit_history)
}

/// exact_greedy's commit beside the scores: the rows exact_greedy_head
/// recorded are (b, h)'s history now.
inline void commit_history(const batch_state_view& st, std::int32_t b, std::int32_t h) noexcept {
  st.history.rows[st.head_index(b, h)] = st.slots.lengths[b];
}

/// KeyDiff's decision of one (b, h): its anchor brought up to the cached
/// keys (a refused key leaves it as it was; the slot pass names it), then
/// observe + evict of the scores against it.
template <class T, class Layout>
std::uint64_t key_diff_head(const batch_state_view& st, std::int32_t b, std::int32_t h,
                            const score_source<key_diff<T, Layout>>& source, std::int32_t& victim,
                            float* staged = nullptr) {
  const std::int64_t bh = st.head_index(b, h);
  refresh_key_anchor(st.anchors, source.in.cache, b, h, st.slots.positions_of(b, h),
                     occupied_end(st.slots.counts[bh], st.slots.next_slots[bh]), st.slots.lengths[b]);
  return observe_evict_head(st, b, h, source, victim, staged);
}

/// Append of sequence b: its next position goes to every head's next slot
/// (write(h, slot) first puts the head's new rows there), or, when a head
/// has no free slot or mapped(slot) fails, nothing changes and the first
/// such head's status word is returned.
template <class Mapped, class Write>
std::uint64_t append_sequence(const batch_state_view& st, std::int32_t b, Mapped mapped, Write write) {
  const std::uint64_t problem = append_problem(st, b, mapped);
  if (problem != batch_status_clear) return problem;
  for (std::int32_t h = 0; h < st.num_heads(); ++h) {
    write(h, st.slots.next_slots[st.head_index(b, h)]);
    commit_append(st, b, h, st.slots.lengths[b]);
  }
  ++st.slots.lengths[b];
  return batch_status_clear;
}

/// Observe + evict of one (b, h): head(b, h, victim) decides it; a good
/// one is committed, then committed(b, h, victim) runs (KeyDiff's anchor
/// follows the victim).
template <class Head, class Committed>
void observe_evict_row(const batch_state_view& st, std::int32_t b, std::int32_t h, std::int32_t* victims,
                       std::uint64_t* status, Head& head, Committed& committed) {
  std::int32_t victim = -1;
  const std::uint64_t problem = head(b, h, victim);
  if (problem == batch_status_clear) {
    commit_observe_evict(st, b, h, victim);
    committed(b, h, victim);
  } else {
    record_status(status, problem);
  }
  if (victims) victims[st.head_index(b, h)] = problem == batch_status_clear ? victim : -1;
}

/// Observe + evict of every stepped (b, h) (observe_evict_row).
template <class Head, class Committed>
void observe_evict_all(const batch_state_view& st, const active_set& active, std::int32_t* victims,
                       std::uint64_t* status, Head head, Committed committed) {
  for_each_active(st, active, status, [&](std::int32_t b) {
    for (std::int32_t h = 0; h < st.num_heads(); ++h)
      if (!observe_skips(st, active, b, h)) observe_evict_row(st, b, h, victims, status, head, committed);
  });
}

template <class Head>
void observe_evict_all(const batch_state_view& st, const active_set& active, std::int32_t* victims,
                       std::uint64_t* status, Head head) {
  observe_evict_all(st, active, victims, status, head, [](std::int32_t, std::int32_t, std::int32_t) {});
}

}  // namespace detail

/// Forgets the active sequences: every slot free, scores 0, length 0, no
/// history. streams (if given): entry i's new random stream (at most
/// max_random_stream); otherwise the sequence index.
inline void reset_batch_sequences(const batch_state_view& st, const active_set& active,
                                  const std::uint64_t* streams = nullptr) {
  const detail::site w{"batch", "reset_sequences"};
  detail::require_state(w, st);
  detail::require_active(w, active, st.num_seqs());
  const std::int32_t entries = active.entries(st.num_seqs());
  for (std::int32_t i = 0; i < entries; ++i) {  // validate everything first: this call throws, it has no status
    const std::int32_t b = active.sequence(i, st.num_seqs());
    if (b == -2) detail::fail<out_of_range>(w, detail::concat("active.list[", i, "]"), "= ", active.list[i],
                                            " is outside [0, num_seqs = ", st.num_seqs(), ")");
    if (detail::check_entry(active, i, st.num_seqs()).word != batch_status_clear)
      detail::fail<invalid_argument>(w, detail::concat("active.list[", i, "]"), "= ", b,
                                     " repeats an earlier entry: a list names each sequence once");
    if (b >= 0 && streams && streams[i] > max_random_stream)
      detail::fail<out_of_range>(w, detail::concat("streams[", i, "]"), "= ", streams[i], " exceeds max_random_stream");
  }
  for (std::int32_t i = 0; i < entries; ++i) {
    const std::int32_t b = active.sequence(i, st.num_seqs());
    if (b < 0) continue;
    detail::clear_sequence_marks(st, b, 0, 1);
    for (std::int32_t h = 0; h < st.num_heads(); ++h) {
      detail::clear_head_slots(st, b, h, 0, st.capacity(), 1);
      detail::clear_head_counters(st, b, h);
    }
    st.slots.lengths[b] = 0;
    if (st.streams) st.streams[b] = streams ? streams[i] : std::uint64_t(b);
  }
}

/// Initialises a state carved by make_batch_state in host memory.
inline void init_batch_state(const batch_state_view& st) { reset_batch_sequences(st, active_set::all()); }

/// Append (step 1 of the decode cycle) for every active sequence: its next
/// position goes to each head's next slot with score 0. A sequence with a
/// head at budget + 1 tokens is left unchanged (status no_free_slot).
inline void batched_append(const batch_state_view& st, const active_set& active, std::uint64_t* status) {
  const detail::site w{"batch", "append"};
  detail::require_state(w, st);
  detail::require_active(w, active, st.num_seqs());
  detail::require_not_null(w, "status", status);
  detail::for_each_active(st, active, status, [&](std::int32_t b) {
    detail::record_status(status, detail::append_sequence(
                                      st, b, [](std::int32_t) { return true; }, [](std::int32_t, std::int32_t) {}));
  });
}

/// Append fused with the scatter of the new K/V rows: k_new(b, h, :) and
/// v_new(b, h, :) go to (b, h)'s next slot of `cache`.
template <class T, class Layout>
void batched_append(const batch_state_view& st, const active_set& active, const kv_view<T, Layout>& cache,
                    const batch_rows<T>& k_new, const batch_rows<T>& v_new, std::uint64_t* status) {
  const detail::site w{"batch", "append"};
  detail::require_state(w, st);
  detail::require_active(w, active, st.num_seqs());
  detail::require_not_null(w, "status", status);
  detail::require_cache(w, st, cache);
  detail::require_rows(w, "k_new", st, k_new, cache);
  detail::require_rows(w, "v_new", st, v_new, cache);
  detail::for_each_active(st, active, status, [&](std::int32_t b) {
    detail::record_status(
        status, detail::append_sequence(
                    st, b, [&](std::int32_t slot) { return row_is_mapped(cache, b, slot); },
                    [&](std::int32_t h, std::int32_t slot) {
                      std::memcpy(cache.k_row(b, h, slot), &k_new.rows(b, h, 0), sizeof(T) * std::size_t(cache.head_dim));
                      std::memcpy(cache.v_row(b, h, slot), &v_new.rows(b, h, 0), sizeof(T) * std::size_t(cache.head_dim));
                    }));
  });
}

/// Observe + evict, fused, for every active (b, h): adds each occupied
/// slot's increment from `in` and, above the budget, frees the policy's
/// victim. `in`: batch_probs, batch_head_scores, batch_logits, key_norms,
/// or the input of any rule registered as design.md ("Adding a scoring
/// rule") says: a score_source specialization and a require_input overload
/// that argument-dependent lookup finds (in the input's namespace).
/// victims (optional, [B][H]): the freed slot of each stepped (b, h), or -1.
template <class Input>
void batched_observe_evict(const batch_state_view& st, const active_set& active, const Input& in,
                           std::int32_t* victims, std::uint64_t* status) {
  const detail::site w{"batch", "observe_evict"};
  detail::require_state(w, st);
  detail::require_active(w, active, st.num_seqs(), true);
  detail::require_not_null(w, "status", status);
  detail::require_score_input(w, st, in);
  const score_source<Input> source{in, st.group_size(), st.rule.reduce};
  detail::observe_evict_all(st, active, victims, status, [&](std::int32_t b, std::int32_t h, std::int32_t& victim) {
    return detail::observe_evict_head(st, b, h, source, victim);
  });
}

/// The one-launch decode step (docs/semantics.md, "Batched steps"): for
/// every active sequence, append (its next position to each head's next
/// slot, where the engine has written the new K/V rows), then observe +
/// evict of each head from `in`, whose columns cover the appended slots.
/// A sequence with a head at budget + 1 tokens is left unchanged
/// (no_free_slot) and steps no head; a head with bad input is left as the
/// append left it, as with the two calls. The same state, victims and
/// status word as batched_append followed by batched_observe_evict over
/// the sequences that appended; CUDA's gpu::batched_step does it in one
/// kernel. `in`: as batched_observe_evict's (not KeyDiff, whose anchors
/// need a launch of their own, nor queries). Retry sets are refused, as
/// append refuses them.
template <class Input>
void batched_step(const batch_state_view& st, const active_set& active, const Input& in, std::int32_t* victims,
                  std::uint64_t* status) {
  const detail::site w{"batch", "step"};
  detail::require_state(w, st);
  detail::require_active(w, active, st.num_seqs());
  detail::require_not_null(w, "status", status);
  detail::require_score_input(w, st, in);
  const score_source<Input> source{in, st.group_size(), st.rule.reduce};
  auto head = [&](std::int32_t b, std::int32_t h, std::int32_t& victim) {
    return detail::observe_evict_head(st, b, h, source, victim);
  };
  auto committed = [](std::int32_t, std::int32_t, std::int32_t) {};
  detail::for_each_active(st, active, status, [&](std::int32_t b) {
    const std::uint64_t refused =
        detail::append_sequence(st, b, [](std::int32_t) { return true; }, [](std::int32_t, std::int32_t) {});
    for (std::int32_t h = 0; h < st.num_heads(); ++h) {
      if (refused == batch_status_clear) detail::observe_evict_row(st, b, h, victims, status, head, committed);
      else if (victims) victims[st.head_index(b, h)] = -1;
    }
    detail::record_status(status, refused);
  });
}

/// Observe + evict by KeyDiff (key_diff_anchor.hpp): each (b, h)'s anchor
/// takes in the keys appended since its last step (or counts every cached
/// key when stale), every cached key scores -cos(k, anchor), and the
/// victim's key leaves the anchor. The state must be an h2o state with
/// decay 0 sized with key_diff_extent(cache.head_dim).
template <class T, class Layout>
void batched_observe_evict(const batch_state_view& st, const active_set& active, const key_diff<T, Layout>& in,
                           std::int32_t* victims, std::uint64_t* status) {
  const detail::site w{"batch", "observe_evict"};
  detail::require_state(w, st);
  detail::require_active(w, active, st.num_seqs(), true);
  detail::require_not_null(w, "status", status);
  detail::require_input(w, st, in);
  const score_source<key_diff<T, Layout>> source{in, st.anchors};
  detail::observe_evict_all(
      st, active, victims, status,
      [&](std::int32_t b, std::int32_t h, std::int32_t& victim) { return detail::key_diff_head(st, b, h, source, victim); },
      [&](std::int32_t b, std::int32_t h, std::int32_t victim) { detail::after_commit(source, st, b, h, victim); });
}

/// Observe + evict from queries + LSE, the logits recomputed from the keys
/// of `cache`; for exact_greedy (a state with a history) the leave-one-out
/// step, which also records the newest K/V rows.
template <class Q, class T, class Layout>
void batched_observe_evict(const batch_state_view& st, const active_set& active, const batch_queries<Q>& in,
                           const kv_view<T, Layout>& cache, std::int32_t* victims, std::uint64_t* status) {
  const detail::site w{"batch", "observe_evict"};
  detail::require_state(w, st);
  detail::require_active(w, active, st.num_seqs(), true);
  detail::require_not_null(w, "status", status);
  detail::require_input(w, st, in, cache);
  if (st.history.keys) {
    detail::require_history(w, st);
    if (cache.head_dim != st.history.head_dim)
      detail::fail<invalid_argument>(w, "cache.head_dim", "= ", cache.head_dim, ", the history has ",
                                     st.history.head_dim);
    detail::observe_evict_all(
        st, active, victims, status,
        [&](std::int32_t b, std::int32_t h, std::int32_t& victim) {
          return detail::exact_greedy_head(st, b, h, in, cache, victim);
        },
        [&](std::int32_t b, std::int32_t h, std::int32_t) { detail::commit_history(st, b, h); });
    return;
  }
  const query_source<Q, T, Layout> source{in, cache, st.group_size(), st.rule.reduce};
  detail::observe_evict_all(st, active, victims, status, [&](std::int32_t b, std::int32_t h, std::int32_t& victim) {
    return detail::observe_evict_head(st, b, h, source, victim);
  });
}

}  // namespace kvevict
