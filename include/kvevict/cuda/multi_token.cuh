#pragma once
// The append of several tokens per sequence on CUDA (chunked prefill,
// speculative decoding), with the decisions of the host's
// batched_append_tokens (kvevict/batch/multi_token.hpp), bit for bit: one
// block per active sequence, a thread per (head, token). evict_to, which
// then frees every surplus token, is in cuda/evict_to.cuh (included here).
#include <cub/block/block_reduce.cuh>
#include <cuda_runtime.h>

#include <cstdint>

#include "kvevict/batch/inputs.hpp"
#include "kvevict/batch/multi_token.hpp"
#include "kvevict/batch/state.hpp"
#include "kvevict/batch/status.hpp"
#include "kvevict/batch/validate.hpp"
#include "kvevict/cuda/device_helpers.cuh"
#include "kvevict/cuda/evict_to.cuh"
#include "kvevict/policy/decode_rules.hpp"
#include "kvevict/policy/evict_to.hpp"

namespace kvevict {
namespace gpu {
namespace detail {

template <int BlockThreads>
__global__ void __launch_bounds__(BlockThreads)
    append_tokens_kernel(batch_state_view st, active_set active, std::int32_t tokens, std::uint64_t* status) {
  using reduce = cub::BlockReduce<unsigned long long, BlockThreads>;
  __shared__ typename reduce::TempStorage temp;
  __shared__ unsigned long long problem;
  const std::int32_t b = entry_sequence(active, static_cast<std::int32_t>(blockIdx.x), st.num_seqs(), 0, status);
  if (b < 0) return;
  const std::int32_t t = static_cast<std::int32_t>(threadIdx.x);
  const std::int32_t first = st.slots.lengths[b];
  unsigned long long mine = batch_status_clear;  // a thread per head: the lowest head that would not fit
  for (std::int32_t h = t; h < st.num_heads(); h += BlockThreads)
    if (st.slots.counts[st.head_index(b, h)] + tokens > st.capacity())
      mine = minimum_of{}(mine, static_cast<unsigned long long>(pack_status(b, h, tokens, batch_code::over_capacity)));
  mine = reduce(temp).Reduce(mine, minimum_of{});
  if (t == 0) {
    problem = mine;
    report(status, mine);
  }
  __syncthreads();
  if (problem != batch_status_clear) return;
  for (std::int64_t i = t; i < std::int64_t{st.num_heads()} * tokens; i += BlockThreads) {  // 64-bit product
    const std::int32_t h = static_cast<std::int32_t>(i / tokens), j = static_cast<std::int32_t>(i % tokens);
    const std::int64_t bh = st.head_index(b, h);
    const std::int32_t s = new_token_slot(st.slots.counts[bh], st.slots.next_slots[bh], j);
    st.slots.positions_of(b, h)[s] = first + j;
    st.scores_of(b, h)[s] = 0.0f;
  }
  __syncthreads();  // every thread has read counts, next_slots and lengths
  for (std::int32_t h = t; h < st.num_heads(); h += BlockThreads) {
    const std::int64_t bh = st.head_index(b, h);
    const std::int32_t count = st.slots.counts[bh] + tokens;
    st.slots.counts[bh] = count;
    kvevict::detail::set_next_slot(st, b, h, next_slot_after_append(count, st.rule.budget), first + tokens);
    st.appended[bh] = 1;
  }
  if (t == 0) st.slots.lengths[b] = first + tokens;
}

}  // namespace detail

/// Appends `tokens` tokens to every active sequence, as the host's
/// batched_append_tokens (status over_capacity for a sequence that would
/// not fit, which is left unchanged).
inline cudaError_t batched_append_tokens(const batch_state_view& st, const active_set& active, std::int32_t tokens,
                                         std::uint64_t* status, cudaStream_t stream) {
  const kvevict::detail::site w{"cuda", "append_tokens"};
  kvevict::detail::require_state(w, st);
  kvevict::detail::require_active(w, active, st.num_seqs());
  kvevict::detail::require_not_null(w, "status", status);
  kvevict::detail::require_tokens(w, st, tokens);
  const std::int32_t entries = active.entries(st.num_seqs());
  if (entries == 0) return cudaSuccess;
  detail::append_tokens_kernel<detail::kBlockThreads>
      <<<entries, detail::kBlockThreads, 0, stream>>>(st, active, tokens, status);
  return cudaGetLastError();
}

}  // namespace gpu
}  // namespace kvevict
