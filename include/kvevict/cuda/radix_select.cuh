#pragma once
// Block-level pieces of the CUDA segmented selection (segmented_select.cuh):
// an MSB-first radix select over 64-bit order keys with 8-bit digits, and the
// emission of the selected elements in index order.
//
// The k lowest of n keys (ties by the lower index) are found digit by digit,
// most significant first. The threshold state says which high bits of the
// k-th key are known (prefix under mask) and how many of the "candidates" —
// the keys whose high bits equal the prefix — still belong to the selection.
// Each pass histograms the candidates' next digit, and the bin that holds the
// remaining rank becomes the next digit. Keys below the prefix are selected,
// keys above it are not. The selection is complete as soon as the remaining
// count equals the whole bin (every candidate is taken), or after the last
// digit, where the candidates are exactly the keys equal to the k-th and the
// first `remaining` of them by index are taken. That rule makes the result
// deterministic: it never depends on the order in which threads or blocks
// run.
#include <cub/block/block_exchange.cuh>
#include <cub/block/block_scan.cuh>
#include <cuda_runtime.h>

#include <cstdint>

#include "kvevict/config.hpp"
#include "kvevict/select/device_plan.hpp"
#include "kvevict/select/segments.hpp"

namespace kvevict {
namespace gpu {
namespace detail {

/// The digit of `key` at `shift`.
KVEVICT_HOST_DEVICE inline int radix_digit(std::uint64_t key, int shift) noexcept {
  return static_cast<int>((key >> shift) & (kRadixBins - 1));
}

/// The result of a digit search: the chosen bin, the candidates in lower
/// bins and in the bin itself. digit < 0: not found (cannot happen while the
/// histogram counts exactly the candidates; callers stop rather than loop).
struct radix_digit_choice {
  std::int32_t digit, before, count;
};

/// The bin of a 256-bin histogram that holds the candidate of rank
/// `remaining` (1-based): the one with before < remaining <= before + count.
/// Host reference of block_digit_finder.
KVEVICT_HOST_DEVICE inline radix_digit_choice choose_digit(const std::int32_t* bins, std::int32_t remaining) noexcept {
  std::int32_t before = 0;
  for (int b = 0; b < kRadixBins; ++b) {
    if (bins[b] > 0 && before < remaining && remaining <= before + bins[b]) return {b, before, bins[b]};
    before += bins[b];
  }
  return {-1, 0, 0};
}

/// Packs the (below, candidate) counts of a run of elements into one word so
/// one scan serves both; each field stays below 2^31 (counts of one segment).
KVEVICT_HOST_DEVICE inline unsigned long long pack_counts(std::int32_t below, std::int32_t candidates) noexcept {
  return (static_cast<unsigned long long>(static_cast<std::uint32_t>(below)) << 32) |
         static_cast<std::uint32_t>(candidates);
}

/// Adds run-length aggregated counts to a shared histogram: neighbouring
/// elements often share a digit (equal or sorted keys), and one atomic per
/// run instead of one per element keeps equal keys from serialising on one
/// bin.
struct digit_run {
  int digit = 0;
  std::int32_t count = 0;

  __device__ void add(std::int32_t* bins, int d) {
    if (count != 0 && d != digit) flush(bins);
    digit = d;
    ++count;
  }
  __device__ void flush(std::int32_t* bins) {
    if (count != 0) atomicAdd(&bins[digit], count);
    count = 0;
  }
};

/// Finds the digit of a block-wide 256-bin histogram: thread t holds bins
/// [t * bins_per_thread, ...) (threads past bin 255 hold zeros); one exclusive
/// scan, and the one thread whose bin holds the rank writes the choice.
template <int BlockThreads>
struct block_digit_finder {
  static constexpr int bins_per_thread = (kRadixBins + BlockThreads - 1) / BlockThreads;
  using scan_type = cub::BlockScan<std::int32_t, BlockThreads>;
  using temp_storage = typename scan_type::TempStorage;

