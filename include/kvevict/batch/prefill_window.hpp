#pragma once
// Batched SnapKV prefill (policy/snapkv.hpp; docs/semantics.md, "Decode
// cycle": prefill compression): every active sequence's prompt scored by the
// attention of its last `window` rows, pooled along positions and folded
// over the group, then kept and compacted as every batched prefill
// (prefill.hpp), with the last max(recent, window) positions protected.
// The rules here are KVEVICT_HOST_DEVICE: the host backend below and the
// CUDA kernels (kvevict/cuda/prefill_scores.cuh) share them.
//
// Status words, beside those of every batched prefill:
//   - bad_length (head 0, index L) for a prompt shorter than the window,
//     found with the per-head checks: after not_empty and bad_page, unlike
//     the other bad_length (a length outside [1, capacity]), which comes
//     first;
//   - per head, non_finite_lse / non_finite_query (index: the query head)
//     for a window row's LSE or query;
//   - per head and column p: the lowest element code of column p's window
//     sums (nan_input, infinite_input, negative_probability: a probability,
//     or a logit that is not finite), else score_overflow when a window sum
//     is not finite; then score_overflow at p when the pooled fold is not
//     finite although every sum it reads is (a bad sum is reported at its
//     own column, not again at its neighbours).
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

#include "kvevict/batch/inputs.hpp"
#include "kvevict/batch/prefill.hpp"
#include "kvevict/batch/prefill_rules.hpp"
#include "kvevict/batch/state.hpp"
#include "kvevict/batch/status.hpp"
#include "kvevict/batch/validate.hpp"
#include "kvevict/dtype/convert.hpp"
#include "kvevict/kv_view.hpp"
#include "kvevict/policy/decode_rules.hpp"
#include "kvevict/policy/snapkv.hpp"

namespace kvevict {
namespace detail {

// ---- the rules both backends run ----

/// Element (b, q, prompt row i, column p) of window probabilities.
struct window_probs_source {
  batch_window_probs in;
  KVEVICT_HOST_DEVICE float value(std::int32_t b, std::int32_t q, std::int32_t length, std::int32_t i,
                                  std::int32_t p) const noexcept {
    return in.probs(b, q, i - (length - in.snap.window), p);
  }
};

/// The same from logits + LSE: the probability, or the logit itself when it
/// is not finite, so that it is reported as the input.
struct window_logits_source {
  batch_window_logits in;
  KVEVICT_HOST_DEVICE float value(std::int32_t b, std::int32_t q, std::int32_t length, std::int32_t i,
                                  std::int32_t p) const noexcept {
    const std::int32_t r = i - (length - in.snap.window);
    const float logit = in.logits(b, q, r, p);
    if (classify_input(logit, false) != batch_code::ok) return logit;
    return probability_from_logit(logit, in.scale, in.lse(b, q, r), in.base);
  }
};

/// Row i's element as window_column_sum adds it: classified into `code`,
/// then decayed. (Functors, not lambdas: a lambda made inside a host-device
/// function could not call the host backend's host-only value().)
template <class Value>
struct classified_row {
  const Value& value;
  batch_code& code;
  float decay;
  std::int32_t length;

  KVEVICT_EXEC_CHECK_DISABLE
  KVEVICT_HOST_DEVICE float operator()(std::int32_t i) const {
    const float x = value(i);
    code = lower_code(code, classify_input(x, true));
    return decayed_row(decay, length, i, x);
  }
};

/// sum(q, p) of snapkv.hpp from value(i), each element classified into
/// `code`; score_overflow when the sum of sound elements is not finite.
KVEVICT_EXEC_CHECK_DISABLE
template <class Value>
KVEVICT_HOST_DEVICE float window_column_sum(std::int32_t p, std::int32_t length, std::int32_t window, float decay,
                                            const Value& value, batch_code& code) {
  const float sum = snap_column_sum(p, length, window, classified_row<Value>{value, code, decay, length});
  if (code == batch_code::ok && classify_input(sum, false) != batch_code::ok) code = batch_code::score_overflow;
  return sum;
}

/// Query head q's window sums as snap_pool reads them, noting any that is
/// not finite.
template <class SumOf>
struct pooled_sums {
  const SumOf& sum_of;
  std::int32_t q;
  bool& inherited;

  KVEVICT_EXEC_CHECK_DISABLE
  KVEVICT_HOST_DEVICE float operator()(std::int32_t j) const {
    const float x = sum_of(q, j);
    if (classify_input(x, false) != batch_code::ok) inherited = true;
    return x;
  }
};

/// Query head q's pooled value of column p.
template <class SumOf>
struct pooled_column {
  const snap_window& snap;
  const SumOf& sum_of;
  std::int32_t p, length;
  bool& inherited;

