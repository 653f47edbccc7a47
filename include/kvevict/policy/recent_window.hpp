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

class recent_window_policy : public policy_base<recent_window_policy> {
 public:
  recent_window_policy(const policy_shape& shape, const recent_window_config& config)
      : policy_base("recent_window_policy", shape, checked_budget(config), group_reduce::sum), config_(config) {}

  const recent_window_config& config() const noexcept { return config_; }

  /// The oldest token that is not a sink.
  std::int32_t choose_victim(std::int32_t b, std::int32_t h) const {
    return min_key_victim(b, h, config_.sinks, 0,
                          [](std::int32_t, std::int32_t p) { return static_cast<std::uint64_t>(p); });
  }

  void select_keep(std::int32_t, std::int32_t, std::int32_t length, const float*, std::int32_t* keep) const {
    keep_top_keys(length, config_.sinks, 0, [](std::int32_t p) { return p; }, keep);
  }

  using policy_base::prefill;
  /// Prefill needs no scores: first sinks + last window.
  template <class T, class Layout>
  prefill_result prefill(std::int32_t b, std::int32_t length, const kv_view<T, Layout>& view) {
    return prefill_without_scores(b, length, view);
  }

 private:
  static std::int32_t checked_budget(const recent_window_config& c) {
    const detail::site w{"recent_window_policy", "constructor"};
    if (c.sinks < 0) detail::fail<budget_error>(w, "config.sinks", "= ", c.sinks, " is negative");
    if (c.window < 0) detail::fail<budget_error>(w, "config.window", "= ", c.window, " is negative");
    return detail::budget_sum(w, "config.sinks + config.window", c.sinks, c.window);
  }

  recent_window_config config_;
};

}  // namespace kvevict
