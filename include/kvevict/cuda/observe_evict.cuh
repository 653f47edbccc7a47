#pragma once
// Launch 2 of a decode step on CUDA: observe + evict fused, one block per
// active (sequence, KV head), one pass over its occupied slots [0, count):
// each thread folds its slots' increments over the GQA group, writes the
// updated scores to the spare buffer and keeps the lowest victim key of its
// slots; a cub::BlockReduce of the packed (score, position) keys gives the
// exact minimum whatever the order. random instead counts the unprotected and
// selects its k-th position (block_select.cuh); exact_greedy has its own
// kernel (exact_greedy.cuh). Same semantics, bit for bit, as
// batched_observe_evict on the host (kvevict/batch/host_backend.hpp): the
// per-slot arithmetic is the same KVEVICT_HOST_DEVICE code.
#include <cub/block/block_reduce.cuh>
#include <cuda_runtime.h>

#include <cstdint>

#include "kvevict/batch/inputs.hpp"
#include "kvevict/batch/score_sources.hpp"
#include "kvevict/batch/state.hpp"
#include "kvevict/batch/status.hpp"
#include "kvevict/batch/step.hpp"
#include "kvevict/batch/validate.hpp"
#include "kvevict/cuda/block_select.cuh"
#include "kvevict/cuda/device_helpers.cuh"
#include "kvevict/cuda/exact_greedy.cuh"
#include "kvevict/policy/decode_rules.hpp"

