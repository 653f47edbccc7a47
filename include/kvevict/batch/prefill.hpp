#pragma once
// Batched prefill compression (docs/semantics.md, "Decode cycle": prefill
// compression, and "Devices"): for every active sequence of a batched state,
// score its prompt, keep min(L, budget) positions per KV head, move the kept
// K/V rows in position order to slots [0, kept) and rewrite the slot table,
// exactly as the per-sequence policies' prefill does (policy_base.hpp), for
// the whole batch in one call. This header holds the inputs, the rules the
// host and the CUDA kernels share (KVEVICT_HOST_DEVICE), and the host
// backend; kvevict/cuda/prefill.cuh runs the same rules on the GPU and gives
// the same bytes.
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
#include <type_traits>
#include <vector>

#include "kvevict/batch/host_backend.hpp"
#include "kvevict/batch/inputs.hpp"
#include "kvevict/batch/state.hpp"
#include "kvevict/batch/status.hpp"
#include "kvevict/batch/validate.hpp"
#include "kvevict/compaction.hpp"
#include "kvevict/config.hpp"
#include "kvevict/dtype/convert.hpp"
#include "kvevict/error.hpp"
#include "kvevict/kv_view.hpp"
#include "kvevict/layout.hpp"
#include "kvevict/order.hpp"
#include "kvevict/philox.hpp"
#include "kvevict/policy/column_sums.hpp"
#include "kvevict/policy/decode_rules.hpp"
#include "kvevict/score_inputs.hpp"
#include "kvevict/select/segmented_select.hpp"
#include "kvevict/select/segments.hpp"
#include "kvevict/tensor_view.hpp"

namespace kvevict {

// ---- inputs: the per-sequence prefill inputs with a leading sequence dimension ----

/// The prompt length of every sequence: lengths[b] (host memory on the host,
/// device memory on CUDA), each at most max_length, a bound known on the
/// host that sizes the inputs and the workspace (1 <= max_length <=
/// capacity). Only active sequences' entries are read.
struct prompt_lengths {
  const std::int32_t* lengths = nullptr;
  std::int32_t max_length = 0;
};

/// Causal attention probabilities of every prompt: probs(b, q, i, p) for
/// query row i and key position p <= i, [B][Hq][>= max_length][>= max_length].
/// Entries above the diagonal and beyond L are not read.
struct batch_prefill_probs {
  tensor_view<const float, 4> probs;
};

/// Column sums the engine computed: sums(b, q, p) = sum over i >= p of
/// probs(b, q, i, p), [B][Hq][>= max_length].
struct batch_prefill_sums {
  tensor_view<const float, 3> sums;
};

/// Every prompt row's query and LSE from a fused prefill kernel; the
/// probabilities are recomputed from the cached keys (slots [0, L)):
/// exp(q(b, q, i, :) . k_p * scale - lse(b, q, i)). q [B][Hq][>= max_length]
/// [head_dim], lse [B][Hq][>= max_length] (natural log, or base 2).
template <class Q>
struct batch_prefill_queries {
  tensor_view<const Q, 4> q;
  tensor_view<const float, 3> lse;
  float scale = 1.0f;
  lse_base base = lse_base::natural;
};

static_assert(std::is_trivially_copyable_v<prompt_lengths>, "inputs go to kernels by value");
static_assert(std::is_trivially_copyable_v<batch_prefill_probs>, "inputs go to kernels by value");
static_assert(std::is_trivially_copyable_v<batch_prefill_queries<float>>, "inputs go to kernels by value");

namespace detail {

/// A slot index that no slot has: "none found".
inline constexpr std::int32_t prefill_no_slot = 0x7FFFFFFF;

// ---- the rules both backends run ----

/// The keep set of one (sequence, head) as ranges of positions: [0, lo),
/// `take` of the candidates [lo, hi), and [hi, L), in slots [0, kept) in
/// that order. Keep sets are the same for every head; only the chosen
/// candidates differ.
struct prefill_plan {
  std::int32_t kept = 0;   ///< min(L, budget)
  std::int32_t lo = 0;     ///< positions below are kept (sinks); lo == kept when nothing is dropped
  std::int32_t take = 0;   ///< candidates kept
  std::int32_t hi = 0;     ///< positions [hi, L) are kept (recent)
  bool select = false;     ///< the candidates are chosen by key (h2o, random), not the newest (recent_window)

