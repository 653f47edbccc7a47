#pragma once
// Launch 2 of a decode step on CUDA: observe + evict fused, one pass over
// every active (sequence, KV head)'s occupied slots [0, count); with its
// Append mode, the whole step in one launch (decode_step.cuh). Each thread
// takes decode_tuning::items slots of a tile and issues all their loads
// (position, score, the group's inputs one query head at a time) before it
// looks at any value; then each slot's new score goes to the spare buffer
// and its victim key bids (observe_slot, the host's per-slot rule). A
// cub::BlockReduce of row_partial gives the block's lowest key, problem and
// head check, exact minima whatever the order.
//
// Long rows are split over several blocks (batch/launch_shape.hpp sizes the
// split from the SM count, so one sequence of 128K slots fills the GPU):
// each block leaves its row_partial in the state's workspace, and the last
// block of the row to arrive merges them and commits. Rows of one chunk
// commit directly. exact_greedy has its own kernel (exact_greedy.cuh);
// KeyDiff a launch before this one that refreshes its anchors
// (key_anchor.cuh). Same
// decisions and status word, bit for bit, as batched_observe_evict on the
// host (batch/host_backend.hpp).
#include <cub/block/block_reduce.cuh>
#include <cuda_runtime.h>

#include <cstdint>

#include "kvevict/batch/inputs.hpp"
#include "kvevict/batch/launch_shape.hpp"
#include "kvevict/batch/row_partial.hpp"
#include "kvevict/batch/score_sources.hpp"
#include "kvevict/batch/state.hpp"
#include "kvevict/batch/status.hpp"
#include "kvevict/batch/step.hpp"
#include "kvevict/batch/validate.hpp"
#include "kvevict/config.hpp"
#include "kvevict/cuda/device_helpers.cuh"
#include "kvevict/cuda/exact_greedy.cuh"
#include "kvevict/cuda/key_anchor.cuh"
#include "kvevict/policy/decode_rules.hpp"

