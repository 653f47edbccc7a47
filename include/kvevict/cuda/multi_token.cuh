#pragma once
// Multi-token steps on CUDA: the append of several tokens per sequence and
// evict_to(target), with the decisions of the host's batched_append_tokens
// and batched_evict_to (kvevict/batch/multi_token.hpp, rules in
// policy/evict_to.hpp), bit for bit.
//
// evict_to runs one block per active (sequence, KV head). Victims are taken
// one round at a time: the block-wide minimum of rule.key over the
// unprotected tokens (an exact integer minimum, so the same victims as the
// host's partial sort), or for random the round's draw and a block radix
// select of the ranked position. Thread 0 then pairs holes with the kept
// rows beyond the span in one two-pointer sweep, and the warps move the rows.
// The rounds make this O(surplus * count / threads) per head: evict_to runs
// after chunked prefill or speculative steps, not every token.
// exact_greedy's evict_to takes the step's queries and re-scores every
// cached token with its leave-one-out error before each round
// (leave_one_out.cuh, the host's bits), so its victims are the host's
// greedy ones.
#include <cub/block/block_reduce.cuh>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "kvevict/batch/inputs.hpp"
#include "kvevict/batch/multi_token.hpp"
#include "kvevict/batch/state.hpp"
#include "kvevict/batch/status.hpp"
#include "kvevict/batch/validate.hpp"
#include "kvevict/cuda/block_select.cuh"
#include "kvevict/cuda/device_helpers.cuh"
#include "kvevict/cuda/leave_one_out.cuh"
#include "kvevict/kv_view.hpp"
#include "kvevict/policy/decode_rules.hpp"
#include "kvevict/policy/evict_to.hpp"

