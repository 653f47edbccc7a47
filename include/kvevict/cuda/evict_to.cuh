#pragma once
// evict_to(target) on CUDA, with the decisions of the host's
// batched_evict_to (kvevict/batch/evict_to.hpp, rules in
// policy/evict_to.hpp), bit for bit. A short, fixed sequence of launches
// (graph-capturable), each spreading a long row over many blocks:
//   1. plan: every active (b, h) is checked (evict_to_check; the page
//      checks of a long row in chunks of blocks, merged by the last to
//      arrive) and gets its plan: unchanged, or how many victims it gives;
//   2. victims: all of a row's victims in one bottom-k selection of its
//      victim keys (cuda/segmented_select.cuh, several blocks per long
//      row), indices in ascending slot order. exact_greedy instead re-scores
//      every cached token before each victim (its greedy rounds: an oracle,
//      one block per row);
//   3. refill: the holes below the new span take the rows beyond it
//      (refill_plan: each move found by a binary search over the sorted
//      free slots, so the row's moves and frees spread over many blocks),
//      and the rows move in the cache or are reported as moves.
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "kvevict/batch/evict_to.hpp"
#include "kvevict/batch/inputs.hpp"
#include "kvevict/batch/launch_shape.hpp"
#include "kvevict/batch/state.hpp"
#include "kvevict/batch/status.hpp"
#include "kvevict/batch/validate.hpp"
#include "kvevict/cuda/device_helpers.cuh"
#include "kvevict/cuda/leave_one_out.cuh"
#include "kvevict/cuda/segmented_select.cuh"
#include "kvevict/kv_view.hpp"
#include "kvevict/policy/decode_rules.hpp"
#include "kvevict/policy/evict_to.hpp"

namespace kvevict {
namespace gpu {
namespace detail {

/// Stands for "no cache": evict_to reports the moves instead of making them.
struct no_cache {};
/// Stands for "no queries": the victims follow the scores as they are
/// (every policy but exact_greedy, which re-scores with batch_queries).
struct no_queries {};

using evict_check = kvevict::detail::evict_to_check;

/// Whether a cache argument is a paged view (whose rows evict_to checks).
template <class Cache>
struct is_paged_cache : std::false_type {};
template <class T>
struct is_paged_cache<kv_view<T, paged_layout>> : std::true_type {};

/// The (b, h) of launch row `row` (entry * H + h) and chunk `chunk` of
/// blockIdx.x = row * chunks + chunk; b < 0 for an inactive entry (a bad
/// list entry is reported once, by chunk 0 of head 0).
struct evict_row {
  std::int32_t row, chunk, b, h;
  std::int64_t bh;

