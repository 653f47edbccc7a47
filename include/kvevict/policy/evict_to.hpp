#pragma once
// Multi-token steps (docs/semantics.md, "Multi-token steps"): chunked
// prefill and speculative decoding append several tokens to a (sequence,
// KV head) at once, and evict_to(target) then frees every surplus token in
// one call.
//
//   - The keep set is the protected tokens plus the highest of the
//     unprotected by the policy's victim order, target tokens in all;
//     equivalently the count - target victims are the lowest victim keys
//     (h2o: (score, position); recent_window: oldest; random: the step's
//     Philox priorities), so the lowest is evict's victim. exact_greedy
//     evicts greedily, one victim at a time with the errors recomputed
//     (exact_greedy.hpp).
//   - The holes this leaves are refilled from the kept tokens beyond the
//     span [0, target + 1), the lowest hole from the lowest such slot, so
//     the occupied slots are that span but one hole, which becomes the next
//     slot: the state evict leaves, and after the next append the occupied
//     slots are a prefix again. (A target above the budget fills every hole
//     of [0, target); the next append then needs another eviction anyway.)
//     Fewer rows move than were evicted.
// With count = target + 1 this is exactly evict: the same victim, whose slot
// becomes the next slot, and no row moves.
//
// The functions here run one (b, h) on the host; the CUDA backend
// (kvevict/cuda/multi_token.cuh) runs the same rules: one bottom-k selection
// of the victim keys, then the refill, with several blocks per long row.
#include <algorithm>
#include <cstdint>

#include "kvevict/config.hpp"
#include "kvevict/policy/decode_rules.hpp"

namespace kvevict {

/// A row move of evict_to: the token in slot `from` goes to slot `to`.
struct slot_move {
  std::int32_t from = -1;
  std::int32_t to = -1;
};

/// Slot of the j-th token of a multi-token append to a (b, h) that holds
/// `count` tokens with next slot `next_slot`: the free slot first (the hole
/// an eviction left, or `count` itself), then the unused slots after the
/// occupied ones. With next_slot = -1 (budget + 1 tokens, no hole) every
/// token goes after them.
KVEVICT_HOST_DEVICE inline std::int32_t new_token_slot(std::int32_t count, std::int32_t next_slot,
                                                       std::int32_t j) noexcept {
  return j == 0 && next_slot >= 0 ? next_slot : count + j;
}

namespace detail {

/// Frees the count - target victims of one (b, h): the lowest victim keys
/// of the step (rule.order; random's are the step's Philox priorities) among
/// the unprotected; their positions become -1 and their scores 0. Returns
/// the number freed. Needs count - target <= the unprotected occupied tokens
/// (the callers' check target >= sinks + recent guarantees it). scratch:
/// `width` ints.
inline std::int32_t free_surplus(const decode_rule& rule, std::int32_t* positions, float* scores, std::int32_t width,
                                 std::int32_t count, std::int32_t length, std::int32_t target, std::uint64_t stream,
                                 std::int32_t head, std::int32_t* scratch) {
  const std::int32_t surplus = count - target;
  if (surplus <= 0) return 0;
  std::int32_t n = 0;
  for (std::int32_t s = 0; s < width; ++s)
    if (positions[s] >= 0 && !rule.protect.covers(positions[s], length)) scratch[n++] = s;
  const victim_order order = rule.order(stream, head, length);
  const auto lower = [&](std::int32_t x, std::int32_t y) {
    return order.key(scores[x], positions[x]) < order.key(scores[y], positions[y]);
  };
  std::nth_element(scratch, scratch + (surplus - 1), scratch + n, lower);
  for (std::int32_t i = 0; i < surplus; ++i) {
    positions[scratch[i]] = -1;
    scores[scratch[i]] = 0.0f;
  }
  return surplus;
}

/// One past the last slot a (b, h) may occupy: its occupied slots are
/// always [0, end) but at most one hole, its next slot (appends fill the
/// hole first, evict frees one slot, evict_to and prefill leave [0, kept)
/// but the next slot).
KVEVICT_HOST_DEVICE inline std::int32_t occupied_end(std::int32_t count, std::int32_t next_slot) noexcept {
  return next_slot >= 0 && next_slot < count ? count + 1 : count;
}


/// The refill of one (b, h) after evict_to freed its victims (at least
/// one), leaving `kept` tokens: the free slots of [0, end) (the victims, and
/// the hole the row had, if any) are freed(0) < freed(1) < ... <
/// freed(free_count - 1). The
/// holes below the span [0, kept + 1) (the spare slot belongs to it; a kept
/// above the budget has a span of kept) take the occupied slots beyond it,
/// the lowest hole the lowest slot, so the occupied slots become the span
/// but one hole, which is the next slot: the state evict leaves. Moves fewer
/// rows than were freed. Each piece of work is independent (refill_work),
/// so the CUDA kernel spreads a row over many threads; `freed` is any
/// callable, an array on the host, a merge of the sorted victims and the
/// old hole on the device.
template <class Freed>
struct refill_plan {
  Freed freed;
  std::int32_t free_count = 0;
  std::int32_t span = 0;   ///< the slots the kept tokens end up in
  std::int32_t end = 0;    ///< occupied_end before the victims left
  std::int32_t holes = 0;  ///< free slots below span: freed(0 .. holes)
  std::int32_t moves = 0;  ///< occupied slots in [span, end), each filling a hole

