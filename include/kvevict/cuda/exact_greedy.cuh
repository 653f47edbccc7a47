#pragma once
// exact_greedy's decode step on CUDA, one block per active (sequence, KV
// head), history in device memory (batch_state_view::history): record every
// appended row not yet in the history (one, or several after a multi-token
// append), score every cached token with its leave-one-out error
// (leave_one_out.cuh, the host's bits) and evict the lowest (score,
// position). The checks and their order are the host backend's
// (exact_greedy_head), so both report the same status word.
#include <cub/block/block_reduce.cuh>
#include <cuda_runtime.h>

#include <cstdint>

#include "kvevict/batch/inputs.hpp"
#include "kvevict/batch/state.hpp"
#include "kvevict/batch/status.hpp"
#include "kvevict/batch/step.hpp"
#include "kvevict/cuda/device_helpers.cuh"
#include "kvevict/cuda/leave_one_out.cuh"
#include "kvevict/dtype/convert.hpp"
#include "kvevict/kv_view.hpp"
#include "kvevict/policy/decode_rules.hpp"

namespace kvevict {
namespace gpu {
namespace detail {

template <int BlockThreads, class Q, class T, class Layout>
__global__ void __launch_bounds__(BlockThreads)
    exact_greedy_kernel(batch_state_view st, active_set active, batch_queries<Q> in, kv_view<T, Layout> cache,
                        std::int32_t* victims, std::uint64_t* status) {
  using reduce_words = cub::BlockReduce<unsigned long long, BlockThreads>;
  using reduce_ints = cub::BlockReduce<std::int32_t, BlockThreads>;
  __shared__ union {
    typename reduce_words::TempStorage words;
    typename reduce_ints::TempStorage ints;
  } temp;
  __shared__ leave_one_out_storage<BlockThreads> scoring;
  __shared__ unsigned long long shared_word;
  __shared__ std::int32_t shared_victim;

  const std::int32_t entry = static_cast<std::int32_t>(blockIdx.x) / st.num_heads();
  const std::int32_t h = static_cast<std::int32_t>(blockIdx.x) % st.num_heads();
  const std::int32_t b = entry_sequence(active, entry, st.num_seqs(), h, status);
  if (b < 0 || kvevict::detail::observe_skips(st, active, b, h)) return;  // a retry skips a head that stepped
  const std::int32_t t = static_cast<std::int32_t>(threadIdx.x);
  const history_view& hv = st.history;
  const std::int64_t bh = st.head_index(b, h);
  const std::int32_t d = hv.head_dim, g = st.group_size(), length = st.slots.lengths[b], count = st.slots.counts[bh];
  const std::int32_t first = hv.rows[bh];  // the oldest position not recorded yet
  const std::int32_t* positions = st.slots.positions_of(b, h);  // occupied: exactly [0, count) after an append

  // ---- checks, before anything changes, in the host's order ----
  if (t == 0) {
    batch_code code = batch_code::ok;
    if (!st.appended[bh]) code = batch_code::not_appended;
    else if (length > hv.max_tokens) code = batch_code::history_full;
    else if (first >= length) code = batch_code::history_gap;
    shared_word = code == batch_code::ok ? batch_status_clear : pack_status(b, h, 0, code);
    shared_victim = -1;
  }
  __syncthreads();
  if (shared_word != batch_status_clear) {
    if (t == 0) give_up(bh, shared_word, victims, status);
    return;
  }
  // Every unrecorded position must still be cached: positions are distinct
  // and below length, so [first, length) is cached exactly when that many
  // cached positions are >= first.
  std::int32_t unrecorded = 0;
  unsigned long long page = batch_status_clear;
  for (std::int32_t s = t; s < count; s += BlockThreads)
    if (positions[s] >= first) {
      ++unrecorded;
      if (!row_is_mapped(cache, b, s))
        page = minimum_of{}(page, static_cast<unsigned long long>(pack_status(b, h, s, batch_code::bad_page)));
    }
  unrecorded = reduce_ints(temp.ints).Sum(unrecorded);
  __syncthreads();
  page = reduce_words(temp.words).Reduce(page, minimum_of{});
  __syncthreads();
  const unsigned long long queries = block_query_problem<BlockThreads>(temp.words, in, b, h, g, d);
  const unsigned long long scales = kv_scale_problem(cache, b, h);  // in the host's order: gap, queries, scales, page
  if (t == 0)
    shared_word = unrecorded != length - first      ? pack_status(b, h, 0, batch_code::history_gap)
                  : queries != batch_status_clear ? queries
                  : scales != batch_status_clear  ? scales
                                                   : page;
  __syncthreads();
  if (shared_word != batch_status_clear) {
    if (t == 0) give_up(bh, shared_word, victims, status);
    return;
  }

  // ---- record the new rows (written either way: beyond rows, they are
  // not state until the commit) ----
  float* keys = hv.keys + bh * hv.max_tokens * d;
  float* values = hv.values + bh * hv.max_tokens * d;
  const float k_scale = cache.k_scale(h), v_scale = cache.v_scale(h);
  unsigned long long problem = batch_status_clear;
  for (std::int64_t i = t; i < std::int64_t{count} * d; i += BlockThreads) {  // 64-bit: count * d may pass 2^31
    const std::int32_t s = static_cast<std::int32_t>(i / d), e = static_cast<std::int32_t>(i % d), p = positions[s];
    if (p < first) continue;
    const float k = kv_value(cache.k_row(b, h, s)[e], k_scale), v = kv_value(cache.v_row(b, h, s)[e], v_scale);
    if (classify_input(k, false) != batch_code::ok || classify_input(v, false) != batch_code::ok)
      problem = minimum_of{}(problem, static_cast<unsigned long long>(pack_status(b, h, s, batch_code::non_finite_kv)));
    keys[std::int64_t{p} * d + e] = k;
    values[std::int64_t{p} * d + e] = v;
  }
  problem = reduce_words(temp.words).Reduce(problem, minimum_of{});
  __syncthreads();  // everyone has read shared_word above before thread 0 rewrites it
  if (t == 0) shared_word = problem;
  __syncthreads();
  if (shared_word != batch_status_clear) {
    if (t == 0) give_up(bh, shared_word, victims, status);
    return;
  }

  // ---- the leave-one-out errors, the scores, the victim, the commit ----
  double* errors = leave_one_out_slot_errors(hv, bh);
  block_leave_one_out_errors<BlockThreads>(scoring, st, b, h, in, count, length, errors);
  float* updated = st.spare_scores_of(b, h);
  const victim_order order = st.order_of(b, h);
  unsigned long long best = ~0ull;
  std::int32_t best_slot = -1;
  for (std::int32_t s = t; s < count; s += BlockThreads) {
    const float score = static_cast<float>(errors[s]);
    updated[s] = score;
    if (st.rule.protect.covers(positions[s], length)) continue;
    const unsigned long long key = order.key(score, positions[s]);
    if (key < best) {
      best = key;
      best_slot = s;
    }
  }
  if (count > st.rule.budget) {
    publish_lowest_key<BlockThreads>(temp.words, best, best_slot, shared_word, shared_victim);
  }
  __syncthreads();
  if (t == 0) {
    hv.rows[bh] = length;
    kvevict::detail::commit_observe_evict(st, b, h, shared_victim);
    if (victims) victims[bh] = shared_victim;
  }
}

template <class Q, class T, class Layout>
cudaError_t launch_exact_greedy(const batch_state_view& st, const active_set& active, const batch_queries<Q>& in,
                                const kv_view<T, Layout>& cache, std::int32_t* victims, std::uint64_t* status,
                                cudaStream_t stream) {
  const std::int64_t blocks = std::int64_t{active.entries(st.num_seqs())} * st.num_heads();
  if (blocks == 0) return cudaSuccess;
  exact_greedy_kernel<kBlockThreads, Q, T, Layout>
      <<<static_cast<unsigned>(blocks), kBlockThreads, 0, stream>>>(st, active, in, cache, victims, status);
  return cudaGetLastError();
}

}  // namespace detail
}  // namespace gpu
}  // namespace kvevict
