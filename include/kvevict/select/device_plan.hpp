#pragma once
// The host side of the CUDA segmented selection (cuda/segmented_select.cuh):
// its launch shapes, the per-segment state of the multi-block path, the plan
// a call makes from O(1) host data and the carving of its workspace. Plain
// C++, so that a batched state can reserve evict_to's selection workspace on
// the host (batch/state.hpp), with the same arithmetic the launcher uses.
#include <climits>
#include <cstddef>
#include <cstdint>

#include "kvevict/status_code.hpp"
#include "kvevict/config.hpp"
#include "kvevict/error.hpp"
#include "kvevict/select/segments.hpp"

namespace kvevict {
namespace gpu {
namespace detail {

inline constexpr int kRadixBits = 8;
inline constexpr int kRadixBins = 1 << kRadixBits;
inline constexpr int kFirstShift = 64 - kRadixBits;  ///< the shift of the most significant digit

/// What is known of the k-th lowest key of a segment after some digit passes.
/// Plain data: the multi-block path keeps one per segment in the workspace.
struct radix_threshold {
  std::uint64_t prefix;     ///< the known high digits of the k-th key (zero below them)
  std::uint64_t mask;       ///< the bits `prefix` covers: a run of high bits
  std::int32_t remaining;   ///< how many candidates, taken by ascending index, complete the selection
  std::int32_t done;        ///< 1 when no further pass is needed

  /// Before the first pass: every key is a candidate. Selecting none or all
  /// needs no pass at all.
  KVEVICT_HOST_DEVICE static radix_threshold start(std::int32_t k, std::int32_t n) noexcept {
    return radix_threshold{0, 0, k, (k == 0 || k == n) ? 1 : 0};
  }
  /// Selected whatever the index: its known high bits are below the k-th key's.
  KVEVICT_HOST_DEVICE bool below(std::uint64_t key) const noexcept { return (key & mask) < prefix; }
  /// Its known high bits equal the k-th key's: selected if among the first
  /// `remaining` such keys by index.
  KVEVICT_HOST_DEVICE bool candidate(std::uint64_t key) const noexcept { return (key & mask) == prefix; }

  /// Fixes the digit at `shift` to `digit`, the bin whose candidates number
  /// `count` and are preceded by `before` candidates in lower bins (which are
  /// now below the threshold and selected).
  KVEVICT_HOST_DEVICE void descend(int digit, int shift, std::int32_t before, std::int32_t count) noexcept {
    prefix |= static_cast<std::uint64_t>(digit) << shift;
    mask |= static_cast<std::uint64_t>(kRadixBins - 1) << shift;
    remaining -= before;
    done = (remaining == count || shift == 0) ? 1 : 0;
  }
};

/// Launch shapes, apart from the algorithm (as CUB's policies).
struct segmented_select_tuning {
  /// One block holds a whole segment of up to small_threads x small_items
  /// keys in registers (32 KiB of exchange storage at 256 x 16).
  static constexpr int small_threads = 256;
  static constexpr int small_items = 16;
  /// Longer segments: one block per chunk of large_threads x large_items keys.
  static constexpr int large_threads = 256;
  static constexpr int large_items = 8;
  /// The one-block-per-segment kernels (digit choice, chunk scan, copy);
  /// 256 threads hold one histogram bin each.
  static constexpr int segment_threads = 256;

  static constexpr int small_tile = small_threads * small_items;
  static constexpr int chunk_items = large_threads * large_items;
};

/// A segment's count fits its length, its length the bound, and its row of
/// indices the stride; otherwise the segment is reported and left unwritten.
KVEVICT_HOST_DEVICE inline bool selection_fits(std::int32_t n, std::int32_t k, std::int32_t max_length,
                                               const selection_output& out) noexcept {
  return n >= 0 && n <= max_length && k >= 0 && k <= n && (out.indices == nullptr || k <= out.index_stride);
}

/// The multi-block path's state of one segment, in the workspace.
struct segment_state {
  radix_threshold th;
  std::int32_t length;  ///< n
  std::int32_t k;       ///< the count, or -1: a bad segment, skipped by every kernel
};

/// The rows of (position, index) pairs that are sorted by position when the
/// keys have explicit positions; row i holds [begin[i], end[i]) of the
/// arrays. Inactive (null) when the output is already in position order.
struct reorder_rows {
  std::int32_t* positions = nullptr;
  std::int32_t* indices = nullptr;
  std::int32_t* begin = nullptr;
  std::int32_t* end = nullptr;
  std::int64_t row = 0;  ///< elements per row: the largest possible k

  KVEVICT_HOST_DEVICE bool active() const { return positions != nullptr; }
  /// Row `segment` sorts its first k entries (0 for a bad segment).
  KVEVICT_HOST_DEVICE void set_segment(std::int32_t segment, std::int32_t k) const {
    begin[segment] = static_cast<std::int32_t>(segment * row);
    end[segment] = static_cast<std::int32_t>(segment * row + k);
  }
  KVEVICT_HOST_DEVICE void put(std::int32_t segment, std::int32_t rank, std::int32_t position, std::int32_t j) const {
    positions[segment * row + rank] = position;
    indices[segment * row + rank] = j;
  }
};

/// What a call needs, from O(1) host data.
template <class Tuning>
struct select_plan {
  std::int32_t num_segments = 0;
  bool large = false;         ///< several blocks per segment
  std::int32_t chunks = 0;    ///< large: chunks per segment
  bool reorder = false;       ///< indices must be sorted by position
  std::int64_t row = 0;       ///< reorder: entries per row (the largest possible k)
  std::int32_t sort_items = 0;
  std::size_t sort_bytes = 0;  ///< cub::DeviceSegmentedRadixSort's temporary storage

