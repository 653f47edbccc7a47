#pragma once
// The slot-table invariants every batched call keeps (docs/semantics.md,
// "Batched steps"), checked on a host state after each step: the occupied
// slots of a (b, h) are [0, count) exactly, or [0, count + 1) but one hole
// that is the next slot; the next slot is free (or -1 at budget + 1 tokens);
// and every free slot holds 0 in both score buffers, so no switch of
// buffers can bring a stale score back. The CUDA evict_to relies on the
// first to pair holes with rows without scanning the row.
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

inline void check_slot_invariants(const kvevict::batch_state_view& st) {
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
