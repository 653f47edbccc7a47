#pragma once
// evict_to on the host (docs/semantics.md, "Multi-token steps"): after a
// step that added several tokens (batched_append_tokens, multi_token.hpp)
// and its observe + evict, every surplus token of each active (b, h) goes
// at once, the policy's order choosing the victims (policy/evict_to.hpp:
// free_surplus and the hole refill), exact_greedy's greedily with the
// step's queries. The per-sequence policies run evict_to_sequence for one
// sequence; the CUDA launchers (kvevict/cuda/evict_to.cuh) make the same
// decisions.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kvevict/batch/host_backend.hpp"
#include "kvevict/batch/inputs.hpp"
#include "kvevict/batch/state.hpp"
#include "kvevict/batch/status.hpp"
#include "kvevict/batch/step.hpp"
#include "kvevict/batch/validate.hpp"
#include "kvevict/kv_view.hpp"
#include "kvevict/policy/evict_to.hpp"

namespace kvevict {
namespace detail {

/// target in [sinks + recent, capacity], and a victim_scratch, where every
/// policy's evict_to lists its victims and holes; `greedy`: whether the
/// call takes the step's queries, which exact_greedy's greedy rounds need
/// and only it uses.
inline void require_target(const site& w, const batch_state_view& st, std::int32_t target, bool greedy = false) {
  require_not_null(w, "state.victim_scratch", st.victim_scratch);
  if (st.history.keys && !greedy)
    fail<invalid_argument>(w, "state", "is exact_greedy's: its greedy evict_to re-scores the tokens with the "
                                       "step's queries; call the batched_evict_to overload that takes them "
                                       "(batch_queries)");
  if (!st.history.keys && greedy)
    fail<invalid_argument>(w, "state", "is not exact_greedy's (it has no history): the batched_evict_to overload "
                                       "with queries is exact_greedy's; call the one without them");
  const std::int64_t protected_max = std::int64_t{st.rule.protect.sinks} + st.rule.protect.recent;
  if (target < protected_max || target > st.capacity())
    fail<budget_error>(w, "target", "= ", target, " is outside [sinks + recent = ", protected_max,
                       ", capacity = ", st.capacity(), "]");
}

/// The queries of exact_greedy's evict_to: the shapes observe + evict takes,
/// head_dim the history's.
template <class Q>
void require_greedy_queries(const site& w, const batch_state_view& st, const batch_queries<Q>& in) {
  require_history(w, st);
  require_batch_extents(w, "q", in.q, {st.num_seqs(), st.num_q_heads, st.history.head_dim}, false);
  require_query_lse(w, st, in);
  require_scale(w, in.scale);
  require_lse_base(w, "base", in.base);
}

/// What evict_to did to one (b, h).
struct evict_to_result {
  std::int32_t freed = 0;  ///< tokens freed
  std::int32_t moves = 0;  ///< rows moved
};

/// evict_to of one (b, h): free_victims(count) frees the surplus over
/// `target` and returns how many; then the holes are refilled,
/// on_move(i, from, to) per row move. The caller checked the head.
template <class FreeVictims, class OnMove>
evict_to_result evict_to_head(const batch_state_view& st, std::int32_t b, std::int32_t h, FreeVictims free_victims,
                              OnMove on_move) {
  const std::int64_t bh = st.head_index(b, h);
  std::int32_t* scratch = st.victim_scratch + bh * st.capacity();
  const std::int32_t count = st.slots.counts[bh];
  const std::int32_t end = occupied_end(count, st.slots.next_slots[bh]);
  // Whether or not it frees a token, evict_to is how an engine says the
  // cached keys may have changed (docs/policies.md): the anchor counts afresh.
  mark_anchor_stale(st, bh);
  evict_to_result r;
  r.freed = free_victims(count);
  if (r.freed == 0) return r;
  st.slots.counts[bh] = count - r.freed;
  r.moves = refill_holes(st.slots.positions_of(b, h), st.scores_of(b, h), st.spare_scores_of(b, h), count - r.freed,
                         st.rule.budget, end, scratch, st.slots.next_slots[bh], on_move);
  mark_row(st, b, h, st.slots.lengths[b], st.slots.next_slots[bh]);
  return r;
}

/// The victims of the score-based policies and random (free_surplus).
inline auto rule_victims(const batch_state_view& st, std::int32_t b, std::int32_t h, std::int32_t target) {
  return [&st, b, h, target](std::int32_t count) {
    return free_surplus(st.rule, st.slots.positions_of(b, h), st.scores_of(b, h), st.capacity(), count,
                        st.slots.lengths[b], target, st.stream_of(b), h,
                        st.victim_scratch + st.head_index(b, h) * st.capacity());
  };
}

/// One round of exact_greedy's removal on (b, h): every cached token is
/// scored with its leave-one-out error for the queries `in` (the tokens
/// freed so far have joined the evicted set), then the lowest (score,
/// position) among the unprotected is freed (position -1, score 0) and its
/// slot returned. The round of evict_to and of prefill alike.
template <class Q>
std::int32_t greedy_round(const batch_state_view& st, std::int32_t b, std::int32_t h, const batch_queries<Q>& in) {
  const std::int64_t bh = st.head_index(b, h);
  const std::int32_t length = st.slots.lengths[b];
  std::int32_t* positions = st.slots.positions_of(b, h);
  float* scores = st.scores_of(b, h);
  std::int32_t* members = st.victim_scratch + bh * st.capacity();
  double* errors = leave_one_out_slot_errors(st, bh);
  std::int32_t n = 0;
  for (std::int32_t s = 0; s < st.capacity(); ++s)
    if (positions[s] >= 0) members[n++] = positions[s];
  group_leave_one_out(st, b, h, in, members, n, length, errors);
  for (std::int32_t s = 0, i = 0; s < st.capacity(); ++s)
    if (positions[s] >= 0) scores[s] = static_cast<float>(errors[i++]);
  const std::int32_t victim = pick_victim(st.rule, positions, scores, st.capacity(), length, std::uint64_t(b), h);
  if (victim >= 0) {
    positions[victim] = -1;
    scores[victim] = 0.0f;
  }
  return victim;
}

/// exact_greedy's victims, one greedy round each. Re-scoring a set that
/// observe + evict scored and left unchanged gives the same bits, so the
/// first round is evict's choice whether or not observe + evict evicted.
template <class Q>
auto greedy_victims(const batch_state_view& st, std::int32_t b, std::int32_t h, std::int32_t target,
                    const batch_queries<Q>& in) {
  return [&st, &in, b, h, target](std::int32_t count) {
    const std::int32_t surplus = count - target;
    for (std::int32_t round = 0; round < surplus; ++round) greedy_round(st, b, h, in);  // target >= sinks + recent
    return surplus > 0 ? surplus : 0;
  };
}

/// evict_to's checks of a (b, h), in the order both devices make them, as
/// keys whose minimum is the first that fails (threads of a kernel each
/// check a share and reduce): appended but not observed; then, for a head
/// above the target, exact_greedy's history and queries, and the pages of
/// every slot the call may touch.
struct evict_to_check {
  enum class stage : std::uint32_t { not_observed = 0, history_gap = 1, query = 2, bad_page = 3 };
  static constexpr std::uint64_t none = ~std::uint64_t{0};

