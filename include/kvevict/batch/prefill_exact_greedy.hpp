#pragma once
// exact_greedy's batched prefill compression, on the host (exact_greedy's
// per-sequence prefill runs it for one sequence). Every prompt row of an
// active sequence joins its history; then per KV head the greedy removal
// of evict_to (greedy_round: every cached token scored with the
// leave-one-out error its eviction would cause for the last prompt row's
// queries, the lowest (error, position) among the unprotected dropped)
// runs until `budget` tokens remain, and the kept rows move in position
// order to slots [0, kept) as every prefill's do. Kept tokens score 0 (the
// next observe scores them all). The CUDA backend refuses it
// (batch/prefill_rules.hpp): an oracle's prompt compression has no place
// on the decode path.
//
// Status words leave the whole sequence unchanged: those of every batched
// prefill about the sequence (bad_length, not_empty, bad_page), then per
// head history_full (a prompt longer than the history's rows),
// non_finite_query (index: the query head) and non_finite_kv (index: the
// slot of the first prompt row with a non-finite K or V element).
#include <cstddef>
#include <cstdint>
#include <vector>

#include "kvevict/batch/evict_to.hpp"
#include "kvevict/batch/host_backend.hpp"
#include "kvevict/batch/prefill_rules.hpp"
#include "kvevict/batch/state.hpp"
#include "kvevict/batch/status.hpp"
#include "kvevict/batch/validate.hpp"
#include "kvevict/compaction.hpp"
#include "kvevict/dtype/convert.hpp"
#include "kvevict/kv_view.hpp"

