#pragma once
// The slot-table invariants (docs/semantics.md, "Notation" and "Decode
// cycle"), checked after every call that succeeded, for the per-sequence
// policies and the batched state alike:
//   - count equals the number of occupied slots, and is at most the capacity;
//   - at most one free slot lies below the highest occupied one, and when
//     there is one it is the next slot;
//   - positions are unique and below the sequence's length;
//   - the next slot is free, and -1 only when the head holds more than
//     the budget;
//   - the protected tokens (the first `sinks`, the `recent` newest) are cached;
//   - between an append and its observe the occupied slots are the prefix
//     [0, count) (what an attention kernel reads).
#include <cstdint>
#include <string>
#include <vector>

#include "finding.hpp"
#include "kvevict/policy/decode_rules.hpp"

namespace kvfuzz {

/// One (b, h) of a slot table, however it is stored.
struct head_slots {
  const std::int32_t* positions;
  std::int32_t capacity, count, next_slot, length, budget;
  bool awaiting_observe;  ///< appended, not yet observed: the prefix rule applies
};

inline std::string where_of(const char* api, std::int32_t b, std::int32_t h) {
  return std::string(api) + " sequence " + std::to_string(b) + " head " + std::to_string(h) + ": ";
}

inline void check_head(const char* api, std::int32_t b, std::int32_t h, const head_slots& s,
                       const kvevict::protection& protect) {
  const std::string at = where_of(api, b, h);
  require(s.count >= 0 && s.count <= s.capacity, at + "count " + std::to_string(s.count) + " outside [0, capacity]");
  std::int32_t occupied = 0, highest = -1;
  std::vector<std::uint8_t> seen(std::size_t(s.length > 0 ? s.length : 0), 0);
  for (std::int32_t slot = 0; slot < s.capacity; ++slot) {
    const std::int32_t p = s.positions[slot];
    if (p < 0) {
      require(p == -1, at + "slot " + std::to_string(slot) + " holds position " + std::to_string(p));
      continue;
    }
    require(p < s.length, at + "slot " + std::to_string(slot) + " holds position " + std::to_string(p) +
                              " >= length " + std::to_string(s.length));
    require(!seen[std::size_t(p)], at + "position " + std::to_string(p) + " is cached twice");
    seen[std::size_t(p)] = 1;
    ++occupied;
    highest = slot;
  }
  require(occupied == s.count, at + "count " + std::to_string(s.count) + " but " + std::to_string(occupied) +
                                   " occupied slots");
  std::int32_t holes = 0, hole = -1;
  for (std::int32_t slot = 0; slot < highest; ++slot)
    if (s.positions[slot] < 0) ++holes, hole = slot;
  require(holes <= 1, at + std::to_string(holes) + " free slots below the highest occupied slot " +
                          std::to_string(highest));
  if (holes == 1)
    require(s.next_slot == hole, at + "the hole is slot " + std::to_string(hole) + " but the next slot is " +
                                     std::to_string(s.next_slot));
  if (s.next_slot >= 0) {
    require(s.next_slot < s.capacity && s.positions[s.next_slot] == -1,
            at + "next slot " + std::to_string(s.next_slot) + " is not a free slot");
  } else {
    require(s.next_slot == -1 && s.count > s.budget,
            at + "next slot " + std::to_string(s.next_slot) + " with count " + std::to_string(s.count) +
                " not above the budget " + std::to_string(s.budget));
  }
  if (s.count <= s.budget)
    require(s.next_slot >= 0, at + "no next slot with count " + std::to_string(s.count) + " <= budget");
  for (std::int32_t p = 0; p < s.length; ++p)
    if (protect.covers(p, s.length))
      require(seen[std::size_t(p)], at + "protected position " + std::to_string(p) + " (length " +
                                        std::to_string(s.length) + ") is not cached");
  if (s.awaiting_observe)
    for (std::int32_t slot = 0; slot < s.count; ++slot)
      require(s.positions[slot] >= 0, at + "appended but slot " + std::to_string(slot) + " of the prefix [0, " +
                                          std::to_string(s.count) + ") is free");
}

}  // namespace kvfuzz