namespace kvevict {
namespace gpu {
namespace detail {

/// The block's (b, h) from blockIdx.x = entry * num_heads + h; -1 when the
/// entry is inactive. Reports a bad list entry once.
__device__ inline std::int32_t block_head(const batch_state_view& st, const active_set& active, std::int32_t& h,
                                          std::uint64_t* status) {
  const std::int32_t entry = static_cast<std::int32_t>(blockIdx.x) / st.num_heads();
  h = static_cast<std::int32_t>(blockIdx.x) % st.num_heads();
  return entry_sequence(active, entry, st.num_seqs(), h, status);
}

template <int BlockThreads, victim_rule Rule, class Source>
__global__ void __launch_bounds__(BlockThreads)
    observe_evict_kernel(batch_state_view st, active_set active, Source source, std::int32_t* victims,
                         std::uint64_t* status) {
  using reduce_keys = cub::BlockReduce<unsigned long long, BlockThreads>;
  using reduce_counts = cub::BlockReduce<std::int32_t, BlockThreads>;
  using select = block_select_kth<BlockThreads>;
  __shared__ union {
    typename reduce_keys::TempStorage keys;
    typename reduce_counts::TempStorage counts;
    typename select::temp_storage select;
  } temp;
  __shared__ unsigned long long shared_word;
  __shared__ std::int32_t shared_victim, shared_rank;

  std::int32_t h = 0;
  const std::int32_t b = block_head(st, active, h, status);
  if (b < 0) return;
  const std::int32_t t = static_cast<std::int32_t>(threadIdx.x);
  const std::int64_t bh = st.head_index(b, h);
  if (t == 0) {
    std::int32_t index = 0;
    const batch_code code = kvevict::detail::check_observe_head(st, source, b, h, index);
    shared_word = code == batch_code::ok ? batch_status_clear : pack_status(b, h, index, code);
    shared_victim = -1;
  }
  __syncthreads();
  if (shared_word != batch_status_clear) {
    if (t == 0) give_up(bh, shared_word, victims, status);
    return;
  }

  const std::int32_t count = st.slots.counts[bh], length = st.slots.lengths[b];
  const std::int32_t* positions = st.slots.positions_of(b, h);
  const float* current = st.scores_of(b, h);
  float* updated = st.spare_scores_of(b, h);
  unsigned long long problem = batch_status_clear, best = ~0ull;
  std::int32_t best_slot = -1, candidates = 0;
  for (std::int32_t s = t; s < count; s += BlockThreads) {
    const slot_increment inc = source.increment(b, h, s);
    if (inc.code != batch_code::ok) {
      problem = minimum_of{}(problem, static_cast<unsigned long long>(pack_status(b, h, s, inc.code)));
      continue;
    }
    const float score = kvevict::detail::add(current[s], inc.value);
    if (classify_input(score, false) != batch_code::ok) {
      problem = minimum_of{}(problem, static_cast<unsigned long long>(pack_status(b, h, s, batch_code::score_overflow)));
      continue;
    }
    updated[s] = score;
    if (st.rule.protect.covers(positions[s], length)) continue;
    ++candidates;
    const unsigned long long key = st.rule.key(score, positions[s]);
    if (key < best) {
      best = key;
      best_slot = s;
    }
  }
  problem = reduce_keys(temp.keys).Reduce(problem, minimum_of{});
  __syncthreads();  // everyone has read shared_word above before thread 0 rewrites it
  if (t == 0) shared_word = problem;
  __syncthreads();
  if (shared_word != batch_status_clear) {
    if (t == 0) give_up(bh, shared_word, victims, status);
    return;
  }

  if (count > st.rule.budget) {
    if constexpr (Rule == victim_rule::random_rank) {
      const std::int32_t n = reduce_counts(temp.counts).Sum(candidates);
      if (t == 0) shared_rank = n > 0 ? random_victim_rank(st.rule.seed, st.streams[b], h, length, n) : -1;
      __syncthreads();
      if (shared_rank >= 0) {
        const std::uint32_t position = select::select(temp.select, shared_rank, [&](auto add) {
          for (std::int32_t s = t; s < count; s += BlockThreads)
            if (!st.rule.protect.covers(positions[s], length)) add(static_cast<std::uint32_t>(positions[s]));
        });
        for (std::int32_t s = t; s < count; s += BlockThreads)
          if (positions[s] == static_cast<std::int32_t>(position)) shared_victim = s;
      }
    } else {
      publish_lowest_key<BlockThreads>(temp.keys, best, best_slot, shared_word, shared_victim);
    }
  }
  __syncthreads();
  if (t == 0) {
    kvevict::detail::commit_observe_evict(st, b, h, shared_victim);
    if (victims) victims[bh] = shared_victim;
  }
}

template <victim_rule Rule, class Source>
cudaError_t launch_observe_evict(const batch_state_view& st, const active_set& active, const Source& source,
                                 std::int32_t* victims, std::uint64_t* status, cudaStream_t stream) {
  const std::int64_t blocks = std::int64_t{active.entries(st.num_seqs())} * st.num_heads();
  if (blocks == 0) return cudaSuccess;
  observe_evict_kernel<kBlockThreads, Rule, Source>
      <<<static_cast<unsigned>(blocks), kBlockThreads, 0, stream>>>(st, active, source, victims, status);
  return cudaGetLastError();
}

/// One kernel per victim rule: the rule is a compile-time choice.
template <class Source>
cudaError_t dispatch_observe_evict(const batch_state_view& st, const active_set& active, const Source& source,
                                   std::int32_t* victims, std::uint64_t* status, cudaStream_t stream) {
  switch (st.rule.victim) {
    case victim_rule::lowest_score:
      return launch_observe_evict<victim_rule::lowest_score>(st, active, source, victims, status, stream);
    case victim_rule::oldest:
      return launch_observe_evict<victim_rule::oldest>(st, active, source, victims, status, stream);
    case victim_rule::random_rank:
      return launch_observe_evict<victim_rule::random_rank>(st, active, source, victims, status, stream);
  }
  return cudaErrorInvalidValue;
}

inline void require_common(const kvevict::detail::site& w, const batch_state_view& st, const active_set& active,
                           const std::uint64_t* status) {
  kvevict::detail::require_state(w, st);
  kvevict::detail::require_active(w, active, st.num_seqs());
  kvevict::detail::require_not_null(w, "status", status);
  if (std::int64_t{active.entries(st.num_seqs())} * st.num_heads() > 0x7FFFFFFF)
    kvevict::detail::fail<invalid_argument>(w, "active", "gives more (sequence, head) blocks than a grid holds");
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
  const kvevict::detail::site w{"cuda", "observe_evict"};
  detail::require_common(w, st, active, status);
  kvevict::detail::require_input(w, st, in);
  if (st.history.keys)
    kvevict::detail::fail<invalid_argument>(w, "in", "is not queries + LSE, which exact_greedy needs (with the cache)");
  const score_source<Input> source{in, st.group_size(), st.rule.reduce};
  return detail::dispatch_observe_evict(st, active, source, victims, status, stream);
}

/// Observe + evict from queries + LSE (device memory), the logits recomputed
/// from the keys of `cache`; for exact_greedy (a state with a history) the
/// leave-one-out step, which also records the newest K/V rows.
template <class Q, class T, class Layout>
cudaError_t batched_observe_evict(const batch_state_view& st, const active_set& active, const batch_queries<Q>& in,
                                  const kv_view<T, Layout>& cache, std::int32_t* victims, std::uint64_t* status,
                                  cudaStream_t stream) {
  const kvevict::detail::site w{"cuda", "observe_evict"};
  detail::require_common(w, st, active, status);
  kvevict::detail::require_input(w, st, in, cache);
  if (st.history.keys) {
    kvevict::detail::require_history(w, st);
    if (cache.head_dim != st.history.head_dim)
      kvevict::detail::fail<invalid_argument>(w, "cache.head_dim", "= ", cache.head_dim, ", the history has ",
                                              st.history.head_dim);
    return detail::launch_exact_greedy(st, active, in, cache, victims, status, stream);
  }
  const query_source<Q, T, Layout> source{in, cache, st.group_size(), st.rule.reduce};
  return detail::dispatch_observe_evict(st, active, source, victims, status, stream);
}

}  // namespace gpu
}  // namespace kvevict
