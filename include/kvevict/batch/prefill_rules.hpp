#pragma once
// The rules of a batched prefill call that the host backend (prefill.hpp)
// and the CUDA kernels (kvevict/cuda/prefill.cuh) share: the batched
// inputs, the keep plan and its selection keys, the per-sequence and
// per-head checks, the slot-table commit (KVEVICT_HOST_DEVICE), and the
// argument checks both launchers run first. The semantics are at the top of
// prefill.hpp.
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "kvevict/batch/inputs.hpp"
#include "kvevict/batch/state.hpp"
#include "kvevict/batch/status.hpp"
#include "kvevict/batch/step.hpp"
#include "kvevict/batch/validate.hpp"
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
#include "kvevict/select/segments.hpp"
#include "kvevict/tensor_view.hpp"

namespace kvevict {

/// The prompt length of every sequence: lengths[b] (host memory on the host,
/// device memory on CUDA), each at most max_length, a bound known on the
/// host that sizes the inputs and the workspace (1 <= max_length <=
/// capacity). Only active sequences' entries are read.
struct prompt_lengths {
  const std::int32_t* lengths = nullptr;
  std::int32_t max_length = 0;
};

static_assert(std::is_trivially_copyable_v<prompt_lengths>, "inputs go to kernels by value");

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
  std::int32_t first_head = 0;             ///< random_priority: the layer-wide index of head 0
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
      const std::uint32_t draw = random_draw(seed, random_use::prefill_priority, streams[i / heads], first_head + i % heads, p);
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
/// key_scale: the key row's kv_value scale (the view's k_scale(h)).
template <class Q, class K>
KVEVICT_HOST_DEVICE inline float prefill_query_value(const Q* q, std::int64_t q_stride, const K* key, float key_scale,
                                                     std::int32_t head_dim, float scale, float lse,
                                                     lse_base base) noexcept {
  const float logit = attention_logit(q, q_stride, key, head_dim, key_scale);
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

/// With a cache: every page of slots [0, L) must be in the pool; when the
/// scoring reads keys (ReadsKeys), each head's fp8 scales must be good.
template <class T, class Layout, bool ReadsKeys = false>
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
  KVEVICT_HOST_DEVICE std::uint64_t head_problem(std::int32_t b, std::int32_t h, std::int32_t, std::int32_t,
                                                 std::int32_t) const noexcept {
    if constexpr (ReadsKeys) return kv_scale_problem(cache, b, h);
    (void)b, (void)h;
    return batch_status_clear;
  }
};

/// The checks of a prefill scored from the cached keys alone (key norms,
/// KeyDiff).
template <class T, class Layout>
using prefill_key_checks = prefill_cache_checks<T, Layout, true>;

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
  /// at (index: the query head) or bad_kv_scale word, or batch_status_clear.
  KVEVICT_HOST_DEVICE std::uint64_t head_problem(std::int32_t b, std::int32_t h, std::int32_t length,
                                                 std::int32_t first, std::int32_t step) const noexcept {
    std::uint64_t word = kv_scale_problem(cache, b, h);
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

/// The counters of (b, h) after prefill of a `length`-token prompt (one
/// thread per head).
KVEVICT_HOST_DEVICE inline void commit_prefill_counters(const batch_state_view& st, std::int32_t b, std::int32_t h,
                                                        std::int32_t kept, std::int32_t length) noexcept {
  const std::int64_t bh = st.head_index(b, h);
  st.slots.counts[bh] = kept;
  set_next_slot(st, b, h, kept, length);  // kept <= budget < capacity
  st.appended[bh] = 0;
  if (st.anchors.upto) st.anchors.upto[bh] = -1;  // a KeyDiff anchor counts the kept keys afresh
}

// ---- argument checks, shared with the CUDA launchers ----

/// The arguments every batched prefill checks first.
inline void require_prefill_args(const site& w, const batch_state_view& st, const active_set& active,
                                 const prompt_lengths& prompts, const std::uint64_t* status) {
  require_state(w, st);
  require_active(w, active, st.num_seqs());
  require_not_null(w, "status", status);
  require_not_null(w, "prompts.lengths", prompts.lengths);
  if (prompts.max_length < 1 || prompts.max_length > st.capacity())
    fail<out_of_range>(w, "prompts.max_length", "= ", prompts.max_length, " is outside [1, capacity = ",
                       st.capacity(), "]");
}

/// require_prefill_args for a prefill scored from attention or keys: not
/// exact_greedy's, whose prefill takes the last prompt row's queries
/// (prefill_exact_greedy.hpp, on the host).
inline void require_prefill_call(const site& w, const batch_state_view& st, const active_set& active,
                                 const prompt_lengths& prompts, const std::uint64_t* status) {
  require_prefill_args(w, st, active, prompts, status);
  if (st.history.keys)
    fail<invalid_argument>(w, "state",
                           "belongs to exact_greedy (it has a history): its prefill is the greedy removal judged "
                           "with the last prompt row's queries; pass batch_queries and the cache (on the host)");
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

}  // namespace detail
}  // namespace kvevict
