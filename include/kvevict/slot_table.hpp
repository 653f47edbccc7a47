#pragma once
// The slot table (docs/semantics.md, "Notation"): for every (sequence b, KV head h) the position
// each slot holds (-1 when free) and the number of occupied slots, plus the
// bookkeeping the decode cycle needs: the slot the next token goes to and the
// number of tokens each sequence has seen.
//
// Invariant (kept by the policies): at most one free slot lies below the
// highest occupied slot. While a cache fills, slots [0, count) are occupied
// and the next slot is `count`; after an eviction the victim's slot is the
// one hole and the next token fills it. So next_slot never needs a search.
#include <cstdint>

#include "kvevict/config.hpp"

namespace kvevict {

/// A trivially copyable view of a slot table, for kernels and engines that
/// read the table in place.
struct slot_table_view {
  std::int32_t* positions = nullptr;  ///< [num_seqs][num_heads][capacity]
  std::int32_t* counts = nullptr;     ///< [num_seqs][num_heads]
  std::int32_t* next_slots = nullptr; ///< [num_seqs][num_heads]
  std::int32_t* lengths = nullptr;    ///< [num_seqs]: tokens seen (next position)
  std::int32_t num_seqs = 0;
  std::int32_t num_heads = 0;
  std::int32_t capacity = 0;

  KVEVICT_HOST_DEVICE std::int64_t head_index(std::int32_t b, std::int32_t h) const noexcept {
    return std::int64_t{b} * num_heads + h;
  }
  KVEVICT_HOST_DEVICE std::int32_t* positions_of(std::int32_t b, std::int32_t h) const noexcept {
    return positions + head_index(b, h) * capacity;
  }
};

/// Read-only access to a host slot table: the per-sequence policies' slots()
/// (their table lives in their batched state). Cheap to copy; valid while
/// the policy that handed it out lives and is not moved.
class slot_table {
 public:
  slot_table() = default;
  explicit slot_table(const slot_table_view& v) noexcept : v_(v) {}

  std::int32_t num_seqs() const noexcept { return v_.num_seqs; }
  std::int32_t num_heads() const noexcept { return v_.num_heads; }
  std::int32_t capacity() const noexcept { return v_.capacity; }

  /// Position held by slot s of (b, h), or -1 when the slot is free.
  std::int32_t position(std::int32_t b, std::int32_t h, std::int32_t s) const noexcept {
    return v_.positions_of(b, h)[s];
  }
  std::int32_t count(std::int32_t b, std::int32_t h) const noexcept { return v_.counts[v_.head_index(b, h)]; }
  std::int32_t next_slot(std::int32_t b, std::int32_t h) const noexcept { return v_.next_slots[v_.head_index(b, h)]; }
  /// Tokens sequence b has seen; the position of its next token.
  std::int32_t length(std::int32_t b) const noexcept { return v_.lengths[b]; }

  /// Slot of position p in (b, h), or -1 when p is not cached there.
  std::int32_t slot_of(std::int32_t b, std::int32_t h, std::int32_t p) const noexcept {
    const std::int32_t* pos = positions_of(b, h);
    for (std::int32_t s = 0; s < v_.capacity; ++s)
      if (pos[s] == p) return s;
    return -1;
  }

  /// One past the highest occupied slot of any head of b: the columns a
  /// decode input must hold for b.
  std::int32_t occupied_width(std::int32_t b) const noexcept {
    std::int32_t width = 0;
    for (std::int32_t h = 0; h < v_.num_heads; ++h) {
      const std::int32_t* pos = positions_of(b, h);
      for (std::int32_t s = v_.capacity - 1; s >= width; --s)
        if (pos[s] >= 0) {
          width = s + 1;
          break;
        }
    }
    return width;
  }

  const std::int32_t* positions_of(std::int32_t b, std::int32_t h) const noexcept { return v_.positions_of(b, h); }

 private:
  slot_table_view v_;
};

}  // namespace kvevict
