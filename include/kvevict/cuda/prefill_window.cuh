#pragma once
// Batched SnapKV prefill on CUDA: the calls of kvevict/batch/prefill_window.hpp
// with the same results. Scoring is two steps over the workspace: the window
// sums of every (entry, query head, column), a thread per column reading
// each window row across consecutive columns (coalesced), then a thread per
// (entry, KV head, column) pooling its neighbours' sums and folding the
// group (snapkv.hpp's code). Keep set, selection and compaction are every
// prefill's (prefill.cuh), with the window protected.
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kvevict/batch/prefill_rules.hpp"
#include "kvevict/batch/prefill_window.hpp"
#include "kvevict/batch/state.hpp"
#include "kvevict/batch/status.hpp"
#include "kvevict/cuda/device_helpers.cuh"
#include "kvevict/cuda/prefill.cuh"
#include "kvevict/cuda/prefill_scores.cuh"
#include "kvevict/cuda/prefill_workspace.cuh"
#include "kvevict/cuda/query_tile.cuh"
#include "kvevict/kv_view.hpp"
#include "kvevict/policy/snapkv.hpp"

namespace kvevict {
namespace gpu {
namespace detail {

/// Window sums from a matrix-like source (probs, logits + LSE).
/// blockIdx.x = pair * tiles + tile with pair = entry * Hq + q.
template <int Threads, class Source>
__global__ void __launch_bounds__(Threads)
    prefill_window_sums_kernel(batch_state_view st, active_set active, prompt_lengths prompts, Source source,
                               std::int32_t window, prefill_workspace ws, std::int32_t tiles, std::uint64_t* status) {
  const prefill_tile at(st, active, prompts, ws, tiles, true);
  if (at.b < 0) return;
  const std::int32_t pair = at.unit, entry = at.entry, q = at.q, h = at.h, b = at.b, length = at.length;
  const std::int32_t p = at.tile * Threads + static_cast<std::int32_t>(threadIdx.x);
  if (p >= length) return;  // no barrier in this kernel
  batch_code code = batch_code::ok;
  ws.partials[std::int64_t{pair} * ws.per_pair + p] = kvevict::detail::window_column_sum(
      p, length, window, st.rule.decay, [&](std::int32_t i) { return source.value(b, q, length, i, p); }, code);
  if (code != batch_code::ok) {
    report(status, pack_status(b, h, p, code));
    mark_bad(ws, entry);
  }
}

/// Window sums from the window rows' queries + LSE and the cached keys: a
/// thread per key of a tile of kPrefillKeys, the keys and 16 query rows at
/// a time in shared memory (query_tile_layout). The same grid with
/// kPrefillKeys columns per tile.
template <int Threads, class Q, class T, class Layout>
__global__ void __launch_bounds__(Threads)
    prefill_window_query_sums_kernel(batch_state_view st, active_set active, prompt_lengths prompts,
                                     batch_window_queries<Q> in, kv_view<T, Layout> cache, prefill_workspace ws,
                                     std::int32_t tiles, std::uint64_t* status) {
  static_assert(Threads == kPrefillKeys, "a thread per key of the tile");
  extern __shared__ __align__(16) unsigned char tile_memory[];
  query_tile<Threads, Q, T> tile_of(tile_memory, cache.head_dim);
  const std::int32_t window = in.snap.window;

  const prefill_tile at(st, active, prompts, ws, tiles, true);
  if (at.b < 0) return;  // the whole block
  const std::int32_t pair = at.unit, entry = at.entry, q = at.q, h = at.h, b = at.b, length = at.length;
  const std::int32_t first = at.tile * Threads;
  if (first >= length) return;  // the whole block
  const std::int32_t t = static_cast<std::int32_t>(threadIdx.x), p = first + t;
  tile_of.stage_keys(cache, b, h, first, length - first < Threads ? length - first : Threads, t);
  const std::int32_t row0 = length - window;  // prompt row of window row 0 (the prompt holds the window: prepare)
  prefill_accumulator acc;                    // snap_column_sum's order: rows ascending from max(p, row0)
  batch_code code = batch_code::ok;
  for (std::int32_t r0 = 0; r0 < window; r0 += kPrefillQueryRows) {
    const std::int32_t rows = window - r0 < kPrefillQueryRows ? window - r0 : kPrefillQueryRows;
    __syncthreads();  // the keys are in; the previous rows are no longer read
    tile_of.stage_rows(
        rows, t, [&](std::int32_t r, std::int32_t e) { return in.q(b, q, r0 + r, e); },
        [&](std::int32_t r) { return in.lse(b, q, r0 + r); });
    __syncthreads();
    if (p < length)
      for (std::int32_t r = 0; r < rows; ++r) {
        const std::int32_t i = row0 + r0 + r;
        if (i < p) continue;
        const float x = kvevict::detail::prefill_query_value(tile_of.query_row(r), 1, tile_of.key_of(t),
                                                             cache.k_scale(h), tile_of.d, in.scale, tile_of.lse[r],
                                                             in.base);
        code = kvevict::detail::lower_code(code, classify_input(x, true));
        acc.add(decayed_row(st.rule.decay, length, i, x));
      }
  }
  if (p >= length) return;
  if (code == batch_code::ok && classify_input(acc.sum, false) != batch_code::ok) code = batch_code::score_overflow;
  ws.partials[std::int64_t{pair} * ws.per_pair + p] = acc.sum;
  if (code != batch_code::ok) {
    report(status, pack_status(b, h, p, code));
    mark_bad(ws, entry);
  }
}

/// A thread per (entry, KV head, column): pools the group's window sums and
/// folds them (fold_window_column). blockIdx.x = segment * tiles + tile.
template <int Threads>
__global__ void __launch_bounds__(Threads)
    prefill_window_pool_kernel(batch_state_view st, active_set active, prompt_lengths prompts, snap_window snap,
                               prefill_workspace ws, std::int32_t tiles, std::uint64_t* status) {
  const prefill_tile at(st, active, prompts, ws, tiles, false);
  if (at.b < 0) return;
  const std::int32_t segment = at.unit, entry = at.entry, h = at.h, b = at.b, length = at.length, g = st.group_size();
  const std::int32_t p = at.tile * Threads + static_cast<std::int32_t>(threadIdx.x);
  if (p >= length) return;
  const float* group = ws.partials + (std::int64_t{entry} * st.num_q_heads + std::int64_t{h} * g) * ws.per_pair;
  const slot_increment inc = kvevict::detail::fold_window_column(
      snap, p, length, h * g, g, st.rule.reduce,
      [&](std::int32_t q, std::int32_t j) { return group[std::int64_t{q - h * g} * ws.per_pair + j]; });
  ws.scores[std::int64_t{segment} * ws.max_length + p] = inc.value;
  if (inc.code != batch_code::ok) {
    report(status, pack_status(b, h, p, inc.code));
    mark_bad(ws, entry);
  }
}

inline cudaError_t launch_window_pool(const prefill_launch& l, const snap_window& snap) {
  const std::int32_t tiles = tiles_of(l.prompts.max_length, kPrefillColumns);
  const std::int64_t blocks = std::int64_t{l.entries} * l.st.num_heads() * tiles;
  prefill_window_pool_kernel<kPrefillColumns><<<static_cast<unsigned>(blocks), kPrefillColumns, 0, l.stream>>>(
      l.st, l.active, l.prompts, snap, l.ws, tiles, l.status);
  return cudaGetLastError();
}

/// The scoring step of probs and logits + LSE: a window sum per (entry,
/// query head, column) in the partials, then the pool.
template <class Source>
struct scoring_window {
  static constexpr bool has_scores = true;
  Source source;
  snap_window snap;

