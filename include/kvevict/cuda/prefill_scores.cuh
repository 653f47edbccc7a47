#pragma once
// Steps 1 and 2 of a batched prefill call on CUDA (cuda/prefill.cuh): the
// per-(entry, head) checks, then the prefill scores per input kind, in the
// canonical column-sum order of policy/column_sums.hpp.
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kvevict/batch/inputs.hpp"
#include "kvevict/batch/prefill_rules.hpp"
#include "kvevict/batch/score_sources.hpp"
#include "kvevict/batch/state.hpp"
#include "kvevict/batch/status.hpp"
#include "kvevict/cuda/device_helpers.cuh"
#include "kvevict/cuda/prefill_workspace.cuh"
#include "kvevict/cuda/query_tile.cuh"
#include "kvevict/kv_view.hpp"
#include "kvevict/policy/column_sums.hpp"
#include "kvevict/policy/decode_rules.hpp"

namespace kvevict {
namespace gpu {
namespace detail {

// ---- 1. prepare ----

template <int Threads, class Checks>
__global__ void __launch_bounds__(Threads)
    prefill_prepare_kernel(batch_state_view st, active_set active, prompt_lengths prompts, Checks checks,
                           prefill_workspace ws, std::uint64_t* status) {
  __shared__ unsigned long long sequence_word, head_word;
  __shared__ std::int32_t first_unmapped;
  const std::int32_t entry = static_cast<std::int32_t>(blockIdx.x) / st.num_heads();
  const std::int32_t h = static_cast<std::int32_t>(blockIdx.x) % st.num_heads();
  const std::int32_t b = entry_sequence(active, entry, st.num_seqs(), h, status);  // reports a bad list entry once
  if (b < 0) return;  // the whole block
  const std::int32_t t = static_cast<std::int32_t>(threadIdx.x);
  const std::int32_t length = prompts.lengths[b];
  if (t == 0) {
    sequence_word = kvevict::detail::prefill_length_problem(st, b, length, prompts.max_length);
    head_word = batch_status_clear;
    first_unmapped = kvevict::detail::prefill_no_slot;
  }
  __syncthreads();
  if (sequence_word == batch_status_clear) {
    const std::int32_t slot = checks.first_unmapped(b, length, t, Threads);
    if (slot != kvevict::detail::prefill_no_slot) atomicMin(&first_unmapped, slot);
  }
  __syncthreads();
  // Every thread derives the sequence's word from the shared values, which
  // no thread writes again (a write by thread 0 here would race with the
  // other threads' reads: racecheck saw it on an H100).
  const unsigned long long sequence_problem =
      sequence_word != batch_status_clear || first_unmapped == kvevict::detail::prefill_no_slot
          ? sequence_word
          : static_cast<unsigned long long>(pack_status(b, 0, first_unmapped, batch_code::bad_page));
  if (sequence_problem == batch_status_clear) {  // the head's own checks, only for a sound sequence
    const unsigned long long found = checks.head_problem(b, h, length, t, Threads);
    if (found != batch_status_clear) atomicMin(&head_word, found);
  }
  __syncthreads();
  if (t == 0) {
    const bool sequence_ok = sequence_problem == batch_status_clear;
    const unsigned long long word = sequence_ok ? head_word : sequence_problem;
    ws.head_refused[std::int64_t{entry} * st.num_heads() + h] = word != batch_status_clear ? 1 : 0;
    if (word != batch_status_clear) {
      if (sequence_ok || h == 0) report(status, word);  // a sequence's word once (all its heads refuse it)
      mark_bad(ws, entry);
    }
    if (h == 0) ws.streams[entry] = st.streams ? st.streams[b] : static_cast<std::uint64_t>(b);
  }
}

// ---- 2. scores ----

/// Chunk partials from the causal matrix. blockIdx.x = pair * tiles + tile
/// with pair = entry * Hq + q; blockIdx.y strides over the chunks.
template <int Threads>
__global__ void __launch_bounds__(Threads)
    prefill_probs_partials_kernel(batch_state_view st, active_set active, prompt_lengths prompts,
                                  batch_prefill_probs in, prefill_workspace ws, std::int32_t tiles,
                                  std::uint64_t* status) {
  const prefill_tile at(st, active, prompts, ws, tiles, true);
  if (at.b < 0) return;
  const std::int32_t pair = at.unit, entry = at.entry, q = at.q, h = at.h, b = at.b, length = at.length;
  const std::int32_t p = at.tile * Threads + static_cast<std::int32_t>(threadIdx.x);
  if (p >= length) return;  // no barrier in this kernel: threads leave on their own
  float* partials = ws.partials + std::int64_t{pair} * ws.per_pair;
  for (std::int32_t chunk = static_cast<std::int32_t>(blockIdx.y); chunk < prefill_chunks(length);
       chunk += static_cast<std::int32_t>(gridDim.y)) {
    if (prefill_chunk_range(p, chunk, length).empty()) continue;
    batch_code code = batch_code::ok;
    const float partial = prefill_chunk_partial(p, chunk, length, [&](std::int32_t i) {
      const float x = in.probs(b, q, i, p);  // row i: consecutive threads read consecutive columns
      code = kvevict::detail::lower_code(code, classify_input(x, true));
      return decayed_row(st.rule.decay, length, i, x);
    });
    partials[partial_offset(chunk) + p] = partial;
    if (code != batch_code::ok) {
      report(status, pack_status(b, h, p, code));
      mark_bad(ws, entry);
    }
  }
}

/// Chunk partials from queries + LSE and the cached keys; the same grid as
/// the probs kernel with kPrefillKeys columns per tile.
template <int Threads, class Q, class T, class Layout>
__global__ void __launch_bounds__(Threads)
    prefill_query_partials_kernel(batch_state_view st, active_set active, prompt_lengths prompts,
                                  batch_prefill_queries<Q> in, kv_view<T, Layout> cache, prefill_workspace ws,
                                  std::int32_t tiles, std::uint64_t* status) {
  static_assert(Threads == kPrefillKeys, "a thread per key of the tile");
  extern __shared__ __align__(16) unsigned char tile_memory[];
  query_tile<Threads, Q, T> tile_of(tile_memory, cache.head_dim);

  const prefill_tile at(st, active, prompts, ws, tiles, true);
  if (at.b < 0) return;  // the whole block
  const std::int32_t pair = at.unit, entry = at.entry, q = at.q, h = at.h, b = at.b, length = at.length;
  const std::int32_t first = at.tile * Threads;
  if (first >= length) return;  // the whole block
  const std::int32_t t = static_cast<std::int32_t>(threadIdx.x), p = first + t;
  tile_of.stage_keys(cache, b, h, first, length - first < Threads ? length - first : Threads, t);
  const float key_scale = cache.k_scale(h);  // checked good by prepare
  float* partials = ws.partials + std::int64_t{pair} * ws.per_pair;
  for (std::int32_t chunk = static_cast<std::int32_t>(blockIdx.y); chunk < prefill_chunks(length);
       chunk += static_cast<std::int32_t>(gridDim.y)) {
    const std::int32_t chunk_first = chunk * prefill_chunk_rows;
    const std::int32_t chunk_end = chunk_first + prefill_chunk_rows < length ? chunk_first + prefill_chunk_rows : length;
    if (chunk_end <= first) continue;  // every row lies above the tile's columns: the whole block
    prefill_accumulator acc;           // this thread's partial, rows in ascending order
    batch_code code = batch_code::ok;
    for (std::int32_t r0 = chunk_first > first ? chunk_first : first; r0 < chunk_end; r0 += kPrefillQueryRows) {
      const std::int32_t rows = chunk_end - r0 < kPrefillQueryRows ? chunk_end - r0 : kPrefillQueryRows;
      __syncthreads();  // the keys are in; the previous rows are no longer read
      tile_of.stage_rows(
          rows, t, [&](std::int32_t r, std::int32_t e) { return in.q(b, q, r0 + r, e); },
          [&](std::int32_t r) { return in.lse(b, q, r0 + r); });
      __syncthreads();
      if (p < length)
        for (std::int32_t r = 0; r < rows; ++r) {
          if (r0 + r < p) continue;
          const float x = kvevict::detail::prefill_query_value(tile_of.query_row(r), 1, tile_of.key_of(t), key_scale,
                                                               tile_of.d, in.scale, tile_of.lse[r], in.base);
          code = kvevict::detail::lower_code(code, classify_input(x, true));
          acc.add(decayed_row(st.rule.decay, length, r0 + r, x));
        }
    }
    if (p < length && acc.started) {
      partials[partial_offset(chunk) + p] = acc.sum;
      if (code != batch_code::ok) {
        report(status, pack_status(b, h, p, code));
        mark_bad(ws, entry);
      }
    }
  }
}

/// A thread per (entry, head, column): the column total of each query head
/// from its partials, folded over the group. blockIdx.x = segment * tiles + tile.
template <int Threads>
__global__ void __launch_bounds__(Threads)
    prefill_combine_kernel(batch_state_view st, active_set active, prompt_lengths prompts, prefill_workspace ws,
                           std::int32_t tiles, std::uint64_t* status) {
  const prefill_tile at(st, active, prompts, ws, tiles, false);
  if (at.b < 0) return;
  const std::int32_t segment = at.unit, entry = at.entry, h = at.h, b = at.b, length = at.length, g = st.group_size();
  const std::int32_t p = at.tile * Threads + static_cast<std::int32_t>(threadIdx.x);
  if (p >= length) return;
  const float* group = ws.partials + (std::int64_t{entry} * st.num_q_heads + std::int64_t{h} * g) * ws.per_pair;
  const slot_increment inc = kvevict::detail::fold_prefill_column(h * g, g, st.rule.reduce, [&](std::int32_t q) {
    const float* part = group + std::int64_t{q - h * g} * ws.per_pair;
    return prefill_combine_chunks(p, length, [&](std::int32_t c) { return part[partial_offset(c) + p]; });
  });
  ws.scores[std::int64_t{segment} * ws.max_length + p] = inc.value;
  if (inc.code != batch_code::ok) {
    report(status, pack_status(b, h, p, inc.code));
    mark_bad(ws, entry);
  }
}

/// The same from column sums the engine computed: elements checked here.
template <int Threads>
__global__ void __launch_bounds__(Threads)
    prefill_sums_kernel(batch_state_view st, active_set active, prompt_lengths prompts, batch_prefill_sums in,
                        prefill_workspace ws, std::int32_t tiles, std::uint64_t* status) {
  const prefill_tile at(st, active, prompts, ws, tiles, false);
  if (at.b < 0) return;
  const std::int32_t segment = at.unit, entry = at.entry, h = at.h, b = at.b, g = st.group_size();
  const std::int32_t p = at.tile * Threads + static_cast<std::int32_t>(threadIdx.x);
  if (p >= at.length) return;
  batch_code code = batch_code::ok;
  for (std::int32_t q = h * g; q < (h + 1) * g; ++q)
    code = kvevict::detail::lower_code(code, classify_input(in.sums(b, q, p), true));
  const slot_increment inc = kvevict::detail::fold_prefill_column(
      h * g, g, st.rule.reduce, [&](std::int32_t q) { return in.sums(b, q, p); });
  ws.scores[std::int64_t{segment} * ws.max_length + p] = inc.value;
  code = kvevict::detail::lower_code(code, inc.code);
  if (code != batch_code::ok) {
    report(status, pack_status(b, h, p, code));
    mark_bad(ws, entry);
  }
}

/// Key norms: a thread per (entry, head, position), the decode source's
/// rule (score_source<key_norms>) on the key in slot p.
template <int Threads, class T, class Layout>
__global__ void __launch_bounds__(Threads)
    prefill_key_norms_kernel(batch_state_view st, active_set active, prompt_lengths prompts, key_norms<T, Layout> in,
                             prefill_workspace ws, std::int32_t tiles, std::uint64_t* status) {
  const prefill_tile at(st, active, prompts, ws, tiles, false);
  if (at.b < 0) return;
  const std::int32_t segment = at.unit, entry = at.entry, h = at.h, b = at.b;
  const std::int32_t p = at.tile * Threads + static_cast<std::int32_t>(threadIdx.x);
  if (p >= at.length) return;
  const slot_increment inc = score_source<key_norms<T, Layout>>{in, st.group_size(), st.rule.reduce}.increment(b, h, p);
  ws.scores[std::int64_t{segment} * ws.max_length + p] = inc.value;
  if (inc.code != batch_code::ok) {
    report(status, pack_status(b, h, p, inc.code));
    mark_bad(ws, entry);
  }
}

// ---- the scoring step per input ----

struct scoring_none {
  static constexpr bool has_scores = false;
  static std::int64_t per_pair(std::int32_t) { return 0; }
  cudaError_t launch(const prefill_launch&) const { return cudaSuccess; }
  void require_grid(const kvevict::detail::site&, std::int64_t, const batch_state_view&, std::int32_t) const {}
};

/// The combine step of probs and queries: a thread per (entry, head, column).
inline cudaError_t launch_combine(const prefill_launch& l) {
  const std::int32_t tiles = tiles_of(l.prompts.max_length, kPrefillColumns);
  const std::int64_t blocks = std::int64_t{l.entries} * l.st.num_heads() * tiles;
  prefill_combine_kernel<kPrefillColumns><<<static_cast<unsigned>(blocks), kPrefillColumns, 0, l.stream>>>(
      l.st, l.active, l.prompts, l.ws, tiles, l.status);
  return cudaGetLastError();
}

inline dim3 partials_grid(std::int64_t blocks, std::int32_t max_length) {
  const unsigned chunks = static_cast<unsigned>(prefill_chunks(max_length));
  return dim3(static_cast<unsigned>(blocks), chunks < kMaxGridY ? chunks : kMaxGridY, 1);
}

struct scoring_probs {
  static constexpr bool has_scores = true;
  static std::int64_t per_pair(std::int32_t max_length) { return partials_per_pair(max_length); }
  batch_prefill_probs in;