  /// The slot move i fills.
  KVEVICT_EXEC_CHECK_DISABLE
  KVEVICT_HOST_DEVICE std::int32_t hole(std::int32_t i) const { return freed(i); }
  /// The slot move i empties: the i-th occupied slot of [span, end), found
  /// by a binary search over the free slots there.
  KVEVICT_EXEC_CHECK_DISABLE
  KVEVICT_HOST_DEVICE std::int32_t source(std::int32_t i) const {
    // j free slots of [span, end) precede the answer: the most j such that
    // freed(holes + j - 1) - span - (j - 1) <= i (the occupied slots before it).
    std::int32_t lo = 0, hi = free_count - holes;
    while (lo < hi) {
      const std::int32_t mid = lo + (hi - lo + 1) / 2;
      if (freed(holes + mid - 1) - span - (mid - 1) <= i) lo = mid;
      else hi = mid - 1;
    }
    return span + i + lo;
  }
  /// The hole left over, or -1 (kept above the budget fills every hole).
  KVEVICT_EXEC_CHECK_DISABLE
  KVEVICT_HOST_DEVICE std::int32_t next_slot() const { return moves < holes ? freed(moves) : -1; }
  /// Pieces of work: moves and frees, [0, free_count).
  KVEVICT_HOST_DEVICE std::int32_t work() const { return free_count; }
};

KVEVICT_EXEC_CHECK_DISABLE
template <class Freed>
KVEVICT_HOST_DEVICE refill_plan<Freed> make_refill_plan(Freed freed, std::int32_t free_count, std::int32_t kept,
                                                        std::int32_t budget, std::int32_t end) {
  refill_plan<Freed> p{freed, free_count, kept <= budget ? kept + 1 : kept, end, 0, 0};
  std::int32_t lo = 0, hi = free_count;  // holes: the free slots below span
  while (lo < hi) {
    const std::int32_t mid = lo + (hi - lo) / 2;
    if (freed(mid) < p.span) lo = mid + 1;
    else hi = mid;
  }
  p.holes = lo;
  p.moves = (end - p.span) - (free_count - p.holes);
  return p;
}

/// Piece i of the refill, in any order: i < moves moves the token of
/// source(i) (position and score) into hole(i) and calls on_move(i, from,
/// to) for its K/V rows; any other i frees freed(i), a hole left over or a slot
/// at or beyond the span (position -1, score 0). The freed slots and the
/// sources leave 0 in `spare` too (the other score buffer, when there is
/// one), as every slot beyond the span must: observe + evict rewrites only
/// the occupied ones there.
KVEVICT_EXEC_CHECK_DISABLE
template <class Freed, class OnMove>
KVEVICT_HOST_DEVICE void refill_work(const refill_plan<Freed>& p, std::int32_t i, std::int32_t* positions,
                                     float* scores, float* spare, OnMove on_move) {
  const std::int32_t slot = i < p.moves ? p.source(i) : p.freed(i);
  if (i < p.moves) {
    const std::int32_t to = p.hole(i);
    positions[to] = positions[slot];
    scores[to] = scores[slot];
    on_move(i, slot, to);
  }
  positions[slot] = -1;
  scores[slot] = 0.0f;
  if (spare) spare[slot] = 0.0f;
}

/// The free slots of a row after evict_to chose its victims, in ascending
/// order without a scan of the row: the victims (sorted) merged with the
/// hole the row had before, if any. What the CUDA refill reads.
struct victims_and_hole {
  const std::int32_t* victims = nullptr;  ///< ascending
  std::int32_t count = 0;                 ///< victims
  std::int32_t hole = -1;                 ///< -1 when the row had none
  std::int32_t rank = 0;                  ///< victims below the hole

  KVEVICT_HOST_DEVICE victims_and_hole(const std::int32_t* v, std::int32_t n, std::int32_t old_hole) noexcept
      : victims(v), count(n), hole(old_hole) {
    if (hole < 0) return;
    std::int32_t lo = 0, hi = n;
    while (lo < hi) {
      const std::int32_t mid = lo + (hi - lo) / 2;
      if (victims[mid] < hole) lo = mid + 1;
      else hi = mid;
    }
    rank = lo;
  }
  KVEVICT_HOST_DEVICE std::int32_t size() const noexcept { return count + (hole >= 0 ? 1 : 0); }
  KVEVICT_HOST_DEVICE std::int32_t operator()(std::int32_t i) const noexcept {
    if (hole < 0 || i < rank) return victims[i];
    return i == rank ? hole : victims[i - 1];
  }
};

/// The hole a row of `count` tokens with next slot `next_slot` has, or -1.
KVEVICT_HOST_DEVICE inline std::int32_t hole_of(std::int32_t count, std::int32_t next_slot) noexcept {
  return next_slot >= 0 && next_slot < count ? next_slot : -1;
}

/// The host's refill of one (b, h) whose victims are already freed, `kept`
/// tokens left of the `end` the row had: lists the free slots of [0, end)
/// in `scratch` (end ints), refills, calls on_move(i, from, to) for row
/// move i and returns the moves; `next_slot` becomes the plan's.
template <class OnMove>
std::int32_t refill_holes(std::int32_t* positions, float* scores, float* spare, std::int32_t kept,
                          std::int32_t budget, std::int32_t end, std::int32_t* scratch, std::int32_t& next_slot,
                          OnMove on_move) {
  std::int32_t n = 0;
  for (std::int32_t s = 0; s < end; ++s)
    if (positions[s] < 0) scratch[n++] = s;
  const auto plan = make_refill_plan([scratch](std::int32_t i) { return scratch[i]; }, n, kept, budget, end);
  for (std::int32_t i = 0; i < plan.work(); ++i) refill_work(plan, i, positions, scores, spare, on_move);
  next_slot = plan.next_slot();
  return plan.moves;
}

}  // namespace detail
}  // namespace kvevict