  KVEVICT_EXEC_CHECK_DISABLE
  KVEVICT_HOST_DEVICE float operator()(std::int32_t q) const {
    return snap_pool(snap, p, length, pooled_sums<SumOf>{sum_of, q, inherited});
  }
};

/// score(h, p) of snapkv.hpp from the group's window sums sum_of(q, j); its
/// code is score_overflow when the fold is not finite although every sum
/// read is (a sum that is not finite was reported at its own column).
KVEVICT_EXEC_CHECK_DISABLE
template <class SumOf>
KVEVICT_HOST_DEVICE slot_increment fold_window_column(const snap_window& snap, std::int32_t p, std::int32_t length,
                                                      std::int32_t first_q, std::int32_t g, group_reduce reduce,
                                                      const SumOf& sum_of) {
  bool inherited = false;
  slot_increment inc = fold_prefill_column(first_q, g, reduce, pooled_column<SumOf>{snap, sum_of, p, length, inherited});
  if (inherited) inc.code = batch_code::ok;
  return inc;
}

/// Per-row checks of the window inputs: none for probabilities.
struct window_no_row_checks {
  static constexpr bool reads_keys = false;
  KVEVICT_HOST_DEVICE batch_code problem(std::int32_t, std::int32_t, std::int32_t) const noexcept {
    return batch_code::ok;
  }
};

/// Logits: each window row's LSE.
struct window_lse_checks {
  static constexpr bool reads_keys = false;
  tensor_view<const float, 3> lse;
  KVEVICT_HOST_DEVICE batch_code problem(std::int32_t b, std::int32_t q, std::int32_t r) const noexcept {
    return classify_input(lse(b, q, r), false) != batch_code::ok ? batch_code::non_finite_lse : batch_code::ok;
  }
};

/// Queries: each window row's LSE, then its query.
template <class Q>
struct window_query_checks {
  static constexpr bool reads_keys = true;  ///< q . k: the head's fp8 scales are checked
  batch_window_queries<Q> in;
  std::int32_t head_dim = 0;
  KVEVICT_HOST_DEVICE batch_code problem(std::int32_t b, std::int32_t q, std::int32_t r) const noexcept {
    if (classify_input(in.lse(b, q, r), false) != batch_code::ok) return batch_code::non_finite_lse;
    for (std::int32_t d = 0; d < head_dim; ++d)
      if (classify_input(to_float(in.q(b, q, r, d)), false) != batch_code::ok) return batch_code::non_finite_query;
    return batch_code::ok;
  }
};

/// The checks of prepare: the pages, a prompt that holds the window, and
/// per head the rows of its group (rows first, first + step, ... of the
/// g * window (query head, row) pairs, query head major).
template <class T, class Layout, class Rows>
struct prefill_window_checks {
  kv_view<T, Layout> cache;
  Rows rows;
  std::int32_t window = 1;
  std::int32_t group_size = 1;

