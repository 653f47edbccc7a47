#pragma once
// SnapKV prefill scoring (Li et al., "SnapKV: LLM Knows What You are Looking
// for Before Generation", 2024; docs/policies.md, "SnapKV"): the prompt is
// scored by the attention of its last `window` rows (the observation
// window) only, pooled along positions so that a kept token brings its
// neighbours, and the window itself is always kept.
//
// For a prompt of L rows, w = window, f = L - w (the first window row) and
// query head q:
//
//   sum(q, p)    = sum over rows i in [max(p, f), L) of P[q][i][p], left to
//                  right in ascending i (each row decayed_row-weighted under
//                  a score decay, as every prefill row is);
//   pooled(q, p) = for p < f: the max, or the sum divided by pool_width
//                  (mean), of sum(q, j) over j in [p - r, p + r] with
//                  r = pool_width / 2, positions outside [0, f) counting as
//                  zero (PyTorch's max_pool1d / avg_pool1d with padding r,
//                  as the SnapKV and kvpress code pool); for p >= f (the
//                  window) sum(q, p) itself;
//   score(h, p)  = fold_group of pooled(q, p) over the group's query heads
//                  (the rule's reduce), as every prefill score is folded.
//
// The keep set protects the window: the last max(recent, window) positions
// (and the sinks), the rest of the budget by the highest (score, position).
// The functions are KVEVICT_HOST_DEVICE: the per-sequence prefill, the
// batched host backend and the CUDA kernels run this code.
#include <cstdint>

#include "kvevict/config.hpp"
#include "kvevict/detail/reproducible_math.hpp"
#include "kvevict/error.hpp"
#include "kvevict/policy/column_sums.hpp"
#include "kvevict/policy/decode_rules.hpp"
#include "kvevict/score_inputs.hpp"
#include "kvevict/tensor_view.hpp"

namespace kvevict {

/// The prompt row of window row r (r in [0, window)).
KVEVICT_HOST_DEVICE constexpr std::int32_t snap_row(std::int32_t length, std::int32_t window, std::int32_t r) noexcept {
  return length - window + r;
}

/// sum(q, p) of the header: value(i) over prompt rows i in [max(p, L - w), L),
/// left to right from the first row. Requires 0 <= p < L and w <= L.
KVEVICT_EXEC_CHECK_DISABLE
template <class Value>
KVEVICT_HOST_DEVICE KVEVICT_REPRODUCIBLE inline float snap_column_sum(std::int32_t p, std::int32_t length,
                                                                      std::int32_t window, Value value) {
  KVEVICT_FP_CONTRACT_OFF
  const std::int32_t first = length - window;
  prefill_accumulator acc;
  for (std::int32_t i = p > first ? p : first; i < length; ++i) acc.add(value(i));
  return acc.sum;
}

/// The host's form of snap_column_sum for a whole row at a time: adds
/// prompt row i's values value(p), p in [0, i], to sums[0, i] in
/// snap_column_sum's order (row `first` starts columns [0, first]; a later
/// row i adds to columns [0, i) and starts column i), so the rows are read
/// contiguously with no per-element branch. `weigh` is row i's row_decay.
template <class Value>
KVEVICT_REPRODUCIBLE inline void add_window_row(float* sums, std::int32_t i, std::int32_t first,
                                                const row_decay& weigh, Value value) {
  KVEVICT_FP_CONTRACT_OFF
  if (i == first) {
    for (std::int32_t p = 0; p <= i; ++p) sums[p] = weigh(value(p));
    return;
  }
  for (std::int32_t p = 0; p < i; ++p) sums[p] = detail::add(sums[p], weigh(value(p)));
  sums[i] = weigh(value(i));
}

/// pooled(q, p) of the header from sum(j) = sum(q, j). Requires 0 <= p < L.
KVEVICT_EXEC_CHECK_DISABLE
template <class Sum>
KVEVICT_HOST_DEVICE KVEVICT_REPRODUCIBLE inline float snap_pool(const snap_window& snap, std::int32_t p,
                                                                std::int32_t length, Sum sum) {
  KVEVICT_FP_CONTRACT_OFF
  const std::int32_t prefix = length - snap.window, r = snap.pool_width / 2;
  if (p >= prefix) return sum(p);
  const std::int32_t lo = p - r > 0 ? p - r : 0, hi = p + r < prefix - 1 ? p + r : prefix - 1;
  if (snap.pooling == snap_pooling::max) {
    // Sums are non-negative (validated probabilities): the zero padding never wins.
    float best = sum(lo);
    for (std::int32_t j = lo + 1; j <= hi; ++j) {
      const float x = sum(j);
      best = x > best ? x : best;
    }
    return best;
  }
  prefill_accumulator acc;
  for (std::int32_t j = lo; j <= hi; ++j) acc.add(sum(j));
  return detail::div(acc.sum, static_cast<float>(snap.pool_width));  // the padding counts (count_include_pad)
}

/// The rule a SnapKV prefill keeps by: the policy's, with the last
/// max(recent, window) positions protected.
KVEVICT_HOST_DEVICE inline decode_rule snap_keep_rule(decode_rule rule, const snap_window& snap) noexcept {
  if (snap.window > rule.protect.recent) rule.protect.recent = snap.window;
  return rule;
}

namespace detail {

/// SnapKV's parameters against the policy's rule: a window of at least one
/// row that fits the budget beside the sinks, an odd pooling width, a known
/// pooling. `arg` names the snap_window in messages.
template <class Where>
void require_snap_window(const Where& where, const char* arg, const snap_window& snap, const decode_rule& rule) {
  if (rule.victim != victim_rule::lowest_score)
    fail<invalid_argument>(where, arg, "asks for SnapKV scores, which only a policy that keeps by score (h2o) uses");
  if (snap.window < 1) fail<out_of_range>(where, concat(arg, ".window"), "= ", snap.window, " is below 1");
  if (std::int64_t{snap.window} + rule.protect.sinks > rule.budget)
    fail<budget_error>(where, concat(arg, ".window"), "= ", snap.window, " plus sinks = ", rule.protect.sinks,
                       " exceeds the budget ", rule.budget, ": the window is always kept");
  if (snap.pool_width < 1 || snap.pool_width % 2 == 0)
    fail<out_of_range>(where, concat(arg, ".pool_width"), "= ", snap.pool_width,
                       " must be odd and positive (a position pools as many neighbours on each side)");
  if (snap.pooling != snap_pooling::max && snap.pooling != snap_pooling::mean)
    fail<invalid_argument>(where, concat(arg, ".pooling"), "= ", static_cast<int>(snap.pooling),
                           " is not a snap_pooling");
}

}  // namespace detail
}  // namespace kvevict