  KVEVICT_HOST_DEVICE std::int32_t candidates() const noexcept { return hi - lo; }
  /// The position slot s < kept receives; `chosen` holds the selected
  /// candidate indices (position - lo) in ascending order when `select`.
  KVEVICT_HOST_DEVICE std::int32_t source(std::int32_t s, const std::int32_t* chosen) const noexcept {
    if (s < lo) return s;
    if (s < lo + take) return select ? lo + chosen[s - lo] : hi - take + (s - lo);
    return hi + (s - lo - take);
  }
};

/// policy_base::keep_top_keys as ranges: every position when L <= budget,
/// else the rule's protected ends and budget - sinks - recent candidates.
KVEVICT_HOST_DEVICE inline prefill_plan plan_prefill(const decode_rule& rule, std::int32_t length) noexcept {
  prefill_plan plan;
  if (length <= rule.budget) {
    plan.kept = plan.lo = plan.hi = length;
    return plan;
  }
  plan.kept = rule.budget;
  plan.lo = rule.protect.sinks < length ? rule.protect.sinks : length;
  plan.hi = length - rule.protect.recent > plan.lo ? length - rule.protect.recent : plan.lo;
  plan.take = rule.budget - plan.lo - (length - plan.hi);
  plan.select = rule.victim != victim_rule::oldest && plan.take > 0;
  return plan;
}

/// The keys of the keep selection, one segment per (entry, KV head):
/// segment i is entry i / heads, head i % heads, and its element j is
/// position first + j among the candidates. A key source for
/// select/segmented_select.hpp and cuda/segmented_select.cuh (top: the
/// highest keys are kept).
struct prefill_keys {
  std::int32_t num_segments = 0;
  std::int32_t max_length = 0;             ///< a bound on every segment's length
  const std::int32_t* lengths = nullptr;   ///< [num_segments]: candidates of each segment
  std::int32_t first = 0;                  ///< position of candidate 0 (the rule's sinks)
  std::int32_t heads = 1;
  victim_rule rule = victim_rule::lowest_score;
  std::uint64_t seed = 0;
  const float* scores = nullptr;           ///< lowest_score: segment i's score of position p at scores[i * score_stride + p]
  std::int64_t score_stride = 0;
  const std::uint64_t* streams = nullptr;  ///< random_priority: entry e's request stream at streams[e]