namespace kvevict {
namespace detail {

/// Why (b, h) cannot take a prompt of `length` rows, or batch_status_clear.
template <class Q, class T, class Layout>
std::uint64_t greedy_prefill_problem(const batch_state_view& st, std::int32_t b, std::int32_t h,
                                     std::int32_t length, const batch_queries<Q>& in, const kv_view<T, Layout>& cache) {
  if (length > st.history.max_tokens) return pack_status(b, h, length, batch_code::history_full);
  const std::uint64_t queries = query_problem(st, b, h, in);
  if (queries != batch_status_clear) return queries;
  const std::uint64_t scales = kv_scale_problem(cache, b, h);
  if (scales != batch_status_clear) return scales;
  const float k_scale = cache.k_scale(h), v_scale = cache.v_scale(h);
  for (std::int32_t s = 0; s < length; ++s)
    for (std::int32_t i = 0; i < cache.head_dim; ++i)
      if (classify_input(kv_value(cache.k_row(b, h, s)[i], k_scale), false) != batch_code::ok ||
          classify_input(kv_value(cache.v_row(b, h, s)[i], v_scale), false) != batch_code::ok)
        return pack_status(b, h, s, batch_code::non_finite_kv);
  return batch_status_clear;
}

/// The prefill of (b, h) once the sequence is known good: the prompt rows
/// join the history, the greedy rounds free length - budget tokens, the
/// kept rows are compacted. `keep`: capacity ints of scratch.
template <class Q, class T, class Layout>
void greedy_prefill_head(const batch_state_view& st, std::int32_t b, std::int32_t h, std::int32_t length,
                         const batch_queries<Q>& in, const kv_view<T, Layout>& cache, std::int32_t* keep) {
  const history_view& hv = st.history;
  const std::int64_t bh = st.head_index(b, h);
  const std::int32_t d = hv.head_dim;
  const float k_scale = cache.k_scale(h), v_scale = cache.v_scale(h);
  for (std::int32_t p = 0; p < length; ++p)
    for (std::int32_t i = 0; i < d; ++i) {
      hv.keys[(bh * hv.max_tokens + p) * d + i] = kv_value(cache.k_row(b, h, p)[i], k_scale);
      hv.values[(bh * hv.max_tokens + p) * d + i] = kv_value(cache.v_row(b, h, p)[i], v_scale);
    }
  hv.rows[bh] = length;
  std::int32_t* positions = st.slots.positions_of(b, h);
  for (std::int32_t s = 0; s < st.capacity(); ++s) positions[s] = s < length ? s : -1;
  for (std::int32_t round = length - st.rule.budget; round > 0; --round) greedy_round(st, b, h, in);
  std::int32_t kept = 0;
  for (std::int32_t s = 0; s < length; ++s)
    if (positions[s] >= 0) keep[kept++] = positions[s];  // slot p holds position p: ascending
  compact_rows(cache, b, h, keep, kept, static_cast<T*>(nullptr));
  float* current = st.scores_of(b, h);
  float* spare = st.spare_scores_of(b, h);
  for (std::int32_t s = 0; s < st.capacity(); ++s) {
    positions[s] = s < kept ? keep[s] : -1;
    current[s] = 0.0f;
    spare[s] = 0.0f;
  }
  commit_prefill_counters(st, b, h, kept, length);
}

/// The prefill of every active sequence, its arguments checked.
template <class Q, class T, class Layout>
void run_prefill(const batch_state_view& st, const active_set& active, const prompt_lengths& prompts,
                 const batch_queries<Q>& last_rows, const kv_view<T, Layout>& cache, std::int32_t* reclaimable_pages,
                 std::uint64_t* status) {
  std::vector<std::int32_t> keep(static_cast<std::size_t>(st.capacity()));
  for_each_active(st, active, status, [&](std::int32_t b) {
    const std::int32_t length = prompts.lengths[b];
    std::uint64_t word = prefill_length_problem(st, b, length, prompts.max_length);
    if (word == batch_status_clear) {
      const std::int32_t slot = prefill_cache_checks<T, Layout>{cache}.first_unmapped(b, length, 0, 1);
      if (slot != prefill_no_slot) word = pack_status(b, 0, slot, batch_code::bad_page);
    }
    for (std::int32_t h = 0; h < st.num_heads() && word == batch_status_clear; ++h)
      word = greedy_prefill_problem(st, b, h, length, last_rows, cache);
    if (word != batch_status_clear) {
      record_status(status, word);
      if (reclaimable_pages) reclaimable_pages[b] = 0;
      return;
    }
    st.slots.lengths[b] = length;  // the rounds protect by it
    for (std::int32_t h = 0; h < st.num_heads(); ++h) greedy_prefill_head(st, b, h, length, last_rows, cache, keep.data());
    if (reclaimable_pages) reclaimable_pages[b] = prefill_reclaimable_pages(cache, st.rule.budget, st.capacity(), length);
  });
}

}  // namespace detail

/// exact_greedy's prefill compression of every active sequence: its prompt
/// in slots [0, L) of `cache` joins the history and is reduced greedily to
/// min(L, budget) tokens judged with `last_rows` (the queries of each
/// prompt's last row, [B][Hq][head_dim]; the LSE is not read); the kept rows
/// move to slots [0, kept). reclaimable_pages: optional [B]. See the top of
/// this header.
template <class Q, class T, class Layout>
void batched_prefill(const batch_state_view& st, const active_set& active, const prompt_lengths& prompts,
                     const batch_queries<Q>& last_rows, const kv_view<T, Layout>& cache,
                     std::int32_t* reclaimable_pages, std::uint64_t* status) {
  const detail::site w{"batch", "prefill"};
  detail::require_prefill_args(w, st, active, prompts, status);
  if (!st.history.keys)
    detail::fail<invalid_argument>(w, "last_rows", "are queries, the prefill input of exact_greedy alone; this "
                                                   "state has no history (pass the prompt's attention or keys)");
  detail::require_history(w, st);
  detail::require_cache(w, st, cache);
  if (cache.head_dim != st.history.head_dim)
    detail::fail<invalid_argument>(w, "cache.head_dim", "= ", cache.head_dim, ", the history has ",
                                   st.history.head_dim);
  detail::require_batch_extents(w, "last_rows.q", last_rows.q, {st.num_seqs(), st.num_q_heads, cache.head_dim}, false);
  detail::require_scale(w, last_rows.scale);
  detail::run_prefill(st, active, prompts, last_rows, cache, reclaimable_pages, status);
}

}  // namespace kvevict
