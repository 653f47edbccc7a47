#pragma once
// Batched prefill compression on CUDA: the calls of kvevict/batch/prefill.hpp
// over device memory, with the host backend's results byte for byte (state,
// K/V rows, reclaimable pages, status word). The semantics, the error rules
// and the KVEVICT_HOST_DEVICE pieces both backends run are in that header.
//
// One call is a fixed sequence of stream-ordered launches over the active
// entries E (sequences of the active set), the KV heads H, the query heads
// Hq and the bound M = prompts.max_length:
//
//   0. clear the per-entry "bad" flags (cudaMemsetAsync);
//   1. prepare, a block per (entry, head): the sequence's checks (length,
//      tokens held, pages of slots [0, L)) and, for queries + LSE, the head's
//      LSE and query rows. A refused (entry, head) is marked, reported, and
//      scored by nobody; its entry is marked bad.
//   2. scores (the inputs that have them):
//      - probs: a block per (entry, query head, tile of 256 columns) and per
//        64-row chunk (grid y): each thread sums its column over the chunk's
//        rows in the canonical order (policy/column_sums.hpp), consecutive
//        threads reading consecutive columns of a row; every partial goes to
//        the workspace, every bad element is reported;
//      - queries + LSE: the same grid with tiles of 64 keys: the tile's keys
//        and 16 query rows at a time sit in shared memory, each thread
//        computes its column's logits with attention_logit, as the host does;
//      - then a thread per (entry, head, column) adds its query heads'
//        partials in ascending chunks, folds the group with fold_group and
//        writes the prefill score (column sums: straight from the input).
//   3. plan, a thread per (entry, head): how many candidates and how many
//      to keep, zero for entries that are bad, inactive or kept whole;
//   4. the keep selection of h2o and random: cuda/segmented_select.cuh over
//      the same keys as the host (detail::prefill_keys);
//   5. compaction, a block per (entry, head): the kept rows move in
//      ascending slots, a pass of up to 16 KiB of K and V rows at a time
//      staged in shared memory (all reads of a pass, a barrier, all writes;
//      sources never lie below their destinations, so no pass overwrites a
//      row a later pass reads), then the slot table, counters, length and
//      reclaimable pages. Bad entries write nothing but reclaimable = 0.
//
// A sequence with any problem is marked in step 1 or 2 (an atomic flag per
// entry) and steps 3-5 leave it alone, so it ends exactly as it was.
//
// Workspace, CUB style: workspace == nullptr only sets workspace_bytes (for
// any alignment of the pointer); it holds per (entry, head) M floats of
// scores and, for probs and queries, per (entry, query head) the chunk
// partials as a triangle (chunk c holds columns [0, 64c + 64)): about
// M * M / 128 floats. Stream-ordered, no allocation, no synchronisation,
// graph-capturable. Arguments throw (kvevict::error) before any launch;
// launch failures return their cudaError_t.
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kvevict/batch/inputs.hpp"
#include "kvevict/batch/prefill_rules.hpp"
#include "kvevict/batch/state.hpp"
#include "kvevict/batch/status.hpp"
#include "kvevict/batch/validate.hpp"
#include "kvevict/cuda/device_helpers.cuh"
#include "kvevict/cuda/prefill_compact.cuh"
#include "kvevict/cuda/prefill_scores.cuh"
#include "kvevict/cuda/prefill_workspace.cuh"
#include "kvevict/cuda/segmented_select.cuh"
#include "kvevict/kv_view.hpp"
#include "kvevict/select/segments.hpp"

