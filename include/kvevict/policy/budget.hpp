#pragma once
// Budgets are absolute token counts; these helpers turn the ratios papers
// quote into counts. H2O's "20% budget" is 10% heavy + 10% recent of the
// sequence length; like the reference code, ratios round down.
#include <cmath>
#include <cstdint>

#include "kvevict/error.hpp"
#include "kvevict/policy/h2o.hpp"
#include "kvevict/policy/recent_window.hpp"

namespace kvevict {

namespace detail {
template <class Where>
std::int32_t tokens_for_ratio(const Where& w, const char* name, std::int32_t length, double ratio) {
  if (length < 0) fail<invalid_argument>(w, "length", "= ", length, " is negative");
  if (!(ratio >= 0.0 && ratio <= 1.0)) fail<budget_error>(w, name, "= ", ratio, " is outside [0, 1]");
  return static_cast<std::int32_t>(std::floor(ratio * length));
}
}  // namespace detail

/// floor(ratio * length), for ratio in [0, 1].
inline std::int32_t tokens_for_ratio(std::int32_t length, double ratio) {
  return detail::tokens_for_ratio(detail::site{"budget", "tokens_for_ratio"}, "ratio", length, ratio);
}

/// H2O with heavy_ratio * length heavy and recent_ratio * length recent tokens.
inline h2o_config h2o_from_ratios(std::int32_t length, double heavy_ratio, double recent_ratio,
                                  group_reduce reduce = group_reduce::sum) {
  const detail::site w{"budget", "h2o_from_ratios"};
  h2o_config c;
  c.heavy = detail::tokens_for_ratio(w, "heavy_ratio", length, heavy_ratio);
  c.recent = detail::tokens_for_ratio(w, "recent_ratio", length, recent_ratio);
  c.reduce = reduce;
  if (c.budget() < 1)
    detail::fail<budget_error>(w, "heavy_ratio + recent_ratio",
                               "gives an empty budget for length ", length);
  return c;
}

/// StreamingLLM with `sinks` sinks and the rest of ratio * length as window.
inline recent_window_config recent_window_from_ratio(std::int32_t length, double ratio, std::int32_t sinks) {
  const detail::site w{"budget", "recent_window_from_ratio"};
  const std::int32_t budget = detail::tokens_for_ratio(w, "ratio", length, ratio);
  if (sinks < 0 || sinks >= budget)
    detail::fail<budget_error>(w, "sinks", "= ", sinks, " does not leave a window within budget ", budget);
  return {sinks, budget - sinks};
}

}  // namespace kvevict
