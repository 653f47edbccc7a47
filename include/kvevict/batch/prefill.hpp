#pragma once
// Batched prefill compression (docs/semantics.md, "Decode cycle": prefill
// compression, and "Devices"): for every active sequence of a batched state,
// score its prompt, keep min(L, budget) positions per KV head, move the kept
// K/V rows in position order to slots [0, kept) and rewrite the slot table,
// exactly as the per-sequence policies' prefill does (policy_base.hpp), for
// the whole batch in one call. This header holds the host backend; the
// inputs and the rules the host and the CUDA kernels share
// (KVEVICT_HOST_DEVICE) are in prefill_rules.hpp, and
// kvevict/cuda/prefill.cuh runs them on the GPU and gives the same bytes.
// Other scorings add their own headers: prefill_key_norms.hpp (no
// attention input) and prefill_window.hpp (SnapKV).
//
// Before the call the engine has written each prompt's K/V rows to slots
// [0, L) of its sequence (position p in slot p), run attention over them, and
// the sequence holds no token in the state (a fresh or reset sequence).
//
// Per (sequence b, KV head h), with the policy read from the state's rule
// (victim_rule lowest_score: h2o; oldest: recent_window; random_priority: random):
//
//   - scores: column p of query head q sums probs(q, i, p) over rows i >= p
//     in the canonical order of policy/column_sums.hpp, and the group's
//     query heads fold with fold_group, as the per-sequence prefill does;
//   - keep set: the first `sinks` and the last `recent` positions (the rule's
//     protection) plus the budget - sinks - recent candidates in between with
//     the highest keys: eviction_key(score, p) for h2o, p for recent_window,
//     (Philox prefill_priority draw << 32 | p) for random with the sequence's
//     stream; L <= budget keeps everything;
//   - the slot table: slot s < kept holds the s-th kept position with its
//     prefill score (0 for the policies without scores) in the current
//     buffer; the other slots are free (-1, score 0); the spare buffer is 0;
//     count = next slot = kept, length = L, appended = 0;
//   - reclaimable_pages[b] (optional, [B]): for a paged cache, the trailing
//     pages of the prompt the sequence no longer needs,
//     max(0, pages_for(L) - pages_for(min(budget + 1, capacity))); 0 for
//     strided caches and for active sequences whose data was refused.
//
// Errors follow the batched rules. Arguments (shapes, pointers, the policy)
// are checked first and throw; nothing has changed then. Data problems leave
// the whole sequence unchanged (state and K/V bytes) and set the status word
// to the lowest pack_status(b, h, index, code) of all offenders:
//
//   - the sequence: bad_length (L outside [1, capacity] or above
//     prompts.max_length; head 0, index: L), else not_empty (the sequence
//     holds tokens; head 0, index 0), else bad_page (a page of slots [0, L)
//     outside the pool; head 0, index: the page's first slot). One of these
//     is all that is reported for the sequence.
//   - per head, queries + LSE: non_finite_lse / non_finite_query (index: the
//     query head); a head with one reports only these.
//   - per head and column p (index p): nan_input, infinite_input,
//     negative_probability for an element of the input (a probability, a
//     column sum, or for queries the logit when it is not finite, else the
//     probability), the lowest code at p; else score_overflow when a column
//     total or the group fold is not finite.
//
// exact_greedy (a state with a history) is refused: its history would need
// every prompt row's keys and values in float, which this call does not
// record. Prefill it per sequence (exact_greedy_policy::prefill).
//
// Page ids of slots [0, L) must be distinct, within a sequence and across the
// sequences of one call: rows move in place. Unlike the per-sequence prefill
// this is not checked (the CUDA backend could not check it cheaply, and both
// backends accept the same data).
//
// The host backend allocates a little scratch per call (scores of one
// sequence, the selection's workspace); prefill is not the decode path.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "kvevict/batch/host_backend.hpp"
#include "kvevict/batch/prefill_rules.hpp"
#include "kvevict/batch/state.hpp"
#include "kvevict/batch/status.hpp"
#include "kvevict/batch/validate.hpp"
#include "kvevict/compaction.hpp"
#include "kvevict/kv_view.hpp"
#include "kvevict/policy/column_sums.hpp"
#include "kvevict/policy/decode_rules.hpp"
#include "kvevict/select/segmented_select.hpp"
#include "kvevict/select/segments.hpp"

