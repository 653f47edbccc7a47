#pragma once
// Test support: the brute-force reference of the decode-time policies,
// written from docs/policies.md. It knows nothing about slots: per
// (sequence, KV head) a map position -> (score, K row, V row), and each rule
// re-selects the whole keep set from scratch. test_policies_bruteforce
// (the per-sequence API) and test_batched_host (the batched one) hold the
// library to it.
#include <algorithm>
#include <cstdint>
#include <map>
#include <random>
#include <vector>

#include "kvevict/kvevict.hpp"
#include "support/random_reference.hpp"

namespace kvtest {

using kvevict::group_reduce;
using kvevict::h2o_config;
using kvevict::h2o_policy;
using kvevict::random_config;
using kvevict::random_draw;
using kvevict::random_policy;
using kvevict::random_use;
using kvevict::recent_window_config;
using kvevict::recent_window_policy;

template <class T>
struct ref_token {
  float score = 0.0f;
  std::vector<T> k, v;
};

template <class T>
using ref_head = std::map<std::int32_t, ref_token<T>>;  // position -> token

// The GQA group fold as docs/semantics.md states it: in query order from +0
// (max: the larger, from 0), the mean divided by the group size at the end.
inline float reduce_group(const std::vector<float>& xs, group_reduce r) {
  float acc = 0.0f;
  for (float x : xs) acc = r == group_reduce::max ? std::max(acc, x) : acc + x;
  return r == group_reduce::mean ? acc / static_cast<float>(xs.size()) : acc;
}

// ---- the reference rules, from scratch ----

// Keep the `take` tokens with the highest (score, position) among `middle`.
template <class T>
std::vector<std::int32_t> top_by_score(const ref_head<T>& head, const std::vector<std::int32_t>& middle,
                                       std::int32_t take) {
  std::vector<std::int32_t> m = middle;
  std::sort(m.begin(), m.end(), [&](std::int32_t a, std::int32_t b) {
    const float sa = head.at(a).score, sb = head.at(b).score;
    if (sa != sb) return sa > sb;
    return a > b;
  });
  m.resize(std::size_t(std::max(take, 0)));
  return m;
}

struct h2o_case {
  using policy_type = h2o_policy;
  h2o_config config;
  static h2o_case draw(std::mt19937& rng, group_reduce reduce) {
    std::uniform_int_distribution<int> d(0, 5), s(0, 2);
    // H2O, TOVA and decays between; 0.5 and 0.75 have powers exact in float
    // up to the prompts drawn here (3^15 < 2^24), so any exponentiation
    // gives the reference's prefill weights.
    const float decays[] = {1.0f, 1.0f, 0.0f, 0.5f, 0.75f};
    h2o_case c;
    do {
      c.config.heavy = d(rng);
      c.config.recent = d(rng);
      c.config.sinks = rng() % 3 == 0 ? s(rng) : 0;
    } while (c.config.budget() < 1);
    c.config.reduce = reduce;
    c.config.decay = decays[rng() % 5];
    return c;
  }
  std::int32_t budget() const { return static_cast<std::int32_t>(config.budget()); }
  policy_type make(const kvevict::policy_shape& s) const { return policy_type(s, config); }
  // Keep: the first `sinks` and the last `recent`, plus the top `heavy` by
  // score among the positions between.
  template <class T>
  std::vector<std::int32_t> keep(const ref_head<T>& head, std::int32_t len, std::int32_t, std::int32_t,
                                 std::uint64_t) const {
    std::vector<std::int32_t> keep, middle;
    for (const auto& [p, tok] : head)
      (p < config.sinks || p >= len - config.recent ? keep : middle).push_back(p);
    for (std::int32_t p : top_by_score(head, middle, budget() - std::int32_t(keep.size()))) keep.push_back(p);
    return keep;
  }
};

struct recent_window_case {
  using policy_type = recent_window_policy;
  recent_window_config config;
  static recent_window_case draw(std::mt19937& rng, group_reduce) {
    std::uniform_int_distribution<int> s(0, 3), w(0, 5);
    recent_window_case c;
    do {
      c.config.sinks = s(rng);
      c.config.window = w(rng);
    } while (c.config.budget() < 1);
    return c;
  }
  std::int32_t budget() const { return static_cast<std::int32_t>(config.budget()); }
  policy_type make(const kvevict::policy_shape& s) const { return policy_type(s, config); }
  template <class T>
  std::vector<std::int32_t> keep(const ref_head<T>& head, std::int32_t len, std::int32_t, std::int32_t,
                                 std::uint64_t) const {
    std::vector<std::int32_t> keep;
    for (const auto& [p, tok] : head)
      if (p < config.sinks || p >= len - config.window) keep.push_back(p);
    return keep;
  }
};

struct random_case {
  using policy_type = random_policy;
  random_config config;
  static random_case draw(std::mt19937& rng, group_reduce) {
    std::uniform_int_distribution<int> b(1, 8), s(0, 2);
    random_case c;
    do {
      c.config.budget = b(rng);
      c.config.sinks = s(rng);
      c.config.recent = s(rng);
    } while (c.config.sinks + c.config.recent >= c.config.budget);
    c.config.seed = rng();
    return c;
  }
  std::int32_t budget() const { return config.budget; }
  policy_type make(const kvevict::policy_shape& s) const { return policy_type(s, config); }
  /// Request streams that a reset gave a sequence; others draw with stream b.
  std::map<std::int32_t, std::uint64_t> streams;
  std::uint64_t stream_of(std::int32_t b) const {
    const auto it = streams.find(b);
    return it == streams.end() ? std::uint64_t(b) : it->second;
  }
  // Decode (one over budget): the unprotected token with the lowest
  // (priority, position), priorities drawn for (seed, b, h, newest position)
  // and each candidate. Prefill: protected tokens plus the unprotected ones
  // with the highest (draw, position) priority.
  template <class T>
  std::vector<std::int32_t> keep(const ref_head<T>& head, std::int32_t len, std::int32_t b, std::int32_t h,
                                 std::uint64_t decoding) const {
    std::vector<std::int32_t> keep, middle;
    for (const auto& [p, tok] : head)
      (p < config.sinks || p >= len - config.recent ? keep : middle).push_back(p);
    if (decoding) {
      const std::int32_t victim = kvtest::random_victims(config.seed, stream_of(b), h, len - 1, middle, 1)[0];
      middle.erase(std::find(middle.begin(), middle.end(), victim));
      keep.insert(keep.end(), middle.begin(), middle.end());
      return keep;
    }
    std::sort(middle.begin(), middle.end(), [&](std::int32_t x, std::int32_t y) {
      const std::uint32_t dx = random_draw(config.seed, random_use::prefill_priority, b, h, x);
      const std::uint32_t dy = random_draw(config.seed, random_use::prefill_priority, b, h, y);
      return dx != dy ? dx > dy : x > y;
    });
    middle.resize(std::size_t(budget()) - keep.size());
    keep.insert(keep.end(), middle.begin(), middle.end());
    return keep;
  }
};

}  // namespace kvtest
