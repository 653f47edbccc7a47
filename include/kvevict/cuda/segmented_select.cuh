#pragma once
// Segmented selection on CUDA: the k highest or lowest (score, position) keys
// of every segment (the problem: select/segments.hpp), with the same indices
// and mask bytes as the host's kvevict::segmented_select
// (select/segmented_select.hpp).
//
// A radix select over the 64-bit order keys (radix_select.cuh): eight passes
// of 8-bit digits at most, most significant first, stopping as soon as the
// remaining count fills a whole bin. Among identical keys the lower index is
// taken, and the selected elements are emitted by one scan in index order,
// so the result never depends on scheduling.
//
// - Segments of up to one tile (4096 keys): one kernel, one block per
//   segment, the keys in registers.
// - Longer segments: several blocks per segment (a chunk of 2048 keys each,
//   so 8 segments of 128K keys give 512 blocks), recomputing the keys from
//   the source in every pass: per digit a histogram kernel (shared-memory
//   histogram per chunk, then global atomics into the segment's 256 bins)
//   and a one-block-per-segment kernel that picks the digit and clears the
//   bins. All eight passes are launched, finished segments return at once,
//   so the launch sequence is fixed and a CUDA graph can capture it. Then a
//   count kernel (per chunk), a scan over each segment's chunks, and a write
//   kernel that emits in index order.
// - Explicit positions: the selected (position, index) pairs go to the
//   workspace in index order and cub::DeviceSegmentedRadixSort orders them by
//   position; it is stable, so equal positions keep index order. A copy
//   kernel moves them to the caller's rows.
//
// CUB style: a call with workspace == nullptr only sets workspace_bytes
// (enough for any alignment of the workspace pointer). Stream-ordered, no
// allocation, no synchronisation, graph-capturable.
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>
#include <cub/device/device_segmented_radix_sort.cuh>
#include <cub/util_type.cuh>
#include <cuda_runtime.h>

#include <climits>
#include <cstddef>
#include <cstdint>

#include "kvevict/batch/status.hpp"
#include "kvevict/cuda/device_helpers.cuh"
#include "kvevict/cuda/radix_select.cuh"
#include "kvevict/error.hpp"
#include "kvevict/select/device_plan.hpp"
#include "kvevict/select/select_checks.hpp"
#include "kvevict/select/segments.hpp"

namespace kvevict {
namespace gpu {
namespace detail {

/// Writes one element's outcome: its mask byte, and its index at output rank
/// `rank` (or its (position, index) pair when a reorder follows).
template <class Keys>
struct output_writer {
  Keys keys;
  std::int32_t segment, k;
  selection_output out;
  reorder_rows rows;