namespace kvevict {
namespace detail {

// ---- the host backend ----

/// The host scorers: the scores of one (b, h) into out[0, L), and the lowest
/// status word of its element and overflow problems (or clear).

/// No scores: recent_window and random keep positions without them.
struct host_no_scores {
  static constexpr bool has_scores = false;
  std::uint64_t score_head(std::int32_t, std::int32_t, std::int32_t, float*) const noexcept {
    return batch_status_clear;
  }
};

/// The causal matrix: each query head's chunk partials accumulate row by
/// row (rows in ascending order within a chunk, as the canonical order
/// wants, reading the matrix a row at a time), then combine in ascending
/// chunks.
struct host_probs_scores {
  static constexpr bool has_scores = true;
  batch_prefill_probs in;
  std::int32_t group_size;
  group_reduce reduce;
  float decay;  ///< the rule's score decay: row i weighs decay^(length - 1 - i)
  std::vector<prefill_accumulator>* chunk;  // [max_length]: this chunk's partial per column
  std::vector<prefill_accumulator>* total;  // [g][max_length]: the column totals per query head
  std::vector<batch_code>* codes;           // [max_length]: the lowest element code per column

  std::uint64_t score_head(std::int32_t b, std::int32_t h, std::int32_t length, float* out) const {
    const std::int32_t g = group_size;
    const std::size_t m = codes->size();
    std::fill(codes->begin(), codes->end(), batch_code::ok);
    for (std::int32_t j = 0; j < g; ++j) {
      const std::int32_t q = h * g + j;
      prefill_accumulator* tot = total->data() + std::size_t(j) * m;
      std::fill_n(tot, length, prefill_accumulator{});
      for (std::int32_t c = 0; c < prefill_chunks(length); ++c) {
        const std::int32_t first = c * prefill_chunk_rows;
        const std::int32_t end = std::min(first + prefill_chunk_rows, length);
        std::fill_n(chunk->data(), end, prefill_accumulator{});
        for (std::int32_t i = first; i < end; ++i) {
          const row_decay weigh(decay, length, i);  // once per row, not per element
          for (std::int32_t p = 0; p <= i; ++p) {
            const float x = in.probs(b, q, i, p);
            (*codes)[std::size_t(p)] = lower_code((*codes)[std::size_t(p)], classify_input(x, true));
            (*chunk)[std::size_t(p)].add(weigh(x));
          }
        }
        for (std::int32_t p = 0; p < end; ++p) tot[p].add((*chunk)[std::size_t(p)].sum);  // chunk c holds rows of p
      }
    }
    std::uint64_t word = batch_status_clear;
    for (std::int32_t p = 0; p < length && word == batch_status_clear; ++p) {
      const slot_increment inc = fold_prefill_column(
          h * g, g, reduce, [&](std::int32_t q) { return (*total)[std::size_t(q - h * g) * m + std::size_t(p)].sum; });
      out[p] = inc.value;
      const batch_code code = lower_code((*codes)[std::size_t(p)], inc.code);
      if (code != batch_code::ok) word = pack_status(b, h, p, code);  // p ascends: the head's lowest word
    }
    return word;
  }
};

struct host_sums_scores {
  static constexpr bool has_scores = true;
  batch_prefill_sums in;
  std::int32_t group_size;
  group_reduce reduce;

  std::uint64_t score_head(std::int32_t b, std::int32_t h, std::int32_t length, float* out) const {
    const std::int32_t g = group_size;
    for (std::int32_t p = 0; p < length; ++p) {
      batch_code code = batch_code::ok;
      for (std::int32_t q = h * g; q < (h + 1) * g; ++q) code = lower_code(code, classify_input(in.sums(b, q, p), true));
      const slot_increment inc = fold_prefill_column(h * g, g, reduce, [&](std::int32_t q) { return in.sums(b, q, p); });
      out[p] = inc.value;
      code = lower_code(code, inc.code);
      if (code != batch_code::ok) return pack_status(b, h, p, code);
    }
    return batch_status_clear;
  }
};

/// Queries + LSE: each (query head, column) with prefill_column_sum, the
/// elements from prefill_query_value.
template <class Q, class T, class Layout>
struct host_query_scores {
  static constexpr bool has_scores = true;
  batch_prefill_queries<Q> in;
  kv_view<T, Layout> cache;
  std::int32_t group_size;
  group_reduce reduce;
  float decay;  ///< as host_probs_scores
  std::vector<float>* total;  // [g]

