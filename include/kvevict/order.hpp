#pragma once
// The one total order behind every eviction and keep decision
// (docs/semantics.md, "Order and ties").
//
// Slots are ordered by the pair (score, position): lower score first, and
// among equal scores the older token (smaller position) first. Victims are
// taken from the front of that order, keep sets from the back. NaN orders
// below every number, and -0.0 equals +0.0, so the order stays total and the
// host and CUDA backends agree bit for bit.
//
// The pair is packed into one unsigned 64-bit key so that a plain integer
// comparison (or a radix sort / radix rank on the GPU) implements it.
#include <cstdint>
#include <cstring>

#include "kvevict/config.hpp"

namespace kvevict {

/// Maps a float to an unsigned key with the same order as the numbers;
/// every NaN maps to 0, below -inf, and -0.0 maps to the key of +0.0.
KVEVICT_HOST_DEVICE inline std::uint32_t score_order_key(float score) noexcept {
  std::uint32_t bits;
  std::memcpy(&bits, &score, sizeof bits);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return 0u;  // NaN
  if (bits == 0x80000000u) bits = 0u;                 // -0.0 == +0.0
  // Negative floats: flip all bits (larger magnitude sorts lower).
  // Non-negative floats: set the sign bit (sort above all negatives).
  std::uint32_t key = (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
  // ~bits of -inf is 0x007FFFFF, so the NaN key 0 stays strictly the lowest.
  return key;
}

/// The eviction key of a (score, position) pair: lower evicts first.
KVEVICT_HOST_DEVICE inline std::uint64_t eviction_key(float score, std::int32_t position) noexcept {
  return (static_cast<std::uint64_t>(score_order_key(score)) << 32) |
         static_cast<std::uint32_t>(position);
}

/// True when slot (score_a, pos_a) is evicted before (score_b, pos_b).
KVEVICT_HOST_DEVICE inline bool evicts_before(float score_a, std::int32_t pos_a, float score_b,
                                              std::int32_t pos_b) noexcept {
  return eviction_key(score_a, pos_a) < eviction_key(score_b, pos_b);
}

}  // namespace kvevict