namespace kvevict {
namespace gpu {
namespace detail {

template <int BlockThreads>
__global__ void __launch_bounds__(BlockThreads)
    append_tokens_kernel(batch_state_view st, active_set active, std::int32_t tokens, std::uint64_t* status) {
  const std::int32_t b = entry_sequence(active, static_cast<std::int32_t>(blockIdx.x), st.num_seqs(), 0, status);
  if (b < 0) return;
  const std::int32_t t = static_cast<std::int32_t>(threadIdx.x);
  __shared__ std::uint64_t problem;
  if (t == 0) {
    problem = batch_status_clear;
    for (std::int32_t h = 0; h < st.num_heads() && problem == batch_status_clear; ++h)
      if (st.slots.counts[st.head_index(b, h)] + tokens > st.capacity())
        problem = pack_status(b, h, tokens, batch_code::over_capacity);
    report(status, problem);
  }
  __syncthreads();
  if (problem != batch_status_clear) return;
  const std::int32_t first = st.slots.lengths[b];
  for (std::int64_t i = t; i < std::int64_t{st.num_heads()} * tokens; i += BlockThreads) {  // 64-bit product
    const std::int32_t h = static_cast<std::int32_t>(i / tokens), j = static_cast<std::int32_t>(i % tokens);
    const std::int64_t bh = st.head_index(b, h);
    const std::int32_t s = new_token_slot(st.slots.counts[bh], st.slots.next_slots[bh], j);
    st.slots.positions_of(b, h)[s] = first + j;
    st.scores_of(b, h)[s] = 0.0f;
  }
  __syncthreads();  // every thread has read counts, next_slots and lengths
  for (std::int32_t h = t; h < st.num_heads(); h += BlockThreads) {
    const std::int64_t bh = st.head_index(b, h);
    const std::int32_t count = st.slots.counts[bh] + tokens;
    st.slots.counts[bh] = count;
    st.slots.next_slots[bh] = next_slot_after_append(count, st.rule.budget);
    st.appended[bh] = 1;
  }
  if (t == 0) st.slots.lengths[b] = first + tokens;
}

/// Stands for "no cache": evict_to reports the moves instead of making them.
struct no_cache {};
/// Stands for "no queries": the victims follow the scores as they are
/// (every policy but exact_greedy, which re-scores with batch_queries).
struct no_queries {};

template <int BlockThreads, class Cache, class Queries>
__global__ void __launch_bounds__(BlockThreads)
    evict_to_kernel(batch_state_view st, active_set active, std::int32_t target, Cache cache, Queries queries,
                    slot_move* moves, std::int32_t* results, std::uint64_t* status) {
  constexpr bool kMoveRows = !std::is_same_v<Cache, no_cache>;
  constexpr bool kGreedy = !std::is_same_v<Queries, no_queries>;
  using reduce_keys = cub::BlockReduce<unsigned long long, BlockThreads>;
  using reduce_counts = cub::BlockReduce<std::int32_t, BlockThreads>;
  using select = block_select_kth<BlockThreads>;
  __shared__ union {
    typename reduce_keys::TempStorage keys;
    typename reduce_counts::TempStorage counts;
    typename select::temp_storage select;
  } temp;
  __shared__ unsigned long long shared_word;
  __shared__ std::int32_t shared_count, shared_victim, shared_moves, shared_next;

  const std::int32_t entry = static_cast<std::int32_t>(blockIdx.x) / st.num_heads();
  const std::int32_t h = static_cast<std::int32_t>(blockIdx.x) % st.num_heads();
  const std::int32_t b = entry_sequence(active, entry, st.num_seqs(), h, status);
  if (b < 0) return;
  const std::int32_t t = static_cast<std::int32_t>(threadIdx.x), cap = st.capacity();
  const std::int64_t bh = st.head_index(b, h);
  std::int32_t* positions = st.slots.positions_of(b, h);
  float* scores = st.scores_of(b, h);
  float* spare = st.spare_scores_of(b, h);
  const std::int32_t count = st.slots.counts[bh], length = st.slots.lengths[b];
  if (t == 0 && results) results[bh] = 0;

  // ---- checks (the host's evict_to_problem, in its order), before anything changes ----
  unsigned long long problem = batch_status_clear;
  if (st.appended[bh]) problem = pack_status(b, h, 0, batch_code::not_observed);
  if (problem == batch_status_clear && count <= target) return;  // nothing to free: unchanged
  if constexpr (kGreedy) {
    if (problem == batch_status_clear && st.history.rows[bh] != length)
      problem = pack_status(b, h, 0, batch_code::history_gap);
    if (problem == batch_status_clear) {  // the same branch in every thread
      problem = block_query_problem<BlockThreads>(temp.keys, queries, b, h, st.group_size(), st.history.head_dim);
      if (t == 0) shared_word = problem;
      __syncthreads();
      problem = shared_word;
      __syncthreads();  // everyone has read shared_word before it is rewritten below
    }
  }
  if constexpr (kMoveRows) {
    if (problem == batch_status_clear)
      for (std::int32_t s = t; s < cap; s += BlockThreads)
        if ((positions[s] >= 0 || s <= target) && !row_is_mapped(cache, b, s))
          problem = minimum_of{}(problem, static_cast<unsigned long long>(pack_status(b, h, s, batch_code::bad_page)));
  }
  problem = reduce_keys(temp.keys).Reduce(problem, minimum_of{});
  if (t == 0) shared_word = problem;
  __syncthreads();
  if (shared_word != batch_status_clear) {
    if (t == 0) report(status, shared_word);
    return;
  }

  // ---- victims, one round at a time ----
  const std::int32_t surplus = count - target;
  const std::uint64_t stream = st.streams ? st.streams[b] : std::uint64_t(b);
  for (std::int32_t round = 0; round < surplus; ++round) {
    if (t == 0) shared_victim = -1;
    __syncthreads();
    if constexpr (kGreedy) {  // re-score the tokens left; the lowest key below is the greedy victim
      __shared__ leave_one_out_storage<BlockThreads> scoring;
      double* errors = leave_one_out_slot_errors(st.history, bh);
      block_leave_one_out_errors<BlockThreads>(scoring, st, b, h, queries, cap, length, errors);
      for (std::int32_t s = t; s < cap; s += BlockThreads)
        if (positions[s] >= 0) scores[s] = static_cast<float>(errors[s]);
      __syncthreads();
    }
    if (st.rule.victim == victim_rule::random_rank) {
      std::int32_t n = 0;
      for (std::int32_t s = t; s < cap; s += BlockThreads)
        n += positions[s] >= 0 && !st.rule.protect.covers(positions[s], length);
      n = reduce_counts(temp.counts).Sum(n);
      if (t == 0) shared_count = n;
      __syncthreads();
      const std::int32_t rank = random_victim_rank(st.rule.seed, stream, h, length, shared_count, round);
      const std::uint32_t chosen = select::select(temp.select, rank, [&](auto emit) {
        for (std::int32_t s = t; s < cap; s += BlockThreads)
          if (positions[s] >= 0 && !st.rule.protect.covers(positions[s], length))
            emit(static_cast<std::uint32_t>(positions[s]));
      });
      for (std::int32_t s = t; s < cap; s += BlockThreads)
        if (positions[s] == static_cast<std::int32_t>(chosen)) shared_victim = s;
    } else {
      unsigned long long best = ~0ull;
      std::int32_t best_slot = -1;
      for (std::int32_t s = t; s < cap; s += BlockThreads) {
        const std::int32_t p = positions[s];
        if (p < 0 || st.rule.protect.covers(p, length)) continue;
        const unsigned long long key = st.rule.key(scores[s], p);
        if (key < best) {
          best = key;
          best_slot = s;
        }
      }
      publish_lowest_key<BlockThreads>(temp.keys, best, best_slot, shared_word, shared_victim);
    }
    __syncthreads();
    if (t == 0) {
      positions[shared_victim] = -1;  // target >= sinks + recent: a victim exists
      scores[shared_victim] = 0.0f;
    }
    __syncthreads();
  }

  // ---- refill the holes (refill_holes' pairing, as a two-pointer sweep) ----
  const std::int32_t kept = target;
  const std::int32_t span = kept <= st.rule.budget ? kept + 1 : kept;
  std::int32_t* pairs = st.victim_scratch + bh * cap;  // [2 * moves]: (from, to); moves <= cap / 2
  if (t == 0) {
    std::int32_t hole = 0, n = 0;
    for (std::int32_t s = span; s < cap; ++s) {
      if (positions[s] < 0) continue;
      while (positions[hole] >= 0) ++hole;  // a hole below span exists for every source beyond it
      positions[hole] = positions[s];
      scores[hole] = scores[s];
      positions[s] = -1;
      scores[s] = 0.0f;
      pairs[2 * n] = s;
      pairs[2 * n + 1] = hole;
      ++n;
      ++hole;
    }
    while (hole < span && positions[hole] >= 0) ++hole;
    shared_moves = n;
    shared_next = hole < span ? hole : -1;
    st.slots.counts[bh] = kept;
    st.slots.next_slots[bh] = shared_next;
    if (results) results[bh] = kMoveRows ? surplus : n;
  }
  __syncthreads();
  for (std::int32_t s = t; s < cap; s += BlockThreads)
    if (positions[s] < 0) spare[s] = 0.0f;  // as the host: free slots read 0 in both buffers
  if constexpr (kMoveRows) {
    const std::int32_t warp = t / 32, lane = t % 32, warps = BlockThreads / 32;
    for (std::int32_t r = warp; r < 2 * shared_moves; r += warps) {
      const std::int32_t from = pairs[2 * (r / 2)], to = pairs[2 * (r / 2) + 1];
      if (r % 2 == 0) copy_row(cache.k_row(b, h, to), cache.k_row(b, h, from), cache.head_dim, lane, 32);
      else copy_row(cache.v_row(b, h, to), cache.v_row(b, h, from), cache.head_dim, lane, 32);
    }
  } else {
    for (std::int32_t i = t; i < shared_moves; i += BlockThreads)
      moves[bh * cap + i] = slot_move{pairs[2 * i], pairs[2 * i + 1]};
  }
}

template <class Cache, class Queries>
cudaError_t launch_evict_to(const batch_state_view& st, const active_set& active, std::int32_t target,
                            const Cache& cache, const Queries& queries, slot_move* moves, std::int32_t* results,
                            std::uint64_t* status, cudaStream_t stream) {
  const std::int64_t blocks = std::int64_t{active.entries(st.num_seqs())} * st.num_heads();
  if (blocks == 0) return cudaSuccess;
  evict_to_kernel<kBlockThreads, Cache, Queries><<<static_cast<unsigned>(blocks), kBlockThreads, 0, stream>>>(
      st, active, target, cache, queries, moves, results, status);
  return cudaGetLastError();
}

}  // namespace detail

/// Appends `tokens` tokens to every active sequence, as the host's
/// batched_append_tokens (status over_capacity for a sequence that would
/// not fit, which is left unchanged).
inline cudaError_t batched_append_tokens(const batch_state_view& st, const active_set& active, std::int32_t tokens,
                                         std::uint64_t* status, cudaStream_t stream) {
  const kvevict::detail::site w{"cuda", "append_tokens"};
  kvevict::detail::require_state(w, st);
  kvevict::detail::require_active(w, active, st.num_seqs());
  kvevict::detail::require_not_null(w, "status", status);
  kvevict::detail::require_tokens(w, st, tokens);
  const std::int32_t entries = active.entries(st.num_seqs());
  if (entries == 0) return cudaSuccess;
  detail::append_tokens_kernel<detail::kBlockThreads>
      <<<entries, detail::kBlockThreads, 0, stream>>>(st, active, tokens, status);
  return cudaGetLastError();
}

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
  return detail::launch_evict_to(st, active, target, cache, detail::no_queries{}, nullptr, freed, status, stream);
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
  return detail::launch_evict_to(st, active, target, detail::no_cache{}, detail::no_queries{}, moves, move_counts,
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
  return detail::launch_evict_to(st, active, target, cache, in, nullptr, freed, status, stream);
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
  return detail::launch_evict_to(st, active, target, detail::no_cache{}, in, moves, move_counts, status, stream);
}

}  // namespace gpu
}  // namespace kvevict