  __device__ evict_row(const batch_state_view& st, const active_set& active, std::int32_t chunks,
                       std::uint64_t* status) {
    row = static_cast<std::int32_t>(blockIdx.x) / chunks;
    chunk = static_cast<std::int32_t>(blockIdx.x) % chunks;
    h = row % st.num_heads();
    b = entry_sequence(active, row / st.num_heads(), st.num_seqs(), chunk == 0 ? h : -1, status);
    bh = b >= 0 ? st.head_index(b, h) : -1;
  }
};

/// Thread 0 once a row's checks are reduced: its plan (unchanged, or the
/// victims it gives), its selection count, and the status and result of a
/// row that stays unchanged.
__device__ inline void plan_row(const batch_state_view& st, const evict_row& at, std::int32_t target,
                                std::uint64_t check, std::int32_t* results, std::uint64_t* status) {
  evict_to_plan plan;
  plan.count = st.slots.counts[at.bh];
  plan.next = st.slots.next_slots[at.bh];
  const bool unobserved = check != evict_check::none && (check >> 32) == std::uint64_t(evict_check::stage::not_observed);
  if (unobserved || (plan.count > target && check != evict_check::none)) {
    report(status, evict_check::word(check, at.b, at.h));
  } else {
    // A head that takes the call leaves its KeyDiff anchor stale, whether
    // or not it frees a token (the host's evict_to_head).
    kvevict::detail::mark_anchor_stale(st, at.bh);
    if (plan.count > target) plan.kept = target;  // else nothing above the target: unchanged, no error
  }
  plan.order = st.order_of(at.b, at.h);
  st.work.evict_plans[at.bh] = plan;
  st.work.evict_counts[at.row] = plan.kept >= 0 ? plan.count - plan.kept : 0;
  if (results && plan.kept < 0) results[at.bh] = 0;
}

/// Launch 1: the checks and plan of every active (b, h). A paged cache's
/// rows are checked in chunks of the row (one block each, merged by the
/// last block to arrive); exact_greedy's history and queries by chunk 0.
template <int BlockThreads, class Cache, class Queries>
__global__ void __launch_bounds__(BlockThreads)
    evict_to_plan_kernel(batch_state_view st, active_set active, std::int32_t target, Cache cache, Queries queries,
                         row_split split, std::int32_t* results, std::uint64_t* status) {
  constexpr bool kPaged = is_paged_cache<Cache>::value;
  constexpr bool kGreedy = !std::is_same_v<Queries, no_queries>;
  using reduce = cub::BlockReduce<unsigned long long, BlockThreads>;
  __shared__ typename reduce::TempStorage temp;
  __shared__ bool finisher;
  const evict_row at(st, active, split.chunks, status);
  const std::int32_t t = static_cast<std::int32_t>(threadIdx.x);
  if (at.b < 0) {  // an inactive entry selects nothing
    if (at.chunk == 0 && t == 0) st.work.evict_counts[at.row] = 0;
    return;
  }
  const std::int32_t count = st.slots.counts[at.bh], next = st.slots.next_slots[at.bh];
  // The slots the call may touch: the occupied ones and those up to the target.
  const std::int32_t end = kvevict::detail::occupied_end(count, next);
  const std::int32_t scan = end > target + 1 ? end : (target + 1 < st.capacity() ? target + 1 : st.capacity());
  const std::int32_t chunks = kPaged && scan > split.chunk_slots ? (scan + split.chunk_slots - 1) / split.chunk_slots : 1;
  if (at.chunk >= chunks) return;

  unsigned long long check = evict_check::none;
  if (at.chunk == 0) {
    if (t == 0 && st.appended[at.bh]) check = evict_check::key(evict_check::stage::not_observed, 0);
    if constexpr (kGreedy) {
      if (t == 0 && st.history.rows[at.bh] != st.slots.lengths[at.b])
        check = minimum_of{}(check, static_cast<unsigned long long>(evict_check::key(evict_check::stage::history_gap, 0)));
      const std::int32_t g = st.group_size(), d = st.history.head_dim;
      for (std::int64_t i = t; i < std::int64_t{g} * d; i += BlockThreads) {
        const std::int32_t q = at.h * g + static_cast<std::int32_t>(i / d);
        if (classify_input(to_float(queries.q(at.b, q, static_cast<std::int32_t>(i % d))), false) != batch_code::ok)
          check = minimum_of{}(check, static_cast<unsigned long long>(evict_check::key(evict_check::stage::query, q)));
      }
    }
  }
  if constexpr (kPaged) {
    const std::int32_t* positions = st.slots.positions_of(at.b, at.h);
    const std::int32_t first = at.chunk * split.chunk_slots;
    const std::int32_t last = scan < first + split.chunk_slots ? scan : first + split.chunk_slots;
    for (std::int32_t s = first + t; s < last; s += BlockThreads)
      if (evict_check::touches(positions[s], s, target) && !row_is_mapped(cache, at.b, s))
        check = minimum_of{}(check, static_cast<unsigned long long>(evict_check::key(evict_check::stage::bad_page, s)));
  }
  check = reduce(temp).Reduce(check, minimum_of{});
  if (chunks == 1) {
    if (t == 0) plan_row(st, at, target, check, results, status);
    return;
  }
  evict_to_plan* plan = st.work.evict_plans + at.bh;
  if (t == 0) {
    atomicMin(reinterpret_cast<unsigned long long*>(&plan->check), check);
    __threadfence();
    finisher = atomicAdd(st.work.arrivals + at.bh, 1u) == static_cast<unsigned>(chunks - 1);
  }
  __syncthreads();
  if (!finisher || t != 0) return;
  __threadfence();
  const unsigned long long gathered = atomicExch(reinterpret_cast<unsigned long long*>(&plan->check), evict_check::none);
  st.work.arrivals[at.bh] = 0;
  plan_row(st, at, target, gathered, results, status);
}

/// The victim keys of every planned row, for the selection: element j of
/// segment i (launch row i) is slot j of its (b, h); free and protected
/// slots key ~0 (never taken: a row's count is at most its unprotected
/// tokens), rows that stay unchanged have no elements.
struct evict_keys {
  batch_state_view st;
  active_set active;
  std::int32_t num_segments = 0;
  std::int32_t max_length = 0;

