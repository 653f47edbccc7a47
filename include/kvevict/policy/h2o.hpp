#pragma once
// H2O, "Heavy-Hitter Oracle" (Zhang et al., NeurIPS 2023): keep the `heavy`
// tokens with the highest accumulated attention plus the `recent` newest.
//
// Decode: once a sequence holds heavy + recent + 1 tokens, the victim is the
// lowest (score, position) among tokens outside the recent window. This is
// exactly the reference "real drop" (re-select top-heavy + last recent every
// step), because the recent window slides by one token per step.
#include <cstdint>

#include "kvevict/error.hpp"
#include "kvevict/order.hpp"
#include "kvevict/policy/policy_base.hpp"

namespace kvevict {

struct h2o_config {
  std::int32_t heavy = 0;   ///< tokens kept by accumulated score
  std::int32_t recent = 0;  ///< newest tokens always kept (the newest included)
  group_reduce reduce = group_reduce::sum;

  /// heavy + recent, computed in 64 bits (the constructor rejects overflow).
  std::int64_t budget() const noexcept { return std::int64_t{heavy} + recent; }
};

class h2o_policy;

template <>
struct policy_traits<h2o_policy> {
  using config_type = h2o_config;
  static constexpr const char* name = "h2o_policy";
  static constexpr bool has_streams = false;
  static constexpr bool has_history = false;

  /// Validates `c` and returns h2o's decode rule: the lowest (score,
  /// position) outside the `recent` newest.
  static decode_rule rule(const h2o_config& c, const char* function = "constructor") {
    const detail::site w{name, function};
    if (c.heavy < 0) detail::fail<budget_error>(w, "config.heavy", "= ", c.heavy, " is negative");
    if (c.recent < 0) detail::fail<budget_error>(w, "config.recent", "= ", c.recent, " is negative");
    detail::require_group_reduce(w, "config.reduce", c.reduce);
    decode_rule r;
    r.victim = victim_rule::lowest_score;
    r.protect = {0, c.recent};
    r.budget = detail::budget_sum(w, "config.heavy + config.recent", c.heavy, c.recent);
    r.reduce = c.reduce;
    return r;
  }
};

class h2o_policy : public policy_base<h2o_policy> {
 public:
  h2o_policy(const policy_shape& shape, const h2o_config& config)
      : policy_base("h2o_policy", shape, policy_traits<h2o_policy>::rule(config)), config_(config) {}

  const h2o_config& config() const noexcept { return config_; }

  void select_keep(std::int32_t, std::int32_t, std::int32_t length, const float* score, std::int32_t* keep) const {
    keep_top_keys(length, 0, config_.recent, [score](std::int32_t p) { return eviction_key(score[p], p); }, keep);
  }

 private:
  h2o_config config_;
};

}  // namespace kvevict
