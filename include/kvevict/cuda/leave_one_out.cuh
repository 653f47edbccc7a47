#pragma once
// exact_greedy's leave-one-out errors on CUDA for one (sequence, KV head),
// computed by a whole block: the scoring that observe + evict
// (exact_greedy.cuh) runs once per step and the greedy evict_to
// (multi_token.cuh) once per victim. It runs the host's computation
// (kvevict/policy/leave_one_out.hpp, called by the host backend's
// group_leave_one_out) with the work spread over the block but every
// rounding in the host's order: logits and exp terms per row in parallel
// (history_logit, reproducible_exp), maxima by exact block reductions, each
// normaliser and numerator component summed by one thread in ascending
// position order, and each cached token's error by leave_one_out_error,
// summed over the group's query heads in ascending order. So the errors are
// the host's bit for bit. It is an oracle: clarity over speed. Also here:
// the check of the query rows both calls make first.
#include <cub/block/block_reduce.cuh>
#include <cuda_runtime.h>

#include <cstdint>

#include "kvevict/batch/inputs.hpp"
#include "kvevict/batch/state.hpp"
#include "kvevict/batch/status.hpp"
#include "kvevict/cuda/device_helpers.cuh"
#include "kvevict/detail/reproducible_math.hpp"
#include "kvevict/dtype/convert.hpp"
#include "kvevict/policy/decode_rules.hpp"
#include "kvevict/policy/leave_one_out.hpp"

