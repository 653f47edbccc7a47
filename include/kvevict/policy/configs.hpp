#pragma once
// The four policies' configurations and what their classes tell the
// batched backends (policy_traits: config_type, name, the state's parts,
// rule(config) which validates a config and returns its decode_rule). The
// policy classes (h2o.hpp, recent_window.hpp, random.hpp,
// exact_greedy.hpp) are the per-sequence API over the batched host
// backend; a batched state needs only these (batch/state.hpp). A new
// decode rule is registered here, once for C++.
#include <cstdint>

#include "kvevict/error.hpp"
#include "kvevict/policy/decode_rules.hpp"
#include "kvevict/policy/policy_shape.hpp"
#include "kvevict/score_inputs.hpp"

namespace kvevict {

// ---- h2o: heavy hitters + recent (and TOVA, key-norm, KeyDiff, SnapKV) ----

struct h2o_config {
  std::int32_t heavy = 0;   ///< tokens kept by accumulated score
  std::int32_t recent = 0;  ///< newest tokens always kept (the newest included)
  group_reduce reduce = group_reduce::sum;
  float decay = 1.0f;       ///< gamma in [0, 1]: 1 accumulates (H2O), 0 is TOVA
  std::int32_t sinks = 0;   ///< first positions always kept (attention sinks)

  /// sinks + heavy + recent, computed in 64 bits (the constructor rejects overflow).
  std::int64_t budget() const noexcept { return std::int64_t{sinks} + heavy + recent; }
};

/// TOVA (Oren et al., "Transformers are Multi-State RNNs", 2024): h2o with
/// decay 0, so the victim is the token the newest query attends to least.
inline h2o_config tova_config(std::int32_t heavy, std::int32_t recent = 0, std::int32_t sinks = 0,
                              group_reduce reduce = group_reduce::mean) noexcept {
  h2o_config c;
  c.heavy = heavy;
  c.recent = recent;
  c.sinks = sinks;
  c.reduce = reduce;
  c.decay = 0.0f;
  return c;
}

/// Key-norm (Devoto et al., "A Simple and Effective L2 Norm-Based Strategy
/// for KV Cache Compression", 2024): h2o with decay 0 that observes
/// key_norms instead of attention, so it keeps the `kept` keys of the
/// smallest L2 norm beside the sinks and the recent window.
inline h2o_config key_norm_config(std::int32_t kept, std::int32_t recent = 0, std::int32_t sinks = 0) noexcept {
  h2o_config c;
  c.heavy = kept;
  c.recent = recent;
  c.sinks = sinks;
  c.decay = 0.0f;
  return c;
}

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
    if (c.sinks < 0) detail::fail<budget_error>(w, "config.sinks", "= ", c.sinks, " is negative");
    detail::require_group_reduce(w, "config.reduce", c.reduce);
    detail::require_decay(w, "config.decay", c.decay);
    decode_rule r;
    r.victim = victim_rule::lowest_score;
    r.protect = {c.sinks, c.recent};
    const std::int32_t kept = detail::budget_sum(w, "config.heavy + config.recent", c.heavy, c.recent);
    r.budget = detail::budget_sum(w, "config.sinks + config.heavy + config.recent", c.sinks, kept);
    r.reduce = c.reduce;
    r.decay = c.decay;
    return r;
  }
};

// ---- recent window with attention sinks (StreamingLLM) ----

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

// ---- random ----

struct random_config {
  std::int32_t budget = 0;
  std::int32_t sinks = 0;   ///< first positions never evicted
  std::int32_t recent = 0;  ///< newest positions never evicted
  std::uint64_t seed = 0;
};

class random_policy;

template <>
struct policy_traits<random_policy> {
  using config_type = random_config;
  static constexpr const char* name = "random_policy";
  static constexpr bool has_streams = true;
  static constexpr bool has_history = false;

  /// Validates `c` and returns the rule: the unprotected token with the
  /// lowest Philox priority of the step (seed, stream, head, newest
  /// position), so each is equally likely.
  static decode_rule rule(const random_config& c, const char* function = "constructor") {
    const detail::site w{name, function};
    if (c.sinks < 0) detail::fail<budget_error>(w, "config.sinks", "= ", c.sinks, " is negative");
    if (c.recent < 0) detail::fail<budget_error>(w, "config.recent", "= ", c.recent, " is negative");
    if (std::int64_t{c.sinks} + c.recent >= c.budget)
      detail::fail<budget_error>(w, "config.sinks + config.recent", "= ", std::int64_t{c.sinks} + c.recent,
                                 " leaves no evictable token within budget = ", c.budget);
    decode_rule r;
    r.victim = victim_rule::random_priority;
    r.protect = {c.sinks, c.recent};
    r.budget = c.budget;
    r.seed = c.seed;
    return r;
  }
};

// ---- exact greedy (the oracle) ----

struct exact_greedy_config {
  std::int32_t budget = 0;
  std::int32_t recent = 0;  ///< newest positions never evicted
  std::int32_t sinks = 0;   ///< first positions never evicted
};

class exact_greedy_policy;

template <>
struct policy_traits<exact_greedy_policy> {
  using config_type = exact_greedy_config;
  static constexpr const char* name = "exact_greedy_policy";
  static constexpr bool has_streams = false;
  static constexpr bool has_history = true;

  /// Validates `c` and returns the rule: the lowest (error, position) among
  /// the unprotected, the error being the score an observe wrote.
  static decode_rule rule(const exact_greedy_config& c, const char* function = "constructor") {
    const detail::site w{name, function};
    if (c.recent < 0) detail::fail<budget_error>(w, "config.recent", "= ", c.recent, " is negative");
    if (c.sinks < 0) detail::fail<budget_error>(w, "config.sinks", "= ", c.sinks, " is negative");
    if (std::int64_t{c.sinks} + c.recent >= c.budget)
      detail::fail<budget_error>(w, "config.sinks + config.recent", "= ", std::int64_t{c.sinks} + c.recent,
                                 " leaves no evictable token within budget = ", c.budget);
    decode_rule r;
    r.victim = victim_rule::lowest_score;
    r.protect = {c.sinks, c.recent};
    r.budget = c.budget;
    return r;
  }
};

}  // namespace kvevict
