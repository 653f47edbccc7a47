#pragma once
// Random eviction: a baseline that any score-based policy must beat. The
// victim is uniform among the unprotected tokens: each candidate draws a
// priority from Philox4x32-10 keyed by (seed, request stream, head, position
// of the newest token) and its own position, and the lowest goes. Counter
// based, so the host and CUDA backends, and any batch schedule, draw the same
// victims; evict_to's k victims are the step's k lowest priorities. Each
// request on a sequence index can have a stream of its own (reset(b, stream));
// by default the stream is the sequence index.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "kvevict/error.hpp"
#include "kvevict/philox.hpp"
#include "kvevict/policy/policy_base.hpp"

namespace kvevict {

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

class random_policy : public policy_base<random_policy> {
 public:
  random_policy(const policy_shape& shape, const random_config& config)
      : policy_base("random_policy", shape, policy_traits<random_policy>::rule(config)),
        config_(config),
        streams_(std::size_t(shape.num_seqs)) {
    for (std::int32_t b = 0; b < shape.num_seqs; ++b) streams_[std::size_t(b)] = std::uint64_t(b);
  }

  const random_config& config() const noexcept { return config_; }

  /// The stream that keys sequence b's draws.
  std::uint64_t stream(std::int32_t b) const {
    detail::require_index(where("stream"), "sequence", b, shape_.num_seqs);
    return streams_[std::size_t(b)];
  }

  using policy_base::reset;
  /// Forgets sequence b and starts a new request there whose draws are keyed
  /// by `stream` (at most max_random_stream): two requests with different
  /// streams draw independently, equal streams replay the same draws.
  /// reset(b) restores the default stream b.
  void reset(std::int32_t b, std::uint64_t stream) {
    const detail::site w = where("reset");
    detail::require_index(w, "sequence", b, shape_.num_seqs);
    if (stream > max_random_stream)
      detail::fail<out_of_range>(w, "stream", "= ", stream, " exceeds max_random_stream = 2^63 - 1");
    policy_base::reset(b);
    streams_[std::size_t(b)] = stream;
  }

  /// policy_base hooks.
  void on_reset(std::int32_t b) noexcept { streams_[std::size_t(b)] = std::uint64_t(b); }
  std::uint64_t stream_of(std::int32_t b) const noexcept { return streams_[std::size_t(b)]; }

  /// Sinks, the recent window, and a uniform random subset of the rest: each
  /// candidate gets a Philox priority, the highest priorities are kept.
  void select_keep(std::int32_t b, std::int32_t h, std::int32_t length, const float*, std::int32_t,
                   std::int32_t* keep) const {
    keep_top_keys(
        length, config_.sinks, config_.recent,
        [&](std::int32_t p) {
          const std::uint32_t draw = random_draw(config_.seed, random_use::prefill_priority, streams_[std::size_t(b)], h, p);
          return (static_cast<std::uint64_t>(draw) << 32) | static_cast<std::uint32_t>(p);
        },
        keep);
  }

  using policy_base::prefill;
  /// Prefill needs no scores.
  template <class T, class Layout>
  prefill_result prefill(std::int32_t b, std::int32_t length, const kv_view<T, Layout>& view) {
    return prefill_without_scores(b, length, view);
  }

 private:
  random_config config_;
  std::vector<std::uint64_t> streams_;  // [num_seqs]
};

}  // namespace kvevict
