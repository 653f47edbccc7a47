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

/// The 32-bit draw of the random policy under `seed` for request stream
/// `stream` (at most max_random_stream; by default the sequence index), KV
/// head `head` and `index`: the position of the newest token for a decode
/// eviction, or the candidate's position for prefill selection. `round`
/// numbers the victims of one evict_to call (0 is the single eviction's
/// draw). Counter: {index, stream bits 0-31, head ^ round << 16, use |
/// stream bits 32-62 << 1}; key: seed. Rounds share the counter's third word
/// with heads: draws stay distinct while heads < 65536 and rounds < 65536,
/// and beyond that they repeat (still valid draws, no longer independent).
KVEVICT_HOST_DEVICE inline std::uint32_t random_draw(std::uint64_t seed, random_use use, std::uint64_t stream,
                                                     std::int32_t head, std::int32_t index,
                                                     std::int32_t round = 0) noexcept {
  const philox4x32_key key{{static_cast<std::uint32_t>(seed), static_cast<std::uint32_t>(seed >> 32)}};
  const philox4x32_counter ctr{{static_cast<std::uint32_t>(index), static_cast<std::uint32_t>(stream),
                                static_cast<std::uint32_t>(head) ^ (static_cast<std::uint32_t>(round) << 16),
                                static_cast<std::uint32_t>(use) | static_cast<std::uint32_t>(stream >> 32) << 1}};
  return philox4x32_10(ctr, key).v[0];
}

/// Maps a uniform 32-bit draw to [0, n) by a multiply-shift (Lemire). The
/// bias is below n / 2^32, and unlike rejection sampling it costs one draw,
/// so every backend takes the same, fixed number of draws.
KVEVICT_HOST_DEVICE inline std::uint32_t uniform_index(std::uint32_t draw, std::uint32_t n) noexcept {
  return static_cast<std::uint32_t>((static_cast<std::uint64_t>(draw) * n) >> 32);
}

}  // namespace kvevict
