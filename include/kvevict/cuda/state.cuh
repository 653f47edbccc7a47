#pragma once
// The batched state on CUDA: initialising and resetting sequences in device
// memory, and copying a state between devices (to inspect it, or to test a
// kernel against the host backend). The state itself is carved from caller
// memory by make_batch_state (kvevict/batch/state.hpp), as on the host.
#include <cuda_runtime.h>

#include <cstdint>

#include "kvevict/batch/inputs.hpp"
#include "kvevict/batch/state.hpp"
#include "kvevict/batch/status.hpp"
#include "kvevict/batch/step.hpp"
#include "kvevict/batch/validate.hpp"
#include "kvevict/cuda/device_helpers.cuh"

namespace kvevict {
namespace gpu {
namespace detail {

template <int BlockThreads>
__global__ void __launch_bounds__(BlockThreads)
    reset_kernel(batch_state_view st, active_set active, const std::uint64_t* streams, std::uint64_t* status) {
  const std::int32_t entry = static_cast<std::int32_t>(blockIdx.x);
  const std::int32_t b = entry_sequence(active, entry, st.num_seqs(), 0, status);
  if (b < 0) return;
  if (streams && streams[entry] > max_random_stream) {
    if (threadIdx.x == 0) report(status, pack_status(b, 0, entry, batch_code::bad_stream));
    return;
  }
  const std::int32_t t = static_cast<std::int32_t>(threadIdx.x), n = BlockThreads;
  for (std::int32_t h = 0; h < st.num_heads(); ++h) kvevict::detail::clear_head_slots(st, b, h, t, st.capacity(), n);
  kvevict::detail::clear_sequence_marks(st, b, t, n);
  __syncthreads();  // the words are zero before the heads' bits change
  for (std::int32_t h = t; h < st.num_heads(); h += n) {
    kvevict::detail::clear_head_counters(st, b, h);
    // The kernels' own per-head words start over too, whatever an aborted
    // call left in them.
    const std::int64_t bh = st.head_index(b, h);
    if (st.work.arrivals) st.work.arrivals[bh] = 0;
    if (st.work.evict_plans) st.work.evict_plans[bh].check = ~std::uint64_t{0};
  }
  if (t == 0) {
    st.slots.lengths[b] = 0;
    if (st.streams) st.streams[b] = streams ? streams[entry] : std::uint64_t(b);
  }
}

}  // namespace detail

/// Forgets the active sequences (every slot free, scores 0, length 0, no
/// history); streams (device memory, optional): entry i's new random
/// stream, else the sequence index. A stream above max_random_stream leaves
/// its sequence unchanged and sets `status` (bad_stream); status may be null
/// when no such data can occur.
inline cudaError_t reset_batch_sequences(const batch_state_view& st, const active_set& active,
                                         const std::uint64_t* streams, std::uint64_t* status, cudaStream_t stream) {
  const kvevict::detail::site w{"cuda", "reset_sequences"};
  kvevict::detail::require_state(w, st);
  kvevict::detail::require_active(w, active, st.num_seqs());
  const std::int32_t entries = active.entries(st.num_seqs());
  if (entries == 0) return cudaSuccess;
  detail::reset_kernel<detail::kBlockThreads><<<entries, detail::kBlockThreads, 0, stream>>>(st, active, streams, status);
  return cudaGetLastError();
}

/// Initialises a state carved by make_batch_state in device memory (its
/// workspace's counters included). The history rows are zeroed too: not needed by the kernels, but it makes every
/// byte of the state defined, so copies of it are (compute-sanitizer's
/// initcheck).
inline cudaError_t init_batch_state(const batch_state_view& st, cudaStream_t stream) {
  // The split rows' arrival counters start (and stay, between calls) at 0,
  // evict_to's gathered checks at all ones.
  const std::size_t heads = std::size_t(st.num_seqs()) * st.num_heads();
  cudaError_t e = cudaSuccess;
  if (st.work.arrivals) e = cudaMemsetAsync(st.work.arrivals, 0, heads * sizeof(std::uint32_t), stream);
  if (e == cudaSuccess && st.work.evict_plans)
    e = cudaMemsetAsync(st.work.evict_plans, 0xFF, heads * sizeof(evict_to_plan), stream);
  if (e != cudaSuccess) return e;
  if (st.history.keys) {
    const std::size_t bytes = std::size_t(st.num_seqs()) * st.num_heads() * std::size_t(st.history.max_tokens) *
                              std::size_t(st.history.head_dim) * sizeof(float);
    e = cudaMemsetAsync(st.history.keys, 0, bytes, stream);
    if (e == cudaSuccess) e = cudaMemsetAsync(st.history.values, 0, bytes, stream);
    if (e != cudaSuccess) return e;
  }
  if (st.anchors.sums) {  // stale after the reset; zeroed so that every byte is defined
    const std::size_t components = heads * std::size_t(st.anchors.head_dim);
    e = cudaMemsetAsync(st.anchors.sums, 0, components * sizeof(std::int64_t), stream);
    if (e == cudaSuccess) e = cudaMemsetAsync(st.anchors.units, 0, components * sizeof(float), stream);
    if (e != cudaSuccess) return e;
  }
  return reset_batch_sequences(st, active_set::all(), nullptr, nullptr, stream);
}

/// Copies every array of `src` into `dst` (the same policy and shape, on
/// either device; kind as for cudaMemcpyAsync), e.g. to read a device state
/// on the host.
inline cudaError_t copy_batch_state(const batch_state_view& dst, const batch_state_view& src, cudaMemcpyKind kind,
                                    cudaStream_t stream) {
  const kvevict::detail::site w{"cuda", "copy_batch_state"};
  if (dst.num_seqs() != src.num_seqs() || dst.num_heads() != src.num_heads() || dst.capacity() != src.capacity() ||
      (dst.streams == nullptr) != (src.streams == nullptr) ||
      (dst.history.keys == nullptr) != (src.history.keys == nullptr) ||
      dst.history.max_tokens != src.history.max_tokens || dst.history.head_dim != src.history.head_dim ||
      (dst.anchors.sums == nullptr) != (src.anchors.sums == nullptr) || dst.anchors.head_dim != src.anchors.head_dim)
    kvevict::detail::fail<invalid_argument>(w, "dst", "does not have the shape of src");
  const std::int64_t heads = std::int64_t{src.num_seqs()} * src.num_heads(), slots = heads * src.capacity();
  cudaError_t e = cudaSuccess;
  auto copy = [&](void* to, const void* from, std::int64_t bytes) {
    if (e == cudaSuccess && bytes > 0) e = cudaMemcpyAsync(to, from, static_cast<std::size_t>(bytes), kind, stream);
  };
  copy(dst.slots.positions, src.slots.positions, slots * 4);
  copy(dst.slots.counts, src.slots.counts, heads * 4);
  copy(dst.slots.next_slots, src.slots.next_slots, heads * 4);
  copy(dst.slots.lengths, src.slots.lengths, std::int64_t{src.num_seqs()} * 4);
  copy(dst.scores, src.scores, 2 * slots * 4);
  copy(dst.score_buffer, src.score_buffer, heads);
  copy(dst.appended, src.appended, heads);
  copy(dst.marks.lengths, src.marks.lengths, heads * 4);
  copy(dst.marks.full, src.marks.full, 2 * std::int64_t{src.num_seqs()} * src.marks.words * 8);
  if (src.streams) copy(dst.streams, src.streams, std::int64_t{src.num_seqs()} * 8);
  if (src.history.keys) {
    const std::int64_t rows = heads * src.history.max_tokens;
    copy(dst.history.keys, src.history.keys, rows * src.history.head_dim * 4);
    copy(dst.history.values, src.history.values, rows * src.history.head_dim * 4);
    copy(dst.history.rows, src.history.rows, heads * 4);
  }
  if (src.anchors.sums) {
    copy(dst.anchors.sums, src.anchors.sums, heads * src.anchors.head_dim * 8);
    copy(dst.anchors.units, src.anchors.units, heads * src.anchors.head_dim * 4);
    copy(dst.anchors.upto, src.anchors.upto, heads * 4);
  }
  return e;
}

}  // namespace gpu
}  // namespace kvevict