  KVEVICT_HOST_DEVICE std::int32_t length(std::int32_t i) const noexcept { return lengths[i]; }
  KVEVICT_HOST_DEVICE bool ordered_by_index() const noexcept { return true; }
  KVEVICT_HOST_DEVICE std::int32_t position(std::int32_t, std::int32_t j) const noexcept { return first + j; }
  KVEVICT_HOST_DEVICE std::uint64_t key(std::int32_t i, std::int32_t j, select_end end) const noexcept {
    const std::int32_t p = first + j;
    std::uint64_t k = 0;
    if (rule == victim_rule::random_priority) {
      const std::uint32_t draw = random_draw(seed, random_use::prefill_priority, streams[i / heads], i % heads, p);
      k = (static_cast<std::uint64_t>(draw) << 32) | static_cast<std::uint32_t>(p);
    } else {
      k = rule == victim_rule::oldest ? std::uint64_t(std::uint32_t(p)) : eviction_key(scores[i * score_stride + p], p);
    }
    return end == select_end::top ? ~k : k;
  }
};

/// The lower of two codes, batch_code::ok counting as "none".
KVEVICT_HOST_DEVICE inline batch_code lower_code(batch_code a, batch_code b) noexcept {
  if (a == batch_code::ok) return b;
  if (b == batch_code::ok) return a;
  return static_cast<std::uint32_t>(a) < static_cast<std::uint32_t>(b) ? a : b;
}

/// One element of the queries path: the probability of row q . key, or the
/// logit itself when it is not finite (a non-finite key), so that it is
/// reported as the input (as the batched decode does).
template <class Q, class K>
KVEVICT_HOST_DEVICE inline float prefill_query_value(const Q* q, std::int64_t q_stride, const K* key,
                                                     std::int32_t head_dim, float scale, float lse,
                                                     lse_base base) noexcept {
  const float logit = attention_logit(q, q_stride, key, head_dim);
  if (classify_input(logit, false) != batch_code::ok) return logit;
  return probability_from_logit(logit, scale, lse, base);
}

/// The prefill score of (h, column p) from each query head's column total
/// total(q), folded over the group as the per-sequence prefill does; its code
/// is score_overflow when a total or the fold is not finite. (Element
/// problems are reported on their own, with lower codes.)
KVEVICT_EXEC_CHECK_DISABLE
template <class Total>
KVEVICT_HOST_DEVICE inline slot_increment fold_prefill_column(std::int32_t first_q, std::int32_t g,
                                                              group_reduce reduce, Total total) {
  slot_increment inc = fold_group(first_q, g, reduce, true, total);
  if (inc.code != batch_code::ok || classify_input(inc.value, false) != batch_code::ok)
    inc.code = batch_code::score_overflow;
  return inc;
}

/// bad_length or not_empty for sequence b with a prompt of `length` tokens,
/// or batch_status_clear.
KVEVICT_HOST_DEVICE inline std::uint64_t prefill_length_problem(const batch_state_view& st, std::int32_t b,
                                                                std::int32_t length,
                                                                std::int32_t max_length) noexcept {
  if (length < 1 || length > st.capacity() || length > max_length)
    return pack_status(b, 0, length, batch_code::bad_length);
  if (st.slots.lengths[b] != 0) return pack_status(b, 0, 0, batch_code::not_empty);
  return batch_status_clear;
}

/// The checks of prepare for a call without a cache (the slot-table-only
/// prefill): nothing beyond the length. Each check looks at the items
/// first, first + step, ...: a kernel splits them across threads.
struct prefill_no_checks {
  KVEVICT_HOST_DEVICE std::int32_t first_unmapped(std::int32_t, std::int32_t, std::int32_t, std::int32_t) const noexcept {
    return prefill_no_slot;
  }
  KVEVICT_HOST_DEVICE std::uint64_t head_problem(std::int32_t, std::int32_t, std::int32_t, std::int32_t,
                                                 std::int32_t) const noexcept {
    return batch_status_clear;
  }
};

/// With a cache: every page of slots [0, L) must be in the pool.
template <class T, class Layout>
struct prefill_cache_checks {
  kv_view<T, Layout> cache;

  /// The first slot of the lowest page among pages first, first + step, ...
  /// of slots [0, length) that is outside the pool, or prefill_no_slot.
  KVEVICT_HOST_DEVICE std::int32_t first_unmapped(std::int32_t b, std::int32_t length, std::int32_t first,
                                                  std::int32_t step) const noexcept {
    if constexpr (std::is_same_v<Layout, paged_layout>) {
      const std::int32_t page = cache.layout.page_size, pages = pages_for(length, page);
      for (std::int32_t i = first; i < pages; i += step)
        if (!row_is_mapped(cache, b, i * page)) return i * page;
    } else {
      (void)b, (void)length, (void)first, (void)step;
    }
    return prefill_no_slot;
  }
  KVEVICT_HOST_DEVICE std::uint64_t head_problem(std::int32_t, std::int32_t, std::int32_t, std::int32_t,
                                                 std::int32_t) const noexcept {
    return batch_status_clear;
  }
};

/// Queries + LSE: the pages, and per head the LSE and query rows of its
/// group for rows [0, L) (rows r = first, first + step, ... of the g * L
/// (query head, row) pairs, query head major).
template <class Q, class T, class Layout>
struct prefill_query_checks {
  kv_view<T, Layout> cache;
  batch_prefill_queries<Q> in;
  std::int32_t group_size = 1;

