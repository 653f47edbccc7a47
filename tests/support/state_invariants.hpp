#pragma once
// The slot-table invariants every batched call keeps (docs/semantics.md,
// "Batched steps"), checked on a host state after each step: the occupied
// slots of a (b, h) are [0, count) exactly, or [0, count + 1) but one hole
// that is the next slot; the next slot is free (or -1 at budget + 1 tokens);
// and every free slot holds 0 in both score buffers, so no switch of
// buffers can bring a stale score back. The CUDA evict_to relies on the
// first to pair holes with rows without scanning the row. And the row marks
// the one-launch step reads (state.hpp, row_marks) agree with the table.
#include <doctest/doctest.h>

#include <cstdint>
#include <cstring>

#include "kvevict/batch/state.hpp"

namespace kvtest {

inline bool positive_zero(float x) {
  std::uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  return bits == 0u;
}

/// Each row's length mark is its sequence's length, and bit h of word
/// [length & 1] is set exactly when (b, h) has no free slot; bits past the
/// last head read 0.
inline void check_row_marks(const kvevict::batch_state_view& st) {
  const kvevict::row_marks& m = st.marks;
  REQUIRE(m.words == (st.num_heads() + 63) / 64);
  for (std::int32_t b = 0; b < st.num_seqs(); ++b) {
    CAPTURE(b);
    const std::int32_t length = st.slots.lengths[b];
    for (std::int32_t w = 0; w < m.words; ++w) {
      const std::uint64_t word = m.full[(std::int64_t{length & 1} * st.num_seqs() + b) * m.words + w];
      for (std::int32_t bit = 0; bit < 64; ++bit) {
        const std::int32_t h = w * 64 + bit;
        const bool set = (word >> bit) & 1u;
        if (h >= st.num_heads()) {
          CHECK_FALSE(set);
          continue;
        }
        CAPTURE(h);
        CHECK(m.lengths[st.head_index(b, h)] == length);
        CHECK(set == (st.slots.next_slots[st.head_index(b, h)] < 0));
      }
    }
  }
}

inline void check_slot_invariants(const kvevict::batch_state_view& st) {
  check_row_marks(st);
  for (std::int32_t b = 0; b < st.num_seqs(); ++b)
    for (std::int32_t h = 0; h < st.num_heads(); ++h) {
      CAPTURE(b);
      CAPTURE(h);
      const std::int64_t bh = st.head_index(b, h);
      const std::int32_t count = st.slots.counts[bh], next = st.slots.next_slots[bh];
      const std::int32_t* pos = st.slots.positions_of(b, h);
      const bool hole = next >= 0 && next < count;
      const std::int32_t end = hole ? count + 1 : count;
      std::int32_t occupied = 0, outside = 0, stale = 0;
      for (std::int32_t s = 0; s < st.capacity(); ++s) {
        if (pos[s] >= 0) {
          ++occupied;
          outside += s >= end || s == next;
        } else {
          stale += !positive_zero(st.buffer_of(b, h, 0)[s]) || !positive_zero(st.buffer_of(b, h, 1)[s]);
        }
      }
      CHECK(occupied == count);
      CHECK(outside == 0);
      CHECK(stale == 0);
      CHECK(next >= -1);
      if (next < 0) CHECK(count >= st.rule.budget + 1);
    }
}

}  // namespace kvtest