  /// The thread's share of `bins` (shared or global memory).
  __device__ static void read_bins(const std::int32_t* bins, std::int32_t (&counts)[bins_per_thread]) {
#pragma unroll
    for (int q = 0; q < bins_per_thread; ++q) {
      const int b = static_cast<int>(threadIdx.x) * bins_per_thread + q;
      counts[q] = b < kRadixBins ? bins[b] : 0;
    }
  }

  /// Every thread calls it with the same `remaining` (>= 1). The finder
  /// writes `choice`; the caller orders that write with a barrier before
  /// anyone reads it, and the reads of the previous choice before it.
  __device__ static void find(temp_storage& temp, const std::int32_t (&counts)[bins_per_thread],
                              std::int32_t remaining, radix_digit_choice& choice) {
    std::int32_t in[bins_per_thread], before[bins_per_thread];  // CUB takes non-const arrays
#pragma unroll
    for (int q = 0; q < bins_per_thread; ++q) in[q] = counts[q];
    scan_type(temp).ExclusiveSum(in, before);
#pragma unroll
    for (int q = 0; q < bins_per_thread; ++q) {
      if (counts[q] > 0 && before[q] < remaining && remaining <= before[q] + counts[q])
        choice = radix_digit_choice{static_cast<std::int32_t>(threadIdx.x) * bins_per_thread + q, before[q], counts[q]};
    }
  }
};

/// One tile of BlockThreads x ItemsPerThread keys of a segment: loading in
/// index order, the radix select of a tile held in registers, and the
/// emission of the selected elements by ascending index.
template <int BlockThreads, int ItemsPerThread>
struct block_radix_select {
  static constexpr int tile_items = BlockThreads * ItemsPerThread;
  using exchange_type = cub::BlockExchange<unsigned long long, BlockThreads, ItemsPerThread>;
  using finder_type = block_digit_finder<BlockThreads>;
  using count_scan_type = cub::BlockScan<unsigned long long, BlockThreads>;
  static constexpr int bins_per_thread = finder_type::bins_per_thread;

  struct temp_storage {
    union {
      typename exchange_type::TempStorage exchange;
      typename finder_type::temp_storage finder;
      typename count_scan_type::TempStorage counts;
    } reuse;
    std::int32_t bins[kRadixBins];
    radix_digit_choice choice;
  };

  /// Keys of elements [base, base + tile_items) of segment `segment` in
  /// blocked order (thread t holds base + t * ItemsPerThread + u): the order
  /// of the index scans. Elements at or past n read as ~0 and are never
  /// counted (callers test the index). Computed in striped order so
  /// neighbouring threads read neighbouring elements, then exchanged through
  /// shared memory. Ends with a barrier: the storage may be reused at once.
  template <class Keys>
  __device__ static void load_blocked(temp_storage& temp, const Keys& keys, std::int32_t segment, select_end end,
                                      std::int64_t base, std::int32_t n, unsigned long long (&items)[ItemsPerThread]) {
#pragma unroll
    for (int u = 0; u < ItemsPerThread; ++u) {
      const std::int64_t j = base + std::int64_t{u} * BlockThreads + threadIdx.x;
      items[u] = j < n ? static_cast<unsigned long long>(keys.key(segment, static_cast<std::int32_t>(j), end)) : ~0ull;
    }
    exchange_type(temp.reuse.exchange).StripedToBlocked(items, items);
    __syncthreads();
  }

  /// Index of the calling thread's item u in blocked order.
  __device__ static std::int64_t blocked_index(std::int64_t base, int u) {
    return base + std::int64_t{threadIdx.x} * ItemsPerThread + u;
  }

