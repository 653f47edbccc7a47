#pragma once
// Small device-side pieces the batched kernels share: the status word's
// atomic minimum, the active-set entry of a block, and row copies with
// 16-byte vectors where alignment allows.
#include <cub/block/block_reduce.cuh>
#include <cuda_runtime.h>

#include <cstdint>

#include "kvevict/batch/inputs.hpp"
#include "kvevict/batch/status.hpp"

namespace kvevict {
namespace gpu {
namespace detail {

/// Threads per block of every batched kernel; the block primitives are
/// specialised for it.
inline constexpr int kBlockThreads = 256;

/// Minimum and maximum for CUB reductions, with cuda::minimum / maximum's
/// semantics; ours because those arrived only with CCCL 2.8 (CUDA 12.9).
struct minimum_of {
  template <class T>
  __device__ T operator()(const T& a, const T& b) const {
    return a < b ? a : b;
  }
};
struct maximum_of {
  template <class T>
  __device__ T operator()(const T& a, const T& b) const {
    return a < b ? b : a;
  }
};

__device__ inline void report(std::uint64_t* status, std::uint64_t word) {
  if (status && word != batch_status_clear)
    atomicMin(reinterpret_cast<unsigned long long*>(status), static_cast<unsigned long long>(word));
}

/// The victim of a block whose threads each hold their lowest (score,
/// position) key and its slot: keys are distinct (positions are), so exactly
/// one thread holds the block's minimum, and it writes its slot to `victim`.
/// Every thread calls it; `shared_word` is scratch; ends before a barrier the
/// caller places.
template <int BlockThreads>
__device__ inline void publish_lowest_key(typename cub::BlockReduce<unsigned long long, BlockThreads>::TempStorage& temp,
                                          unsigned long long best, std::int32_t best_slot,
                                          unsigned long long& shared_word, std::int32_t& victim) {
  const unsigned long long lowest =
      cub::BlockReduce<unsigned long long, BlockThreads>(temp).Reduce(best, minimum_of{});
  __syncthreads();  // every thread has read shared_word before thread 0 rewrites it
  if (threadIdx.x == 0) shared_word = lowest;
  __syncthreads();
  if (best_slot >= 0 && best == shared_word) victim = best_slot;
}

/// Thread 0: a problem leaves head `bh` unchanged; it is reported and its
/// victim is -1.
__device__ inline void give_up(std::int64_t bh, std::uint64_t word, std::int32_t* victims, std::uint64_t* status) {
  report(status, word);
  if (victims) victims[bh] = -1;
}

/// The sequence of active entry `entry`, or -1 when it steps nothing,
/// checked as the host checks it (detail::check_entry: an index outside the
/// batch, or a sequence other entries name too, steps nothing). The block's
/// threads share the scan of a list for repeats; the entry's status word is
/// reported once, by thread 0 of the block whose `head` is 0. Every thread
/// of the block calls it (it has barriers).
__device__ inline std::int32_t entry_sequence(const active_set& active, std::int32_t entry, std::int32_t num_seqs,
                                              std::int32_t head, std::uint64_t* status) {
  const std::int32_t b = active.sequence(entry, num_seqs);
  std::uint32_t repeats = 0;
  if (b >= 0 && active.mode == active_set::kind::list) {  // the same branch in every thread
    const std::uint32_t mine = kvevict::detail::list_repeats(active, entry, b, static_cast<std::int32_t>(threadIdx.x),
                                                             static_cast<std::int32_t>(blockDim.x));
    repeats = (__syncthreads_or(static_cast<int>(mine & 1u)) ? 1u : 0u) |
              (__syncthreads_or(static_cast<int>(mine & 2u)) ? 2u : 0u);
  }
  const kvevict::detail::checked_entry e = kvevict::detail::entry_after_scan(active, entry, num_seqs, repeats);
  if (head == 0 && threadIdx.x == 0) report(status, e.word);
  return e.sequence;
}

/// The multiprocessors of the current device (1 if it cannot be asked):
/// the launch heuristics (batch/launch_shape.hpp) size grids from it.
inline std::int32_t device_sm_count() {
  int device = 0, sms = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || sms < 1)
    return 1;
  return sms;
}

/// Copies n elements of T from src to dst with threads [lane, lane + lanes,
/// ...): 16-byte vectors when both rows are 16-byte aligned and n * sizeof(T)
/// is a multiple of 16, elements otherwise.
template <class T>
__device__ inline void copy_row(T* dst, const T* src, std::int32_t n, std::int32_t lane, std::int32_t lanes) {
  const bool vector = (reinterpret_cast<std::uintptr_t>(dst) % 16 == 0) &&
                      (reinterpret_cast<std::uintptr_t>(src) % 16 == 0) && (n * sizeof(T)) % 16 == 0;
  if (vector) {
    const std::int32_t vectors = static_cast<std::int32_t>(n * sizeof(T) / 16);
    for (std::int32_t i = lane; i < vectors; i += lanes)
      reinterpret_cast<uint4*>(dst)[i] = reinterpret_cast<const uint4*>(src)[i];
  } else {
    for (std::int32_t i = lane; i < n; i += lanes) dst[i] = src[i];
  }
}

}  // namespace detail
}  // namespace gpu
}  // namespace kvevict
