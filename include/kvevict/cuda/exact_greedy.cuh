#pragma once
// exact_greedy's decode step on CUDA, one block per active (sequence, KV
// head), history in device memory (batch_state_view::history). It runs the
// host's leave-one-out computation (kvevict/policy/leave_one_out.hpp) with
// the work spread over the block but every rounding in the host's order:
// logits and exp terms per row in parallel (history_logit, reproducible_exp),
// maxima by exact block reductions, each normaliser and numerator component
// summed by one thread in ascending position order, and each cached token's
// error by leave_one_out_error. So the scores, and the victims, are the
// host's bit for bit. It is an oracle: clarity over speed.
#include <cub/block/block_reduce.cuh>
#include <cuda_runtime.h>

#include <cstdint>

#include "kvevict/batch/inputs.hpp"
#include "kvevict/batch/state.hpp"
#include "kvevict/batch/status.hpp"
#include "kvevict/batch/step.hpp"
#include "kvevict/cuda/device_helpers.cuh"
#include "kvevict/dtype/convert.hpp"
#include "kvevict/kv_view.hpp"
#include "kvevict/policy/decode_rules.hpp"
#include "kvevict/policy/leave_one_out.hpp"

namespace kvevict {
namespace gpu {
namespace detail {

template <int BlockThreads, class Q, class T, class Layout>
__global__ void __launch_bounds__(BlockThreads)
    exact_greedy_kernel(batch_state_view st, active_set active, batch_queries<Q> in, kv_view<T, Layout> cache,
                        std::int32_t* victims, std::uint64_t* status) {
  using reduce_words = cub::BlockReduce<unsigned long long, BlockThreads>;
  using reduce_reals = cub::BlockReduce<double, BlockThreads>;
  using reduce_ints = cub::BlockReduce<std::int32_t, BlockThreads>;
  __shared__ union {
    typename reduce_words::TempStorage words;
    typename reduce_reals::TempStorage reals;
    typename reduce_ints::TempStorage ints;
  } temp;
  __shared__ unsigned long long shared_word;
  __shared__ std::int32_t newest, shared_victim, top_position;
  __shared__ double top_logit, rest_logit, evicted_logit, z[3];  // z: cached, rest, evicted

  const std::int32_t entry = static_cast<std::int32_t>(blockIdx.x) / st.num_heads();
  const std::int32_t h = static_cast<std::int32_t>(blockIdx.x) % st.num_heads();
  const std::int32_t b = entry_sequence(active, entry, st.num_seqs(), h, status);
  if (b < 0) return;
  const std::int32_t t = static_cast<std::int32_t>(threadIdx.x);
  const history_view& hv = st.history;
  const std::int64_t bh = st.head_index(b, h);
  const std::int32_t d = hv.head_dim, g = st.group_size(), length = st.slots.lengths[b], count = st.slots.counts[bh];
  const std::int32_t* positions = st.slots.positions_of(b, h);

  // ---- checks, before anything changes ----
  if (t == 0) {
    batch_code code = batch_code::ok;
    if (!st.appended[bh]) code = batch_code::not_appended;
    else if (length > hv.max_tokens) code = batch_code::history_full;
    else if (hv.rows[bh] != length - 1) code = batch_code::history_gap;
    shared_word = code == batch_code::ok ? batch_status_clear : pack_status(b, h, 0, code);
    newest = -1;
    shared_victim = -1;
  }
  __syncthreads();
  if (shared_word != batch_status_clear) {
    if (t == 0) give_up(bh, shared_word, victims, status);
    return;
  }
  // The host's order of checks: the queries, then the newest K/V row.
  unsigned long long problem = batch_status_clear;
  for (std::int32_t i = t; i < g * d; i += BlockThreads) {
    const std::int32_t q = h * g + i / d;
    if (classify_input(to_float(in.q(b, q, i % d)), false) != batch_code::ok)
      problem = minimum_of{}(problem, static_cast<unsigned long long>(pack_status(b, h, q, batch_code::non_finite_query)));
  }
  for (std::int32_t s = t; s < count; s += BlockThreads)
    if (positions[s] == length - 1) newest = s;
  problem = reduce_words(temp.words).Reduce(problem, minimum_of{});
  __syncthreads();  // every thread's search for `newest` is done
  if (t == 0)
    shared_word = newest < 0                               ? pack_status(b, h, 0, batch_code::history_gap)
                  : problem != batch_status_clear          ? problem
                  : !row_is_mapped(cache, b, newest)       ? pack_status(b, h, newest, batch_code::bad_page)
                                                           : batch_status_clear;
  __syncthreads();
  if (shared_word != batch_status_clear) {
    if (t == 0) give_up(bh, shared_word, victims, status);
    return;
  }
  const std::int32_t slot = newest;
  float* keys = hv.keys + bh * hv.max_tokens * d;
  float* values = hv.values + bh * hv.max_tokens * d;
  problem = batch_status_clear;
  for (std::int32_t i = t; i < d; i += BlockThreads) {
    const float k = to_float(cache.k_row(b, h, slot)[i]), v = to_float(cache.v_row(b, h, slot)[i]);
    if (classify_input(k, false) != batch_code::ok || classify_input(v, false) != batch_code::ok)
      problem = pack_status(b, h, slot, batch_code::non_finite_kv);
    keys[std::int64_t{length - 1} * d + i] = k;  // beyond rows: not state until the commit
    values[std::int64_t{length - 1} * d + i] = v;
  }
  problem = reduce_words(temp.words).Reduce(problem, minimum_of{});
  __syncthreads();  // everyone has read shared_word above before thread 0 rewrites it
  if (t == 0) shared_word = problem;
  __syncthreads();
  if (shared_word != batch_status_clear) {
    if (t == 0) give_up(bh, shared_word, victims, status);
    return;
  }

  // ---- the leave-one-out errors, query head by query head ----
  std::uint8_t* cached = hv.cached + bh * hv.max_tokens;
  double* logit = hv.work + bh * hv.work_doubles();
  double* term = logit + hv.max_tokens;         // exp in the frame of the row's set (G or X)
  double* rest_term = term + hv.max_tokens;     // exp in the frame of G without its top
  double* numerators = rest_term + hv.max_tokens;  // [3][d]: cached, rest, evicted
  double* errors = numerators + 3 * d;
  for (std::int32_t p = t; p < length; p += BlockThreads) cached[p] = 0;
  __syncthreads();
  for (std::int32_t s = t; s < count; s += BlockThreads) {
    cached[positions[s]] = 1;
    errors[s] = 0.0;
  }
  __syncthreads();
  const double minus_inf = -kvevict::detail::infinity();
  for (std::int32_t q = h * g; q < (h + 1) * g; ++q) {
    const Q* query = &in.q(b, q, 0);
    double top = minus_inf, evicted = minus_inf;
    for (std::int32_t p = t; p < length; p += BlockThreads) {
      logit[p] = history_logit(query, in.q.strides[2], keys + std::int64_t{p} * d, d, in.scale);
      if (cached[p]) top = maximum_of{}(top, logit[p]);
      else evicted = maximum_of{}(evicted, logit[p]);
    }
    top = reduce_reals(temp.reals).Reduce(top, maximum_of{});
    __syncthreads();
    evicted = reduce_reals(temp.reals).Reduce(evicted, maximum_of{});
    if (t == 0) {
      top_logit = top;
      evicted_logit = evicted;
    }
    __syncthreads();
    std::int32_t first = 0x7FFFFFFF;  // the oldest position holding the top logit
    for (std::int32_t p = t; p < length; p += BlockThreads)
      if (cached[p] && logit[p] == top_logit && p < first) first = p;
    first = reduce_ints(temp.ints).Reduce(first, minimum_of{});
    if (t == 0) top_position = first;
    __syncthreads();
    double rest = minus_inf;
    for (std::int32_t p = t; p < length; p += BlockThreads)
      if (cached[p] && p != top_position) rest = maximum_of{}(rest, logit[p]);
    rest = reduce_reals(temp.reals).Reduce(rest, maximum_of{});
    if (t == 0) rest_logit = rest;
    __syncthreads();
    for (std::int32_t p = t; p < length; p += BlockThreads) {
      const bool in_g = cached[p] != 0;
      term[p] = reproducible_exp(kvevict::detail::sub(logit[p], in_g ? top_logit : evicted_logit));
      rest_term[p] = in_g && p != top_position ? reproducible_exp(kvevict::detail::sub(logit[p], rest_logit)) : 0.0;
    }
    __syncthreads();
    // Each normaliser (i == d) and numerator component summed by one thread,
    // in ascending positions, as leave_one_out_errors does on the host.
    for (std::int32_t task = t; task < 3 * (d + 1); task += BlockThreads) {
      const std::int32_t set = task / (d + 1), i = task % (d + 1);
      double acc = 0.0;
      for (std::int32_t p = 0; p < length; ++p) {
        const bool in_g = cached[p] != 0;
        if (set == 0 ? !in_g : set == 1 ? (!in_g || p == top_position) : in_g) continue;
        const double e = set == 1 ? rest_term[p] : term[p];
        acc = kvevict::detail::add(acc, i == d ? e : kvevict::detail::mul(e, double(values[std::int64_t{p} * d + i])));
      }
      if (i < d) numerators[set * d + i] = acc;
      else z[set] = acc;
    }
    __syncthreads();
    leave_one_out_frames f;
    f.top_logit = top_logit;
    f.top = top_position;
    f.rest_logit = rest_logit;
    f.evicted_logit = evicted_logit;
    f.z_cached = z[0];
    f.z_rest = z[1];
    f.z_evicted = z[2];
    for (std::int32_t s = t; s < count; s += BlockThreads) {
      const std::int32_t v = positions[s];
      errors[s] = kvevict::detail::add(errors[s], leave_one_out_error(f, numerators, numerators + d, numerators + 2 * d,
                                                                       v, logit[v], values + std::int64_t{v} * d, d));
    }
    __syncthreads();
  }

  // ---- the scores, the victim, the commit ----
  float* updated = st.spare_scores_of(b, h);
  unsigned long long best = ~0ull;
  std::int32_t best_slot = -1;
  for (std::int32_t s = t; s < count; s += BlockThreads) {
    const float score = static_cast<float>(errors[s]);
    updated[s] = score;
    if (st.rule.protect.covers(positions[s], length)) continue;
    const unsigned long long key = st.rule.key(score, positions[s]);
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
