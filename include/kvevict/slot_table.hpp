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
#include <vector>

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

/// Owning host slot table.
class slot_table {
 public:
  slot_table() = default;
  slot_table(std::int32_t num_seqs, std::int32_t num_heads, std::int32_t capacity)
      : positions_(std::size_t(num_seqs) * num_heads * capacity, -1),
        counts_(std::size_t(num_seqs) * num_heads, 0),
        next_slots_(std::size_t(num_seqs) * num_heads, 0),
        lengths_(std::size_t(num_seqs), 0),
        num_seqs_(num_seqs),
        num_heads_(num_heads),
        capacity_(capacity) {}

  std::int32_t num_seqs() const noexcept { return num_seqs_; }
  std::int32_t num_heads() const noexcept { return num_heads_; }
  std::int32_t capacity() const noexcept { return capacity_; }

  /// Position held by slot s of (b, h), or -1 when the slot is free.
  std::int32_t position(std::int32_t b, std::int32_t h, std::int32_t s) const noexcept {
    return positions_[index(b, h) * capacity_ + s];
  }
  std::int32_t count(std::int32_t b, std::int32_t h) const noexcept { return counts_[index(b, h)]; }
  std::int32_t next_slot(std::int32_t b, std::int32_t h) const noexcept { return next_slots_[index(b, h)]; }
  /// Tokens sequence b has seen; the position of its next token.
  std::int32_t length(std::int32_t b) const noexcept { return lengths_[std::size_t(b)]; }

  /// Slot of position p in (b, h), or -1 when p is not cached there.
  std::int32_t slot_of(std::int32_t b, std::int32_t h, std::int32_t p) const noexcept {
    const std::int32_t* pos = positions_of(b, h);
    for (std::int32_t s = 0; s < capacity_; ++s)
      if (pos[s] == p) return s;
    return -1;
  }

  /// One past the highest occupied slot of any head of b: the columns a
  /// decode input must hold for b.
  std::int32_t occupied_width(std::int32_t b) const noexcept {
    std::int32_t width = 0;
    for (std::int32_t h = 0; h < num_heads_; ++h) {
      const std::int32_t* pos = positions_of(b, h);
      for (std::int32_t s = capacity_ - 1; s >= width; --s)
        if (pos[s] >= 0) {
          width = s + 1;
          break;
        }
    }
    return width;
  }

  const std::int32_t* positions_of(std::int32_t b, std::int32_t h) const noexcept {
    return positions_.data() + index(b, h) * capacity_;
  }
  std::int32_t* positions_of(std::int32_t b, std::int32_t h) noexcept {
    return positions_.data() + index(b, h) * capacity_;
  }
  std::int32_t& count_ref(std::int32_t b, std::int32_t h) noexcept { return counts_[index(b, h)]; }
  std::int32_t& next_slot_ref(std::int32_t b, std::int32_t h) noexcept { return next_slots_[index(b, h)]; }
  std::int32_t& length_ref(std::int32_t b) noexcept { return lengths_[std::size_t(b)]; }

  slot_table_view view() noexcept {
    return {positions_.data(), counts_.data(), next_slots_.data(), lengths_.data(), num_seqs_, num_heads_, capacity_};
  }

  /// Forgets sequence b (every slot free, length 0).
  void clear(std::int32_t b) noexcept {
    for (std::int32_t h = 0; h < num_heads_; ++h) {
      std::int32_t* pos = positions_of(b, h);
      for (std::int32_t s = 0; s < capacity_; ++s) pos[s] = -1;
      counts_[index(b, h)] = 0;
      next_slots_[index(b, h)] = 0;
    }
    lengths_[std::size_t(b)] = 0;
  }

 private:
  std::size_t index(std::int32_t b, std::int32_t h) const noexcept { return std::size_t(b) * num_heads_ + h; }

  std::vector<std::int32_t> positions_, counts_, next_slots_, lengths_;
  std::int32_t num_seqs_ = 0, num_heads_ = 0, capacity_ = 0;
};

}  // namespace kvevict