  KVEVICT_HOST_DEVICE std::int32_t first_unmapped(std::int32_t b, std::int32_t length, std::int32_t first,
                                                  std::int32_t step) const noexcept {
    return prefill_cache_checks<T, Layout>{cache}.first_unmapped(b, length, first, step);
  }
  KVEVICT_HOST_DEVICE std::uint64_t head_problem(std::int32_t b, std::int32_t h, std::int32_t length,
                                                 std::int32_t first, std::int32_t step) const noexcept {
    if (length < window) return pack_status(b, 0, length, batch_code::bad_length);  // every head says the same
    std::uint64_t word = Rows::reads_keys ? kv_scale_problem(cache, b, h) : batch_status_clear;
    for (std::int32_t x = first; x < group_size * window; x += step) {
      const std::int32_t q = h * group_size + x / window;
      const batch_code code = rows.problem(b, q, x % window);
      if (code != batch_code::ok) {
        const std::uint64_t found = pack_status(b, h, q, code);
        if (found < word) word = found;
      }
    }
    return word;
  }
};

// ---- argument checks, shared with the CUDA launchers ----

inline void require_window_call(const site& w, const batch_state_view& st, const prompt_lengths& prompts,
                                const snap_window& snap) {
  require_snap_window(w, "in.snap", snap, st.rule);
  if (snap.window > prompts.max_length)
    fail<out_of_range>(w, "in.snap.window", "= ", snap.window, " exceeds prompts.max_length = ", prompts.max_length,
                       ": the observation window is longer than every prompt");
}

/// Extents exactly as expected, the last at least when `last_at_least`
/// (the columns of a window row).
template <class V>
void require_window_extents(const site& w, const char* arg, const V& view, const std::int32_t (&expected)[V::rank],
                            bool last_at_least) {
  bool at_least[V::rank] = {};
  at_least[V::rank - 1] = last_at_least;
  require_extents(w, arg, view, expected, at_least);
}

inline void require_window_input(const site& w, const batch_state_view& st, const prompt_lengths& prompts,
                                 const batch_window_probs& in) {
  require_window_call(w, st, prompts, in.snap);
  require_window_extents(w, "probs", in.probs, {st.num_seqs(), st.num_q_heads, in.snap.window, prompts.max_length},
                         true);
}

inline void require_window_input(const site& w, const batch_state_view& st, const prompt_lengths& prompts,
                                 const batch_window_logits& in) {
  require_window_call(w, st, prompts, in.snap);
  require_window_extents(w, "logits", in.logits,
                         {st.num_seqs(), st.num_q_heads, in.snap.window, prompts.max_length}, true);
  require_window_extents(w, "lse", in.lse, {st.num_seqs(), st.num_q_heads, in.snap.window}, false);
  require_scale(w, in.scale);
  require_lse_base(w, "base", in.base);
}

template <class Q, class T, class Layout>
void require_window_input(const site& w, const batch_state_view& st, const prompt_lengths& prompts,
                          const batch_window_queries<Q>& in, const kv_view<T, Layout>& cache) {
  require_window_call(w, st, prompts, in.snap);
  require_window_extents(w, "q", in.q, {st.num_seqs(), st.num_q_heads, in.snap.window, cache.head_dim}, false);
  require_window_extents(w, "lse", in.lse, {st.num_seqs(), st.num_q_heads, in.snap.window}, false);
  require_scale(w, in.scale);
  require_lse_base(w, "base", in.base);
}

// ---- the host backend ----

/// The host scorer: the group's window sums of every column first (their
/// codes per column), then the pooled fold of each column.
template <class Value>
struct host_window_scores {
  static constexpr bool has_scores = true;
  Value value;  ///< value(b, h, q, length, i, p): the element of row i, column p
  snap_window snap;
  std::int32_t group_size;
  group_reduce reduce;
  float decay;
  std::vector<float>* sums;        // [g][max_length]
  std::vector<batch_code>* codes;  // [max_length]

