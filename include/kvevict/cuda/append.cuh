#pragma once
// Launch 1 of a decode step on CUDA: every active sequence's new position
// goes to each head's next slot (score 0), optionally fused with the scatter
// of its new K and V rows into the cache, for every dtype and layout. One
// block per active sequence; a thread per head checks it (one dependent
// load), a block reduction decides, and the rows move as 16-byte vectors
// where the buffers allow. Same semantics as batched_append on the host
// (kvevict/batch/host_backend.hpp).
#include <cub/block/block_reduce.cuh>
#include <cuda_runtime.h>

#include <cstdint>

#include "kvevict/batch/inputs.hpp"
#include "kvevict/batch/state.hpp"
#include "kvevict/batch/status.hpp"
#include "kvevict/batch/step.hpp"
#include "kvevict/batch/validate.hpp"
#include "kvevict/cuda/device_helpers.cuh"
#include "kvevict/kv_view.hpp"

namespace kvevict {
namespace gpu {
namespace detail {

/// Stands for "no cache" in the append kernel.
struct no_scatter {};

template <int BlockThreads, class T, class Layout, bool Scatter>
__global__ void __launch_bounds__(BlockThreads)
    append_kernel(batch_state_view st, active_set active, kv_view<T, Layout> cache, tensor_view<const T, 3> k_new,
                  tensor_view<const T, 3> v_new, std::uint64_t* status) {
  using reduce = cub::BlockReduce<unsigned long long, BlockThreads>;
  __shared__ typename reduce::TempStorage temp;
  __shared__ unsigned long long problem;
  const std::int32_t b = entry_sequence(active, static_cast<std::int32_t>(blockIdx.x), st.num_seqs(), 0, status);
  if (b < 0) return;
  const std::int32_t t = static_cast<std::int32_t>(threadIdx.x);
  const std::int32_t position = st.slots.lengths[b];  // loaded beside the heads' checks, not after them
  // Thread h checks head h (a free slot, a mapped page): one dependent load
  // per thread, not one per head in a row. Its slot, count and score
  // buffer stay in registers for the commit (heads past the block size are
  // read again).
  const bool own = t < st.num_heads();
  const std::int32_t own_slot = own ? st.slots.next_slots[st.head_index(b, t)] : -1;
  const std::int32_t own_count = own ? st.slots.counts[st.head_index(b, t)] : 0;
  const std::int32_t own_buffer = own ? st.score_buffer[st.head_index(b, t)] : 0;
  unsigned long long mine = batch_status_clear;
  for (std::int32_t h = t; h < st.num_heads(); h += BlockThreads)
    mine = minimum_of{}(mine, static_cast<unsigned long long>(kvevict::detail::append_head_problem(
                                  st, b, h, [=](std::int32_t slot) {
                                    if constexpr (Scatter) return row_is_mapped(cache, b, slot);
                                    (void)slot;
                                    return true;
                                  })));
  mine = reduce(temp).Reduce(mine, minimum_of{});
  if (t == 0) {
    problem = mine;
    report(status, mine);
  }
  __syncthreads();
  if (problem != batch_status_clear) return;
  if constexpr (Scatter) {
    // A warp per (head, K or V) row at a time.
    const std::int32_t warp = t / 32, lane = t % 32, warps = BlockThreads / 32;
    for (std::int32_t r = warp; r < 2 * st.num_heads(); r += warps) {
      const std::int32_t h = r / 2;
      const std::int32_t slot = st.slots.next_slots[st.head_index(b, h)];
      if (r % 2 == 0) copy_row(cache.k_row(b, h, slot), &k_new(b, h, 0), cache.head_dim, lane, 32);
      else copy_row(cache.v_row(b, h, slot), &v_new(b, h, 0), cache.head_dim, lane, 32);
    }
    __syncthreads();  // every warp has read next_slots before the commit changes them
  }
  if (own) kvevict::detail::commit_append(st, b, t, position, own_slot, own_count, own_buffer);
  for (std::int32_t h = t + BlockThreads; h < st.num_heads(); h += BlockThreads)
    kvevict::detail::commit_append(st, b, h, position);
  if (t == 0) st.slots.lengths[b] = position + 1;
}

}  // namespace detail

/// Append for every active sequence (no K/V rows: the engine's own append
/// kernel writes them to next_slots, before or after this call). A sequence
/// with a head at budget + 1 tokens is left unchanged (status no_free_slot).
inline cudaError_t batched_append(const batch_state_view& st, const active_set& active, std::uint64_t* status,
                                  cudaStream_t stream) {
  const kvevict::detail::site w{"cuda", "append"};
  kvevict::detail::require_state(w, st);
  kvevict::detail::require_active(w, active, st.num_seqs());
  kvevict::detail::require_not_null(w, "status", status);
  const std::int32_t entries = active.entries(st.num_seqs());
  if (entries == 0) return cudaSuccess;
  detail::append_kernel<detail::kBlockThreads, float, strided_layout, false>
      <<<entries, detail::kBlockThreads, 0, stream>>>(st, active, {}, {}, {}, status);
  return cudaGetLastError();
}

/// Append fused with the scatter of k_new(b, h, :) and v_new(b, h, :) into
/// each head's next slot of `cache`. A next slot on a page outside the pool
/// leaves its sequence unchanged (status bad_page).
template <class T, class Layout>
cudaError_t batched_append(const batch_state_view& st, const active_set& active, const kv_view<T, Layout>& cache,
                           const batch_rows<T>& k_new, const batch_rows<T>& v_new, std::uint64_t* status,
                           cudaStream_t stream) {
  const kvevict::detail::site w{"cuda", "append"};
  kvevict::detail::require_state(w, st);
  kvevict::detail::require_active(w, active, st.num_seqs());
  kvevict::detail::require_not_null(w, "status", status);
  kvevict::detail::require_cache(w, st, cache);
  kvevict::detail::require_rows(w, "k_new", st, k_new, cache);
  kvevict::detail::require_rows(w, "v_new", st, v_new, cache);
  const std::int32_t entries = active.entries(st.num_seqs());
  if (entries == 0) return cudaSuccess;
  detail::append_kernel<detail::kBlockThreads, T, Layout, true>
      <<<entries, detail::kBlockThreads, 0, stream>>>(st, active, cache, k_new.rows, v_new.rows, status);
  return cudaGetLastError();
}

}  // namespace gpu
}  // namespace kvevict
