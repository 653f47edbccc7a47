#pragma once
// The workspace of a batched prefill call on CUDA (cuda/prefill.cuh): its
// layout in caller memory, the tuning constants of the kernels and what
// every launch of one call shares.
#include <cuda_runtime.h>

#include <climits>
#include <cstddef>
#include <cstdint>

#include "kvevict/batch/inputs.hpp"
#include "kvevict/batch/prefill_rules.hpp"
#include "kvevict/batch/state.hpp"
#include "kvevict/batch/validate.hpp"
#include "kvevict/policy/column_sums.hpp"

namespace kvevict {
namespace gpu {
namespace detail {

inline constexpr int kPrefillColumns = 256;        ///< columns per block of the probs and combine kernels
inline constexpr int kPrefillKeys = 64;            ///< keys per block of the queries kernel
inline constexpr int kPrefillQueryRows = 16;       ///< query rows staged in shared memory at a time
inline constexpr int kPrefillStageBytes = 16384;   ///< K and V bytes staged per compaction pass
inline constexpr int kPrefillPlanThreads = 256;
inline constexpr unsigned kMaxGridY = 65535;

/// Offset of chunk c's partials within a (entry, query head) pair's
/// triangle: chunks before c hold 64, 128, ... columns.
KVEVICT_HOST_DEVICE inline std::int64_t partial_offset(std::int32_t chunk) noexcept {
  return std::int64_t{prefill_chunk_rows / 2} * chunk * (chunk + 1);
}

/// Partials of one pair: the last chunk holds all max_length columns.
inline std::int64_t partials_per_pair(std::int32_t max_length) noexcept {
  return partial_offset(prefill_chunks(max_length) - 1) + max_length;
}

/// The call's workspace, carved from caller memory.
struct prefill_workspace {
  std::uint32_t* seq_bad = nullptr;       ///< [E]: nonzero once any problem of the entry's sequence is found
  std::uint8_t* head_refused = nullptr;   ///< [E][H]: refused before scoring (its sequence, or its queries)
  std::uint64_t* streams = nullptr;       ///< [E]: random's request stream of the entry's sequence
  float* partials = nullptr;              ///< [E][Hq][per_pair]: chunk partials (probs, queries) or window sums
  float* scores = nullptr;                ///< [E][H][max_length]: prefill scores by position
  std::int32_t* candidates = nullptr;     ///< [E][H]: candidates of the keep selection (0: none)
  std::int32_t* takes = nullptr;          ///< [E][H]: how many of them are kept
  std::int32_t* chosen = nullptr;         ///< [E][H][index_stride]: the kept candidates, ascending
  void* select = nullptr;                 ///< the selection's own workspace
  std::size_t select_bytes = 0;
  std::int64_t per_pair = 0;
  std::int32_t max_length = 0;
  std::int32_t index_stride = 0;
};

/// What every launch of one call needs.
struct prefill_launch {
  batch_state_view st;
  active_set active;
  prompt_lengths prompts;
  prefill_workspace ws;
  std::int32_t entries = 0;
  std::uint64_t* status = nullptr;
  cudaStream_t stream = nullptr;
};

/// The (entry, head) of blockIdx.x = entry * heads + head and its sequence
/// (-1 when the entry steps nothing: inactive, a bad index or a repeat).
struct prefill_head {
  std::int32_t entry, h, b;
  __device__ prefill_head(const batch_state_view& st, const active_set& active, std::int32_t index)
      : entry(index / st.num_heads()),
        h(index % st.num_heads()),
        b(kvevict::detail::check_entry(active, entry, st.num_seqs()).sequence) {}
  __device__ std::int64_t segment(const batch_state_view& st) const { return std::int64_t{entry} * st.num_heads() + h; }
};

/// The prologue of every tiled scoring kernel: blockIdx.x = unit * tiles +
/// tile, the unit an (entry, query head) pair when `pairs`, else an (entry,
/// KV head) segment; the sequence b (-1: the block has nothing to do, its
/// entry steps nothing or prepare refused its head) and its prompt length.
struct prefill_tile {
  std::int32_t unit, tile, entry, q, h, b = -1, length = 0;
  __device__ prefill_tile(const batch_state_view& st, const active_set& active, const prompt_lengths& prompts,
                          const prefill_workspace& ws, std::int32_t tiles, bool pairs)
      : unit(static_cast<std::int32_t>(blockIdx.x) / tiles), tile(static_cast<std::int32_t>(blockIdx.x) % tiles) {
    entry = unit / (pairs ? st.num_q_heads : st.num_heads());
    q = pairs ? unit % st.num_q_heads : -1;
    h = pairs ? q / st.group_size() : unit % st.num_heads();
    const std::int32_t sequence = kvevict::detail::check_entry(active, entry, st.num_seqs()).sequence;  // repeats step nothing
    if (sequence < 0 || ws.head_refused[std::int64_t{entry} * st.num_heads() + h]) return;
    b = sequence;
    length = prompts.lengths[b];
  }
  __device__ std::int64_t segment(const batch_state_view& st) const { return std::int64_t{entry} * st.num_heads() + h; }
};

__device__ inline void mark_bad(const prefill_workspace& ws, std::int32_t entry) { atomicOr(&ws.seq_bad[entry], 1u); }

/// Carves the workspace (memory null: only counts); returns the bytes.
/// per_pair: the partials of one (entry, query head), 0 for none.
inline std::size_t carve_prefill(void* memory, const batch_state_view& st, std::int32_t entries,
                                 std::int32_t max_length, std::int64_t per_pair, bool scores, std::size_t select_bytes,
                                 prefill_workspace& ws) {
  kvevict::detail::state_carver c(memory);
  const std::int64_t heads = std::int64_t{entries} * st.num_heads();
  ws.max_length = max_length;
  ws.index_stride = st.rule.budget;
  ws.per_pair = per_pair;
  ws.seq_bad = c.take<std::uint32_t>(entries);
  ws.head_refused = c.take<std::uint8_t>(heads);
  ws.streams = c.take<std::uint64_t>(entries);
  ws.partials = c.take<float>(std::int64_t{entries} * st.num_q_heads * per_pair);
  ws.scores = c.take<float>(scores ? heads * max_length : 0);
  ws.candidates = c.take<std::int32_t>(heads);
  ws.takes = c.take<std::int32_t>(heads);
  ws.chosen = c.take<std::int32_t>(heads * ws.index_stride);
  ws.select = c.take<unsigned char>(static_cast<std::int64_t>(select_bytes));
  ws.select_bytes = select_bytes;
  return c.bytes();
}

inline void require_blocks(const kvevict::detail::site& w, std::int64_t blocks) {
  if (blocks > INT_MAX)
    kvevict::detail::fail<invalid_argument>(w, "active", "with these heads and prompt lengths needs ", blocks,
                                            " blocks, more than a grid holds");
}

inline std::int32_t tiles_of(std::int32_t max_length, std::int32_t width) {
  return (max_length + width - 1) / width;
}

}  // namespace detail
}  // namespace gpu
}  // namespace kvevict