namespace kvevict {
namespace gpu {
namespace detail {

struct merge_partials {
  __device__ row_partial operator()(const row_partial& a, const row_partial& b) const {
    return row_partial::merge(a, b);
  }
};

/// A partial another block of the row wrote: past L1, which is not coherent
/// between SMs.
__device__ inline row_partial load_partial(const row_partial* p) {
  static_assert(sizeof(row_partial) == 32 && alignof(row_partial) >= 16, "two 16-byte loads");
  const ulonglong2 lo = __ldcg(reinterpret_cast<const ulonglong2*>(p));
  const ulonglong2 hi = __ldcg(reinterpret_cast<const ulonglong2*>(p) + 1);
  row_partial r;
  r.key = lo.x;
  r.problem = lo.y;
  r.head = hi.x;
  r.slot = static_cast<std::int32_t>(hi.y & 0xFFFFFFFFu);  // little-endian: slot, then the unused word
  return r;
}

/// What a block knows of its row before it walks the slots. In the
/// one-launch step (`slot` >= 0) the row as its append leaves it: the new
/// token's slot holds position length - 1 with score 0, which only the
/// commit writes.
struct row_start {
  std::int32_t count = 0;   ///< occupied slots [0, count)
  std::int32_t length = 0;  ///< the sequence's length
  std::int32_t buffer = 0;  ///< the score buffer holding the current scores
  std::int32_t slot = -1;   ///< the appended slot, -1 in observe + evict alone
  bool appended = false;
};

/// Thread 0, once a row is reduced: the append (in the one-launch step),
/// then refuse the observation (status word, victim -1, nothing else
/// changes) or commit its victim, from the values the block read at its
/// start (no load before the stores).
template <class Source>
__device__ void finish_row(const batch_state_view& st, const Source& source, std::int32_t b, std::int32_t h,
                           const row_start& row, const row_partial& total, std::int32_t* victims,
                           std::uint64_t* status) {
  const std::int64_t bh = st.head_index(b, h);
  if (row.slot >= 0) {
    kvevict::detail::commit_append(st, b, h, row.length - 1, row.slot, row.count - 1, row.buffer);
    if (h == 0) st.slots.lengths[b] = row.length;  // no row of the launch reads it: they read their marks
  }
  const std::uint64_t word = total.status_word(b, h);
  if (word != batch_status_clear) return give_up(bh, word, victims, status);
  const std::int32_t victim = row.count > st.rule.budget ? total.slot : -1;
  kvevict::detail::commit_observe_evict(st, b, h, victim, row.buffer, row.count, row.length);
  kvevict::detail::after_commit(source, st, b, h, victim);
  if (victims) victims[bh] = victim;
}

/// The row of a one-launch step: the row's own length mark and the parity
/// words of its sequence (loaded side by side), then append's verdict. A
/// sequence with a full head steps nothing: its block of head 0, chunk 0
/// reports it, and every row's chunk 0 sets its victim to -1.
__device__ inline bool start_step_row(const batch_state_view& st, std::int32_t b, std::int32_t h, std::int32_t chunk,
                                      row_start& row, std::int32_t* victims, std::uint64_t* status) {
  const std::int64_t bh = st.head_index(b, h);
  const std::int32_t seen = st.marks.lengths[bh];  // no other row of the launch writes it
  const std::int32_t next = st.slots.next_slots[bh], count = st.slots.counts[bh];
  row.buffer = st.score_buffer[bh];
  const std::int64_t words = st.marks.words;
  const std::uint64_t even = st.marks.full[b * words], odd = st.marks.full[(st.num_seqs() + b) * words];
  std::int32_t full = words == 1 ? kvevict::detail::lowest_bit(seen & 1 ? odd : even, st.num_heads())
                                 : kvevict::detail::first_full_head(st, b, seen);
  // Marks that disagree with the table (a state written by hand): this row
  // refuses and says so, and never writes.
  const bool disagree = full < 0 && next < 0;
  if (disagree) full = h;
  if (full >= 0) {
    if (chunk == 0 && threadIdx.x == 0) {
      if (h == 0 || disagree) report(status, pack_status(b, full, 0, batch_code::no_free_slot));
      if (victims) victims[bh] = -1;
    }
    return false;
  }
  row.count = count + 1;
  row.length = seen + 1;
  row.slot = next;
  row.appended = true;
  return true;
}

template <class Source, bool Append>
__global__ void __launch_bounds__(decode_tuning::threads, Source::min_blocks)
    observe_evict_kernel(batch_state_view st, active_set active, Source source, row_split split,
                         std::int32_t* victims, std::uint64_t* status) {
  constexpr int kThreads = decode_tuning::threads, kItems = Source::items;
  constexpr std::int32_t kTile = kThreads * kItems;
  using reduce = cub::BlockReduce<row_partial, kThreads>;
  __shared__ typename reduce::TempStorage temp;
  __shared__ bool finisher;

  const std::int32_t row = static_cast<std::int32_t>(blockIdx.x) / split.chunks;
  const std::int32_t chunk = static_cast<std::int32_t>(blockIdx.x) % split.chunks;
  const std::int32_t h = row % st.num_heads();
  // A bad list entry is reported once: by the first chunk of head 0.
  const std::int32_t b = entry_sequence(active, row / st.num_heads(), st.num_seqs(), chunk == 0 ? h : -1, status);
  if (b < 0 || kvevict::detail::observe_skips(st, active, b, h)) return;  // a retry skips a head that stepped
  const std::int32_t t = static_cast<std::int32_t>(threadIdx.x);
  const std::int64_t bh = st.head_index(b, h);
  // Everything the row needs, loaded side by side before any branch on it.
  row_start start;
  if constexpr (Append) {
    if (!start_step_row(st, b, h, chunk, start, victims, status)) return;
  } else {
    start.count = st.slots.counts[bh];
    start.length = st.slots.lengths[b];
    start.buffer = st.score_buffer[bh];
    start.appended = st.appended[bh] != 0;
  }
  const std::int32_t count = start.count, length = start.length, buffer = start.buffer;
  const victim_order order = st.rule.order(st.stream_of(b), h, length);
  // Chunks past the occupied slots walk no slot and do not arrive.
  const std::int32_t chunks = count > split.chunk_slots ? (count + split.chunk_slots - 1) / split.chunk_slots : 1;
  const bool live = chunk < chunks;

  // Never a column the input does not have: such a head is refused (narrow_input).
  const std::int32_t width = count < source.columns() ? count : source.columns();
  const std::int32_t first = chunk * split.chunk_slots;
  const std::int32_t end = width < first + split.chunk_slots ? width : first + split.chunk_slots;
  const std::int32_t* __restrict__ positions = st.slots.positions_of(b, h);
  const float* __restrict__ current = st.buffer_of(b, h, buffer);
  float* __restrict__ updated = st.buffer_of(b, h, 1 - buffer);

  row_partial part;
  if (chunk == 0) part.head = kvevict::detail::head_check_share(source, b, h, t, kThreads, start.appended, count);
  for (std::int32_t base = first; base < end; base += kTile) {
    std::int32_t s[kItems], pos[kItems];
    float cur[kItems];
    slot_increment inc[kItems];
    KVEVICT_UNROLL
    for (int u = 0; u < kItems; ++u) {  // past the end: a valid slot whose result is dropped
      const std::int32_t slot = base + u * kThreads + t;
      s[u] = slot < end ? slot : end - 1;
    }
    KVEVICT_UNROLL
    for (int u = 0; u < kItems; ++u) {  // through L2, not the read-only path: the commit writes these
      pos[u] = __ldcg(positions + s[u]);
      cur[u] = __ldcg(current + s[u]);
      if (Append && s[u] == start.slot) {  // the appended token, as the commit will write it
        pos[u] = length - 1;
        cur[u] = 0.0f;
      }
    }
    source.template fold_items<kItems>(b, h, s, inc);
    KVEVICT_UNROLL
    for (int u = 0; u < kItems; ++u)
      if (base + u * kThreads + t < end && pos[u] >= 0)  // a free slot (a refused row's hole) is never written
        observe_slot(st.rule, order, b, h, s[u], pos[u], length, cur[u], inc[u], updated, part);
  }
  part = reduce(temp).Reduce(part, merge_partials{});
  // The blocks that arrive: the live ones; in the one-launch step every
  // block of the row, so that none can start after the commit and read the
  // row as its append left it (a block past the slots brings an empty part).
  if (!Append && !live) return;
  const std::int32_t arriving = Append ? split.chunks : chunks;
  if (arriving == 1) {
    if (t == 0) finish_row(st, source, b, h, start, part, victims, status);
    return;
  }

  // Several blocks: publish this chunk's part; the last block of the row to
  // arrive merges them all (the fences order the scores and parts before
  // the count) and commits, then leaves the counter at 0 for the next call.
  row_partial* parts = st.work.partials + bh * max_row_chunks(st.capacity());
  if (t == 0) {
    parts[chunk] = part;
    __threadfence();
    finisher = atomicAdd(st.work.arrivals + bh, 1u) == static_cast<unsigned>(arriving - 1);
  }
  __syncthreads();
  if (!finisher) return;
  __threadfence();
  row_partial total;
  for (std::int32_t c = t; c < arriving; c += kThreads) total = row_partial::merge(total, load_partial(parts + c));
  total = reduce(temp).Reduce(total, merge_partials{});
  if (t == 0) {
    st.work.arrivals[bh] = 0;
    finish_row(st, source, b, h, start, total, victims, status);
  }
}

/// The checks every decode launcher makes first; the one-launch step
/// refuses retry sets (accepts_retry false), as append does.
inline void require_common(const kvevict::detail::site& w, const batch_state_view& st, const active_set& active,
                           const std::uint64_t* status, bool accepts_retry = true) {
  kvevict::detail::require_state(w, st);
  kvevict::detail::require_active(w, active, st.num_seqs(), accepts_retry);
  kvevict::detail::require_not_null(w, "status", status);
  if (std::int64_t{active.entries(st.num_seqs())} * st.num_heads() > 0x7FFFFFFF)
    kvevict::detail::fail<invalid_argument>(w, "active", "gives more (sequence, head) blocks than a grid holds");
}

/// The decode launch with a given split (tests force several chunks per row
/// on small rows with it); `split` must come from split_by_tiles.
/// The checks of the decode launch's own arguments (the split and the
/// workspace it needs), before anything is enqueued.
inline void require_split(const kvevict::detail::site& w, const batch_state_view& st, const active_set& active,
                          const row_split& split) {
  const std::int64_t rows = std::int64_t{active.entries(st.num_seqs())} * st.num_heads();
  if (split.chunks > 1) kvevict::detail::require_not_null(w, "state.work.partials", st.work.partials);
  kvevict::detail::require_not_null(w, "state.work.arrivals", st.work.arrivals);
  if (split.chunks < 1 || split.chunks > max_row_chunks(st.capacity()) || split.chunk_slots < 1 ||
      split.chunk_slots % decode_tuning::tile || std::int64_t{split.chunks} * split.chunk_slots < st.capacity())
    kvevict::detail::fail<invalid_argument>(w, "split", "is not a split of the state's rows into whole tiles");
  if (rows * split.chunks > 0x7FFFFFFF)
    kvevict::detail::fail<invalid_argument>(w, "active", "gives more blocks than a grid holds");
}

/// Append = true: the one-launch step (decode_step.cuh).
template <class Source, bool Append = false>
cudaError_t launch_observe_evict(const batch_state_view& st, const active_set& active, const Source& source,
                                 std::int32_t* victims, std::uint64_t* status, cudaStream_t stream,
                                 const row_split& split) {
  const kvevict::detail::site w{"cuda", Append ? "step" : "observe_evict"};
  require_split(w, st, active, split);
  const std::int64_t rows = std::int64_t{active.entries(st.num_seqs())} * st.num_heads();
  if (rows == 0) return cudaSuccess;
  observe_evict_kernel<Source, Append>
      <<<static_cast<unsigned>(rows * split.chunks), decode_tuning::threads, 0, stream>>>(st, active, source, split,
                                                                                          victims, status);
  return cudaGetLastError();
}

/// The split the launchers use: split_rows for the active rows on this
/// device, at the residency of Source's kernel.
template <class Source>
row_split default_split(const batch_state_view& st, const active_set& active) {
  return split_rows(std::int64_t{active.entries(st.num_seqs())} * st.num_heads(), st.capacity(), device_sm_count(),
                    Source::min_blocks);
}

/// Observe + evict from batch_probs, batch_head_scores, batch_logits,
/// key_norms or a registered rule's input with a given split (see
/// launch_observe_evict).
template <class Input>
cudaError_t observe_evict_split(const batch_state_view& st, const active_set& active, const Input& in,
                                std::int32_t* victims, std::uint64_t* status, cudaStream_t stream,
                                const row_split& split) {
  const kvevict::detail::site w{"cuda", "observe_evict"};
  require_common(w, st, active, status);
  kvevict::detail::require_score_input(w, st, in);
  return launch_observe_evict(st, active, score_source<Input>{in, st.group_size(), st.rule.reduce}, victims, status,
                              stream, split);
}

/// Observe + evict by KeyDiff with a given split: the anchors' refresh,
/// then the pass over the keys, whose finishing block takes the victim out
/// of its anchor.
template <class T, class Layout>
cudaError_t observe_evict_split(const batch_state_view& st, const active_set& active, const key_diff<T, Layout>& in,
                                std::int32_t* victims, std::uint64_t* status, cudaStream_t stream,
                                const row_split& split) {
  const kvevict::detail::site w{"cuda", "observe_evict"};
  require_common(w, st, active, status);
  kvevict::detail::require_input(w, st, in);
  // 48 KiB without an opt-in, less the refresh kernel's few static bytes.
  if (std::size_t(in.cache.head_dim) * (sizeof(unsigned long long) + sizeof(float)) > 48 * 1024 - 64)
    kvevict::detail::fail<invalid_argument>(w, "in.cache.head_dim", "= ", in.cache.head_dim,
                                            " needs more than 48 KiB of shared memory for KeyDiff's anchor");
  require_split(w, st, active, split);  // every check before the refresh changes anything
  const cudaError_t e = launch_refresh_key_anchor(st, active, in, stream);
  if (e != cudaSuccess) return e;
  return launch_observe_evict(st, active, score_source<key_diff<T, Layout>>{in, st.anchors}, victims, status, stream,
                              split);
}

/// Observe + evict from queries + LSE with a given split; exact_greedy (a
/// state with a history) runs its own kernel, one block per (b, h).
template <class Q, class T, class Layout>
cudaError_t observe_evict_split(const batch_state_view& st, const active_set& active, const batch_queries<Q>& in,
                                const kv_view<T, Layout>& cache, std::int32_t* victims, std::uint64_t* status,
                                cudaStream_t stream, const row_split& split) {
  const kvevict::detail::site w{"cuda", "observe_evict"};
  require_common(w, st, active, status);
  kvevict::detail::require_input(w, st, in, cache);
  if (st.history.keys) {
    kvevict::detail::require_history(w, st);
    if (cache.head_dim != st.history.head_dim)
      kvevict::detail::fail<invalid_argument>(w, "cache.head_dim", "= ", cache.head_dim, ", the history has ",
                                              st.history.head_dim);
    return launch_exact_greedy(st, active, in, cache, victims, status, stream);
  }
  return launch_observe_evict(st, active, query_source<Q, T, Layout>{in, cache, st.group_size(), st.rule.reduce},
                              victims, status, stream, split);
}

}  // namespace detail

/// Observe + evict for every active (b, h) from `in` (batch_probs,
/// batch_head_scores or batch_logits; device memory): adds each occupied
/// slot's increment and, above the budget, frees the policy's victim.
/// victims (optional, device [B][H]): the freed slot of each stepped (b, h),
/// or -1. Bad input leaves its (b, h) unchanged and sets `status`.
template <class Input>
cudaError_t batched_observe_evict(const batch_state_view& st, const active_set& active, const Input& in,
                                  std::int32_t* victims, std::uint64_t* status, cudaStream_t stream) {
  return detail::observe_evict_split(st, active, in, victims, status, stream,
                                     detail::default_split<score_source<Input>>(st, active));
}

/// Observe + evict by KeyDiff (device memory): each (b, h)'s running anchor
/// takes in its new keys, every cached key scores -cos(k, anchor), the
/// victim leaves the anchor; an h2o state with decay 0 sized with
/// key_diff_extent(cache.head_dim). The same decisions as the host's.
template <class T, class Layout>
cudaError_t batched_observe_evict(const batch_state_view& st, const active_set& active, const key_diff<T, Layout>& in,
                                  std::int32_t* victims, std::uint64_t* status, cudaStream_t stream) {
  return detail::observe_evict_split(st, active, in, victims, status, stream,
                                     detail::default_split<score_source<key_diff<T, Layout>>>(st, active));
}

/// Observe + evict from queries + LSE (device memory), the logits recomputed
/// from the keys of `cache`; for exact_greedy (a state with a history) the
/// leave-one-out step, which also records the newest K/V rows.
template <class Q, class T, class Layout>
cudaError_t batched_observe_evict(const batch_state_view& st, const active_set& active, const batch_queries<Q>& in,
                                  const kv_view<T, Layout>& cache, std::int32_t* victims, std::uint64_t* status,
                                  cudaStream_t stream) {
  return detail::observe_evict_split(st, active, in, cache, victims, status, stream,
                                     detail::default_split<query_source<Q, T, Layout>>(st, active));
}

}  // namespace gpu
}  // namespace kvevict
