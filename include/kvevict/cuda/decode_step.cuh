#pragma once
// The one-launch decode step on CUDA: append + observe + evict of every
// active (sequence, KV head) in one kernel, where the two-launch cycle
// runs batched_append, then batched_observe_evict. The engine reads
// next_slots (its slot mapping), writes the new token's K/V rows there and
// runs its attention over slots [0, count + 1) before this call.
//
// Rows of a sequence never wait for one another: append's verdict (does
// any head of b lack a free slot?) comes from the state's row marks, which
// a row of the launch reads at parity L & 1 and writes at (L + 1) & 1, and
// each row reads its own copy of the length (batch/state.hpp, row_marks).
// The kernel is observe_evict_kernel with its Append mode: the appended
// slot is read as position L, score 0, and the finishing thread commits
// the append before the observation. Same state, victims and status word,
// bit for bit, as batched_step on the host (batch/host_backend.hpp).
#include <cuda_runtime.h>

#include <cstdint>

#include "kvevict/batch/inputs.hpp"
#include "kvevict/batch/launch_shape.hpp"
#include "kvevict/batch/score_sources.hpp"
#include "kvevict/batch/state.hpp"
#include "kvevict/batch/validate.hpp"
#include "kvevict/cuda/observe_evict.cuh"

namespace kvevict {
namespace gpu {
namespace detail {

/// The one-launch step with a given split (tests force several chunks per
/// row with it); `split` must come from split_by_tiles.
template <class Input>
cudaError_t step_split(const batch_state_view& st, const active_set& active, const Input& in, std::int32_t* victims,
                       std::uint64_t* status, cudaStream_t stream, const row_split& split) {
  const kvevict::detail::site w{"cuda", "step"};
  require_common(w, st, active, status, /*accepts_retry=*/false);
  kvevict::detail::require_score_input(w, st, in);
  return launch_observe_evict<score_source<Input>, true>(
      st, active, score_source<Input>{in, st.group_size(), st.rule.reduce}, victims, status, stream, split);
}

}  // namespace detail

/// Append + observe + evict of every active sequence in one launch, from
/// `in` (batch_probs, batch_head_scores or batch_logits; device memory),
/// whose columns cover slots [0, count + 1): each head's next slot
/// takes position lengths[b], then every occupied slot takes its increment
/// and, above the budget, the policy's victim is freed. A sequence with a
/// head at budget + 1 tokens is left unchanged (no_free_slot); bad input
/// leaves its head as the append left it. victims (optional, device
/// [B][H]): the freed slot, or -1. Retry sets are refused.
template <class Input>
cudaError_t batched_step(const batch_state_view& st, const active_set& active, const Input& in,
                         std::int32_t* victims, std::uint64_t* status, cudaStream_t stream) {
  return detail::step_split(st, active, in, victims, status, stream,
                            detail::default_split<score_source<Input>>(st, active));
}

}  // namespace gpu
}  // namespace kvevict
