#pragma once
// fork on CUDA (batch/fork.hpp has the semantics and the host form).
// Within one state, two launches over the entries: the first copies every
// source into a snapshot in the caller's workspace, the second the
// snapshot into the destinations, so a sequence may be a source and a
// destination of one call. Across states, one launch copies directly.
// Both copy with batch/fork.hpp's copy_head, the host's own. A bad entry (a
// destination outside [0, num_seqs) or repeated, a source outside it, a
// stream above max_random_stream) leaves its destination unchanged and sets
// the status word; the other entries fork.
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kvevict/batch/fork.hpp"
#include "kvevict/batch/inputs.hpp"
#include "kvevict/batch/state.hpp"
#include "kvevict/batch/validate.hpp"
#include "kvevict/cuda/device_helpers.cuh"

namespace kvevict {
namespace gpu {
namespace detail {

/// Checks entry blockIdx.x and copies its source of `from` into `target`:
/// the destination itself across states (direct), else the snapshot's
/// sequence `entry`, with `good` telling the scatter which entries passed.
template <int BlockThreads>
__global__ void __launch_bounds__(BlockThreads)
    fork_gather_kernel(batch_state_view from, std::int32_t to_seqs, active_set destinations,
                       const std::int32_t* sources, const std::uint64_t* streams, batch_state_view target, bool direct,
                       std::uint8_t* good, std::uint64_t* status) {
  const std::int32_t entry = static_cast<std::int32_t>(blockIdx.x);
  const std::int32_t t = static_cast<std::int32_t>(threadIdx.x), n = BlockThreads;
  const std::int32_t d = entry_sequence(destinations, entry, to_seqs, 0, status);
  std::int32_t source = -1;
  bool ok = d >= 0;
  if (ok) {
    source = sources[entry];
    std::uint64_t problem = batch_status_clear;
    if (source < 0 || source >= from.num_seqs()) problem = pack_status(d, 0, source, batch_code::bad_fork_source);
    else if (streams && streams[entry] > max_random_stream) problem = pack_status(d, 0, entry, batch_code::bad_stream);
    if (problem != batch_status_clear) {
      if (t == 0) report(status, problem);
      ok = false;
    }
  }
  if (!direct && t == 0) good[entry] = ok ? 1 : 0;
  if (!ok) return;
  const std::int32_t at = direct ? d : entry;
  for (std::int32_t h = 0; h < from.num_heads(); ++h) kvevict::detail::copy_head(from, source, target, at, h, t, n);
  if (t == 0) {
    target.slots.lengths[at] = from.slots.lengths[source];
    if (direct && target.streams) target.streams[d] = kvevict::detail::forked_stream(streams, entry, d);
  }
}

template <int BlockThreads>
__global__ void __launch_bounds__(BlockThreads)
    fork_scatter_kernel(batch_state_view st, active_set destinations, const std::uint64_t* streams,
                        batch_state_view snapshot, const std::uint8_t* good) {
  const std::int32_t entry = static_cast<std::int32_t>(blockIdx.x);
  if (!good[entry]) return;
  const std::int32_t d = destinations.sequence(entry, st.num_seqs());
  const std::int32_t t = static_cast<std::int32_t>(threadIdx.x), n = BlockThreads;
  for (std::int32_t h = 0; h < st.num_heads(); ++h) kvevict::detail::copy_head(snapshot, entry, st, d, h, t, n);
  if (t == 0) {
    st.slots.lengths[d] = snapshot.slots.lengths[entry];
    if (st.streams) st.streams[d] = kvevict::detail::forked_stream(streams, entry, d);
  }
}

}  // namespace detail

/// Forks from device state `from` into device state `to` (the same state,
/// or one of the same policy, heads and capacity with any number of
/// sequences; batch/fork.hpp): entry i's destination in `to` becomes a copy
/// of sequence sources[i] of `from` as it was before the call; streams
/// (optional): random's new request streams, else the destination index.
/// destinations' list, sources and streams are device memory, [entries].
/// Workspace, CUB style: workspace == nullptr only sets workspace_bytes (a
/// snapshot of `entries` sequences within one state, a byte across two).
/// Bad entries set `status` (see the top).
inline cudaError_t batched_fork(void* workspace, std::size_t& workspace_bytes, const batch_state_view& from,
                                const batch_state_view& to, const active_set& destinations,
                                const std::int32_t* sources, const std::uint64_t* streams, std::uint64_t* status,
                                cudaStream_t stream) {
  const kvevict::detail::site w{"cuda", "fork"};
  kvevict::detail::require_fork_states(w, from, to, destinations);
  const std::int32_t entries = destinations.entries(to.num_seqs());
  const bool within = kvevict::detail::same_state(from, to);
  std::size_t snapshot_bytes = 0;
  if (within) kvevict::detail::carve_fork_snapshot(nullptr, from, entries, w, &snapshot_bytes);
  // Within a state: the snapshot, then a flag per entry; across states a byte
  // (a zero-byte workspace could not be told from the size query).
  const std::size_t needed = within ? snapshot_bytes + static_cast<std::size_t>(entries > 0 ? entries : 1) : 1;
  if (workspace == nullptr) {
    workspace_bytes = needed;
    return cudaSuccess;
  }
  if (workspace_bytes < needed)
    kvevict::detail::fail<invalid_argument>(w, "workspace_bytes", "= ", workspace_bytes, " is below the ", needed,
                                            " bytes the size query gave");
  if (entries == 0) return cudaSuccess;
  kvevict::detail::require_not_null(w, "sources", sources);
  kvevict::detail::require_not_null(w, "status", status);
  const batch_state_view target =
      within ? kvevict::detail::carve_fork_snapshot(workspace, from, entries, w, nullptr) : to;
  auto* good = static_cast<std::uint8_t*>(workspace) + snapshot_bytes;
  detail::fork_gather_kernel<detail::kBlockThreads><<<entries, detail::kBlockThreads, 0, stream>>>(
      from, to.num_seqs(), destinations, sources, streams, target, !within, good, status);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess || !within) return e;
  detail::fork_scatter_kernel<detail::kBlockThreads>
      <<<entries, detail::kBlockThreads, 0, stream>>>(to, destinations, streams, target, good);
  return cudaGetLastError();
}

/// Forks within device state `st`: batched_fork(..., st, st, ...).
inline cudaError_t batched_fork(void* workspace, std::size_t& workspace_bytes, const batch_state_view& st,
                                const active_set& destinations, const std::int32_t* sources,
                                const std::uint64_t* streams, std::uint64_t* status, cudaStream_t stream) {
  return batched_fork(workspace, workspace_bytes, st, st, destinations, sources, streams, status, stream);
}

}  // namespace gpu
}  // namespace kvevict
