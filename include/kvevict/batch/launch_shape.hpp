#pragma once
// Launch shapes of the CUDA decode kernels, kept apart from the algorithm as
// CUB keeps its tuning policies. Plain C++: the batched state sizes its
// per-row workspace from them on the host, and host tests check the
// heuristics' promises (every slot covered, no more chunks than the
// workspace holds, enough blocks to fill the device).
//
// The fused observe + evict walks a (sequence, KV head) row in tiles of
// threads x items slots; each thread issues the loads of its `items` slots
// before it looks at any value. A long row is split into chunks of whole
// tiles, one block each, so that one sequence of 128K slots still fills
// every SM; the blocks of a row combine their exact minima (row_partial)
// in the last block to arrive. Short rows take one block and no workspace.
// The split follows a cost model (split_rows): waves of resident blocks
// times the tiles each block walks.
#include <cstdint>

#include "kvevict/config.hpp"

namespace kvevict {

struct decode_tuning {
  static constexpr int threads = 256;
  static constexpr int items = 8;  ///< slots per thread per tile: loads in flight per thread
  static constexpr std::int32_t tile = threads * items;
  /// Resident blocks per SM the grid is sized for, and the kernel's
  /// __launch_bounds__ minimum for the sources that fold `items` slots at
  /// once: 3 x 256 threads caps them at 80 registers, 24 warps per SM with
  /// 8 loads in flight each. They spill at that cap (ptxas, sm_90: the
  /// figures in tests/proxies/budgets.txt); 4 items a thread spill about a
  /// tenth as much, but halve the loads in flight: a GPU measures which
  /// wins (docs/gpu.md, "Static proxies").
  static constexpr int blocks_per_sm = 3;
};

/// How the blocks of a launch share each row: `chunks` blocks per row, each
/// over `chunk_slots` consecutive slots (a multiple of decode_tuning::tile).
struct row_split {
  std::int32_t chunk_slots = decode_tuning::tile;
  std::int32_t chunks = 1;
};

/// The most chunks a row of `capacity` slots is ever split into: one per
/// tile. The state keeps a row_partial per chunk and row when it is above 1.
KVEVICT_HOST_DEVICE constexpr std::int32_t max_row_chunks(std::int32_t capacity) noexcept {
  return capacity <= decode_tuning::tile ? 1 : (capacity + decode_tuning::tile - 1) / decode_tuning::tile;
}

/// `chunk_tiles` tiles per chunk (at least 1) over a row of `capacity` slots.
constexpr row_split split_by_tiles(std::int32_t capacity, std::int32_t chunk_tiles) noexcept {
  const std::int32_t tiles = (capacity + decode_tuning::tile - 1) / decode_tuning::tile;
  const std::int32_t per_chunk = chunk_tiles < 1 ? 1 : (chunk_tiles < tiles ? chunk_tiles : (tiles > 0 ? tiles : 1));
  row_split split;
  split.chunk_slots = per_chunk * decode_tuning::tile;
  split.chunks = tiles > 0 ? (tiles + per_chunk - 1) / per_chunk : 1;
  return split;
}

/// The split for `rows` active (sequence, head) rows of `capacity` slots on a
/// device with `sms` multiprocessors that holds `blocks_per_sm` blocks each:
/// the chunk length (in whole tiles) that minimises the estimated time,
/// waves x tiles per block, waves = ceil(rows x chunks / resident blocks),
/// and among equal estimates the longest chunks (fewest merges). So rows that
/// fill the device already take one block each, a few long rows take many,
/// and counts just above one wave are split to even out the waves.
constexpr row_split split_rows(std::int64_t rows, std::int32_t capacity, std::int32_t sms,
                               std::int32_t blocks_per_sm = decode_tuning::blocks_per_sm) noexcept {
  const std::int64_t resident = std::int64_t{sms > 0 ? sms : 1} * (blocks_per_sm > 0 ? blocks_per_sm : 1);
  const std::int32_t tiles = (capacity + decode_tuning::tile - 1) / decode_tuning::tile;
  if (rows < 1 || tiles <= 1) return split_by_tiles(capacity, tiles);
  std::int32_t best = tiles;
  std::int64_t best_cost = -1;
  for (std::int32_t per_chunk = tiles; per_chunk >= 1; --per_chunk) {
    const std::int64_t chunks = (tiles + per_chunk - 1) / per_chunk;
    const std::int64_t waves = (rows * chunks + resident - 1) / resident;
    const std::int64_t cost = waves * per_chunk;
    if (best_cost < 0 || cost < best_cost) {
      best = per_chunk;
      best_cost = cost;
    }
  }
  return split_by_tiles(capacity, best);
}

}  // namespace kvevict