namespace kvevict {
namespace gpu {
namespace detail {

/// The keep selection's keys, count and output over the workspace.
inline kvevict::detail::prefill_keys selection_keys(const batch_state_view& st, std::int32_t entries,
                                                    const prefill_workspace& ws) {
  kvevict::detail::prefill_keys keys;
  keys.num_segments = entries * st.num_heads();
  keys.max_length = ws.max_length;
  keys.lengths = ws.candidates;
  keys.first = st.rule.protect.sinks;
  keys.heads = st.num_heads();
  keys.rule = st.rule.victim;
  keys.seed = st.rule.seed;
  keys.first_head = st.rule.first_head;
  keys.scores = ws.scores;
  keys.score_stride = ws.max_length;
  keys.streams = ws.streams;
  return keys;
}

/// The whole call for any scoring, checks and cache (Move: a cache whose
/// rows move; otherwise the slot table only).
template <bool Move, class Scoring, class Checks, class T, class Layout>
cudaError_t run_prefill(const kvevict::detail::site& w, void* workspace, std::size_t& workspace_bytes,
                        const batch_state_view& st, const active_set& active, const prompt_lengths& prompts,
                        const Scoring& scoring, const Checks& checks, const kv_view<T, Layout>& cache,
                        std::int32_t* reclaimable, std::uint64_t* status, cudaStream_t stream) {
  const std::int32_t entries = active.entries(st.num_seqs()), m = prompts.max_length;
  require_blocks(w, std::int64_t{entries} * st.num_heads());
  scoring.require_grid(w, entries, st, m);
  const bool select = st.rule.victim != victim_rule::oldest;

  // The selection's size, asked with the call's shapes (and stand-ins for
  // the workspace pointers, which it does not read when asking).
  std::int32_t stand_in = 0;
  prefill_workspace ws;
  carve_prefill(nullptr, st, entries, m, scoring.per_pair(m), Scoring::has_scores, 0, ws);
  std::size_t select_bytes = 0;
  auto selection = [&](const prefill_workspace& at, void* memory, std::size_t& bytes) {
    kvevict::detail::prefill_keys keys = selection_keys(st, entries, at);
    if (!keys.lengths) keys.lengths = &stand_in;
    selection_output out;
    out.indices = at.chosen ? at.chosen : &stand_in;
    out.index_stride = at.index_stride;
    const selection_count count{0, at.takes ? at.takes : &stand_in};
    // No status: the plan kernel writes counts that always fit; a status
    // word would name segments, not sequences.
    return select_segments(memory, bytes, keys, select_end::top, count, out, nullptr, stream);
  };
  if (select && entries > 0) {
    const cudaError_t e = selection(ws, nullptr, select_bytes);
    if (e != cudaSuccess) return e;
  }
  const std::size_t needed =
      carve_prefill(nullptr, st, entries, m, scoring.per_pair(m), Scoring::has_scores, select_bytes, ws);
  if (workspace == nullptr) {
    workspace_bytes = needed;
    return cudaSuccess;
  }
  if (workspace_bytes < needed)
    kvevict::detail::fail<invalid_argument>(w, "workspace_bytes", "= ", workspace_bytes, " is below the ", needed,
                                            " this call needs (ask with workspace = nullptr)");
  if (entries == 0) return cudaSuccess;
  carve_prefill(workspace, st, entries, m, scoring.per_pair(m), Scoring::has_scores, select_bytes, ws);

  const prefill_launch l{st, active, prompts, ws, entries, status, stream};
  const unsigned heads = static_cast<unsigned>(std::int64_t{entries} * st.num_heads());
  cudaError_t e = cudaMemsetAsync(ws.seq_bad, 0, sizeof(std::uint32_t) * std::size_t(entries), stream);
  if (e != cudaSuccess) return e;
  prefill_prepare_kernel<kBlockThreads, Checks><<<heads, kBlockThreads, 0, stream>>>(st, active, prompts, checks, ws,
                                                                                      status);
  if ((e = cudaGetLastError()) != cudaSuccess) return e;
  if ((e = scoring.launch(l)) != cudaSuccess) return e;
  prefill_plan_kernel<kPrefillPlanThreads><<<(heads + kPrefillPlanThreads - 1) / kPrefillPlanThreads, kPrefillPlanThreads, 0, stream>>>(
      st, active, prompts, ws, static_cast<std::int32_t>(heads));
  if ((e = cudaGetLastError()) != cudaSuccess) return e;
  if (select) {
    std::size_t bytes = ws.select_bytes;
    if ((e = selection(ws, ws.select, bytes)) != cudaSuccess) return e;
  }
  prefill_compact_kernel<kBlockThreads, T, Layout, Move, Scoring::has_scores>
      <<<heads, kBlockThreads, 0, stream>>>(st, active, prompts, cache, ws, reclaimable);
  return cudaGetLastError();
}

}  // namespace detail

/// Prefill compression of every active sequence from its causal attention
/// probabilities (device memory); the kept rows of `cache` move to slots
/// [0, kept). reclaimable_pages: optional, device [B]. The same results as
/// kvevict::batched_prefill on the host (kvevict/batch/prefill.hpp).
/// workspace == nullptr: only sets workspace_bytes.
template <class T, class Layout>
cudaError_t batched_prefill(void* workspace, std::size_t& workspace_bytes, const batch_state_view& st,
                            const active_set& active, const prompt_lengths& prompts, const batch_prefill_probs& in,
                            const kv_view<T, Layout>& cache, std::int32_t* reclaimable_pages, std::uint64_t* status,
                            cudaStream_t stream) {
  const kvevict::detail::site w{"cuda", "prefill"};
  kvevict::detail::require_prefill_call(w, st, active, prompts, status);
  kvevict::detail::require_cache(w, st, cache);
  kvevict::detail::require_prefill_input(w, st, prompts, in);
  return detail::run_prefill<true>(w, workspace, workspace_bytes, st, active, prompts, detail::scoring_probs{in},
                                   kvevict::detail::prefill_cache_checks<T, Layout>{cache}, cache, reclaimable_pages,
                                   status, stream);
}

/// The same from column sums the engine computed.
template <class T, class Layout>
cudaError_t batched_prefill(void* workspace, std::size_t& workspace_bytes, const batch_state_view& st,
                            const active_set& active, const prompt_lengths& prompts, const batch_prefill_sums& in,
                            const kv_view<T, Layout>& cache, std::int32_t* reclaimable_pages, std::uint64_t* status,
                            cudaStream_t stream) {
  const kvevict::detail::site w{"cuda", "prefill"};
  kvevict::detail::require_prefill_call(w, st, active, prompts, status);
  kvevict::detail::require_cache(w, st, cache);
  kvevict::detail::require_prefill_input(w, st, prompts, in);
  return detail::run_prefill<true>(w, workspace, workspace_bytes, st, active, prompts, detail::scoring_sums{in},
                                   kvevict::detail::prefill_cache_checks<T, Layout>{cache}, cache, reclaimable_pages,
                                   status, stream);
}

/// The same from every prompt row's query and LSE, the probabilities
/// recomputed from the keys in slots [0, L) of `cache`. The keys of 64
/// positions and 16 query rows share a block's shared memory; above 48 KiB
/// (float head_dim > 150 or so) the kernel opts in to more, up to the
/// device's limit.
template <class Q, class T, class Layout>
cudaError_t batched_prefill(void* workspace, std::size_t& workspace_bytes, const batch_state_view& st,
                            const active_set& active, const prompt_lengths& prompts,
                            const batch_prefill_queries<Q>& in, const kv_view<T, Layout>& cache,
                            std::int32_t* reclaimable_pages, std::uint64_t* status, cudaStream_t stream) {
  const kvevict::detail::site w{"cuda", "prefill"};
  kvevict::detail::require_prefill_call(w, st, active, prompts, status);
  kvevict::detail::require_cache(w, st, cache);
  kvevict::detail::require_prefill_input(w, st, prompts, in, cache);
  return detail::run_prefill<true>(w, workspace, workspace_bytes, st, active, prompts,
                                   detail::scoring_queries<Q, T, Layout>{in, cache},
                                   kvevict::detail::prefill_query_checks<Q, T, Layout>{cache, in, st.group_size()},
                                   cache, reclaimable_pages, status, stream);
}

/// The same scored by the norms of the prompt's keys in slots [0, L) of
/// in.cache (no attention input; a rule that keeps by score needs decay 0).
template <class T, class Layout>
cudaError_t batched_prefill(void* workspace, std::size_t& workspace_bytes, const batch_state_view& st,
                            const active_set& active, const prompt_lengths& prompts, const key_norms<T, Layout>& in,
                            std::int32_t* reclaimable_pages, std::uint64_t* status, cudaStream_t stream) {
  const kvevict::detail::site w{"cuda", "prefill"};
  kvevict::detail::require_prefill_call(w, st, active, prompts, status);
  kvevict::detail::require_input(w, st, in);
  return detail::run_prefill<true>(w, workspace, workspace_bytes, st, active, prompts,
                                   detail::scoring_key_norms<T, Layout>{in},
                                   kvevict::detail::prefill_key_checks<T, Layout>{in.cache}, in.cache,
                                   reclaimable_pages, status, stream);
}

/// Prefill without scores, for recent_window and random (h2o throws).
template <class T, class Layout>
cudaError_t batched_prefill(void* workspace, std::size_t& workspace_bytes, const batch_state_view& st,
                            const active_set& active, const prompt_lengths& prompts, const kv_view<T, Layout>& cache,
                            std::int32_t* reclaimable_pages, std::uint64_t* status, cudaStream_t stream) {
  const kvevict::detail::site w{"cuda", "prefill"};
  kvevict::detail::require_prefill_call(w, st, active, prompts, status);
  kvevict::detail::require_scoreless_rule(w, st);
  kvevict::detail::require_cache(w, st, cache);
  return detail::run_prefill<true>(w, workspace, workspace_bytes, st, active, prompts, detail::scoring_none{},
                                   kvevict::detail::prefill_cache_checks<T, Layout>{cache}, cache, reclaimable_pages,
                                   status, stream);
}

/// For engines that compact their own rows: only the slot table changes
/// (afterwards slot s holds position positions_of(b, h)[s]; the engine moves
/// row positions[s] to s).
inline cudaError_t batched_prefill(void* workspace, std::size_t& workspace_bytes, const batch_state_view& st,
                                   const active_set& active, const prompt_lengths& prompts,
                                   const batch_prefill_sums& in, std::uint64_t* status, cudaStream_t stream) {
  const kvevict::detail::site w{"cuda", "prefill"};
  kvevict::detail::require_prefill_call(w, st, active, prompts, status);
  kvevict::detail::require_prefill_input(w, st, prompts, in);
  return detail::run_prefill<false>(w, workspace, workspace_bytes, st, active, prompts, detail::scoring_sums{in},
                                    kvevict::detail::prefill_no_checks{}, kv_view<float, strided_layout>{}, nullptr,
                                    status, stream);
}

}  // namespace gpu
}  // namespace kvevict
