#pragma once
// Block-wide selection of the k-th smallest of a set of distinct
// non-negative 32-bit values that the block's threads enumerate, by radix
// select: four passes of 8 bits, each a shared-memory histogram and a
// cub::BlockScan over its 256 bins. The random policy uses it to find the
// k-th unprotected position without sorting.
#include <cub/block/block_scan.cuh>

#include <cstdint>

namespace kvevict {
namespace gpu {
namespace detail {

template <int BlockThreads>
struct block_select_kth {
  static_assert(BlockThreads == 256, "one scan element per histogram bin");
  using scan_type = cub::BlockScan<std::int32_t, BlockThreads>;
  struct temp_storage {
    typename scan_type::TempStorage scan;
    std::int32_t bins[256];
    std::uint32_t digit;
    std::int32_t rank;
  };

  /// The k-th smallest (k from 0) value v with candidate(f) calling f(v)
  /// for each of the calling thread's candidates. Every thread of the block
  /// calls it with the same k; k must be below the number of candidates.
  template <class Candidates>
  __device__ static std::uint32_t select(temp_storage& temp, std::int32_t k, Candidates candidates) {
    const int t = static_cast<int>(threadIdx.x);
    std::uint32_t prefix = 0, mask = 0;
    if (t == 0) temp.rank = k;
    for (int shift = 24; shift >= 0; shift -= 8) {
      temp.bins[t] = 0;
      __syncthreads();
      candidates([&](std::uint32_t v) {
        if ((v & mask) == prefix) atomicAdd(&temp.bins[(v >> shift) & 0xFFu], 1);
      });
      __syncthreads();
      const std::int32_t count = temp.bins[t];
      std::int32_t before = 0;
      scan_type(temp.scan).ExclusiveSum(count, before);
      const std::int32_t rank = temp.rank;
      __syncthreads();  // everyone has read rank before the winner moves it
      if (before <= rank && rank < before + count) {
        temp.digit = static_cast<std::uint32_t>(t);
        temp.rank = rank - before;
      }
      __syncthreads();
      prefix |= temp.digit << shift;
      mask |= 0xFFu << shift;
    }
    return prefix;
  }
};

}  // namespace detail
}  // namespace gpu
}  // namespace kvevict