  void require_grid(const kvevict::detail::site& w, std::int64_t entries, const batch_state_view& st,
                    std::int32_t max_length) const {
    require_blocks(w, entries * st.num_q_heads * tiles_of(max_length, kPrefillColumns));
    require_blocks(w, entries * st.num_heads() * tiles_of(max_length, kPrefillColumns));
  }
  cudaError_t launch(const prefill_launch& l) const {
    const std::int32_t tiles = tiles_of(l.prompts.max_length, kPrefillColumns);
    const std::int64_t blocks = std::int64_t{l.entries} * l.st.num_q_heads * tiles;
    prefill_probs_partials_kernel<kPrefillColumns><<<partials_grid(blocks, l.prompts.max_length), kPrefillColumns, 0,
                                                     l.stream>>>(l.st, l.active, l.prompts, in, l.ws, tiles, l.status);
    const cudaError_t e = cudaGetLastError();
    return e == cudaSuccess ? launch_combine(l) : e;
  }
};

template <class Q, class T, class Layout>
struct scoring_queries {
  static constexpr bool has_scores = true;
  static std::int64_t per_pair(std::int32_t max_length) { return partials_per_pair(max_length); }
  batch_prefill_queries<Q> in;
  kv_view<T, Layout> cache;

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
    const auto kernel = prefill_query_partials_kernel<kPrefillKeys, Q, T, Layout>;
    cudaError_t e = opt_in_shared(kernel, shared);
    if (e != cudaSuccess) return e;
    kernel<<<partials_grid(blocks, l.prompts.max_length), kPrefillKeys, shared, l.stream>>>(
        l.st, l.active, l.prompts, in, cache, l.ws, tiles, l.status);
    e = cudaGetLastError();
    return e == cudaSuccess ? launch_combine(l) : e;
  }
};

struct scoring_sums {
  static constexpr bool has_scores = true;
  static std::int64_t per_pair(std::int32_t) { return 0; }
  batch_prefill_sums in;