  /// The threshold of the k lowest of the n keys a block holds in registers
  /// (all of one segment, n <= tile_items, blocked from index 0). Every
  /// thread calls it with the same k and n, and gets the same result.
  __device__ static radix_threshold select(temp_storage& temp, const unsigned long long (&items)[ItemsPerThread],
                                           std::int32_t n, std::int32_t k) {
    radix_threshold th = radix_threshold::start(k, n);
    const int t = static_cast<int>(threadIdx.x);
    for (int shift = kFirstShift; shift >= 0 && !th.done; shift -= kRadixBits) {
      for (int b = t; b < kRadixBins; b += BlockThreads) temp.bins[b] = 0;
      __syncthreads();  // A: bins are clear; every read of the previous choice is done
      if (t == 0) temp.choice = radix_digit_choice{-1, 0, 0};
      digit_run run;
#pragma unroll
      for (int u = 0; u < ItemsPerThread; ++u)
        if (blocked_index(0, u) < n && th.candidate(items[u])) run.add(temp.bins, radix_digit(items[u], shift));
      run.flush(temp.bins);
      __syncthreads();  // B: the histogram is complete, the choice preset
      std::int32_t counts[bins_per_thread];
      finder_type::read_bins(temp.bins, counts);
      finder_type::find(temp.reuse.finder, counts, th.remaining, temp.choice);
      __syncthreads();  // C: the choice is visible (and the scan storage free again)
      const radix_digit_choice c = temp.choice;
      if (c.digit < 0) break;  // unreachable: the histogram counts exactly the candidates
      th.descend(c.digit, shift, c.before, c.count);
    }
    return th;
  }

  /// The (below, candidate) counts of the calling thread's valid items,
  /// packed (pack_counts).
  __device__ static unsigned long long thread_counts(const unsigned long long (&items)[ItemsPerThread],
                                                     const radix_threshold& th, std::int64_t base, std::int32_t n) {
    std::int32_t below = 0, candidates = 0;
#pragma unroll
    for (int u = 0; u < ItemsPerThread; ++u) {
      if (blocked_index(base, u) >= n) continue;
      below += th.below(items[u]) ? 1 : 0;
      candidates += th.candidate(items[u]) ? 1 : 0;
    }
    return pack_counts(below, candidates);
  }

  /// Calls sink(j, selected, rank) for every valid element j of the tile in
  /// ascending j, where rank is j's place in the segment's output (meaningful
  /// when selected). `tile_before` packs the (below, candidate) counts of the
  /// segment's elements before this tile. The element of rank r among the
  /// selected is the one with r selected elements before it, which are all
  /// the "below" ones before it plus the first min(candidates before,
  /// remaining) candidates: one exclusive scan of the packed counts gives it.
  /// Ends with a barrier.
  template <class Sink>
  __device__ static void emit(temp_storage& temp, const unsigned long long (&items)[ItemsPerThread],
                              const radix_threshold& th, std::int64_t base, std::int32_t n,
                              unsigned long long tile_before, Sink sink) {
    unsigned long long before = 0;
    count_scan_type(temp.reuse.counts).ExclusiveSum(thread_counts(items, th, base, n), before);
    before += tile_before;
    std::int32_t below = static_cast<std::int32_t>(before >> 32);
    std::int32_t candidates = static_cast<std::int32_t>(before & 0xFFFFFFFFull);
#pragma unroll
    for (int u = 0; u < ItemsPerThread; ++u) {
      const std::int64_t j = blocked_index(base, u);
      if (j >= n) continue;
      if (th.below(items[u])) {
        sink(static_cast<std::int32_t>(j), true, below + (candidates < th.remaining ? candidates : th.remaining));
        ++below;
      } else if (th.candidate(items[u])) {
        sink(static_cast<std::int32_t>(j), candidates < th.remaining, below + candidates);
        ++candidates;
      } else {
        sink(static_cast<std::int32_t>(j), false, 0);
      }
    }
    __syncthreads();  // the scan storage may be reused
  }
};

}  // namespace detail
}  // namespace gpu
}  // namespace kvevict