  KVEVICT_HOST_DEVICE static std::uint64_t key(stage s, std::int32_t index) noexcept {
    return std::uint64_t(s) << 32 | std::uint32_t(index);
  }
  KVEVICT_HOST_DEVICE static std::uint64_t word(std::uint64_t key, std::int32_t b, std::int32_t h) noexcept {
    if (key == none) return batch_status_clear;
    const std::int32_t index = static_cast<std::int32_t>(key & 0xFFFFFFFFu);
    switch (static_cast<stage>(key >> 32)) {
      case stage::not_observed: return pack_status(b, h, index, batch_code::not_observed);
      case stage::history_gap: return pack_status(b, h, index, batch_code::history_gap);
      case stage::query: return pack_status(b, h, index, batch_code::non_finite_query);
      default: return pack_status(b, h, index, batch_code::bad_page);
    }
  }
  /// Slot s may be touched: it is occupied, or a kept row may land there.
  KVEVICT_HOST_DEVICE static bool touches(std::int32_t position, std::int32_t s, std::int32_t target) noexcept {
    return position >= 0 || s <= target;
  }
};

/// Slot j's key in evict_to's victim selection of (b, h) (the CUDA path
/// selects the lowest count - target of these in one pass): the step's
/// victim key of an unprotected occupied slot; all ones for a free or
/// protected slot, never taken, since a head gives at most its unprotected
/// tokens (target >= sinks + recent). The host's free_surplus takes the same
/// victims among the unprotected alone.
KVEVICT_HOST_DEVICE inline std::uint64_t evict_to_key(const batch_state_view& st, std::int32_t b, std::int32_t h,
                                                      const victim_order& order, std::int32_t j) noexcept {
  const std::int32_t p = st.slots.positions_of(b, h)[j];
  if (p < 0 || st.rule.protect.covers(p, st.slots.lengths[b])) return ~std::uint64_t{0};
  return order.key(st.scores_of(b, h)[j], p);
}

/// Why (b, h) cannot take evict_to (evict_to_check), or batch_status_clear.
template <class Mapped, class Queries = std::nullptr_t>
std::uint64_t evict_to_problem(const batch_state_view& st, std::int32_t b, std::int32_t h, std::int32_t target,
                               Mapped mapped, const Queries* queries = nullptr) {
  using check = evict_to_check;
  const std::int64_t bh = st.head_index(b, h);
  if (st.appended[bh]) return check::word(check::key(check::stage::not_observed, 0), b, h);
  if (st.slots.counts[bh] <= target) return batch_status_clear;
  if constexpr (!std::is_same_v<Queries, std::nullptr_t>) {
    if (st.history.rows[bh] != st.slots.lengths[b]) return check::word(check::key(check::stage::history_gap, 0), b, h);
    const std::uint64_t problem = query_problem(st, b, h, *queries);
    if (problem != batch_status_clear) return problem;
  }
  const std::int32_t* positions = st.slots.positions_of(b, h);
  for (std::int32_t s = 0; s < st.capacity(); ++s)
    if (check::touches(positions[s], s, target) && !mapped(s))
      return check::word(check::key(check::stage::bad_page, s), b, h);
  return batch_status_clear;
}

/// evict_to of every head of sequence b: problem_of(b, h, mapped) refuses a
/// head (its word goes to `status`), else victims_of(b, h) frees its
/// surplus and the refill calls on_move(h, i, from, to) per row move; then
/// on_done(h, result) for each head that took the call.
template <class Mapped, class Problem, class Victims, class OnMove, class OnDone>
void evict_to_sequence(const batch_state_view& st, std::int32_t b, std::uint64_t* status, Mapped mapped,
                       Problem problem_of, Victims victims_of, OnMove on_move, OnDone on_done) {
  for (std::int32_t h = 0; h < st.num_heads(); ++h) {
    const std::uint64_t problem = problem_of(b, h, mapped);
    if (problem != batch_status_clear) {
      record_status(status, problem);
      continue;
    }
    on_done(h, evict_to_head(st, b, h, victims_of(b, h),
                             [&](std::int32_t i, std::int32_t from, std::int32_t to) { on_move(h, i, from, to); }));
  }
}

/// The rows of a move of (b, h) in `cache`: from slot `from` to slot `to`.
template <class T, class Layout>
void move_rows(const kv_view<T, Layout>& cache, std::int32_t b, std::int32_t h, std::int32_t from, std::int32_t to) {
  std::memcpy(cache.k_row(b, h, to), cache.k_row(b, h, from), sizeof(T) * std::size_t(cache.head_dim));
  std::memcpy(cache.v_row(b, h, to), cache.v_row(b, h, from), sizeof(T) * std::size_t(cache.head_dim));
}

/// batched_evict_to with the rows moved in `cache`; freed[b * H + h] (if
/// given) the tokens each stepped head freed, 0 for a refused one.
template <class T, class Layout, class Problem, class Victims>
void evict_to_all(const batch_state_view& st, const active_set& active, const kv_view<T, Layout>& cache,
                  std::int32_t* freed, std::uint64_t* status, Problem problem_of, Victims victims_of) {
  for_each_active(st, active, status, [&](std::int32_t b) {
    if (freed)
      for (std::int32_t h = 0; h < st.num_heads(); ++h) freed[st.head_index(b, h)] = 0;
    evict_to_sequence(
        st, b, status, [&](std::int32_t s) { return row_is_mapped(cache, b, s); }, problem_of, victims_of,
        [&](std::int32_t h, std::int32_t, std::int32_t from, std::int32_t to) { move_rows(cache, b, h, from, to); },
        [&](std::int32_t h, const evict_to_result& r) {
          if (freed) freed[st.head_index(b, h)] = r.freed;
        });
  });
}

/// batched_evict_to with the moves reported: moves[(b * H + h) * capacity +
/// i], move_counts[b * H + h] (0 for a refused head).
template <class Problem, class Victims>
void evict_to_all(const batch_state_view& st, const active_set& active, slot_move* moves, std::int32_t* move_counts,
                  std::uint64_t* status, Problem problem_of, Victims victims_of) {
  for_each_active(st, active, status, [&](std::int32_t b) {
    for (std::int32_t h = 0; h < st.num_heads(); ++h) move_counts[st.head_index(b, h)] = 0;
    evict_to_sequence(
        st, b, status, [](std::int32_t) { return true; }, problem_of, victims_of,
        [&](std::int32_t h, std::int32_t i, std::int32_t from, std::int32_t to) {
          moves[st.head_index(b, h) * st.capacity() + i] = slot_move{from, to};
        },
        [&](std::int32_t h, const evict_to_result& r) { move_counts[st.head_index(b, h)] = r.moves; });
  });
}

}  // namespace detail

/// evict_to(target) for every active (b, h), after observe + evict: each
/// head above `target` keeps its protected tokens and the best of the rest,
/// `target` in all, and the kept rows move in `cache` so the occupied slots
/// are [0, target + 1) but one hole, the next slot (policy/evict_to.hpp).
/// freed (optional, [B][H]): tokens freed per stepped head. A head that was
/// appended but not observed, or whose rows are not mapped, is left
/// unchanged (not_observed, bad_page). exact_greedy takes the overload with
/// the step's queries.
template <class T, class Layout>
void batched_evict_to(const batch_state_view& st, const active_set& active, std::int32_t target,
                      const kv_view<T, Layout>& cache, std::int32_t* freed, std::uint64_t* status) {
  const detail::site w{"batch", "evict_to"};
  detail::require_state(w, st);
  detail::require_active(w, active, st.num_seqs());
  detail::require_not_null(w, "status", status);
  detail::require_target(w, st, target);
  detail::require_cache(w, st, cache);
  detail::evict_to_all(
      st, active, cache, freed, status,
      [&](std::int32_t b, std::int32_t h, auto mapped) { return detail::evict_to_problem(st, b, h, target, mapped); },
      [&](std::int32_t b, std::int32_t h) { return detail::rule_victims(st, b, h, target); });
}

/// The same for engines that move rows themselves: moves[(b * H + h) *
/// capacity + i] for i < move_counts[b * H + h] (fewer than the tokens
/// freed) says which slot's K/V rows go where; sources and destinations are
/// distinct, so any order works. The counts and moves of sequences the call
/// does not step are left as they were: read only the active sequences'.
inline void batched_evict_to(const batch_state_view& st, const active_set& active, std::int32_t target,
                             slot_move* moves, std::int32_t* move_counts, std::uint64_t* status) {
  const detail::site w{"batch", "evict_to"};
  detail::require_state(w, st);
  detail::require_active(w, active, st.num_seqs());
  detail::require_not_null(w, "status", status);
  detail::require_not_null(w, "moves", moves);
  detail::require_not_null(w, "move_counts", move_counts);
  detail::require_target(w, st, target);
  detail::evict_to_all(
      st, active, moves, move_counts, status,
      [&](std::int32_t b, std::int32_t h, auto mapped) { return detail::evict_to_problem(st, b, h, target, mapped); },
      [&](std::int32_t b, std::int32_t h) { return detail::rule_victims(st, b, h, target); });
}

/// exact_greedy's evict_to(target), greedily: for every active (b, h) above
/// `target`, one victim at a time, each the lowest (leave-one-out error,
/// position) among the unprotected with the errors recomputed for the
/// queries `in` (those this step's observe + evict took) after every
/// victim; then the holes are refilled as for the other policies. Equals
/// exact_greedy_policy::evict_to after observe bit for bit. Besides
/// not_observed and bad_page, a head with non-finite queries is left
/// unchanged (non_finite_query). Refuses a state of another policy.
template <class Q, class T, class Layout>
void batched_evict_to(const batch_state_view& st, const active_set& active, std::int32_t target,
                      const batch_queries<Q>& in, const kv_view<T, Layout>& cache, std::int32_t* freed,
                      std::uint64_t* status) {
  const detail::site w{"batch", "evict_to"};
  detail::require_state(w, st);
  detail::require_active(w, active, st.num_seqs());
  detail::require_not_null(w, "status", status);
  detail::require_target(w, st, target, true);
  detail::require_greedy_queries(w, st, in);
  detail::require_cache(w, st, cache);
  if (cache.head_dim != st.history.head_dim)
    detail::fail<invalid_argument>(w, "cache.head_dim", "= ", cache.head_dim, ", the history has ",
                                   st.history.head_dim);
  detail::evict_to_all(
      st, active, cache, freed, status,
      [&](std::int32_t b, std::int32_t h, auto mapped) {
        return detail::evict_to_problem(st, b, h, target, mapped, &in);
      },
      [&](std::int32_t b, std::int32_t h) { return detail::greedy_victims(st, b, h, target, in); });
}

/// exact_greedy's evict_to for engines that move rows themselves (moves as
/// in the overload without queries).
template <class Q>
void batched_evict_to(const batch_state_view& st, const active_set& active, std::int32_t target,
                      const batch_queries<Q>& in, slot_move* moves, std::int32_t* move_counts,
                      std::uint64_t* status) {
  const detail::site w{"batch", "evict_to"};
  detail::require_state(w, st);
  detail::require_active(w, active, st.num_seqs());
  detail::require_not_null(w, "status", status);
  detail::require_not_null(w, "moves", moves);
  detail::require_not_null(w, "move_counts", move_counts);
  detail::require_target(w, st, target, true);
  detail::require_greedy_queries(w, st, in);
  detail::evict_to_all(
      st, active, moves, move_counts, status,
      [&](std::int32_t b, std::int32_t h, auto mapped) {
        return detail::evict_to_problem(st, b, h, target, mapped, &in);
      },
      [&](std::int32_t b, std::int32_t h) { return detail::greedy_victims(st, b, h, target, in); });
}

}  // namespace kvevict