  KVEVICT_HOST_DEVICE std::int32_t first_unmapped(std::int32_t b, std::int32_t length, std::int32_t first,
                                                  std::int32_t step) const noexcept {
    return prefill_cache_checks<T, Layout>{cache}.first_unmapped(b, length, first, step);
  }
  /// The lowest non_finite_lse / non_finite_query word of the rows looked
  /// at (index: the query head), or batch_status_clear.
  KVEVICT_HOST_DEVICE std::uint64_t head_problem(std::int32_t b, std::int32_t h, std::int32_t length,
                                                 std::int32_t first, std::int32_t step) const noexcept {
    std::uint64_t word = batch_status_clear;
    const std::int64_t rows = std::int64_t{group_size} * length;
    for (std::int64_t r = first; r < rows; r += step) {
      const std::int32_t q = h * group_size + static_cast<std::int32_t>(r / length);
      const std::int32_t i = static_cast<std::int32_t>(r % length);
      std::uint64_t found = batch_status_clear;
      if (classify_input(in.lse(b, q, i), false) != batch_code::ok) {
        found = pack_status(b, h, q, batch_code::non_finite_lse);
      } else {
        for (std::int32_t d = 0; d < cache.head_dim; ++d)
          if (classify_input(to_float(in.q(b, q, i, d)), false) != batch_code::ok) {
            found = pack_status(b, h, q, batch_code::non_finite_query);
            break;
          }
      }
      if (found < word) word = found;
    }
    return word;
  }
};

/// Trailing pages of the prompt a paged cache no longer needs after prefill.
template <class T, class Layout>
KVEVICT_HOST_DEVICE std::int32_t prefill_reclaimable_pages(const kv_view<T, Layout>& cache, std::int32_t budget,
                                                           std::int32_t capacity, std::int32_t length) noexcept {
  if constexpr (std::is_same_v<Layout, paged_layout>) {
    const std::int32_t page = cache.layout.page_size;
    const std::int32_t keep = budget + 1 < capacity ? budget + 1 : capacity;
    const std::int32_t spare = pages_for(length, page) - pages_for(keep, page);
    return spare > 0 ? spare : 0;
  } else {
    (void)cache, (void)budget, (void)capacity, (void)length;
    return 0;
  }
}

/// The slot table of (b, h) after prefill, slots first, first + step, ...:
/// slot s < kept holds plan.source(s) with score(position) in the current
/// buffer; free slots hold -1 and 0; the spare buffer is 0. Positions are
/// read (by source) from `chosen`, never from the table, so threads may
/// write any slots in any order.
KVEVICT_EXEC_CHECK_DISABLE
template <class Score>
KVEVICT_HOST_DEVICE void commit_prefill_slots(const batch_state_view& st, std::int32_t b, std::int32_t h,
                                              const prefill_plan& plan, const std::int32_t* chosen, Score score,
                                              std::int32_t first, std::int32_t step) {
  std::int32_t* positions = st.slots.positions_of(b, h);
  float* current = st.scores_of(b, h);
  float* spare = st.spare_scores_of(b, h);
  for (std::int32_t s = first; s < st.capacity(); s += step) {
    const std::int32_t p = s < plan.kept ? plan.source(s, chosen) : -1;
    positions[s] = p;
    current[s] = p >= 0 ? score(p) : 0.0f;
    spare[s] = 0.0f;
  }
}

/// The counters of (b, h) after prefill (one thread per head).
KVEVICT_HOST_DEVICE inline void commit_prefill_counters(const batch_state_view& st, std::int32_t b, std::int32_t h,
                                                        std::int32_t kept) noexcept {
  const std::int64_t bh = st.head_index(b, h);
  st.slots.counts[bh] = kept;
  st.slots.next_slots[bh] = kept;  // kept <= budget < capacity
  st.appended[bh] = 0;
}

// ---- argument checks, shared with the CUDA launchers ----

inline void require_prefill_call(const site& w, const batch_state_view& st, const active_set& active,
                                 const prompt_lengths& prompts, const std::uint64_t* status) {
  require_state(w, st);
  require_active(w, active, st.num_seqs());
  require_not_null(w, "status", status);
  if (st.history.keys)
    fail<invalid_argument>(w, "state",
                           "belongs to exact_greedy (it has a history): batched prefill of exact_greedy is not "
                           "supported, since its history would need every prompt row; use "
                           "exact_greedy_policy::prefill per sequence");
  require_not_null(w, "prompts.lengths", prompts.lengths);
  if (prompts.max_length < 1 || prompts.max_length > st.capacity())
    fail<out_of_range>(w, "prompts.max_length", "= ", prompts.max_length, " is outside [1, capacity = ",
                       st.capacity(), "]");
}

/// Extents [B][Hq][>= max_length]... with at_least for the dimensions after the second.
template <class V>
void require_prefill_extents(const site& w, const char* arg, const V& view, const std::int32_t (&expected)[V::rank],
                             int exact_last = 0) {
  bool at_least[V::rank] = {};
  for (int d = 2; d < V::rank - exact_last; ++d) at_least[d] = true;
  require_extents(w, arg, view, expected, at_least);
}

inline void require_prefill_input(const site& w, const batch_state_view& st, const prompt_lengths& prompts,
                                  const batch_prefill_probs& in) {
  const std::int32_t m = prompts.max_length;
  require_prefill_extents(w, "probs", in.probs, {st.num_seqs(), st.num_q_heads, m, m});
}

inline void require_prefill_input(const site& w, const batch_state_view& st, const prompt_lengths& prompts,
                                  const batch_prefill_sums& in) {
  require_prefill_extents(w, "sums", in.sums, {st.num_seqs(), st.num_q_heads, prompts.max_length});
}

template <class Q, class T, class Layout>
void require_prefill_input(const site& w, const batch_state_view& st, const prompt_lengths& prompts,
                           const batch_prefill_queries<Q>& in, const kv_view<T, Layout>& cache) {
  require_prefill_extents(w, "q", in.q, {st.num_seqs(), st.num_q_heads, prompts.max_length, cache.head_dim}, 1);
  require_prefill_extents(w, "lse", in.lse, {st.num_seqs(), st.num_q_heads, prompts.max_length});
  require_scale(w, in.scale);
  require_lse_base(w, "base", in.base);
}

/// recent_window and random keep positions without scores; h2o cannot.
inline void require_scoreless_rule(const site& w, const batch_state_view& st) {
  if (st.rule.victim == victim_rule::lowest_score)
    fail<invalid_argument>(w, "state", "belongs to h2o, whose prefill needs scores: pass batch_prefill_probs, "
                                       "batch_prefill_sums or batch_prefill_queries");
}

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
    for (std::int32_t p = 0; p < length; ++p) {
      const T* key = cache.k_row(b, h, p);
      batch_code code = batch_code::ok;
      for (std::int32_t j = 0; j < g; ++j) {
        const std::int32_t q = h * g + j;
        (*total)[std::size_t(j)] = prefill_column_sum(p, length, [&](std::int32_t i) {
          const float x = prefill_query_value(&in.q(b, q, i, 0), in.q.strides[3], key, cache.head_dim, in.scale,
                                              in.lse(b, q, i), in.base);
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
      commit_prefill_counters(st, b, h, plan.kept);
    }
    st.slots.lengths[b] = length;
    if (reclaimable_pages)
      reclaimable_pages[b] = cache ? prefill_reclaimable_pages(*cache, st.rule.budget, st.capacity(), length) : 0;
  });
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
  const std::size_t m = static_cast<std::size_t>(prompts.max_length);
  std::vector<prefill_accumulator> chunk(m), total(std::size_t(st.group_size()) * m);
  std::vector<batch_code> codes(m);
  const detail::host_probs_scores scorer{in, st.group_size(), st.rule.reduce, st.rule.decay, &chunk, &total, &codes};
  detail::host_prefill(st, active, prompts, scorer, detail::prefill_cache_checks<T, Layout>{cache}, &cache,
                       reclaimable_pages, status);
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
  const detail::host_sums_scores scorer{in, st.group_size(), st.rule.reduce};
  detail::host_prefill(st, active, prompts, scorer, detail::prefill_cache_checks<T, Layout>{cache}, &cache,
                       reclaimable_pages, status);
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
  std::vector<float> total(static_cast<std::size_t>(st.group_size()));
  const detail::host_query_scores<Q, T, Layout> scorer{in, cache, st.group_size(), st.rule.reduce, st.rule.decay, &total};
  detail::host_prefill(st, active, prompts, scorer,
                       detail::prefill_query_checks<Q, T, Layout>{cache, in, st.group_size()}, &cache,
                       reclaimable_pages, status);
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
  detail::host_prefill(st, active, prompts, detail::host_no_scores{}, detail::prefill_cache_checks<T, Layout>{cache},
                       &cache, reclaimable_pages, status);
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
  const detail::host_sums_scores scorer{in, st.group_size(), st.rule.reduce};
  detail::host_prefill(st, active, prompts, scorer, detail::prefill_no_checks{},
                       static_cast<const kv_view<float, strided_layout>*>(nullptr), nullptr, status);
}

}  // namespace kvevict