namespace kvevict {
namespace gpu {
namespace detail {

/// Shared memory of block_leave_one_out_errors; the caller declares it
/// __shared__.
template <int BlockThreads>
struct leave_one_out_storage {
  union {
    typename cub::BlockReduce<double, BlockThreads>::TempStorage reals;
    typename cub::BlockReduce<std::int32_t, BlockThreads>::TempStorage ints;
  } temp;
  double top_logit, rest_logit, evicted_logit;
  double z[3];  // normalisers: cached, rest (cached without the top token), evicted
  std::int32_t top_position;
};

/// Where (b, h)'s errors land, one double per slot: the tail of its history
/// work, after logits, two exp terms per row and three numerators (the host
/// backend uses the same tail).
__device__ inline double* leave_one_out_slot_errors(const history_view& hv, std::int64_t bh) {
  return hv.work + (bh + 1) * hv.work_doubles() - hv.capacity;
}

/// The first non-finite element of group h's query rows, as the lowest
/// non_finite_query word over the block (batch_status_clear if none). Every
/// thread calls it; ends before a barrier the caller places.
template <int BlockThreads, class Q>
__device__ unsigned long long block_query_problem(
    typename cub::BlockReduce<unsigned long long, BlockThreads>::TempStorage& temp, const batch_queries<Q>& in,
    std::int32_t b, std::int32_t h, std::int32_t g, std::int32_t d) {
  unsigned long long problem = batch_status_clear;
  for (std::int32_t i = static_cast<std::int32_t>(threadIdx.x); i < g * d; i += BlockThreads) {
    const std::int32_t q = h * g + i / d;
    if (classify_input(to_float(in.q(b, q, i % d)), false) != batch_code::ok)
      problem = minimum_of{}(problem, static_cast<unsigned long long>(pack_status(b, h, q, batch_code::non_finite_query)));
  }
  return cub::BlockReduce<unsigned long long, BlockThreads>(temp).Reduce(problem, minimum_of{});
}

/// errors[s] = the leave-one-out error of the token in slot s, for every
/// occupied slot s < width of (b, h), for the query rows of group h (summed
/// in ascending query-head order), against history rows [0, length); the
/// occupied slots are exactly the cached set. Every thread of the block
/// calls it; it starts and ends with a barrier, so history rows the block
/// just wrote are visible and the errors are ready on return.
template <int BlockThreads, class Q>
__device__ void block_leave_one_out_errors(leave_one_out_storage<BlockThreads>& sh, const batch_state_view& st,
                                           std::int32_t b, std::int32_t h, const batch_queries<Q>& in,
                                           std::int32_t width, std::int32_t length, double* errors) {
  using reduce_reals = cub::BlockReduce<double, BlockThreads>;
  using reduce_ints = cub::BlockReduce<std::int32_t, BlockThreads>;
  using kvevict::detail::add;
  using kvevict::detail::mul;
  using kvevict::detail::sub;
  const std::int32_t t = static_cast<std::int32_t>(threadIdx.x);
  const history_view& hv = st.history;
  const std::int64_t bh = st.head_index(b, h);
  const std::int32_t d = hv.head_dim, g = st.group_size();
  const std::int32_t* positions = st.slots.positions_of(b, h);
  const float* keys = hv.keys + bh * hv.max_tokens * d;
  const float* values = hv.values + bh * hv.max_tokens * d;
  std::uint8_t* cached = hv.cached + bh * hv.max_tokens;
  double* logit = hv.work + bh * hv.work_doubles();
  double* term = logit + hv.max_tokens;             // exp in the frame of the row's set (G or X)
  double* rest_term = term + hv.max_tokens;         // exp in the frame of G without its top
  double* numerators = rest_term + hv.max_tokens;   // [3][d]: cached, rest, evicted

  __syncthreads();  // the caller's history writes and reads of the previous errors are done
  for (std::int32_t p = t; p < length; p += BlockThreads) cached[p] = 0;
  __syncthreads();
  for (std::int32_t s = t; s < width; s += BlockThreads)
    if (positions[s] >= 0) {
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
    top = reduce_reals(sh.temp.reals).Reduce(top, maximum_of{});
    __syncthreads();
    evicted = reduce_reals(sh.temp.reals).Reduce(evicted, maximum_of{});
    if (t == 0) {
      sh.top_logit = top;
      sh.evicted_logit = evicted;
    }
    __syncthreads();
    std::int32_t first = 0x7FFFFFFF;  // the oldest position holding the top logit
    for (std::int32_t p = t; p < length; p += BlockThreads)
      if (cached[p] && logit[p] == sh.top_logit && p < first) first = p;
    first = reduce_ints(sh.temp.ints).Reduce(first, minimum_of{});
    if (t == 0) sh.top_position = first;
    __syncthreads();
    double rest = minus_inf;
    for (std::int32_t p = t; p < length; p += BlockThreads)
      if (cached[p] && p != sh.top_position) rest = maximum_of{}(rest, logit[p]);
    rest = reduce_reals(sh.temp.reals).Reduce(rest, maximum_of{});
    if (t == 0) sh.rest_logit = rest;
    __syncthreads();
    for (std::int32_t p = t; p < length; p += BlockThreads) {
      const bool in_g = cached[p] != 0;
      term[p] = reproducible_exp(sub(logit[p], in_g ? sh.top_logit : sh.evicted_logit));
      rest_term[p] = in_g && p != sh.top_position ? reproducible_exp(sub(logit[p], sh.rest_logit)) : 0.0;
    }
    __syncthreads();
    // Each normaliser (i == d) and numerator component summed by one thread,
    // in ascending positions, as leave_one_out_errors does on the host.
    for (std::int32_t task = t; task < 3 * (d + 1); task += BlockThreads) {
      const std::int32_t set = task / (d + 1), i = task % (d + 1);
      double acc = 0.0;
      for (std::int32_t p = 0; p < length; ++p) {
        const bool in_g = cached[p] != 0;
        if (set == 0 ? !in_g : set == 1 ? (!in_g || p == sh.top_position) : in_g) continue;
        const double e = set == 1 ? rest_term[p] : term[p];
        acc = add(acc, i == d ? e : mul(e, double(values[std::int64_t{p} * d + i])));
      }
      if (i < d) numerators[set * d + i] = acc;
      else sh.z[set] = acc;
    }
    __syncthreads();
    leave_one_out_frames f;
    f.top_logit = sh.top_logit;
    f.top = sh.top_position;
    f.rest_logit = sh.rest_logit;
    f.evicted_logit = sh.evicted_logit;
    f.z_cached = sh.z[0];
    f.z_rest = sh.z[1];
    f.z_evicted = sh.z[2];
    for (std::int32_t s = t; s < width; s += BlockThreads) {
      const std::int32_t v = positions[s];
      if (v < 0) continue;
      errors[s] = add(errors[s], leave_one_out_error(f, numerators, numerators + d, numerators + 2 * d, v, logit[v],
                                                     values + std::int64_t{v} * d, d));
    }
    __syncthreads();
  }
}

}  // namespace detail
}  // namespace gpu
}  // namespace kvevict
