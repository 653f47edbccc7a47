#pragma once
// Test support: every decode input of the batched API (the attention
// inputs of batch_streams.hpp plus the key-scored ones), a config of each
// policy drawn for it, and one observe + evict that feeds a policy its part
// of a drawn step: all of it, or the heads [first, first + heads) of a
// tensor-parallel shard; and the comparison of one sequence's state in two
// layers. Shared by the tests that run two layers side by side
// (test_tensor_parallel, test_fork, test_fp8_keys).
#include <doctest/doctest.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <type_traits>
#include <vector>

#include "kvevict/kvevict.hpp"
#include "support/batch_streams.hpp"
#include "support/h2o_draws.hpp"

namespace kvtest {

enum class decode_input { probs, head_scores, logits, queries, key_norms, key_diff };

/// A config of Policy that takes input `in` (h2o by keys: decay 0).
template <class Policy>
typename kvevict::policy_traits<Policy>::config_type draw_config(std::mt19937& rng, decode_input in) {
  using namespace kvevict;
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  if constexpr (std::is_same_v<Policy, h2o_policy>) {
    if (in == decode_input::key_norms || in == decode_input::key_diff)
      return key_norm_config(pick(2, 5), pick(0, 2), pick(0, 1));
    return draw_h2o_config(pick, 4, 4);
  } else if constexpr (std::is_same_v<Policy, recent_window_policy>) {
    return recent_window_config{pick(0, 2), pick(2, 6)};
  } else if constexpr (std::is_same_v<Policy, random_policy>) {
    random_config c{pick(3, 8), pick(0, 1), 0, std::uint64_t(rng())};
    c.recent = pick(0, c.budget - 1 - c.sinks);
    return c;
  } else {
    exact_greedy_config c;
    c.budget = pick(3, 6);
    return c;
  }
}

/// What the state of Policy keeps of the keys for input `in`.
template <class Policy>
kvevict::history_extent history_of(decode_input in, std::int32_t max_tokens, std::int32_t head_dim) {
  if constexpr (std::is_same_v<Policy, kvevict::exact_greedy_policy>) return {max_tokens, head_dim};
  return in == decode_input::key_diff ? kvevict::key_diff_extent(head_dim) : kvevict::history_extent{};
}

/// Heads [first, first + count) of a [B][heads][...] tensor.
template <class T, int R>
kvevict::tensor_view<T, R> heads_of(kvevict::tensor_view<T, R> t, std::int32_t first, std::int32_t count) {
  t.data += first * t.strides[1];
  t.extents[1] = count;
  return t;
}

/// Observe + evict of policy p (its heads: KV heads [first, first + its
/// num_kv_heads) of step `st`, whose sizes are `dm`) from input `in`.
template <class Policy, class View>
void observe_step(kvevict::batched_policy<Policy>& p, const batch_step<float>& st, const batch_dims& dm,
                  decode_input in, const View& view, std::int32_t first, std::int32_t* victims) {
  using namespace kvevict;
  using Layout = typename View::layout_type;
  using T = typename View::element_type;  // a float cache, or fp8 codes with their scales
  const std::int32_t B = dm.seqs, H = dm.heads, Hq = dm.q_heads(), W = dm.width(), D = dm.head_dim;
  const std::int32_t heads = p.shape().num_kv_heads, qf = first * dm.group, qn = heads * dm.group;
  const auto lse = heads_of(make_tensor_view<const float>(st.lse.data(), B, Hq), qf, qn);
  const auto per_query = [&](const std::vector<float>& x) {
    return heads_of(make_tensor_view<const float>(x.data(), B, Hq, W), qf, qn);
  };
  const active_set active = st.active_set();
  switch (in) {
    case decode_input::probs: p.observe_evict(batch_probs{per_query(st.probs)}, active, victims); break;
    case decode_input::head_scores:
      p.observe_evict(batch_head_scores{heads_of(make_tensor_view<const float>(st.increments.data(), B, H, W), first,
                                                 heads)},
                      active, victims);
      break;
    case decode_input::logits: p.observe_evict(batch_logits{per_query(st.logits), lse, st.scale}, active, victims); break;
    case decode_input::queries:
      p.observe_evict(batch_queries<float>{heads_of(make_tensor_view<const float>(st.q.data(), B, Hq, D), qf, qn), lse,
                                           st.scale},
                      view, active, victims);
      break;
    case decode_input::key_norms: p.observe_evict(key_norms<T, Layout>{view}, active, victims); break;
    case decode_input::key_diff: p.observe_evict(key_diff<T, Layout>{view}, active, victims); break;
  }
}

template <class T>
void require_equal(const T* a, const T* b, std::int64_t n, const char* what) {
  CAPTURE(what);
  REQUIRE(std::memcmp(a, b, sizeof(T) * std::size_t(n)) == 0);
}

/// Everything sequence b carries from step to step, in states a and r.
inline void require_same_sequence(const kvevict::batch_state_view& a, std::int32_t b,
                                  const kvevict::batch_state_view& r, std::int32_t rb) {
  CAPTURE(b);
  CAPTURE(rb);
  REQUIRE(a.slots.lengths[b] == r.slots.lengths[rb]);
  if (a.streams) REQUIRE(a.streams[b] == r.streams[rb]);
  for (std::int32_t h = 0; h < a.num_heads(); ++h) {
    CAPTURE(h);
    const std::int64_t x = a.head_index(b, h), y = r.head_index(rb, h);
    REQUIRE(a.slots.counts[x] == r.slots.counts[y]);
    REQUIRE(a.slots.next_slots[x] == r.slots.next_slots[y]);
    REQUIRE(a.appended[x] == r.appended[y]);
    require_equal(a.slots.positions_of(b, h), r.slots.positions_of(rb, h), a.capacity(), "positions");
    require_equal(a.scores_of(b, h), r.scores_of(rb, h), a.capacity(), "scores");
    if (a.anchors.sums) {
      const std::int64_t d = a.anchors.head_dim;
      REQUIRE(a.anchors.upto[x] == r.anchors.upto[y]);
      require_equal(a.anchors.sums + x * d, r.anchors.sums + y * d, d, "anchor sums");
      require_equal(a.anchors.units + x * d, r.anchors.units + y * d, d, "anchor units");
    }
    if (a.history.keys) {
      const std::int64_t rows = a.history.rows[x], per_head = a.history.max_tokens * a.history.head_dim;
      REQUIRE(rows == r.history.rows[y]);
      require_equal(a.history.keys + x * per_head, r.history.keys + y * per_head, rows * a.history.head_dim,
                    "history keys");
      require_equal(a.history.values + x * per_head, r.history.values + y * per_head, rows * a.history.head_dim,
                    "history values");
    }
  }
}

}  // namespace kvtest