  KVEVICT_HOST_DEVICE bool ordered_by_index() const noexcept { return true; }
  KVEVICT_HOST_DEVICE std::int32_t position(std::int32_t, std::int32_t j) const noexcept { return j; }
  __device__ std::int64_t head_of(std::int32_t i) const {
    const std::int32_t b = active.sequence(i / st.num_heads(), st.num_seqs());
    return b >= 0 ? st.head_index(b, i % st.num_heads()) : -1;
  }
  __device__ std::int32_t length(std::int32_t i) const {
    if (st.work.evict_counts[i] == 0) return 0;  // unplanned, refused, inactive or a repeat: nothing to select
    const std::int64_t bh = head_of(i);
    if (bh < 0) return 0;
    const evict_to_plan& p = st.work.evict_plans[bh];
    return p.kept >= 0 ? kvevict::detail::occupied_end(p.count, p.next) : 0;
  }
  __device__ std::uint64_t key(std::int32_t i, std::int32_t j, select_end) const {
    const std::int32_t b = active.sequence(i / st.num_heads(), st.num_seqs()), h = i % st.num_heads();
    return kvevict::detail::evict_to_key(st, b, h, st.work.evict_plans[st.head_index(b, h)].order, j);
  }
};

/// Launch 2, exact_greedy: one victim at a time (re-scoring the tokens left
/// before each, the host's bits), freed in place; then the victims' slots
/// in ascending order into the row's selection output, for the refill.
template <int BlockThreads, class Q>
__global__ void __launch_bounds__(BlockThreads)
    evict_to_greedy_kernel(batch_state_view st, active_set active, batch_queries<Q> queries) {
  using scan = cub::BlockScan<std::int32_t, BlockThreads>;
  __shared__ union {
    typename cub::BlockReduce<unsigned long long, BlockThreads>::TempStorage keys;
    typename scan::TempStorage scan;
  } temp;
  __shared__ leave_one_out_storage<BlockThreads> scoring;
  __shared__ unsigned long long shared_word;
  __shared__ std::int32_t shared_victim, carry;
  const evict_row at(st, active, 1, nullptr);
  if (at.b < 0) return;
  const evict_to_plan plan = st.work.evict_plans[at.bh];
  if (plan.kept < 0) return;  // the whole block
  const std::int32_t t = static_cast<std::int32_t>(threadIdx.x), cap = st.capacity();
  const std::int32_t length = st.slots.lengths[at.b];
  std::int32_t* positions = st.slots.positions_of(at.b, at.h);
  float* scores = st.scores_of(at.b, at.h);
  double* errors = leave_one_out_slot_errors(st.history, at.bh);
  for (std::int32_t round = 0; round < plan.count - plan.kept; ++round) {
    block_leave_one_out_errors<BlockThreads>(scoring, st, at.b, at.h, queries, cap, length, errors);
    for (std::int32_t s = t; s < cap; s += BlockThreads)
      if (positions[s] >= 0) scores[s] = static_cast<float>(errors[s]);
    __syncthreads();
    unsigned long long best = ~0ull;
    std::int32_t best_slot = -1;
    for (std::int32_t s = t; s < cap; s += BlockThreads) {
      const std::int32_t p = positions[s];
      if (p < 0 || st.rule.protect.covers(p, length)) continue;
      const unsigned long long key = plan.order.key(scores[s], p);
      if (key < best) {
        best = key;
        best_slot = s;
      }
    }
    if (t == 0) shared_victim = -1;
    publish_lowest_key<BlockThreads>(temp.keys, best, best_slot, shared_word, shared_victim);
    __syncthreads();
    if (t == 0) {
      positions[shared_victim] = -1;  // target >= sinks + recent: a victim exists
      scores[shared_victim] = 0.0f;
    }
    __syncthreads();
  }
  // The victims: the free slots of [0, end) but the hole the row had.
  const std::int32_t end = kvevict::detail::occupied_end(plan.count, plan.next);
  const std::int32_t hole = kvevict::detail::hole_of(plan.count, plan.next);
  std::int32_t* out = st.victim_scratch + std::int64_t{at.row} * cap;
  if (t == 0) carry = 0;
  __syncthreads();
  for (std::int32_t base = 0; base < end; base += BlockThreads) {
    const std::int32_t s = base + t;
    const std::int32_t flag = s < end && positions[s] < 0 && s != hole ? 1 : 0;
    std::int32_t rank = 0, total = 0;
    scan(temp.scan).ExclusiveSum(flag, rank, total);
    if (flag) out[carry + rank] = s;
    __syncthreads();  // everyone has read carry and the scan storage
    if (t == 0) carry += total;
    __syncthreads();
  }
}

/// Launch 3: the refill of every planned row, its pieces of work
/// (refill_work) spread over the row's blocks, a warp per piece so a moved
/// K/V row goes as one warp's 16-byte vectors; the first block's thread 0
/// writes the row's count, next slot and result.
template <int BlockThreads, int Items, class Cache>
__global__ void __launch_bounds__(BlockThreads)
    evict_to_refill_kernel(batch_state_view st, active_set active, std::int32_t chunks, Cache cache, slot_move* moves,
                           std::int32_t* results) {
  constexpr bool kMoveRows = !std::is_same_v<Cache, no_cache>;
  constexpr int kWarps = BlockThreads / 32;
  constexpr unsigned kAll = 0xFFFFFFFFu;
  const evict_row at(st, active, chunks, nullptr);
  if (at.b < 0) return;
  const evict_to_plan plan = st.work.evict_plans[at.bh];
  if (plan.kept < 0) return;  // the whole block
  const std::int32_t cap = st.capacity(), victims = plan.count - plan.kept;
  const std::int32_t hole = kvevict::detail::hole_of(plan.count, plan.next);
  const std::int32_t work = victims + (hole >= 0 ? 1 : 0), first = at.chunk * kWarps * Items;
  if (at.chunk > 0 && first >= work) return;  // no piece here (chunk 0 also writes the row's counters)
  const kvevict::detail::victims_and_hole freed(st.victim_scratch + std::int64_t{at.row} * cap, victims, hole);
  const auto refill = kvevict::detail::make_refill_plan(freed, work, plan.kept, st.rule.budget,
                                                        kvevict::detail::occupied_end(plan.count, plan.next));
  std::int32_t* positions = st.slots.positions_of(at.b, at.h);
  float* scores = st.scores_of(at.b, at.h);
  float* spare = st.spare_scores_of(at.b, at.h);
  const std::int32_t lane = static_cast<std::int32_t>(threadIdx.x) % 32, warp = static_cast<std::int32_t>(threadIdx.x) / 32;
  const std::int32_t last = first + kWarps * Items < work ? first + kWarps * Items : work;
  for (std::int32_t i = first + warp; i < last; i += kWarps) {  // warp-uniform
    slot_move m;
    if (lane == 0)
      kvevict::detail::refill_work(refill, i, positions, scores, spare,
                                   [&m](std::int32_t, std::int32_t from, std::int32_t to) { m = slot_move{from, to}; });
    m.from = __shfl_sync(kAll, m.from, 0);
    m.to = __shfl_sync(kAll, m.to, 0);
    if (m.from < 0) continue;  // a free, not a move
    if constexpr (kMoveRows) {
      copy_row(cache.k_row(at.b, at.h, m.to), cache.k_row(at.b, at.h, m.from), cache.head_dim, lane, 32);
      copy_row(cache.v_row(at.b, at.h, m.to), cache.v_row(at.b, at.h, m.from), cache.head_dim, lane, 32);
    } else if (lane == 0) {
      moves[at.bh * cap + i] = m;
    }
  }
  if (at.chunk == 0 && threadIdx.x == 0) {
    st.slots.counts[at.bh] = plan.kept;
    kvevict::detail::set_next_slot(st, at.b, at.h, refill.next_slot(), st.slots.lengths[at.b]);
    if (results) results[at.bh] = kMoveRows ? victims : refill.moves;
  }
}

inline constexpr int kRefillItems = 16;  ///< refill pieces per warp of a block

/// Launch 2 for the policies whose keys stand still: one bottom-k selection
/// of every planned row's victims, into the rows of victim_scratch.
inline cudaError_t launch_victims(const batch_state_view& st, const active_set& active, std::int64_t rows,
                                  no_queries, cudaStream_t stream) {
  std::size_t bytes = st.work.select_bytes;
  selection_output out;
  out.indices = st.victim_scratch;
  out.index_stride = st.capacity();
  return select_segments(st.work.select, bytes, evict_keys{st, active, static_cast<std::int32_t>(rows), st.capacity()},
                         select_end::bottom, selection_count{0, st.work.evict_counts}, out, nullptr, stream);
}

/// Launch 2 for exact_greedy: its greedy rounds, a block per row.
template <class Q>
cudaError_t launch_victims(const batch_state_view& st, const active_set& active, std::int64_t rows,
                           const batch_queries<Q>& queries, cudaStream_t stream) {
  evict_to_greedy_kernel<kBlockThreads, Q><<<static_cast<unsigned>(rows), kBlockThreads, 0, stream>>>(st, active, queries);
  return cudaGetLastError();
}

template <class Cache, class Queries>
cudaError_t launch_evict_to(const kvevict::detail::site& w, const batch_state_view& st, const active_set& active,
                            std::int32_t target, const Cache& cache, const Queries& queries, slot_move* moves,
                            std::int32_t* results, std::uint64_t* status, cudaStream_t stream) {
  kvevict::detail::require_not_null(w, "state.work.arrivals", st.work.arrivals);
  kvevict::detail::require_not_null(w, "state.work.evict_plans", st.work.evict_plans);
  kvevict::detail::require_not_null(w, "state.work.evict_counts", st.work.evict_counts);
  kvevict::detail::require_not_null(w, "state.victim_scratch", st.victim_scratch);
  if constexpr (std::is_same_v<Queries, no_queries>)
    kvevict::detail::require_not_null(w, "state.work.select", st.work.select);
  const std::int64_t rows = std::int64_t{active.entries(st.num_seqs())} * st.num_heads();
  // Pieces of a row's refill: its victims and the hole it had, at most capacity + 1.
  const std::int32_t pieces = kBlockThreads / 32 * kRefillItems;
  const std::int32_t refill_chunks = (st.capacity() + pieces) / pieces;
  // Only a paged cache's rows are checked, in chunks; otherwise one block per row plans.
  const row_split plan_split =
      is_paged_cache<Cache>::value ? split_rows(rows, st.capacity(), device_sm_count()) : row_split{};
  if (rows * plan_split.chunks > 0x7FFFFFFF || rows * refill_chunks > 0x7FFFFFFF)
    kvevict::detail::fail<invalid_argument>(w, "active", "gives more blocks than a grid holds");
  if (rows == 0) return cudaSuccess;
  evict_to_plan_kernel<kBlockThreads, Cache, Queries><<<static_cast<unsigned>(rows * plan_split.chunks), kBlockThreads,
                                                        0, stream>>>(st, active, target, cache, queries, plan_split,
                                                                     results, status);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  e = launch_victims(st, active, rows, queries, stream);
  if (e != cudaSuccess) return e;
  evict_to_refill_kernel<kBlockThreads, kRefillItems, Cache>
      <<<static_cast<unsigned>(rows * refill_chunks), kBlockThreads, 0, stream>>>(st, active, refill_chunks, cache,
                                                                                   moves, results);
  return cudaGetLastError();
}

}  // namespace detail

/// evict_to(target) for every active (b, h), moving the kept rows in
/// `cache`, as the host's batched_evict_to; freed (optional, [B][H]
/// device memory): tokens freed per stepped head. exact_greedy takes the
/// overload with the step's queries.
template <class T, class Layout>
cudaError_t batched_evict_to(const batch_state_view& st, const active_set& active, std::int32_t target,
                             const kv_view<T, Layout>& cache, std::int32_t* freed, std::uint64_t* status,
                             cudaStream_t stream) {
  const kvevict::detail::site w{"cuda", "evict_to"};
  kvevict::detail::require_state(w, st);
  kvevict::detail::require_active(w, active, st.num_seqs());
  kvevict::detail::require_not_null(w, "status", status);
  kvevict::detail::require_target(w, st, target);
  kvevict::detail::require_cache(w, st, cache);
  return detail::launch_evict_to(w, st, active, target, cache, detail::no_queries{}, nullptr, freed, status, stream);
}

/// The same for engines that move rows themselves: moves[(b * H + h) *
/// capacity + i] for i < move_counts[b * H + h] (device memory).
inline cudaError_t batched_evict_to(const batch_state_view& st, const active_set& active, std::int32_t target,
                                    slot_move* moves, std::int32_t* move_counts, std::uint64_t* status,
                                    cudaStream_t stream) {
  const kvevict::detail::site w{"cuda", "evict_to"};
  kvevict::detail::require_state(w, st);
  kvevict::detail::require_active(w, active, st.num_seqs());
  kvevict::detail::require_not_null(w, "status", status);
  kvevict::detail::require_not_null(w, "moves", moves);
  kvevict::detail::require_not_null(w, "move_counts", move_counts);
  kvevict::detail::require_target(w, st, target);
  return detail::launch_evict_to(w, st, active, target, detail::no_cache{}, detail::no_queries{}, moves, move_counts,
                                 status, stream);
}

/// exact_greedy's greedy evict_to(target), moving the kept rows in `cache`,
/// as the host's batched_evict_to with queries: `in` (device memory) holds
/// the queries this step's observe + evict took; a head with non-finite
/// queries is left unchanged (non_finite_query). Refuses a state of another
/// policy.
template <class Q, class T, class Layout>
cudaError_t batched_evict_to(const batch_state_view& st, const active_set& active, std::int32_t target,
                             const batch_queries<Q>& in, const kv_view<T, Layout>& cache, std::int32_t* freed,
                             std::uint64_t* status, cudaStream_t stream) {
  const kvevict::detail::site w{"cuda", "evict_to"};
  kvevict::detail::require_state(w, st);
  kvevict::detail::require_active(w, active, st.num_seqs());
  kvevict::detail::require_not_null(w, "status", status);
  kvevict::detail::require_target(w, st, target, true);
  kvevict::detail::require_greedy_queries(w, st, in);
  kvevict::detail::require_cache(w, st, cache);
  if (cache.head_dim != st.history.head_dim)
    kvevict::detail::fail<invalid_argument>(w, "cache.head_dim", "= ", cache.head_dim, ", the history has ",
                                            st.history.head_dim);
  return detail::launch_evict_to(w, st, active, target, cache, in, nullptr, freed, status, stream);
}

/// The same for engines that move rows themselves (moves as in the
/// overload without queries, device memory).
template <class Q>
cudaError_t batched_evict_to(const batch_state_view& st, const active_set& active, std::int32_t target,
                             const batch_queries<Q>& in, slot_move* moves, std::int32_t* move_counts,
                             std::uint64_t* status, cudaStream_t stream) {
  const kvevict::detail::site w{"cuda", "evict_to"};
  kvevict::detail::require_state(w, st);
  kvevict::detail::require_active(w, active, st.num_seqs());
  kvevict::detail::require_not_null(w, "status", status);
  kvevict::detail::require_not_null(w, "moves", moves);
  kvevict::detail::require_not_null(w, "move_counts", move_counts);
  kvevict::detail::require_target(w, st, target, true);
  kvevict::detail::require_greedy_queries(w, st, in);
  return detail::launch_evict_to(w, st, active, target, detail::no_cache{}, in, moves, move_counts, status, stream);
}

}  // namespace gpu
}  // namespace kvevict