  static std::int64_t per_pair(std::int32_t max_length) { return max_length; }
  void require_grid(const kvevict::detail::site& w, std::int64_t entries, const batch_state_view& st,
                    std::int32_t max_length) const {
    require_blocks(w, entries * st.num_q_heads * tiles_of(max_length, kPrefillColumns));
    require_blocks(w, entries * st.num_heads() * tiles_of(max_length, kPrefillColumns));
  }
  cudaError_t launch(const prefill_launch& l) const {
    const std::int32_t tiles = tiles_of(l.prompts.max_length, kPrefillColumns);
    const std::int64_t blocks = std::int64_t{l.entries} * l.st.num_q_heads * tiles;
    prefill_window_sums_kernel<kPrefillColumns, Source><<<static_cast<unsigned>(blocks), kPrefillColumns, 0, l.stream>>>(
        l.st, l.active, l.prompts, source, snap.window, l.ws, tiles, l.status);
    const cudaError_t e = cudaGetLastError();
    return e == cudaSuccess ? launch_window_pool(l, snap) : e;
  }
};

template <class Q, class T, class Layout>
struct scoring_window_queries {
  static constexpr bool has_scores = true;
  batch_window_queries<Q> in;
  kv_view<T, Layout> cache;

  static std::int64_t per_pair(std::int32_t max_length) { return max_length; }
  void require_grid(const kvevict::detail::site& w, std::int64_t entries, const batch_state_view& st,
                    std::int32_t max_length) const {
    require_blocks(w, entries * st.num_q_heads * tiles_of(max_length, kPrefillKeys));
    require_blocks(w, entries * st.num_heads() * tiles_of(max_length, kPrefillColumns));
    require_query_tile<Q, T>(w, cache.head_dim);
  }
  cudaError_t launch(const prefill_launch& l) const {
    const std::int32_t tiles = tiles_of(l.prompts.max_length, kPrefillKeys);
    const std::int64_t blocks = std::int64_t{l.entries} * l.st.num_q_heads * tiles;
    const std::size_t shared = query_tile_layout<Q, T>(cache.head_dim).total();
    const auto kernel = prefill_window_query_sums_kernel<kPrefillKeys, Q, T, Layout>;
    cudaError_t e = opt_in_shared(kernel, shared);
    if (e != cudaSuccess) return e;
    kernel<<<static_cast<unsigned>(blocks), kPrefillKeys, shared, l.stream>>>(l.st, l.active, l.prompts, in, cache,
                                                                            l.ws, tiles, l.status);
    e = cudaGetLastError();
    return e == cudaSuccess ? launch_window_pool(l, in.snap) : e;
  }
};

/// The whole call with the window protected (snap_keep_rule).
template <class Scoring, class Rows, class T, class Layout>
cudaError_t run_window_prefill(const kvevict::detail::site& w, void* workspace, std::size_t& workspace_bytes,
                               const batch_state_view& st, const active_set& active, const prompt_lengths& prompts,
                               const snap_window& snap, const Scoring& scoring, Rows rows,
                               const kv_view<T, Layout>& cache, std::int32_t* reclaimable, std::uint64_t* status,
                               cudaStream_t stream) {
  batch_state_view keep = st;
  keep.rule = snap_keep_rule(st.rule, snap);
  return run_prefill<true>(w, workspace, workspace_bytes, keep, active, prompts, scoring,
                           kvevict::detail::prefill_window_checks<T, Layout, Rows>{cache, rows, snap.window,
                                                                                   st.group_size()},
                           cache, reclaimable, status, stream);
}

}  // namespace detail

/// SnapKV prefill compression of every active sequence from the
/// probabilities of its last in.snap.window prompt rows (device memory);
/// the kept rows of `cache` move to slots [0, kept). The same results as
/// kvevict::batched_prefill on the host (kvevict/batch/prefill_window.hpp).
/// workspace == nullptr: only sets workspace_bytes.
template <class T, class Layout>
cudaError_t batched_prefill(void* workspace, std::size_t& workspace_bytes, const batch_state_view& st,
                            const active_set& active, const prompt_lengths& prompts, const batch_window_probs& in,
                            const kv_view<T, Layout>& cache, std::int32_t* reclaimable_pages, std::uint64_t* status,
                            cudaStream_t stream) {
  const kvevict::detail::site w{"cuda", "prefill"};
  kvevict::detail::require_prefill_call(w, st, active, prompts, status);
  kvevict::detail::require_cache(w, st, cache);
  kvevict::detail::require_window_input(w, st, prompts, in);
  using source = kvevict::detail::window_probs_source;
  return detail::run_window_prefill(w, workspace, workspace_bytes, st, active, prompts, in.snap,
                                    detail::scoring_window<source>{source{in}, in.snap},
                                    kvevict::detail::window_no_row_checks{}, cache, reclaimable_pages, status, stream);
}

/// The same from the window rows' logits and LSE.
template <class T, class Layout>
cudaError_t batched_prefill(void* workspace, std::size_t& workspace_bytes, const batch_state_view& st,
                            const active_set& active, const prompt_lengths& prompts, const batch_window_logits& in,
                            const kv_view<T, Layout>& cache, std::int32_t* reclaimable_pages, std::uint64_t* status,
                            cudaStream_t stream) {
  const kvevict::detail::site w{"cuda", "prefill"};
  kvevict::detail::require_prefill_call(w, st, active, prompts, status);
  kvevict::detail::require_cache(w, st, cache);
  kvevict::detail::require_window_input(w, st, prompts, in);
  using source = kvevict::detail::window_logits_source;
  return detail::run_window_prefill(w, workspace, workspace_bytes, st, active, prompts, in.snap,
                                    detail::scoring_window<source>{source{in}, in.snap},
                                    kvevict::detail::window_lse_checks{in.lse}, cache, reclaimable_pages, status,
                                    stream);
}

/// The same from the window rows' queries and LSE, the probabilities
/// recomputed from the keys in slots [0, L) of `cache` (shared memory as
/// the full prefill's queries path).
template <class Q, class T, class Layout>
cudaError_t batched_prefill(void* workspace, std::size_t& workspace_bytes, const batch_state_view& st,
                            const active_set& active, const prompt_lengths& prompts,
                            const batch_window_queries<Q>& in, const kv_view<T, Layout>& cache,
                            std::int32_t* reclaimable_pages, std::uint64_t* status, cudaStream_t stream) {
  const kvevict::detail::site w{"cuda", "prefill"};
  kvevict::detail::require_prefill_call(w, st, active, prompts, status);
  kvevict::detail::require_cache(w, st, cache);
  kvevict::detail::require_window_input(w, st, prompts, in, cache);
  return detail::run_window_prefill(w, workspace, workspace_bytes, st, active, prompts, in.snap,
                                    detail::scoring_window_queries<Q, T, Layout>{in, cache},
                                    kvevict::detail::window_query_checks<Q>{in, cache.head_dim}, cache,
                                    reclaimable_pages, status, stream);
}

}  // namespace gpu
}  // namespace kvevict
