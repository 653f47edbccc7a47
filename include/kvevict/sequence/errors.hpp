#pragma once
// How the per-sequence calls name what they refuse. The batched backend
// they run on reports a data problem as a status word (sequence, head,
// slot, code); the per-sequence API throws the library's exception naming
// the element instead (`probs[3][17]`, `sums[0][4]`). These functions run
// on the failure path only: they look again at the input the status word
// points to and throw what the per-sequence API has always thrown. They
// decide nothing: the decision and the refusal are the backend's.
#include <cmath>
#include <cstdint>
#include <limits>

#include "kvevict/batch/row_partial.hpp"
#include "kvevict/batch/state.hpp"
#include "kvevict/batch/status.hpp"
#include "kvevict/error.hpp"
#include "kvevict/policy/decode_rules.hpp"
#include "kvevict/policy/input_checks.hpp"

namespace kvevict {
namespace detail {

/// Throws for the first problem of sequence b's decode step through
/// `source`, in the order the per-sequence API has always named them: head
/// by head and slot by slot the first bad input (fail_element(h, s, inc)
/// throws for it) or group fold that overflows; then the first score that
/// the update would take out of the float range. `word`, the backend's
/// status, is the fallback.
template <class Source, class FailElement>
[[noreturn]] void fail_decode_step(const site& w, const batch_state_view& st, std::int32_t b, const Source& source,
                                   const char* arg, FailElement fail_element, std::uint64_t word) {
  const std::int32_t g = st.group_size();
  for (std::int32_t h = 0; h < st.num_heads(); ++h) {
    const std::int32_t* positions = st.slots.positions_of(b, h);
    for (std::int32_t s = 0; s < st.slots.counts[st.head_index(b, h)]; ++s) {
      if (positions[s] < 0) continue;
      const slot_increment inc = source.increment(b, h, s);
      if (inc.code != batch_code::ok) fail_element(h, s, inc);
      if (!std::isfinite(inc.value))
        fail<non_finite_error>(w, concat(arg, "[", h * g, "..", (h + 1) * g - 1, "][", s, "]"), "overflows to ",
                               inc.value, " when reduced over the query heads of KV head ", h);
    }
  }
  for (std::int32_t h = 0; h < st.num_heads(); ++h) {
    const std::int32_t* positions = st.slots.positions_of(b, h);
    const float* score = st.scores_of(b, h);
    for (std::int32_t s = 0; s < st.slots.counts[st.head_index(b, h)]; ++s) {
      if (positions[s] < 0) continue;
      const float inc = source.increment(b, h, s).value;
      if (!std::isfinite(updated_score(st.rule.decay, score[s], inc)))
        fail_state<non_finite_error>(w, "sequence ", b, " head ", h, " slot ", s, ": score ", score[s],
                                     " updated by increment ", inc, " overflows");
    }
  }
  throw_status(w, word, false);  // what no element explains (a page outside the pool: the argument checks catch it)
  fail_state<invalid_argument>(w, "the step was refused");  // not reached: a refusal has a word
}

/// Throws for a refused prefill of one sequence: column(h, p) throws for a
/// problem of column p of KV head h (an element named with its indices, or
/// a total that overflows); any other word becomes the exception the
/// batched call would throw.
template <class Column>
[[noreturn]] void fail_prefill(const site& w, std::uint64_t word, Column column) {
  const batch_status s = batch_status::unpack(word);
  switch (s.code) {
    case batch_code::nan_input:
    case batch_code::infinite_input:
    case batch_code::negative_probability:
    case batch_code::score_overflow:
    case batch_code::non_finite_kv: column(s.head, s.index); break;
    default: break;
  }
  throw_status(w, word, true);
  fail_state<invalid_argument>(w, "the prompt was refused");  // not reached
}

/// Names the first element of column p of the query heads of KV head h
/// (element(q, r) over rows r in [first, end), named arg[q][r][p]) that
/// is not a probability; failing that, the column's total, named
/// total[q0..q1][p], overflowed.
template <class Element>
[[noreturn]] void fail_prefill_column(const site& w, const char* arg, const char* total, std::int32_t g,
                                      std::int32_t h, std::int32_t p, std::int32_t first, std::int32_t end,
                                      Element element) {
  for (std::int32_t q = h * g; q < (h + 1) * g; ++q)
    for (std::int32_t r = first; r < end; ++r) require_probability(w, arg, element(q, r), q, r, p);
  fail<non_finite_error>(w, concat(total, "[", h * g, "..", (h + 1) * g - 1, "][", p, "]"),
                         "overflows when summed and reduced over the query heads of KV head ", h);
}

}  // namespace detail
}  // namespace kvevict