  __device__ void operator()(std::int32_t j, bool selected, std::int32_t rank) const {
    if (out.mask) out.mask[segment * out.mask_stride + j] = selected ? 1 : 0;
    // rank < k by construction; the test keeps a key source that is not a
    // pure function inside the row.
    if (!selected || rank >= k) return;
    if (rows.active())
      rows.put(segment, rank, keys.position(segment, j), j);
    else if (out.indices)
      out.indices[segment * out.index_stride + rank] = j;
  }
};

__device__ inline void report_bad_count(std::uint64_t* status, std::int32_t segment) {
  report(status, pack_status(segment, 0, segment, batch_code::bad_count));
}

// ---- one block per segment ----

template <class Tuning, class Keys>
__global__ void __launch_bounds__(Tuning::small_threads)
    select_small_kernel(Keys keys, select_end end, selection_count count, selection_output out, reorder_rows rows,
                        std::uint64_t* status) {
  using block = block_radix_select<Tuning::small_threads, Tuning::small_items>;
  __shared__ typename block::temp_storage temp;
  const std::int32_t segment = static_cast<std::int32_t>(blockIdx.x);
  const std::int32_t n = keys.length(segment), k = count.of(segment);
  const bool fits = selection_fits(n, k, keys.max_length, out) && n <= block::tile_items;
  if (threadIdx.x == 0) {
    if (!fits) report_bad_count(status, segment);
    if (rows.active()) rows.set_segment(segment, fits ? k : 0);
  }
  if (!fits) return;  // the whole block: fits is the same in every thread

  unsigned long long items[Tuning::small_items];
  radix_threshold th = radix_threshold::start(k, n);
  if (th.done) {  // none or all: every element is a candidate, no key is needed
#pragma unroll
    for (int u = 0; u < Tuning::small_items; ++u) items[u] = 0;
  } else {
    block::load_blocked(temp, keys, segment, end, 0, n, items);
    th = block::select(temp, items, n, k);
  }
  block::emit(temp, items, th, 0, n, 0ull, output_writer<Keys>{keys, segment, k, out, rows});
}

// ---- several blocks per segment ----

/// Blocks of the chunked kernels: blockIdx.x = segment * chunks + chunk.
struct chunk_of_block {
  std::int32_t segment, chunk;
  __device__ explicit chunk_of_block(std::int32_t chunks)
      : segment(static_cast<std::int32_t>(blockIdx.x) / chunks), chunk(static_cast<std::int32_t>(blockIdx.x) % chunks) {}
};

/// Validates every segment, starts its threshold, clears its histogram.
template <class Tuning, class Keys>
__global__ void __launch_bounds__(Tuning::segment_threads)
    select_init_kernel(Keys keys, selection_count count, selection_output out, segment_state* states,
                       std::int32_t* hist, reorder_rows rows, std::uint64_t* status) {
  const std::int32_t segment = static_cast<std::int32_t>(blockIdx.x);
  for (int b = static_cast<int>(threadIdx.x); b < kRadixBins; b += Tuning::segment_threads)
    hist[std::int64_t{segment} * kRadixBins + b] = 0;
  if (threadIdx.x != 0) return;
  const std::int32_t n = keys.length(segment), k = count.of(segment);
  const bool fits = selection_fits(n, k, keys.max_length, out);
  segment_state s;
  s.th = fits ? radix_threshold::start(k, n) : radix_threshold{0, 0, 0, 1};
  s.length = fits ? n : 0;
  s.k = fits ? k : -1;
  states[segment] = s;
  if (!fits) report_bad_count(status, segment);
  if (rows.active()) rows.set_segment(segment, fits ? k : 0);
}

/// One digit pass over one chunk: the chunk's candidates by digit into a
/// shared histogram, then its nonzero bins into the segment's.
template <class Tuning, class Keys>
__global__ void __launch_bounds__(Tuning::large_threads)
    select_histogram_kernel(Keys keys, select_end end, std::int32_t chunks, int shift, const segment_state* states,
                            std::int32_t* hist) {
  constexpr int threads = Tuning::large_threads;
  __shared__ std::int32_t bins[kRadixBins];
  const chunk_of_block at(chunks);
  const segment_state s = states[at.segment];
  const std::int64_t base = std::int64_t{at.chunk} * Tuning::chunk_items;
  if (s.th.done || base >= s.length) return;  // the whole block

  for (int b = static_cast<int>(threadIdx.x); b < kRadixBins; b += threads) bins[b] = 0;
  __syncthreads();
  digit_run run;
#pragma unroll
  for (int u = 0; u < Tuning::large_items; ++u) {
    const std::int64_t j = base + std::int64_t{u} * threads + threadIdx.x;
    if (j >= s.length) continue;
    const std::uint64_t key = keys.key(at.segment, static_cast<std::int32_t>(j), end);
    if (s.th.candidate(key)) run.add(bins, radix_digit(key, shift));
  }
  run.flush(bins);
  __syncthreads();
  std::int32_t* const segment_bins = hist + std::int64_t{at.segment} * kRadixBins;
  for (int b = static_cast<int>(threadIdx.x); b < kRadixBins; b += threads)
    if (bins[b] != 0) atomicAdd(&segment_bins[b], bins[b]);
}

/// One block per segment: picks the digit of this pass from the segment's
/// histogram, advances its threshold and clears the histogram for the next
/// pass.
template <class Tuning>
__global__ void __launch_bounds__(Tuning::segment_threads)
    select_choose_kernel(int shift, segment_state* states, std::int32_t* hist) {
  using finder = block_digit_finder<Tuning::segment_threads>;
  __shared__ typename finder::temp_storage temp;
  __shared__ radix_digit_choice choice;
  const std::int32_t segment = static_cast<std::int32_t>(blockIdx.x);
  const segment_state s = states[segment];
  if (s.th.done) return;  // the whole block
  if (threadIdx.x == 0) choice = radix_digit_choice{-1, 0, 0};
  std::int32_t* const bins = hist + std::int64_t{segment} * kRadixBins;
  std::int32_t counts[finder::bins_per_thread];
  finder::read_bins(bins, counts);
#pragma unroll
  for (int q = 0; q < finder::bins_per_thread; ++q) {  // each thread clears the bins it read
    const int b = static_cast<int>(threadIdx.x) * finder::bins_per_thread + q;
    if (b < kRadixBins) bins[b] = 0;
  }
  __syncthreads();  // the preset precedes the finder's write; every thread has read `states`
  finder::find(temp, counts, s.th.remaining, choice);
  __syncthreads();
  if (threadIdx.x == 0) {
    segment_state next = s;
    if (choice.digit < 0)
      next.th.done = 1;  // unreachable: the histogram counts exactly the candidates
    else
      next.th.descend(choice.digit, shift, choice.before, choice.count);
    states[segment] = next;
  }
}

/// The packed (below, candidate) counts of every chunk, once the thresholds
/// are final.
template <class Tuning, class Keys>
__global__ void __launch_bounds__(Tuning::large_threads)
    select_count_kernel(Keys keys, select_end end, std::int32_t chunks, const segment_state* states,
                        unsigned long long* chunk_counts) {
  constexpr int threads = Tuning::large_threads;
  using reduce = cub::BlockReduce<unsigned long long, threads>;
  __shared__ typename reduce::TempStorage temp;
  const chunk_of_block at(chunks);
  const segment_state s = states[at.segment];
  const std::int64_t base = std::int64_t{at.chunk} * Tuning::chunk_items;
  if (s.k < 0 || base >= s.length) return;  // the whole block

  const bool keyed = s.th.mask != 0;  // otherwise every element is a candidate
  std::int32_t below = 0, candidates = 0;
#pragma unroll
  for (int u = 0; u < Tuning::large_items; ++u) {
    const std::int64_t j = base + std::int64_t{u} * threads + threadIdx.x;
    if (j >= s.length) continue;
    if (!keyed) {
      ++candidates;
      continue;
    }
    const std::uint64_t key = keys.key(at.segment, static_cast<std::int32_t>(j), end);
    below += s.th.below(key) ? 1 : 0;
    candidates += s.th.candidate(key) ? 1 : 0;
  }
  const unsigned long long total = reduce(temp).Sum(pack_counts(below, candidates));
  if (threadIdx.x == 0) chunk_counts[std::int64_t{at.segment} * chunks + at.chunk] = total;
}

/// One block per segment: the exclusive prefix of the packed chunk counts,
/// in place. Fields never carry: a segment holds fewer than 2^31 elements.
template <class Tuning>
__global__ void __launch_bounds__(Tuning::segment_threads)
    select_scan_kernel(std::int32_t chunks, const segment_state* states, unsigned long long* chunk_counts) {
  constexpr int threads = Tuning::segment_threads;
  using scan = cub::BlockScan<unsigned long long, threads>;
  __shared__ typename scan::TempStorage temp;
  const std::int32_t segment = static_cast<std::int32_t>(blockIdx.x);
  const segment_state s = states[segment];
  if (s.k < 0) return;  // the whole block
  const std::int32_t used = static_cast<std::int32_t>((std::int64_t{s.length} + Tuning::chunk_items - 1) /
                                                      Tuning::chunk_items);
  unsigned long long* const row = chunk_counts + std::int64_t{segment} * chunks;
  unsigned long long carry = 0;
  for (std::int32_t first = 0; first < used; first += threads) {
    const std::int32_t c = first + static_cast<std::int32_t>(threadIdx.x);
    unsigned long long before = 0, total = 0;
    scan(temp).ExclusiveSum(c < used ? row[c] : 0ull, before, total);
    if (c < used) row[c] = carry + before;
    carry += total;
    __syncthreads();  // the scan storage is reused
  }
}

/// Emits every chunk's elements in index order from its prefix counts.
template <class Tuning, class Keys>
__global__ void __launch_bounds__(Tuning::large_threads)
    select_write_kernel(Keys keys, select_end end, std::int32_t chunks, const segment_state* states,
                        const unsigned long long* chunk_counts, selection_output out, reorder_rows rows) {
  using block = block_radix_select<Tuning::large_threads, Tuning::large_items>;
  __shared__ typename block::temp_storage temp;
  const chunk_of_block at(chunks);
  const segment_state s = states[at.segment];
  const std::int64_t base = std::int64_t{at.chunk} * Tuning::chunk_items;
  if (s.k < 0 || base >= s.length) return;  // the whole block

  unsigned long long items[Tuning::large_items];
  if (s.th.mask == 0) {  // every element is a candidate: no key is needed
#pragma unroll
    for (int u = 0; u < Tuning::large_items; ++u) items[u] = 0;
  } else {
    block::load_blocked(temp, keys, at.segment, end, base, s.length, items);
  }
  block::emit(temp, items, s.th, base, s.length, chunk_counts[std::int64_t{at.segment} * chunks + at.chunk],
              output_writer<Keys>{keys, at.segment, s.k, out, rows});
}

// ---- reorder by position ----

/// Copies each segment's sorted indices to its output row: blockIdx.x =
/// segment * chunks + chunk, chunk_items indices per block.
template <class Tuning>
__global__ void __launch_bounds__(Tuning::segment_threads)
    select_copy_kernel(std::int32_t chunks, const std::int32_t* sorted, reorder_rows rows, selection_output out) {
  const chunk_of_block at(chunks);
  const std::int32_t begin = rows.begin[at.segment];
  const std::int64_t count = std::int64_t{rows.end[at.segment]} - begin;
  const std::int64_t first = std::int64_t{at.chunk} * Tuning::chunk_items;
  const std::int64_t last = count < first + Tuning::chunk_items ? count : first + Tuning::chunk_items;
  std::int32_t* const row = out.indices + at.segment * out.index_stride;
  for (std::int64_t r = first + threadIdx.x; r < last; r += Tuning::segment_threads) row[r] = sorted[begin + r];
}

/// Sorts every row's pairs by position (stable: equal positions keep index
/// order), keys and values each in a double buffer; `sorted` is where the
/// indices end up. With temp == nullptr only sets temp_bytes.
inline cudaError_t sort_rows(void* temp, std::size_t& temp_bytes, const reorder_rows& rows,
                             std::int32_t* positions_alt, std::int32_t* indices_alt, std::int32_t num_segments,
                             std::int32_t num_items, const std::int32_t*& sorted, cudaStream_t stream) {
  cub::DoubleBuffer<std::int32_t> keys(rows.positions, positions_alt), values(rows.indices, indices_alt);
  const cudaError_t e = cub::DeviceSegmentedRadixSort::SortPairs(temp, temp_bytes, keys, values, num_items,
                                                                 num_segments, rows.begin, rows.end, 0, 32, stream);
  sorted = values.Current();  // which buffer depends on the pass count, known on the host
  return e;
}

// ---- the host side ----

template <class Tuning, class Keys>
cudaError_t launch_small(const Keys& keys, select_end end, const selection_count& count, const selection_output& out,
                         const select_buffers& b, std::uint64_t* status, cudaStream_t stream) {
  select_small_kernel<Tuning, Keys>
      <<<static_cast<unsigned>(keys.num_segments), Tuning::small_threads, 0, stream>>>(keys, end, count, out, b.rows,
                                                                                        status);
  return cudaGetLastError();
}

template <class Tuning, class Keys>
cudaError_t launch_large(const Keys& keys, select_end end, const selection_count& count, const selection_output& out,
                         const select_plan<Tuning>& p, const select_buffers& b, std::uint64_t* status,
                         cudaStream_t stream) {
  const unsigned segments = static_cast<unsigned>(p.num_segments);
  const unsigned chunk_blocks = static_cast<unsigned>(std::int64_t{p.num_segments} * p.chunks);
  select_init_kernel<Tuning, Keys>
      <<<segments, Tuning::segment_threads, 0, stream>>>(keys, count, out, b.states, b.hist, b.rows, status);
  cudaError_t e = cudaGetLastError();
  for (int shift = kFirstShift; shift >= 0 && e == cudaSuccess; shift -= kRadixBits) {
    select_histogram_kernel<Tuning, Keys>
        <<<chunk_blocks, Tuning::large_threads, 0, stream>>>(keys, end, p.chunks, shift, b.states, b.hist);
    if ((e = cudaGetLastError()) != cudaSuccess) break;
    select_choose_kernel<Tuning><<<segments, Tuning::segment_threads, 0, stream>>>(shift, b.states, b.hist);
    e = cudaGetLastError();
  }
  if (e != cudaSuccess) return e;
  select_count_kernel<Tuning, Keys>
      <<<chunk_blocks, Tuning::large_threads, 0, stream>>>(keys, end, p.chunks, b.states, b.chunk_counts);
  if ((e = cudaGetLastError()) != cudaSuccess) return e;
  select_scan_kernel<Tuning><<<segments, Tuning::segment_threads, 0, stream>>>(p.chunks, b.states, b.chunk_counts);
  if ((e = cudaGetLastError()) != cudaSuccess) return e;
  select_write_kernel<Tuning, Keys><<<chunk_blocks, Tuning::large_threads, 0, stream>>>(
      keys, end, p.chunks, b.states, b.chunk_counts, out, b.rows);
  return cudaGetLastError();
}

template <class Tuning>
cudaError_t launch_reorder(const select_plan<Tuning>& p, const select_buffers& b, const selection_output& out,
                           cudaStream_t stream) {
  if (p.sort_items == 0) return cudaSuccess;  // k = 0 everywhere: nothing to order
  std::size_t bytes = p.sort_bytes;
  const std::int32_t* sorted = nullptr;
  cudaError_t e = sort_rows(b.sort_temp, bytes, b.rows, b.positions_alt, b.indices_alt, p.num_segments, p.sort_items,
                            sorted, stream);
  if (e != cudaSuccess) return e;
  const std::int32_t chunks = p.copy_chunks();
  select_copy_kernel<Tuning><<<static_cast<unsigned>(std::int64_t{p.num_segments} * chunks),
                               Tuning::segment_threads, 0, stream>>>(chunks, sorted, b.rows, out);
  return cudaGetLastError();
}

/// The generic core: any trivially copyable key source with members
/// num_segments, max_length and __host__ __device__ length(i),
/// key(i, j, end) -> uint64, position(i, j) -> int32, ordered_by_index().
/// Same contract as gpu::segmented_select.
template <class Keys>
cudaError_t select_segments(void* workspace, std::size_t& workspace_bytes, const Keys& keys, select_end end,
                            const selection_count& count, const selection_output& out, std::uint64_t* status,
                            cudaStream_t stream) {
  using tuning = segmented_select_tuning;
  const kvevict::detail::site w{"cuda", "segmented_select"};
  select_plan<tuning> p = plan_selection<tuning>(w, keys, count, out, status);
  if (p.reorder && p.sort_items > 0) {
    const std::int32_t* unused = nullptr;
    const cudaError_t e =
        sort_rows(nullptr, p.sort_bytes, reorder_rows{}, nullptr, nullptr, p.num_segments, p.sort_items, unused, stream);
    if (e != cudaSuccess) return e;
  }
  select_buffers buffers;
  const std::size_t needed = carve_workspace(nullptr, p, buffers);
  if (workspace == nullptr) {
    workspace_bytes = needed + kWorkspaceAlign - 1;  // any alignment of the caller's pointer
    return cudaSuccess;
  }
  const std::uintptr_t raw = reinterpret_cast<std::uintptr_t>(workspace);
  const std::size_t slack = static_cast<std::size_t>((kWorkspaceAlign - raw % kWorkspaceAlign) % kWorkspaceAlign);
  if (workspace_bytes < needed + slack)
    kvevict::detail::fail<invalid_argument>(w, "workspace_bytes", "= ", workspace_bytes, " is below the ",
                                            needed + slack, " this call needs at this alignment (ask with workspace = "
                                            "nullptr)");
  if (p.num_segments == 0) return cudaSuccess;
  carve_workspace(static_cast<unsigned char*>(workspace) + slack, p, buffers);

  const cudaError_t e = p.large ? launch_large(keys, end, count, out, p, buffers, status, stream)
                                : launch_small<tuning>(keys, end, count, out, buffers, status, stream);
  if (e != cudaSuccess || !p.reorder) return e;
  return launch_reorder(p, buffers, out, stream);
}

}  // namespace detail

/// Selects count.of(i) elements of every segment i of `keys` (device
/// memory): the highest keys (select_end::top) or the lowest
/// (select_end::bottom), see select/segments.hpp; indices ascending by
/// position into out.indices and/or the mask into out.mask, bit for bit as
/// the host's kvevict::segmented_select.
///
/// Two phases, as CUB: with workspace == nullptr it only sets
/// workspace_bytes (which depends on the shapes, on count.k or count.ks, on
/// whether positions and out.indices are given; ask with the call's own
/// arguments) and returns cudaSuccess. O(1) argument errors throw
/// (invalid_argument, out_of_range) before any launch, in both phases. A
/// segment whose ks[i] or lengths[i] is out of range (or ks[i] exceeds
/// out.index_stride) is left unwritten and reported to `status` (optional)
/// as pack_status(i, 0, i, batch_code::bad_count); the other segments are
/// selected. Stream-ordered, no allocation or synchronisation,
/// graph-capturable.
inline cudaError_t segmented_select(void* workspace, std::size_t& workspace_bytes, const segment_set& keys,
                                    select_end end, const selection_count& count, const selection_output& out,
                                    std::uint64_t* status, cudaStream_t stream) {
  const kvevict::detail::site w{"cuda", "segmented_select"};
  kvevict::detail::require_select_end(w, end);
  kvevict::detail::require_select_strides(w, keys, count.ks ? keys.max_length : count.k, out);
  if (keys.num_segments > 0 && keys.max_length > 0) kvevict::detail::require_not_null(w, "keys.scores", keys.scores);
  if (keys.stride < keys.max_length)
    kvevict::detail::fail<invalid_argument>(w, "keys.stride", "= ", keys.stride, " is below keys.max_length = ",
                                            keys.max_length);
  return detail::select_segments(workspace, workspace_bytes, keys, end, count, out, status, stream);
}

}  // namespace gpu
}  // namespace kvevict
