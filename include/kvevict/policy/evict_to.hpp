#pragma once
// Multi-token steps (docs/semantics.md, "Multi-token steps"): chunked
// prefill and speculative decoding append several tokens to a (sequence,
// KV head) at once, and evict_to(target) then frees every surplus token in
// one call.
//
//   - The keep set is the protected tokens plus the highest of the
//     unprotected by the policy's order, target tokens in all; equivalently
//     the count - target victims are taken from the bottom of the order
//     (h2o, exact_greedy: lowest (score, position); recent_window: oldest).
//     random draws its victims one at a time, round j with the j-th draw,
//     so round 0 is evict's victim. exact_greedy evicts greedily, one victim
//     at a time with the errors recomputed (exact_greedy.hpp).
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
// The functions here run one (b, h) on the host; the CUDA kernel
// (kvevict/cuda/evict_to.cuh) runs the same rules with a block per (b, h).
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

/// Frees the count - target victims of one (b, h) by `rule` (random's round
/// j drawn in turn; the others from the bottom of rule.key): their positions
/// become -1 and their scores 0. Returns the number freed. Needs
/// count - target <= the unprotected occupied tokens (the callers' check
/// target >= sinks + recent guarantees it). scratch: `width` ints.
inline std::int32_t free_surplus(const decode_rule& rule, std::int32_t* positions, float* scores, std::int32_t width,
                                 std::int32_t count, std::int32_t length, std::int32_t target, std::uint64_t stream,
                                 std::int32_t head, std::int32_t* scratch) {
  const std::int32_t surplus = count - target;
  if (surplus <= 0) return 0;
  const auto candidates = [&] {
    std::int32_t n = 0;
    for (std::int32_t s = 0; s < width; ++s)
      if (positions[s] >= 0 && !rule.protect.covers(positions[s], length)) scratch[n++] = s;
    return n;
  };
  const auto free_slot = [&](std::int32_t s) {
    positions[s] = -1;
    scores[s] = 0.0f;
  };
  if (rule.victim == victim_rule::random_rank) {
    for (std::int32_t round = 0; round < surplus; ++round) {
      const std::int32_t n = candidates();
      const std::int32_t k = random_victim_rank(rule.seed, stream, head, length, n, round);
      std::nth_element(scratch, scratch + k, scratch + n,
                       [positions](std::int32_t x, std::int32_t y) { return positions[x] < positions[y]; });
      free_slot(scratch[k]);
    }
    return surplus;
  }
  const std::int32_t n = candidates();
  const auto lower = [&](std::int32_t x, std::int32_t y) {
    return rule.key(scores[x], positions[x]) < rule.key(scores[y], positions[y]);
  };
  std::nth_element(scratch, scratch + (surplus - 1), scratch + n, lower);
  for (std::int32_t i = 0; i < surplus; ++i) free_slot(scratch[i]);
  return surplus;
}

/// Refills the holes of one (b, h) after free_surplus left it `count`
/// tokens. The occupied slots become [0, count) plus, when count <= budget,
/// one hole below count + 1 that is the next slot, as after evict: the
/// lowest holes are filled from the lowest occupied slots beyond that span,
/// which leaves the highest hole free. Moves positions and scores, calls
/// on_move(from, to) for each row move (sources and destinations are
/// distinct slots, so rows may move at once), returns how many, and sets
/// `next_slot` (-1 when count > budget). scratch: count + 1 ints.
template <class OnMove>
std::int32_t refill_holes(std::int32_t* positions, float* scores, std::int32_t width, std::int32_t count,
                          std::int32_t budget, std::int32_t* scratch, std::int32_t& next_slot, OnMove on_move) {
  const std::int32_t span = count <= budget ? count + 1 : count;  // the spare slot is part of the span
  std::int32_t holes = 0;
  for (std::int32_t s = 0; s < span; ++s)
    if (positions[s] < 0) scratch[holes++] = s;
  std::int32_t n = 0;
  for (std::int32_t s = span; s < width && n < holes; ++s) {
    if (positions[s] < 0) continue;
    const std::int32_t to = scratch[n++];
    positions[to] = positions[s];
    scores[to] = scores[s];
    positions[s] = -1;
    scores[s] = 0.0f;
    on_move(s, to);
  }
  next_slot = n < holes ? scratch[n] : -1;
  return n;
}

}  // namespace detail
}  // namespace kvevict
