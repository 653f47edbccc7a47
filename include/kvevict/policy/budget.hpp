#pragma once
// Budgets are absolute token counts; these helpers turn the ratios papers
// quote into counts. H2O's "20% budget" is 10% heavy + 10% recent of the
// sequence length; like the reference code, ratios round down.
#include <cmath>
#include <cstdint>
#include <vector>

#include "kvevict/error.hpp"
#include "kvevict/policy/configs.hpp"

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

/// Which way a per-layer schedule runs.
enum class layer_schedule : std::uint8_t {
  pyramid,   ///< PyramidKV: the most in the lowest layer, the least in the highest
  inverted,  ///< the same budgets in reverse: the least in the lowest layer
};

/// Per-layer budgets (token counts, layer 0 first) for `layers` layers that
/// average about `average` tokens, by PyramidKV's linear schedule (Cai et
/// al. 2024, "PyramidKV: Dynamic KV Cache Compression based on Pyramidal
/// Information Funneling", the formula of its reference code): each layer
/// keeps the `window` tokens of its observation window (0 for decode-time
/// policies) plus a share that falls linearly from top = 2A - bottom in the
/// lowest layer to bottom = floor(A / beta) in the highest, A = average -
/// window, in integer steps of floor((top - bottom) / (layers - 1)). As in
/// the reference, the floored step leaves layer l less than l tokens above
/// the exact line, so the mean exceeds `average` by less than (layers - 1) /
/// 2 tokens. `inverted` reverses the order.
inline std::vector<std::int32_t> layer_budgets(std::int32_t average, std::int32_t layers, std::int32_t window = 0,
                                               std::int32_t beta = 20,
                                               layer_schedule schedule = layer_schedule::pyramid) {
  const detail::site w{"budget", "layer_budgets"};
  if (layers < 1) detail::fail<invalid_argument>(w, "layers", "= ", layers, " is below 1");
  if (window < 0) detail::fail<budget_error>(w, "window", "= ", window, " is negative");
  if (beta < 1) detail::fail<invalid_argument>(w, "beta", "= ", beta, " is below 1");
  if (average <= window)
    detail::fail<budget_error>(w, "average", "= ", average, " leaves no token beyond the window ", window);
  const std::int64_t share = std::int64_t{average} - window;
  const std::int64_t bottom = share / beta, top = 2 * share - bottom;
  const std::int64_t step = layers > 1 ? (top - bottom) / (layers - 1) : 0;
  std::vector<std::int32_t> out(static_cast<std::size_t>(layers));
  for (std::int32_t l = 0; l < layers; ++l) {
    const std::int64_t budget = layers > 1 ? window + top - l * step : average;
    if (budget < 1 || budget > 0x7FFFFFFF)
      detail::fail<budget_error>(w, "average", "= ", average, " gives layer ", l, " a budget of ", budget);
    out[static_cast<std::size_t>(schedule == layer_schedule::pyramid ? l : layers - 1 - l)] =
        static_cast<std::int32_t>(budget);
  }
  return out;
}

}  // namespace kvevict
