#pragma once
// policy_base: what every per-sequence policy (h2o_policy,
// recent_window_policy, random_policy, exact_greedy_policy) is made of, a
// facade over the batched host backend for one sequence at a time:
//
//   - protocol.hpp: the state, the accessors, append, skip_observe, evict,
//     evict_to, reset, and the per-sequence contract (all or nothing across
//     heads, observe and evict as two calls);
//   - observe_calls.hpp: observe from every decode input;
//   - prefill_calls.hpp: prefill compression from every prompt input.
//
// A policy adds its config and the inputs only it takes (h2o: KeyDiff and
// SnapKV; exact_greedy: its own observe, prefill and evict_to).
#include <cstdint>

#include "kvevict/batch/prefill.hpp"
#include "kvevict/kv_view.hpp"
#include "kvevict/policy/decode_rules.hpp"
#include "kvevict/sequence/observe.hpp"
#include "kvevict/policy/policy_shape.hpp"
#include "kvevict/sequence/prefill.hpp"
#include "kvevict/sequence/protocol.hpp"

namespace kvevict {

template <class Derived>
class policy_base : public detail::sequence_prefill {
 protected:
  policy_base(const policy_shape& shape, const decode_rule& rule)
      : detail::sequence_prefill(policy_traits<Derived>::name, shape, rule,
                                 detail::state_parts{policy_traits<Derived>::has_streams,
                                                     policy_traits<Derived>::has_history, false}) {}

  /// Prefill for policies that need no scores (recent window, random): the
  /// rule's protected ends, and between them the newest (recent window) or
  /// the highest Philox priorities of the sequence's stream (random).
  template <class T, class Layout>
  prefill_result prefill_without_scores(std::int32_t b, std::int32_t length, const kv_view<T, Layout>& view) {
    const detail::site w = where("prefill");
    require_prompt(w, b, length, view);
    return run_one(
        w, b, length,
        [&](const prompt_lengths& prompts, std::int32_t* pages, std::uint64_t* status) {
          detail::run_prefill(state(), active_set::of_list(&b, 1), prompts, view, pages, status);
        },
        [](std::int32_t, std::int32_t) {});
  }
};

}  // namespace kvevict