  std::int32_t copy_chunks() const {
    return static_cast<std::int32_t>((row + Tuning::chunk_items - 1) / Tuning::chunk_items);
  }
};

/// The workspace, carved from a 256-byte aligned base in this order (each
/// piece 256-byte aligned): large path: segment states [segments], histograms
/// [segments][256] int32, chunk counts [segments][chunks] uint64; reorder:
/// row begin / end [segments] int32, positions, indices and their two
/// alternates [segments][row] int32 each, CUB's sort storage.
struct select_buffers {
  segment_state* states = nullptr;
  std::int32_t* hist = nullptr;
  unsigned long long* chunk_counts = nullptr;
  reorder_rows rows;
  std::int32_t* positions_alt = nullptr;
  std::int32_t* indices_alt = nullptr;
  void* sort_temp = nullptr;
};

inline constexpr std::size_t kWorkspaceAlign = 256;

/// Carves `buffers` from `base` (or only counts, with base == nullptr);
/// returns the bytes used from base.
template <class Tuning>
std::size_t carve_workspace(unsigned char* base, const select_plan<Tuning>& p, select_buffers& buffers) {
  std::size_t used = 0;
  const auto take = [&](std::size_t bytes) -> void* {
    void* piece = base ? base + used : nullptr;
    used += (bytes + kWorkspaceAlign - 1) / kWorkspaceAlign * kWorkspaceAlign;
    return piece;
  };
  const std::size_t segments = static_cast<std::size_t>(p.num_segments);
  if (p.large) {
    buffers.states = static_cast<segment_state*>(take(segments * sizeof(segment_state)));
    buffers.hist = static_cast<std::int32_t*>(take(segments * kRadixBins * sizeof(std::int32_t)));
    buffers.chunk_counts =
        static_cast<unsigned long long*>(take(segments * static_cast<std::size_t>(p.chunks) * sizeof(unsigned long long)));
  }
  if (p.reorder) {
    const std::size_t items = static_cast<std::size_t>(p.sort_items) * sizeof(std::int32_t);
    buffers.rows.begin = static_cast<std::int32_t*>(take(segments * sizeof(std::int32_t)));
    buffers.rows.end = static_cast<std::int32_t*>(take(segments * sizeof(std::int32_t)));
    buffers.rows.positions = static_cast<std::int32_t*>(take(items));
    buffers.rows.indices = static_cast<std::int32_t*>(take(items));
    buffers.positions_alt = static_cast<std::int32_t*>(take(items));
    buffers.indices_alt = static_cast<std::int32_t*>(take(items));
    buffers.sort_temp = take(p.sort_bytes);
    buffers.rows.row = p.row;
  }
  return used;
}

/// The O(1) checks of every call, then the plan. Throws.
template <class Tuning, class Keys>
select_plan<Tuning> plan_selection(const kvevict::detail::site& w, const Keys& keys, const selection_count& count,
                                   const selection_output& out, const std::uint64_t* status) {
  using kvevict::detail::fail;
  const std::int32_t segments = keys.num_segments, max_length = keys.max_length;
  if (segments < 0) fail<invalid_argument>(w, "keys.num_segments", "= ", segments, " is negative");
  if (max_length < 0) fail<invalid_argument>(w, "keys.max_length", "= ", max_length, " is negative");
  if (!out.indices && !out.mask) fail<invalid_argument>(w, "out", "has neither indices nor mask");
  if (!count.ks && (count.k < 0 || count.k > max_length))
    fail<out_of_range>(w, "count.k", "= ", count.k, " is outside [0, ", max_length, "]");
  if (out.indices && out.index_stride < 0)
    fail<invalid_argument>(w, "out.index_stride", "= ", out.index_stride, " is negative");
  if (out.indices && !count.ks && out.index_stride < count.k)
    fail<invalid_argument>(w, "out.index_stride", "= ", out.index_stride, " is below count.k = ", count.k);
  if (out.mask && out.mask_stride < max_length)
    fail<invalid_argument>(w, "out.mask_stride", "= ", out.mask_stride, " is below keys.max_length = ", max_length);
  if (status && segments > batch_status_limits::max_seqs)
    fail<out_of_range>(w, "keys.num_segments", "= ", segments, " exceeds the ", batch_status_limits::max_seqs,
                       " segments a status word can name");

  select_plan<Tuning> p;
  p.num_segments = segments;
  p.large = max_length > Tuning::small_tile;
  if (p.large) {
    p.chunks = static_cast<std::int32_t>((std::int64_t{max_length} + Tuning::chunk_items - 1) / Tuning::chunk_items);
    if (std::int64_t{segments} * p.chunks > INT_MAX)
      fail<invalid_argument>(w, "keys", "has ", segments, " segments of up to ", max_length,
                             " keys: more chunks than one grid holds");
  }
  p.reorder = out.indices != nullptr && !keys.ordered_by_index();
  if (p.reorder) {
    p.row = count.ks ? max_length : count.k;
    if (std::int64_t{segments} * p.row > INT_MAX)
      fail<invalid_argument>(w, "keys", "has ", segments, " segments of up to ", p.row,
                             " selected keys: more than one position sort holds");
    p.sort_items = static_cast<std::int32_t>(std::int64_t{segments} * p.row);
  }
  return p;
}

/// Bytes of workspace a call with plan `p` asks for (any alignment of the
/// caller's pointer).
template <class Tuning>
std::size_t workspace_bytes_of(const select_plan<Tuning>& p) {
  select_buffers unused;
  return carve_workspace(nullptr, p, unused) + kWorkspaceAlign - 1;
}

}  // namespace detail
}  // namespace gpu
}  // namespace kvevict