  std::uint64_t score_head(std::int32_t b, std::int32_t h, std::int32_t length, float* out) const {
    const std::int32_t g = group_size;
    const std::size_t m = codes->size();
    std::fill(codes->begin(), codes->end(), batch_code::ok);
    // A row at a time (add_window_row: window_column_sum's order and codes).
    for (std::int32_t j = 0; j < g; ++j) {
      float* sum = sums->data() + std::size_t(j) * m;
      for (std::int32_t i = length - snap.window; i < length; ++i)
        add_window_row(sum, i, length - snap.window, row_decay(decay, length, i), [&](std::int32_t p) {
          const float x = value(b, h, h * g + j, length, i, p);
          if (!(x >= 0.0f && x <= std::numeric_limits<float>::max()))  // NaN fails the first test
            (*codes)[std::size_t(p)] = lower_code((*codes)[std::size_t(p)], classify_input(x, true));
          return x;
        });
      for (std::int32_t p = 0; p < length; ++p)
        if ((*codes)[std::size_t(p)] == batch_code::ok && classify_input(sum[p], false) != batch_code::ok)
          (*codes)[std::size_t(p)] = batch_code::score_overflow;  // as window_column_sum
    }
    for (std::int32_t p = 0; p < length; ++p) {
      const slot_increment inc = fold_window_column(snap, p, length, h * g, g, reduce, [&](std::int32_t q, std::int32_t c) {
        return (*sums)[std::size_t(q - h * g) * m + std::size_t(c)];
      });
      out[p] = inc.value;
      const batch_code code = lower_code((*codes)[std::size_t(p)], inc.code);
      if (code != batch_code::ok) return pack_status(b, h, p, code);  // p ascends: the head's lowest word
    }
    return batch_status_clear;
  }
};

/// host_prefill with the window protected and the window's checks.
template <class Value, class Rows, class T, class Layout>
void host_window_prefill(const batch_state_view& st, const active_set& active, const prompt_lengths& prompts,
                         const snap_window& snap, Value value, Rows rows, const kv_view<T, Layout>& cache,
                         std::int32_t* reclaimable_pages, std::uint64_t* status) {
  const std::size_t m = static_cast<std::size_t>(prompts.max_length);
  std::vector<float> sums(std::size_t(st.group_size()) * m);
  std::vector<batch_code> codes(m);
  const host_window_scores<Value> scorer{value, snap, st.group_size(), st.rule.reduce, st.rule.decay, &sums, &codes};
  batch_state_view keep = st;
  keep.rule = snap_keep_rule(st.rule, snap);
  host_prefill(keep, active, prompts, scorer,
               prefill_window_checks<T, Layout, Rows>{cache, rows, snap.window, st.group_size()}, &cache,
               reclaimable_pages, status);
}

/// The window prefill from a matrix-like source (probs, logits + LSE) with
/// the row checks `rows`.
template <class Source, class Rows, class T, class Layout>
void run_window_prefill(const batch_state_view& st, const active_set& active, const prompt_lengths& prompts,
                        const snap_window& snap, const Source& source, Rows rows, const kv_view<T, Layout>& cache,
                        std::int32_t* reclaimable_pages, std::uint64_t* status) {
  host_window_prefill(
      st, active, prompts, snap,
      [source](std::int32_t b, std::int32_t, std::int32_t q, std::int32_t length, std::int32_t i, std::int32_t p) {
        return source.value(b, q, length, i, p);
      },
      rows, cache, reclaimable_pages, status);
}

template <class T, class Layout>
void run_prefill(const batch_state_view& st, const active_set& active, const prompt_lengths& prompts,
                 const batch_window_probs& in, const kv_view<T, Layout>& cache, std::int32_t* reclaimable_pages,
                 std::uint64_t* status) {
  run_window_prefill(st, active, prompts, in.snap, window_probs_source{in}, window_no_row_checks{}, cache,
                     reclaimable_pages, status);
}

template <class T, class Layout>
void run_prefill(const batch_state_view& st, const active_set& active, const prompt_lengths& prompts,
                 const batch_window_logits& in, const kv_view<T, Layout>& cache, std::int32_t* reclaimable_pages,
                 std::uint64_t* status) {
  run_window_prefill(st, active, prompts, in.snap, window_logits_source{in}, window_lse_checks{in.lse}, cache,
                     reclaimable_pages, status);
}

template <class Q, class T, class Layout>
void run_prefill(const batch_state_view& st, const active_set& active, const prompt_lengths& prompts,
                 const batch_window_queries<Q>& in, const kv_view<T, Layout>& cache, std::int32_t* reclaimable_pages,
                 std::uint64_t* status) {
  host_window_prefill(
      st, active, prompts, in.snap,
      [&](std::int32_t b, std::int32_t h, std::int32_t q, std::int32_t length, std::int32_t i, std::int32_t p) {
        const std::int32_t r = i - (length - in.snap.window);
        return prefill_query_value(&in.q(b, q, r, 0), in.q.strides[3], cache.k_row(b, h, p), cache.k_scale(h),
                                   cache.head_dim, in.scale, in.lse(b, q, r), in.base);
      },
      window_query_checks<Q>{in, cache.head_dim}, cache, reclaimable_pages, status);
}

}  // namespace detail

/// SnapKV prefill compression of every active sequence from the
/// probabilities of its last in.snap.window prompt rows; the kept rows of
/// `cache` move to slots [0, kept). reclaimable_pages: optional [B]. The
/// state's rule must keep by score (h2o).
template <class T, class Layout>
void batched_prefill(const batch_state_view& st, const active_set& active, const prompt_lengths& prompts,
                     const batch_window_probs& in, const kv_view<T, Layout>& cache, std::int32_t* reclaimable_pages,
                     std::uint64_t* status) {
  const detail::site w{"batch", "prefill"};
  detail::require_prefill_call(w, st, active, prompts, status);
  detail::require_cache(w, st, cache);
  detail::require_window_input(w, st, prompts, in);
  detail::run_prefill(st, active, prompts, in, cache, reclaimable_pages, status);
}

/// The same from the window rows' logits and LSE.
template <class T, class Layout>
void batched_prefill(const batch_state_view& st, const active_set& active, const prompt_lengths& prompts,
                     const batch_window_logits& in, const kv_view<T, Layout>& cache, std::int32_t* reclaimable_pages,
                     std::uint64_t* status) {
  const detail::site w{"batch", "prefill"};
  detail::require_prefill_call(w, st, active, prompts, status);
  detail::require_cache(w, st, cache);
  detail::require_window_input(w, st, prompts, in);
  detail::run_prefill(st, active, prompts, in, cache, reclaimable_pages, status);
}

/// The same from the window rows' queries and LSE, the probabilities
/// recomputed from the keys in slots [0, L) of `cache`.
template <class Q, class T, class Layout>
void batched_prefill(const batch_state_view& st, const active_set& active, const prompt_lengths& prompts,
                     const batch_window_queries<Q>& in, const kv_view<T, Layout>& cache,
                     std::int32_t* reclaimable_pages, std::uint64_t* status) {
  const detail::site w{"batch", "prefill"};
  detail::require_prefill_call(w, st, active, prompts, status);
  detail::require_cache(w, st, cache);
  detail::require_window_input(w, st, prompts, in, cache);
  detail::run_prefill(st, active, prompts, in, cache, reclaimable_pages, status);
}

}  // namespace kvevict
