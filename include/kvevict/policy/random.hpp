#pragma once
// Random eviction: a baseline that any score-based policy must beat. The
// victim is uniform among the unprotected tokens: each candidate draws a
// priority from Philox4x32-10 keyed by (seed, request stream, head, position
// of the newest token) and its own position, and the lowest goes. Counter
// based, so the host and CUDA backends, and any batch schedule, draw the same
// victims; evict_to's k victims are the step's k lowest priorities. Each
// request on a sequence index can have a stream of its own (reset(b, stream));
// by default the stream is the sequence index.
#include <cstdint>

#include "kvevict/error.hpp"
#include "kvevict/philox.hpp"
#include "kvevict/policy/configs.hpp"
#include "kvevict/policy/policy_base.hpp"

namespace kvevict {

class random_policy : public policy_base<random_policy> {
 public:
  random_policy(const policy_shape& shape, const random_config& config)
      : policy_base(shape, policy_traits<random_policy>::rule(config)), config_(config) {}

  const random_config& config() const noexcept { return config_; }

  /// The stream that keys sequence b's draws.
  std::uint64_t stream(std::int32_t b) const {
    detail::require_index(where("stream"), "sequence", b, shape_.num_seqs);
    return state().stream_of(b);
  }

  using policy_base::reset;
  /// Forgets sequence b and starts a new request there whose draws are keyed
  /// by `stream` (at most max_random_stream): two requests with different
  /// streams draw independently, equal streams replay the same draws.
  /// reset(b) restores the default stream b.
  void reset(std::int32_t b, std::uint64_t stream) {
    const detail::site w = where("reset");
    detail::require_index(w, "sequence", b, shape_.num_seqs);
    require_stream(w, stream);
    reset_sequence(b, &stream);
  }

  using policy_base::fork;
  /// fork, the copy's draws keyed by `stream` (at most max_random_stream)
  /// instead of the destination index.
  void fork(std::int32_t source, std::int32_t destination, std::uint64_t stream) {
    require_stream(where("fork"), stream);
    fork_sequence(source, destination, &stream);
  }

  using policy_base::prefill;
  /// Prefill needs no scores: sinks, the recent window, and a uniform random
  /// subset of the rest (the highest Philox priorities of the stream).
  template <class T, class Layout>
  prefill_result prefill(std::int32_t b, std::int32_t length, const kv_view<T, Layout>& view) {
    return prefill_without_scores(b, length, view);
  }

 private:
  static void require_stream(const detail::site& w, std::uint64_t stream) {
    if (stream > max_random_stream)
      detail::fail<out_of_range>(w, "stream", "= ", stream, " exceeds max_random_stream = 2^63 - 1");
  }

  random_config config_;
};

}  // namespace kvevict