  std::uint64_t score_head(std::int32_t b, std::int32_t h, std::int32_t length, float* out) const {
    const std::int32_t g = group_size;
    const float key_scale = cache.k_scale(h);
    for (std::int32_t p = 0; p < length; ++p) {
      const T* key = cache.k_row(b, h, p);
      batch_code code = batch_code::ok;
      for (std::int32_t j = 0; j < g; ++j) {
        const std::int32_t q = h * g + j;
        (*total)[std::size_t(j)] = prefill_column_sum(p, length, [&](std::int32_t i) {
          const float x = prefill_query_value(&in.q(b, q, i, 0), in.q.strides[3], key, key_scale, cache.head_dim,
                                              in.scale, in.lse(b, q, i), in.base);
          code = lower_code(code, classify_input(x, true));
          return decayed_row(decay, length, i, x);
        });
      }
      const slot_increment inc =
          fold_prefill_column(h * g, g, reduce, [&](std::int32_t q) { return (*total)[std::size_t(q - h * g)]; });
      out[p] = inc.value;
      code = lower_code(code, inc.code);
      if (code != batch_code::ok) return pack_status(b, h, p, code);
    }
    return batch_status_clear;
  }
};

/// The host batched prefill, for any scorer and checks; `cache` null for the
/// slot-table-only form.
template <class Scores, class Checks, class T, class Layout>
void host_prefill(const batch_state_view& st, const active_set& active, const prompt_lengths& prompts,
                  const Scores& scorer, const Checks& checks, const kv_view<T, Layout>* cache,
                  std::int32_t* reclaimable_pages, std::uint64_t* status) {
  const std::int32_t heads = st.num_heads(), m = prompts.max_length;
  std::vector<float> scores(Scores::has_scores ? std::size_t(heads) * std::size_t(m) : 0);
  std::vector<std::int32_t> candidates(std::size_t(heads), 0);
  std::vector<std::int32_t> chosen(std::size_t(heads) * std::size_t(st.rule.budget));
  std::vector<std::int32_t> keep(std::size_t(st.rule.budget));
  prefill_keys keys;
  keys.num_segments = heads;
  keys.max_length = m;
  keys.lengths = candidates.data();
  keys.first = st.rule.protect.sinks;
  keys.heads = heads;
  keys.rule = st.rule.victim;
  keys.seed = st.rule.seed;
  keys.first_head = st.rule.first_head;
  keys.scores = scores.data();
  keys.score_stride = m;
  std::vector<unsigned char> select_workspace(select_workspace_bytes(keys));
  // Head h's prompt scores; none without scores (no offset from a null data()).
  const auto scores_of = [&](std::int32_t h) {
    return Scores::has_scores ? scores.data() + std::size_t(h) * std::size_t(m) : nullptr;
  };

  for_each_active(st, active, status, [&](std::int32_t b) {
    const std::int32_t length = prompts.lengths[b];
    std::uint64_t word = prefill_length_problem(st, b, length, m);
    if (word == batch_status_clear) {
      const std::int32_t slot = checks.first_unmapped(b, length, 0, 1);
      if (slot != prefill_no_slot) word = pack_status(b, 0, slot, batch_code::bad_page);
    }
    // Every head is looked at (the lowest word over all of them is the
    // one a kernel's atomic minimum keeps), unless the sequence itself is bad.
    for (std::int32_t h = 0; h < heads && word == batch_status_clear; ++h) {
      std::uint64_t found = checks.head_problem(b, h, length, 0, 1);
      if (found == batch_status_clear) found = scorer.score_head(b, h, length, scores_of(h));
      if (found != batch_status_clear) word = found;  // heads ascend: the first is the lowest
    }
    if (word != batch_status_clear) {
      record_status(status, word);
      if (reclaimable_pages) reclaimable_pages[b] = 0;
      return;
    }
    const prefill_plan plan = plan_prefill(st.rule, length);
    if (plan.select) {
      std::fill(candidates.begin(), candidates.end(), plan.candidates());
      const std::uint64_t stream = st.stream_of(b);
      keys.streams = &stream;
      selection_output out;
      out.indices = chosen.data();
      out.index_stride = st.rule.budget;
      select_segments(select_workspace.data(), select_workspace.size(), keys, select_end::top,
                      selection_count{plan.take, nullptr}, out);
    }
    for (std::int32_t h = 0; h < heads; ++h) {
      const std::int32_t* picked = chosen.data() + std::size_t(h) * std::size_t(st.rule.budget);
      if (cache) {
        for (std::int32_t s = 0; s < plan.kept; ++s) keep[std::size_t(s)] = plan.source(s, picked);
        compact_rows(*cache, b, h, keep.data(), plan.kept, static_cast<T*>(nullptr));  // sources ascend: in place
      }
      const float* score = scores_of(h);
      commit_prefill_slots(
          st, b, h, plan, picked, [&](std::int32_t p) { return Scores::has_scores ? score[p] : 0.0f; }, 0, 1);
      commit_prefill_counters(st, b, h, plan.kept, length);
    }
    st.slots.lengths[b] = length;
    if (reclaimable_pages)
      reclaimable_pages[b] = cache ? prefill_reclaimable_pages(*cache, st.rule.budget, st.capacity(), length) : 0;
  });
}

/// Every batched prefill once its arguments are checked: one per input,
/// shared by the batched calls below and the per-sequence policies
/// (policy/prefill_calls.hpp, one active sequence). `cache` moves the kept
/// rows; without one (the overload of column sums) only the slot table
/// changes.
template <class T, class Layout>
void run_prefill(const batch_state_view& st, const active_set& active, const prompt_lengths& prompts,
                 const batch_prefill_probs& in, const kv_view<T, Layout>& cache, std::int32_t* reclaimable_pages,
                 std::uint64_t* status) {
  const std::size_t m = static_cast<std::size_t>(prompts.max_length);
  std::vector<prefill_accumulator> chunk(m), total(std::size_t(st.group_size()) * m);
  std::vector<batch_code> codes(m);
  const host_probs_scores scorer{in, st.group_size(), st.rule.reduce, st.rule.decay, &chunk, &total, &codes};
  host_prefill(st, active, prompts, scorer, prefill_cache_checks<T, Layout>{cache}, &cache, reclaimable_pages, status);
}

template <class T, class Layout>
void run_prefill(const batch_state_view& st, const active_set& active, const prompt_lengths& prompts,
                 const batch_prefill_sums& in, const kv_view<T, Layout>& cache, std::int32_t* reclaimable_pages,
                 std::uint64_t* status) {
  const host_sums_scores scorer{in, st.group_size(), st.rule.reduce};
  host_prefill(st, active, prompts, scorer, prefill_cache_checks<T, Layout>{cache}, &cache, reclaimable_pages, status);
}

inline void run_prefill(const batch_state_view& st, const active_set& active, const prompt_lengths& prompts,
                        const batch_prefill_sums& in, std::uint64_t* status) {
  const host_sums_scores scorer{in, st.group_size(), st.rule.reduce};
  host_prefill(st, active, prompts, scorer, prefill_no_checks{},
               static_cast<const kv_view<float, strided_layout>*>(nullptr), nullptr, status);
}

template <class Q, class T, class Layout>
void run_prefill(const batch_state_view& st, const active_set& active, const prompt_lengths& prompts,
                 const batch_prefill_queries<Q>& in, const kv_view<T, Layout>& cache, std::int32_t* reclaimable_pages,
                 std::uint64_t* status) {
  std::vector<float> total(static_cast<std::size_t>(st.group_size()));
  const host_query_scores<Q, T, Layout> scorer{in, cache, st.group_size(), st.rule.reduce, st.rule.decay, &total};
  host_prefill(st, active, prompts, scorer, prefill_query_checks<Q, T, Layout>{cache, in, st.group_size()}, &cache,
               reclaimable_pages, status);
}

/// No scores: recent_window and random.
template <class T, class Layout>
void run_prefill(const batch_state_view& st, const active_set& active, const prompt_lengths& prompts,
                 const kv_view<T, Layout>& cache, std::int32_t* reclaimable_pages, std::uint64_t* status) {
  host_prefill(st, active, prompts, host_no_scores{}, prefill_cache_checks<T, Layout>{cache}, &cache,
               reclaimable_pages, status);
}

}  // namespace detail

/// Prefill compression of every active sequence from its causal attention
/// probabilities; the kept rows of `cache` move to slots [0, kept).
/// reclaimable_pages: optional [B]. See the top of this header.
template <class T, class Layout>
void batched_prefill(const batch_state_view& st, const active_set& active, const prompt_lengths& prompts,
                     const batch_prefill_probs& in, const kv_view<T, Layout>& cache, std::int32_t* reclaimable_pages,
                     std::uint64_t* status) {
  const detail::site w{"batch", "prefill"};
  detail::require_prefill_call(w, st, active, prompts, status);
  detail::require_cache(w, st, cache);
  detail::require_prefill_input(w, st, prompts, in);
  detail::run_prefill(st, active, prompts, in, cache, reclaimable_pages, status);
}

/// The same from column sums the engine computed.
template <class T, class Layout>
void batched_prefill(const batch_state_view& st, const active_set& active, const prompt_lengths& prompts,
                     const batch_prefill_sums& in, const kv_view<T, Layout>& cache, std::int32_t* reclaimable_pages,
                     std::uint64_t* status) {
  const detail::site w{"batch", "prefill"};
  detail::require_prefill_call(w, st, active, prompts, status);
  detail::require_cache(w, st, cache);
  detail::require_prefill_input(w, st, prompts, in);
  detail::run_prefill(st, active, prompts, in, cache, reclaimable_pages, status);
}

/// The same from every prompt row's query and LSE, the probabilities
/// recomputed from the keys in slots [0, L) of `cache`.
template <class Q, class T, class Layout>
void batched_prefill(const batch_state_view& st, const active_set& active, const prompt_lengths& prompts,
                     const batch_prefill_queries<Q>& in, const kv_view<T, Layout>& cache,
                     std::int32_t* reclaimable_pages, std::uint64_t* status) {
  const detail::site w{"batch", "prefill"};
  detail::require_prefill_call(w, st, active, prompts, status);
  detail::require_cache(w, st, cache);
  detail::require_prefill_input(w, st, prompts, in, cache);
  detail::run_prefill(st, active, prompts, in, cache, reclaimable_pages, status);
}

/// Prefill without scores, for recent_window and random (h2o throws):
/// the first sinks + last window, or protected ends + Philox priorities.
template <class T, class Layout>
void batched_prefill(const batch_state_view& st, const active_set& active, const prompt_lengths& prompts,
                     const kv_view<T, Layout>& cache, std::int32_t* reclaimable_pages, std::uint64_t* status) {
  const detail::site w{"batch", "prefill"};
  detail::require_prefill_call(w, st, active, prompts, status);
  detail::require_scoreless_rule(w, st);
  detail::require_cache(w, st, cache);
  detail::run_prefill(st, active, prompts, cache, reclaimable_pages, status);
}

/// For engines that compact their own rows: only the slot table changes.
/// Afterwards slot s of (b, h) must hold prompt position
/// positions_of(b, h)[s]: the engine moves row positions[s] to slot s (in
/// ascending s, sources never below their destination, so in place).
inline void batched_prefill(const batch_state_view& st, const active_set& active, const prompt_lengths& prompts,
                            const batch_prefill_sums& in, std::uint64_t* status) {
  const detail::site w{"batch", "prefill"};
  detail::require_prefill_call(w, st, active, prompts, status);
  detail::require_prefill_input(w, st, prompts, in);
  detail::run_prefill(st, active, prompts, in, status);
}

}  // namespace kvevict