  void require_grid(const kvevict::detail::site& w, std::int64_t entries, const batch_state_view& st,
                    std::int32_t max_length) const {
    require_blocks(w, entries * st.num_heads() * tiles_of(max_length, kPrefillColumns));
  }
  cudaError_t launch(const prefill_launch& l) const {
    const std::int32_t tiles = tiles_of(l.prompts.max_length, kPrefillColumns);
    const std::int64_t blocks = std::int64_t{l.entries} * l.st.num_heads() * tiles;
    prefill_sums_kernel<kPrefillColumns><<<static_cast<unsigned>(blocks), kPrefillColumns, 0, l.stream>>>(
        l.st, l.active, l.prompts, in, l.ws, tiles, l.status);
    return cudaGetLastError();
  }
};

template <class T, class Layout>
struct scoring_key_norms {
  static constexpr bool has_scores = true;
  static std::int64_t per_pair(std::int32_t) { return 0; }
  key_norms<T, Layout> in;

  void require_grid(const kvevict::detail::site& w, std::int64_t entries, const batch_state_view& st,
                    std::int32_t max_length) const {
    require_blocks(w, entries * st.num_heads() * tiles_of(max_length, kPrefillColumns));
  }
  cudaError_t launch(const prefill_launch& l) const {
    const std::int32_t tiles = tiles_of(l.prompts.max_length, kPrefillColumns);
    const std::int64_t blocks = std::int64_t{l.entries} * l.st.num_heads() * tiles;
    prefill_key_norms_kernel<kPrefillColumns, T, Layout>
        <<<static_cast<unsigned>(blocks), kPrefillColumns, 0, l.stream>>>(l.st, l.active, l.prompts, in, l.ws, tiles,
                                                                           l.status);
    return cudaGetLastError();
  }
};

}  // namespace detail
}  // namespace gpu
}  // namespace kvevict
