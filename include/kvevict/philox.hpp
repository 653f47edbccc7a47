#pragma once
// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3",
// SC'11), the counter-based generator behind the random policy.
//
// A counter-based generator is a pure function of (counter, key): the host and
// a CUDA thread that evaluate the same (seed, sequence, head, step) draw the
// same numbers without sharing any state, which is what makes random eviction
// reproducible across backends and batch schedules.
#include <cstdint>

#include "kvevict/config.hpp"

namespace kvevict {

struct philox4x32_counter {
  std::uint32_t v[4];
};

struct philox4x32_key {
  std::uint32_t v[2];
};

namespace detail {

KVEVICT_HOST_DEVICE inline void mul_hi_lo(std::uint32_t a, std::uint32_t b, std::uint32_t& hi,
                                          std::uint32_t& lo) noexcept {
  const std::uint64_t p = static_cast<std::uint64_t>(a) * b;
  hi = static_cast<std::uint32_t>(p >> 32);
  lo = static_cast<std::uint32_t>(p);
}

}  // namespace detail

/// Ten rounds of Philox4x32 on `ctr` under `key`.
KVEVICT_HOST_DEVICE inline philox4x32_counter philox4x32_10(philox4x32_counter ctr,
                                                            philox4x32_key key) noexcept {
  constexpr std::uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;
  constexpr std::uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      key.v[0] += kWeyl0;
      key.v[1] += kWeyl1;
    }
    std::uint32_t hi0, lo0, hi1, lo1;
    detail::mul_hi_lo(kMul0, ctr.v[0], hi0, lo0);
    detail::mul_hi_lo(kMul1, ctr.v[2], hi1, lo1);
    ctr = philox4x32_counter{{hi1 ^ ctr.v[1] ^ key.v[0], lo1, hi0 ^ ctr.v[3] ^ key.v[1], lo0}};
  }
  return ctr;
}

/// What a draw of the random policy is for; part of the counter so that
/// decode and prefill draws never collide.
enum class random_use : std::uint32_t { decode_victim = 0, prefill_priority = 1 };

/// Largest request stream id: the counter has 63 bits for it.
inline constexpr std::uint64_t max_random_stream = (std::uint64_t{1} << 63) - 1;

/// The Philox block of the random policy under `seed` for request stream
/// `stream` (at most max_random_stream; by default the sequence index), KV
/// head `head` and `index` (the newest position for a decode step, the
/// candidate's position for prefill selection). Counter: {index, stream bits
/// 0-31, head, use | stream bits 32-62 << 1}; key: seed.
KVEVICT_HOST_DEVICE inline philox4x32_counter random_block(std::uint64_t seed, random_use use, std::uint64_t stream,
                                                           std::int32_t head, std::int32_t index) noexcept {
  const philox4x32_key key{{static_cast<std::uint32_t>(seed), static_cast<std::uint32_t>(seed >> 32)}};
  const philox4x32_counter ctr{{static_cast<std::uint32_t>(index), static_cast<std::uint32_t>(stream),
                                static_cast<std::uint32_t>(head),
                                static_cast<std::uint32_t>(use) | static_cast<std::uint32_t>(stream >> 32) << 1}};
  return philox4x32_10(ctr, key);
}

/// The first word of random_block: prefill's priority of a candidate.
KVEVICT_HOST_DEVICE inline std::uint32_t random_draw(std::uint64_t seed, random_use use, std::uint64_t stream,
                                                     std::int32_t head, std::int32_t index) noexcept {
  return random_block(seed, use, stream, head, index).v[0];
}

/// The key of one decode step's draws: the first two words of the
/// decode_victim block of (seed, stream, head, newest position). Every
/// candidate of that step gets random_priority(step_key, position), so a
/// step's victims are the lowest priorities: one draw per candidate, no
/// rounds, and evict_to's k victims are the k lowest of the same step.
KVEVICT_HOST_DEVICE inline philox4x32_key random_step_key(std::uint64_t seed, std::uint64_t stream, std::int32_t head,
                                                          std::int32_t newest) noexcept {
  const philox4x32_counter block = random_block(seed, random_use::decode_victim, stream, head, newest);
  return philox4x32_key{{block.v[0], block.v[1]}};
}

/// A candidate's priority in the step keyed by `step_key`: Philox4x32-10
/// of the counter {position, 0, 0, 0}.
KVEVICT_HOST_DEVICE inline std::uint32_t random_priority(philox4x32_key step_key, std::int32_t position) noexcept {
  return philox4x32_10(philox4x32_counter{{static_cast<std::uint32_t>(position), 0u, 0u, 0u}}, step_key).v[0];
}

}  // namespace kvevict
