#pragma once
// The random policy's decode draws, written in the tests from their
// definition (docs/policies.md, "random"), so the library's random_step_key
// and random_priority are checked against it rather than used as their own
// expectation. Philox4x32-10 itself is checked against Random123's
// known-answer vectors (test_order.cpp).
#include <algorithm>
#include <cstdint>
#include <vector>

#include "kvevict/philox.hpp"

namespace kvtest {

/// The priority of the candidate at `position` in the decode step of KV
/// head `head` whose newest position is `newest`: Philox4x32-10 of
/// {newest, stream low word, head, stream high word << 1} under the seed
/// gives the step key (its first two words); Philox4x32-10 of {position, 0,
/// 0, 0} under the step key gives the priority (its first word).
inline std::uint32_t decode_priority(std::uint64_t seed, std::uint64_t stream, std::int32_t head,
                                     std::int32_t newest, std::int32_t position) {
  const kvevict::philox4x32_counter step = kvevict::philox4x32_10(
      {{std::uint32_t(newest), std::uint32_t(stream), std::uint32_t(head), std::uint32_t(stream >> 32) << 1}},
      {{std::uint32_t(seed), std::uint32_t(seed >> 32)}});
  return kvevict::philox4x32_10({{std::uint32_t(position), 0u, 0u, 0u}}, {{step.v[0], step.v[1]}}).v[0];
}

/// The `k` victims among `candidates` (positions) of that step: the lowest
/// (priority, position) pairs.
inline std::vector<std::int32_t> random_victims(std::uint64_t seed, std::uint64_t stream, std::int32_t head,
                                                std::int32_t newest, std::vector<std::int32_t> candidates,
                                                std::size_t k) {
  const auto key = [&](std::int32_t p) {
    return std::uint64_t{decode_priority(seed, stream, head, newest, p)} << 32 | std::uint32_t(p);
  };
  std::sort(candidates.begin(), candidates.end(), [&](std::int32_t x, std::int32_t y) { return key(x) < key(y); });
  candidates.resize(std::min(k, candidates.size()));
  return candidates;
}

}  // namespace kvtest
