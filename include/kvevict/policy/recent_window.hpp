#pragma once
// Recent window with attention sinks (StreamingLLM, Xiao et al., ICLR 2024):
// keep the first `sinks` positions and the `window` newest. Scores are still
// accumulated when observed (for inspection), but never affect a decision.
#include <cstdint>

#include "kvevict/error.hpp"
#include "kvevict/order.hpp"
#include "kvevict/policy/policy_base.hpp"

namespace kvevict {

struct recent_window_config {
  std::int32_t sinks = 0;
  std::int32_t window = 0;

  /// sinks + window, computed in 64 bits (the constructor rejects overflow).
  std::int64_t budget() const noexcept { return std::int64_t{sinks} + window; }
};

class recent_window_policy;

template <>
struct policy_traits<recent_window_policy> {
  using config_type = recent_window_config;
  static constexpr const char* name = "recent_window_policy";
  static constexpr bool has_streams = false;
  static constexpr bool has_history = false;

  /// Validates `c` and returns the rule: the oldest token that is not a sink.
  static decode_rule rule(const recent_window_config& c, const char* function = "constructor") {
    const detail::site w{name, function};
    if (c.sinks < 0) detail::fail<budget_error>(w, "config.sinks", "= ", c.sinks, " is negative");
    if (c.window < 0) detail::fail<budget_error>(w, "config.window", "= ", c.window, " is negative");
    decode_rule r;
    r.victim = victim_rule::oldest;
    r.protect = {c.sinks, 0};
    r.budget = detail::budget_sum(w, "config.sinks + config.window", c.sinks, c.window);
    return r;
  }
};

class recent_window_policy : public policy_base<recent_window_policy> {
 public:
  recent_window_policy(const policy_shape& shape, const recent_window_config& config)
      : policy_base("recent_window_policy", shape, policy_traits<recent_window_policy>::rule(config)),
        config_(config) {}

  const recent_window_config& config() const noexcept { return config_; }

  void select_keep(std::int32_t, std::int32_t, std::int32_t length, const float*, std::int32_t,
                   std::int32_t* keep) const {
    keep_top_keys(length, config_.sinks, 0, [](std::int32_t p) { return p; }, keep);
  }

  using policy_base::prefill;
  /// Prefill needs no scores: first sinks + last window.
  template <class T, class Layout>
  prefill_result prefill(std::int32_t b, std::int32_t length, const kv_view<T, Layout>& view) {
    return prefill_without_scores(b, length, view);
  }

 private:
  recent_window_config config_;
};

}  // namespace kvevict
