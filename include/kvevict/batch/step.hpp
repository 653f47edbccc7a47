#pragma once
// The state changes of a batched decode step for one (sequence, KV head), as
// KVEVICT_HOST_DEVICE functions that the host backend and the CUDA kernels
// both call once a (b, h) is known to be good (docs/semantics.md,
// "Batched steps").
#include <cstdint>

#include "kvevict/batch/inputs.hpp"
#include "kvevict/batch/state.hpp"
#include "kvevict/batch/status.hpp"
#include "kvevict/config.hpp"
#include "kvevict/policy/decode_rules.hpp"

namespace kvevict {
namespace detail {

/// The row marks of (b, h) (state.hpp, row_marks) at sequence length
/// `length` with next slot `next_slot`. Every writer of next_slots or
/// lengths calls it for each head it changes, and for every head of a
/// sequence whose length it changes. On CUDA the rows of a sequence share
/// a word: the bit changes atomically.
KVEVICT_HOST_DEVICE inline void mark_row(const batch_state_view& st, std::int32_t b, std::int32_t h,
                                         std::int32_t length, std::int32_t next_slot) noexcept {
  const row_marks& m = st.marks;
  m.lengths[st.head_index(b, h)] = length;
  std::uint64_t* word = m.word_of(b, h, length, st.num_seqs());
  const std::uint64_t bit = std::uint64_t{1} << (h % 64);
#ifdef __CUDA_ARCH__
  if (next_slot < 0) atomicOr(reinterpret_cast<unsigned long long*>(word), static_cast<unsigned long long>(bit));
  else atomicAnd(reinterpret_cast<unsigned long long*>(word), static_cast<unsigned long long>(~bit));
#else
  *word = next_slot < 0 ? (*word | bit) : (*word & ~bit);
#endif
}

/// Zeroes both parity words of sequence b (a reset, before its heads'
/// marks): bits past the last head then read 0 on every device. Threads
/// split the words as [first, 2 * words) by `step`.
KVEVICT_HOST_DEVICE inline void clear_sequence_marks(const batch_state_view& st, std::int32_t b, std::int32_t first,
                                                     std::int32_t step) noexcept {
  const row_marks& m = st.marks;
  for (std::int32_t i = first; i < 2 * m.words; i += step)
    m.full[(std::int64_t{i / m.words} * st.num_seqs() + b) * m.words + i % m.words] = 0;
}

/// The lowest set bit of `word` among its first `bits` (64 for all), or -1.
KVEVICT_HOST_DEVICE inline std::int32_t lowest_bit(std::uint64_t word, std::int32_t bits) noexcept {
  if (bits < 64) word &= (std::uint64_t{1} << bits) - 1;
  if (word == 0) return -1;
  std::int32_t bit = 0;
  while (!((word >> bit) & 1u)) ++bit;
  return bit;
}

/// The first head of sequence b with no free slot at length `length`,
/// from its marks, or -1: append's verdict (append_problem's head) as the
/// one-launch step reads it.
KVEVICT_HOST_DEVICE inline std::int32_t first_full_head(const batch_state_view& st, std::int32_t b,
                                                        std::int32_t length) noexcept {
  for (std::int32_t h = 0; h < st.num_heads(); h += 64) {
    const std::int32_t bit = lowest_bit(*st.marks.word_of(b, h, length, st.num_seqs()), st.num_heads() - h);
    if (bit >= 0) return h + bit;
  }
  return -1;
}

/// next_slots(b, h) = slot, at sequence length `length`, with its marks.
KVEVICT_HOST_DEVICE inline void set_next_slot(const batch_state_view& st, std::int32_t b, std::int32_t h,
                                              std::int32_t slot, std::int32_t length) noexcept {
  st.slots.next_slots[st.head_index(b, h)] = slot;
  mark_row(st, b, h, length, slot);
}

/// The check of append for head h of sequence b: a free slot, and
/// mapped(slot) for it (a paged cache's page id is in the pool). The status
/// word of the problem, or batch_status_clear; over the heads the lowest
/// word is the first head's, so threads may check a head each and reduce.
KVEVICT_EXEC_CHECK_DISABLE
template <class Mapped>
KVEVICT_HOST_DEVICE std::uint64_t append_head_problem(const batch_state_view& st, std::int32_t b, std::int32_t h,
                                                      Mapped mapped) noexcept {
  const std::int32_t slot = st.slots.next_slots[st.head_index(b, h)];
  if (slot < 0) return pack_status(b, h, 0, batch_code::no_free_slot);
  if (!mapped(slot)) return pack_status(b, h, slot, batch_code::bad_page);
  return batch_status_clear;
}

/// The checks of append for sequence b, every head in turn.
KVEVICT_EXEC_CHECK_DISABLE
template <class Mapped>
KVEVICT_HOST_DEVICE std::uint64_t append_problem(const batch_state_view& st, std::int32_t b, Mapped mapped) noexcept {
  for (std::int32_t h = 0; h < st.num_heads(); ++h) {
    const std::uint64_t word = append_head_problem(st, b, h, mapped);
    if (word != batch_status_clear) return word;
  }
  return batch_status_clear;
}

/// Append, step 1 of the cycle: position `position` goes to (b, h)'s next
/// slot with score 0. The caller checked next_slot >= 0 for every head of b
/// and bumps lengths[b] once.
/// The commit with the head's next slot, count and score buffer already
/// read (a kernel reads them beside its checks, so the commit adds no
/// dependent load).
KVEVICT_HOST_DEVICE inline void commit_append(const batch_state_view& st, std::int32_t b, std::int32_t h,
                                              std::int32_t position, std::int32_t slot, std::int32_t count,
                                              std::int32_t buffer) noexcept {
  const std::int64_t bh = st.head_index(b, h);
  st.slots.positions_of(b, h)[slot] = position;
  st.buffer_of(b, h, buffer)[slot] = 0.0f;
  st.slots.counts[bh] = count + 1;
  set_next_slot(st, b, h, next_slot_after_append(count + 1, st.rule.budget), position + 1);
  st.appended[bh] = 1;
}

KVEVICT_HOST_DEVICE inline void commit_append(const batch_state_view& st, std::int32_t b, std::int32_t h,
                                              std::int32_t position) noexcept {
  const std::int64_t bh = st.head_index(b, h);
  commit_append(st, b, h, position, st.slots.next_slots[bh], st.slots.counts[bh], st.score_buffer[bh]);
}

/// Whether observe + evict skips (b, h): in a retry, a head that is not
/// waiting for its observation, which it took in the call retried. Nothing
/// is reported or written for it.
KVEVICT_HOST_DEVICE inline bool observe_skips(const batch_state_view& st, const active_set& active, std::int32_t b,
                                              std::int32_t h) noexcept {
  return active.retry && !st.appended[st.head_index(b, h)];
}

/// Observe, the commit of the scores: the updated scores in the spare
/// buffer become current and (b, h) is observed.
KVEVICT_HOST_DEVICE inline void commit_observed_scores(const batch_state_view& st, std::int64_t bh,
                                                       std::int32_t buffer) noexcept {
  st.score_buffer[bh] = static_cast<std::uint8_t>(1 - buffer);
  st.appended[bh] = 0;
}

/// Evict, the commit: `victim` is freed (its score 0 in both buffers, so a
/// later switch of buffers cannot bring a stale score back) and becomes the
/// next slot; no K/V bytes move. `count` is the head's tokens before the
/// eviction. A KeyDiff anchor still counts
/// the victim: it becomes stale (the KeyDiff step follows up, after_commit).
/// `length` is the sequence's.
KVEVICT_HOST_DEVICE inline void free_victim(const batch_state_view& st, std::int32_t b, std::int32_t h,
                                            std::int32_t victim, std::int32_t count, std::int32_t length) noexcept {
  const std::int64_t bh = st.head_index(b, h);
  if (st.anchors.upto) st.anchors.upto[bh] = -1;
  st.slots.positions_of(b, h)[victim] = -1;
  st.buffer_of(b, h, 0)[victim] = 0.0f;
  st.buffer_of(b, h, 1)[victim] = 0.0f;
  st.slots.counts[bh] = count - 1;
  set_next_slot(st, b, h, victim, length);
}

/// Observe + evict, the commit: the updated scores become current and
/// `victim` (or none, -1) is freed. The head's score buffer, count and
/// sequence length already read (a kernel has them in registers: no
/// dependent load before the stores).
KVEVICT_HOST_DEVICE inline void commit_observe_evict(const batch_state_view& st, std::int32_t b, std::int32_t h,
                                                     std::int32_t victim, std::int32_t buffer, std::int32_t count,
                                                     std::int32_t length) noexcept {
  commit_observed_scores(st, st.head_index(b, h), buffer);
  if (victim >= 0) free_victim(st, b, h, victim, count, length);
}

KVEVICT_HOST_DEVICE inline void commit_observe_evict(const batch_state_view& st, std::int32_t b, std::int32_t h,
                                                     std::int32_t victim) noexcept {
  const std::int64_t bh = st.head_index(b, h);
  commit_observe_evict(st, b, h, victim, st.score_buffer[bh], st.slots.counts[bh], st.slots.lengths[b]);
}

/// Forgets (b, h): every slot free with score 0 in both buffers, no history.
/// One thread per call; kernels split slots across threads with the range
/// [first, end).
KVEVICT_HOST_DEVICE inline void clear_head_slots(const batch_state_view& st, std::int32_t b, std::int32_t h,
                                                 std::int32_t first, std::int32_t end, std::int32_t step) noexcept {
  std::int32_t* pos = st.slots.positions_of(b, h);
  float* s0 = st.buffer_of(b, h, 0);
  float* s1 = st.buffer_of(b, h, 1);
  for (std::int32_t s = first; s < end; s += step) {
    pos[s] = -1;
    s0[s] = 0.0f;
    s1[s] = 0.0f;
  }
}

/// The counters of (b, h) as a reset leaves them; the caller sets lengths[b] to 0.
KVEVICT_HOST_DEVICE inline void clear_head_counters(const batch_state_view& st, std::int32_t b,
                                                    std::int32_t h) noexcept {
  const std::int64_t bh = st.head_index(b, h);
  st.slots.counts[bh] = 0;
  set_next_slot(st, b, h, 0, 0);  // the sequence's length becomes 0
  st.score_buffer[bh] = 0;
  st.appended[bh] = 0;
  if (st.history.rows) st.history.rows[bh] = 0;
  if (st.anchors.upto) st.anchors.upto[bh] = -1;
}

/// The anchor of (b, h), if the state keeps one, no longer follows its
/// cached tokens (evict_to, prefill): the next KeyDiff step counts afresh.
KVEVICT_HOST_DEVICE inline void mark_anchor_stale(const batch_state_view& st, std::int64_t bh) noexcept {
  if (st.anchors.upto) st.anchors.upto[bh] = -1;
}

}  // namespace detail
}  // namespace kvevict
