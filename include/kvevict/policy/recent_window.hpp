#pragma once
// Recent window with attention sinks (StreamingLLM, Xiao et al., ICLR 2024):
// keep the first `sinks` positions and the `window` newest. Scores are still
// accumulated when observed (for inspection), but never affect a decision.
#include <cstdint>

#include "kvevict/error.hpp"
#include "kvevict/policy/configs.hpp"
#include "kvevict/policy/policy_base.hpp"

namespace kvevict {

class recent_window_policy : public policy_base<recent_window_policy> {
 public:
  recent_window_policy(const policy_shape& shape, const recent_window_config& config)
      : policy_base(shape, policy_traits<recent_window_policy>::rule(config)), config_(config) {}

  const recent_window_config& config() const noexcept { return config_; }

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
