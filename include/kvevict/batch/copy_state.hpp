#pragma once
// copy_state: a batched state moved to a state of another capacity
// (docs/semantics.md, "Moving a state to another capacity").
//
// A (b, h) row's occupied slots always lie in [0, count + 1) (append fills
// the hole first; prefill and evict_to compact to [0, kept)), so between
// steps a decode-time row fits budget + 1 slots whatever capacity its state
// was made with. An engine that compressed a long prompt in a state sized for
// the prompt (prefill needs the prompt in slots [0, L)) moves it to a state of
// budget + 1 slots and frees the rest, with the K/V rows of slots
// [0, budget + 1) (integrations/llama.cpp does).
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "kvevict/batch/state.hpp"
#include "kvevict/batch/validate.hpp"

namespace kvevict {

namespace detail {

// What must match for a sequence of dst to continue one of src's: everything
// but the capacity and the number of sequences.
inline void require_same_policy(const site& w, const batch_state_view& src, const batch_state_view& dst) {
  const auto same = [&](const char* what, std::int64_t a, std::int64_t b) {
    if (a != b) fail<invalid_argument>(w, what, "= ", b, " in dst, ", a, " in src");
  };
  same("num_heads", src.num_heads(), dst.num_heads());
  same("num_q_heads", src.num_q_heads, dst.num_q_heads);
  const decode_rule &a = src.rule, &b = dst.rule;
  if (a.victim != b.victim || a.budget != b.budget || a.reduce != b.reduce || a.decay != b.decay || a.seed != b.seed ||
      a.first_head != b.first_head || a.protect.sinks != b.protect.sinks || a.protect.recent != b.protect.recent)
    fail<invalid_argument>(w, "dst.rule", "differs from src's (policy, budget, protection, reduce, decay, seed or first KV head)");
  same("history.max_tokens", src.history.max_tokens, dst.history.max_tokens);
  same("history.head_dim", src.history.head_dim, dst.history.head_dim);
  same("anchors.head_dim", src.anchors.head_dim, dst.anchors.head_dim);
  same("anchors (kept or not)", src.anchors.sums != nullptr, dst.anchors.sums != nullptr);
}

// Every (b, h) of src must fit dst: its occupied slots and next slot below
// dst's capacity.
inline void require_fits(const site& w, const batch_state_view& src, std::int32_t capacity) {
  for (std::int32_t b = 0; b < src.num_seqs(); ++b)
    for (std::int32_t h = 0; h < src.num_heads(); ++h) {
      const std::int32_t* pos = src.slots.positions_of(b, h);
      for (std::int32_t s = capacity; s < src.capacity(); ++s)
        if (pos[s] >= 0)
          fail<invalid_argument>(w, "dst.capacity", "= ", capacity, " is below slot ", s, " of (b, h) = (", b, ", ", h,
                                 "), which holds position ", pos[s]);
      const std::int32_t next = src.slots.next_slots[src.head_index(b, h)];
      if (next >= capacity)
        fail<invalid_argument>(w, "dst.capacity", "= ", capacity, " is not above the next slot ", next,
                               " of (b, h) = (", b, ", ", h, ")");
    }
}

template <class T>
void copy_array(T* dst, const T* src, std::int64_t count) {
  if (count > 0 && src && dst) std::memcpy(dst, src, sizeof(T) * static_cast<std::size_t>(count));
}

}  // namespace detail

/// Copies host state `src` into host state `dst`, made for the same policy,
/// sequences, heads, rule and history or anchor extents at any capacity that
/// holds every (b, h)'s occupied slots and next slot (budget + 1 always does
/// between steps). dst then makes src's decisions; src is unchanged. Checks
/// everything before writing (dst is unchanged when it throws).
inline void copy_state(const batch_state_view& src, const batch_state_view& dst) {
  const detail::site w{"batch", "copy_state"};
  detail::require_state(w, src);
  detail::require_state(w, dst);
  if (src.num_seqs() != dst.num_seqs())
    detail::fail<invalid_argument>(w, "num_seqs", "= ", dst.num_seqs(), " in dst, ", src.num_seqs(), " in src");
  detail::require_same_policy(w, src, dst);
  detail::require_fits(w, src, dst.capacity());
  const std::int64_t heads = std::int64_t{src.num_seqs()} * src.num_heads();
  const std::int32_t kept = std::min(src.capacity(), dst.capacity());
  for (std::int32_t b = 0; b < src.num_seqs(); ++b)
    for (std::int32_t h = 0; h < src.num_heads(); ++h) {
      std::int32_t* pos = dst.slots.positions_of(b, h);
      std::copy_n(src.slots.positions_of(b, h), kept, pos);
      std::fill(pos + kept, pos + dst.capacity(), -1);
      for (std::int32_t which = 0; which < 2; ++which) {  // free slots hold 0 in both buffers
        float* scores = dst.buffer_of(b, h, which);
        std::copy_n(src.buffer_of(b, h, which), kept, scores);
        std::fill(scores + kept, scores + dst.capacity(), 0.0f);
      }
    }
  detail::copy_array(dst.slots.counts, src.slots.counts, heads);
  detail::copy_array(dst.slots.next_slots, src.slots.next_slots, heads);
  detail::copy_array(dst.slots.lengths, src.slots.lengths, src.num_seqs());
  detail::copy_array(dst.score_buffer, src.score_buffer, heads);
  detail::copy_array(dst.appended, src.appended, heads);
  detail::copy_array(dst.marks.lengths, src.marks.lengths, heads);
  detail::copy_array(dst.marks.full, src.marks.full, 2 * std::int64_t{src.num_seqs()} * src.marks.words);
  detail::copy_array(dst.streams, src.streams, src.num_seqs());
  const std::int64_t rows = heads * src.history.max_tokens * src.history.head_dim;
  detail::copy_array(dst.history.keys, src.history.keys, rows);
  detail::copy_array(dst.history.values, src.history.values, rows);
  detail::copy_array(dst.history.rows, src.history.rows, heads);
  detail::copy_array(dst.anchors.sums, src.anchors.sums, heads * src.anchors.head_dim);
  detail::copy_array(dst.anchors.units, src.anchors.units, heads * src.anchors.head_dim);
  detail::copy_array(dst.anchors.upto, src.anchors.upto, heads);
}

}  // namespace kvevict
