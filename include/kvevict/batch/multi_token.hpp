#pragma once
// Multi-token steps of the batched API on the host (docs/semantics.md,
// "Multi-token steps"): an append of several tokens per sequence (chunked
// prefill, speculative decoding); evict_to, which then frees every surplus
// token of each (b, h) at once, is in evict_to.hpp (included here). The
// per-(b, h) rules are policy/evict_to.hpp's; the CUDA launchers
// (kvevict/cuda/multi_token.cuh, evict_to.cuh) make the same decisions.
//
// A step with several tokens: batched_append_tokens, attention over the
// occupied prefix, batched_observe_evict (adds the scores and evicts one
// token above the budget), then batched_evict_to(budget) for the rest.
// exact_greedy's evict_to takes that step's queries again: it re-scores the
// tokens left after each victim.
#include <cstdint>

#include "kvevict/batch/evict_to.hpp"
#include "kvevict/batch/host_backend.hpp"
#include "kvevict/batch/inputs.hpp"
#include "kvevict/batch/state.hpp"
#include "kvevict/batch/status.hpp"
#include "kvevict/batch/validate.hpp"
#include "kvevict/policy/evict_to.hpp"

namespace kvevict {
namespace detail {

inline void require_tokens(const site& w, const batch_state_view& st, std::int32_t tokens) {
  if (tokens < 1 || tokens > st.capacity())
    fail<out_of_range>(w, "tokens", "= ", tokens, " is outside [1, capacity = ", st.capacity(), "]");
}

/// Appends `tokens` tokens to sequence b: positions length(b) .. length(b)
/// + tokens - 1, token j of (b, h) in new_token_slot(count, next_slot, j)
/// with score 0 (on_slot(h, j, slot) says where); or, when a head would
/// exceed the capacity, nothing changes and its over_capacity word is
/// returned.
template <class OnSlot>
std::uint64_t append_tokens_sequence(const batch_state_view& st, std::int32_t b, std::int32_t tokens, OnSlot on_slot) {
  for (std::int32_t h = 0; h < st.num_heads(); ++h)
    if (std::int64_t{st.slots.counts[st.head_index(b, h)]} + tokens > st.capacity())
      return pack_status(b, h, tokens, batch_code::over_capacity);
  const std::int32_t first = st.slots.lengths[b];
  for (std::int32_t h = 0; h < st.num_heads(); ++h) {
    const std::int64_t bh = st.head_index(b, h);
    const std::int32_t count = st.slots.counts[bh], next = st.slots.next_slots[bh];
    for (std::int32_t j = 0; j < tokens; ++j) {
      const std::int32_t s = new_token_slot(count, next, j);
      st.slots.positions_of(b, h)[s] = first + j;
      st.scores_of(b, h)[s] = 0.0f;
      on_slot(h, j, s);
    }
    st.slots.counts[bh] = count + tokens;
    set_next_slot(st, b, h, next_slot_after_append(count + tokens, st.rule.budget), first + tokens);
    st.appended[bh] = 1;
  }
  st.slots.lengths[b] = first + tokens;
  return batch_status_clear;
}

}  // namespace detail

/// Appends `tokens` tokens to every active sequence: positions length(b) ..
/// length(b) + tokens - 1, token j of (b, h) in new_token_slot(count,
/// next_slot, j) with score 0. The engine writes the rows there (the slots
/// follow from counts and next_slots before the call). A sequence with a
/// head that would exceed the capacity is left unchanged (over_capacity).
inline void batched_append_tokens(const batch_state_view& st, const active_set& active, std::int32_t tokens,
                                  std::uint64_t* status) {
  const detail::site w{"batch", "append_tokens"};
  detail::require_state(w, st);
  detail::require_active(w, active, st.num_seqs());
  detail::require_not_null(w, "status", status);
  detail::require_tokens(w, st, tokens);
  detail::for_each_active(st, active, status, [&](std::int32_t b) {
    detail::record_status(status, detail::append_tokens_sequence(st, b, tokens, [](std::int32_t, std::int32_t, std::int32_t) {}));
  });
}

}  // namespace kvevict
