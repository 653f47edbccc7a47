// Multi-token steps: append of several tokens and evict_to(target), per
// sequence and batched, against brute-force references written here from
// the definitions (docs/semantics.md, "Multi-token steps"), never against
// the per-sequence policies as an expectation (they are a facade over the
// batched host backend): a brute-force keep set, the reference model of
// support/multi_token_reference.hpp (slot tables, next slots, scores bit
// for bit, the refill's moves and K/V rows; exact_greedy's errors in long
// double within 1e-6), random's Philox victims (support/random_reference.hpp),
// and the refill rule itself. The model and keep sets are the test's own
// code; it calls the library only for Philox4x32-10 (checked against
// Random123's known answers in test_order.cpp). Also: evict_to against
// repeated single evictions and against evict itself when one token was
// added (both also against the model).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <set>
#include <string>
#include <type_traits>
#include <vector>

#include "kvevict/kvevict.hpp"
#include "kvevict/batch/multi_token.hpp"
#include "support/caches.hpp"
#include "support/state_invariants.hpp"
#include "support/multi_token_reference.hpp"
#include "support/random_reference.hpp"

namespace kv = kvevict;

namespace {

constexpr std::int32_t kSeqs = 3, kHeads = 2, kGroup = 2, kDim = 8;

kv::policy_shape shape_of(std::int32_t capacity) { return {kSeqs, kHeads, kHeads * kGroup, capacity}; }

/// The tokens (position -> score) a head keeps after evict_to(target), from
/// scratch: the protected ones plus the best of the others by `better`.
template <class Better>
std::set<std::int32_t> brute_keep(const std::vector<std::pair<std::int32_t, float>>& held, std::int32_t target,
                                  std::int32_t sinks, std::int32_t recent, std::int32_t length, Better better) {
  std::set<std::int32_t> keep;
  std::vector<std::pair<std::int32_t, float>> others;
  for (const auto& [p, score] : held)
    if (p < sinks || p >= length - recent) keep.insert(p);
    else others.push_back({p, score});
  std::sort(others.begin(), others.end(), better);  // best first
  for (std::size_t i = 0; keep.size() < std::size_t(target) && i < others.size(); ++i) keep.insert(others[i].first);
  return keep;
}

template <class Policy>
std::vector<std::pair<std::int32_t, float>> held_of(const Policy& p, std::int32_t b, std::int32_t h) {
  std::vector<std::pair<std::int32_t, float>> held;
  for (std::int32_t s = 0; s < p.shape().capacity; ++s)
    if (p.slots().position(b, h, s) >= 0) held.push_back({p.slots().position(b, h, s), p.score(b, h, s)});
  return held;
}

template <class Policy>
std::set<std::int32_t> positions_of(const Policy& p, std::int32_t b, std::int32_t h) {
  std::set<std::int32_t> out;
  for (const auto& [pos, score] : held_of(p, b, h)) out.insert(pos);
  return out;
}

/// K row of (position, head) as the test writes it: element d = position * 8 + h + d / 16.
float row_value(std::int32_t position, std::int32_t h, std::int32_t d) {
  return static_cast<float>(position % 512) + 0.25f * static_cast<float>(h) + static_cast<float>(d) / 16.0f;
}

/// Occupied slots are [0, count + 1) but the next slot (or [0, count) when
/// count > budget), and each slot's K/V rows belong to its position.
template <class Policy, class View>
void check_layout(const Policy& p, const View& view, std::int32_t b, std::int32_t h) {
  const std::int32_t count = p.slots().count(b, h), next = p.next_slot(b, h);
  const std::int32_t span = count <= p.budget() ? count + 1 : count;
  for (std::int32_t s = 0; s < p.shape().capacity; ++s) {
    const std::int32_t pos = p.slots().position(b, h, s);
    const bool should_hold = s < span && s != next;
    CHECK_MESSAGE((pos >= 0) == should_hold, "slot ", s, " of ", b, ",", h);
    if (pos >= 0)
      for (std::int32_t d = 0; d < kDim; ++d) {
        CHECK(view.k_row(b, h, s)[d] == row_value(pos, h, d));
        CHECK(view.v_row(b, h, s)[d] == -row_value(pos, h, d));
      }
  }
}

/// Drives `policy` with random multi-token steps and checks every evict_to
/// against the brute-force keep set of `better` (the policy's order).
template <class Policy, class Better>
void run_keep_set_stream(Policy& policy, std::uint32_t seed, std::int32_t sinks, std::int32_t recent, Better better) {
  std::mt19937 rng(seed);
  const std::int32_t cap = policy.shape().capacity, budget = policy.budget();
  auto cache = kv::make_bhsd_cache<float>(kSeqs, kHeads, cap, kDim);
  const auto view = cache.view();
  std::vector<float> inc(std::size_t(kHeads) * cap);
  std::vector<std::int32_t> slots(std::size_t(kHeads) * cap);
  for (std::int32_t step = 0; step < 60; ++step) {
    const std::int32_t b = std::int32_t(rng() % kSeqs);
    const std::int32_t room = cap - policy.slots().count(b, 0);
    const std::int32_t tokens = 1 + std::int32_t(rng() % std::uint32_t(std::max(1, std::min(room, 6))));
    if (room < 1) continue;
    const std::int32_t first = policy.append(b, tokens, slots.data());
    for (std::int32_t h = 0; h < kHeads; ++h)
      for (std::int32_t j = 0; j < tokens; ++j)
        for (std::int32_t d = 0; d < kDim; ++d) {
          view.k_row(b, h, slots[std::size_t(h * tokens + j)])[d] = row_value(first + j, h, d);
          view.v_row(b, h, slots[std::size_t(h * tokens + j)])[d] = -row_value(first + j, h, d);
        }
    for (float& x : inc) x = static_cast<float>(rng() % 8) / 8.0f;  // many exact ties
    policy.observe(b, kv::head_scores{kv::make_tensor_view<const float>(inc.data(), kHeads, cap)});
    const std::int32_t target = std::max(sinks + recent, budget - std::int32_t(rng() % 3));
    std::vector<std::set<std::int32_t>> expected;
    for (std::int32_t h = 0; h < kHeads; ++h)
      expected.push_back(brute_keep(held_of(policy, b, h), target, sinks, recent, policy.length(b), better));
    const std::int32_t before = policy.slots().count(b, 0);
    CHECK(policy.evict_to(b, target, view) == std::max(0, before - target));
    for (std::int32_t h = 0; h < kHeads; ++h) {
      if (before > target) CHECK(positions_of(policy, b, h) == expected[std::size_t(h)]);
      check_layout(policy, view, b, h);
    }
  }
}

bool by_score_then_newer(const std::pair<std::int32_t, float>& a, const std::pair<std::int32_t, float>& b) {
  return a.second != b.second ? a.second > b.second : a.first > b.first;
}
bool newest_first(const std::pair<std::int32_t, float>& a, const std::pair<std::int32_t, float>& b) {
  return a.first > b.first;
}

/// The reference model's configuration of each policy's config.
kvtest::model_config model_of(const kv::h2o_config& c) {
  return {kvtest::model_rule::lowest_score, std::int32_t(c.budget()), c.sinks, c.recent, 0};
}
kvtest::model_config model_of(const kv::recent_window_config& c) {
  return {kvtest::model_rule::oldest, std::int32_t(c.budget()), c.sinks, 0, 0};
}
kvtest::model_config model_of(const kv::random_config& c) {
  return {kvtest::model_rule::random_priority, c.budget, c.sinks, c.recent, c.seed};
}
kvtest::model_config model_of(const kv::exact_greedy_config& c) {
  return {kvtest::model_rule::greedy, c.budget, c.sinks, c.recent, 0};
}

/// exact_greedy's float score against the model's error: within a relative
/// 1e-6 (the library computes in double from float rows, then rounds to float:
/// seen within 6e-8).
bool close_error(float got, long double want) {
  if (std::isinf(want)) return std::isinf(got) && got > 0;
  const long double diff = static_cast<long double>(got) - want;
  return (diff < 0 ? -diff : diff) <= want * 1e-6L + 1e-37L;
}

}  // namespace

TEST_CASE("evict_to keeps the brute-force keep set and a prefix of slots: h2o and recent_window") {
  for (std::uint32_t seed = 1; seed <= 20; ++seed) {
    kv::h2o_policy h2o(shape_of(16), {5, 3});
    run_keep_set_stream(h2o, seed, 0, 3, by_score_then_newer);
    kv::recent_window_policy window(shape_of(16), {2, 6});
    run_keep_set_stream(window, seed, 2, 0, newest_first);
  }
}

TEST_CASE("refill: the lowest hole below the span takes the lowest occupied slot beyond it, the next hole is left") {
  // Written from the rule (policy/evict_to.hpp): span = kept + 1 when kept
  // <= budget (the spare slot), else kept; holes are the free slots below
  // the span, ascending; sources the occupied slots at or beyond it,
  // ascending; source i moves into hole i, and the first hole left over is
  // the next slot (-1 when none).
  std::mt19937 rng(17);
  std::int64_t moves_checked = 0;
  for (int trial = 0; trial < 4000; ++trial) {
    const std::int32_t width = 1 + std::int32_t(rng() % 40);
    std::vector<std::int32_t> pos(static_cast<std::size_t>(width), -1);
    std::int32_t kept = 0;
    for (std::int32_t s = 0; s < width; ++s)
      if (rng() % 3 != 0) pos[std::size_t(s)] = 100 + s, ++kept;
    if (kept == 0 || kept == width) continue;  // evict_to freed at least one slot of the row
    const std::int32_t budget = std::max(1, kept - 2 + std::int32_t(rng() % 6));
    std::vector<float> score(pos.size()), spare(pos.size(), 7.0f);
    for (std::int32_t s = 0; s < width; ++s) score[std::size_t(s)] = pos[std::size_t(s)] >= 0 ? 0.5f + float(s) : 0.0f;
    const std::int32_t span = kept <= budget ? kept + 1 : kept;
    std::vector<std::int32_t> holes, sources;
    for (std::int32_t s = 0; s < width; ++s) {
      if (s < span && pos[std::size_t(s)] < 0) holes.push_back(s);
      if (s >= span && pos[std::size_t(s)] >= 0) sources.push_back(s);
    }
    std::vector<std::int32_t> want = pos;
    for (std::size_t i = 0; i < sources.size(); ++i) {
      want[std::size_t(holes[i])] = pos[std::size_t(sources[i])];
      want[std::size_t(sources[i])] = -1;
    }
    const std::int32_t want_next = sources.size() < holes.size() ? holes[sources.size()] : -1;
    std::vector<std::int32_t> scratch(pos.size()), got = pos;
    std::vector<kv::slot_move> moves(pos.size());
    std::int32_t next = -2;
    const std::int32_t n = kv::detail::refill_holes(
        got.data(), score.data(), spare.data(), kept, budget, width, scratch.data(), next,
        [&](std::int32_t i, std::int32_t from, std::int32_t to) { moves[std::size_t(i)] = {from, to}; });
    CAPTURE(trial);
    REQUIRE(n == std::int32_t(sources.size()));
    CHECK(got == want);
    CHECK(next == want_next);
    for (std::int32_t i = 0; i < n; ++i) {
      CHECK(moves[std::size_t(i)].from == sources[std::size_t(i)]);
      CHECK(moves[std::size_t(i)].to == holes[std::size_t(i)]);
      CHECK(score[std::size_t(holes[std::size_t(i)])] == 0.5f + float(sources[std::size_t(i)]));
    }
    for (std::int32_t s = 0; s < width; ++s)
      if (got[std::size_t(s)] < 0) CHECK((score[std::size_t(s)] == 0.0f && spare[std::size_t(s)] == 0.0f));
    moves_checked += n;
  }
  CHECK(moves_checked > 5000);
}

TEST_CASE("evict_to with one token above the target is evict, for every policy, both the reference model's step") {
  // a evicts, b calls evict_to(budget) after the same single-token steps:
  // both must leave the slot table and scores of the reference model
  // (support/multi_token_reference.hpp: the victim by the policy's order,
  // its slot the next slot, no row moved).
  std::mt19937 rng(7);
  const std::int32_t cap = 9;
  auto cache = kv::make_bhsd_cache<float>(kSeqs, kHeads, cap, kDim);
  for (auto& x : cache.k_storage()) x = static_cast<float>(rng() % 16) / 8.0f - 1.0f;
  for (auto& x : cache.v_storage()) x = static_cast<float>(rng() % 16) / 8.0f - 1.0f;
  std::vector<float> inc(std::size_t(kHeads) * cap), q(std::size_t(kHeads) * kGroup * kDim);
  std::int64_t evictions = 0;
  auto drive = [&](auto& a, auto& b, auto observe) {
    using Policy = std::decay_t<decltype(a)>;
    constexpr bool greedy = std::is_same_v<Policy, kv::exact_greedy_policy>;
    kvtest::multi_token_model model(kSeqs, kHeads, cap, model_of(a.config()));
    // exact_greedy's history: the rows of position p are the cache's rows
    // of the slot p was appended to (the cache never changes here).
    std::vector<std::int32_t> slot_of(std::size_t(kSeqs) * kHeads * 64, -1);
    std::int32_t s = 0;
    kvtest::greedy_inputs in;
    in.group = kGroup;
    in.head_dim = kDim;
    in.key = [&](std::int32_t p, std::int32_t h, std::int32_t d) {
      return cache.view().k_row(s, h, slot_of[(std::size_t(s) * kHeads + std::size_t(h)) * 64 + std::size_t(p)])[d];
    };
    in.value = [&](std::int32_t p, std::int32_t h, std::int32_t d) {
      return cache.view().v_row(s, h, slot_of[(std::size_t(s) * kHeads + std::size_t(h)) * 64 + std::size_t(p)])[d];
    };
    in.query = [&](std::int32_t, std::int32_t qh, std::int32_t d) { return q[std::size_t(qh) * kDim + std::size_t(d)]; };
    for (std::int32_t step = 0; step < 40; ++step) {
      CAPTURE(step);
      s = std::int32_t(rng() % kSeqs);
      a.append(s);
      b.append(s);
      std::vector<std::int32_t> slots;
      const std::int32_t first = model.append(s, 1, slots);
      for (std::int32_t h = 0; h < kHeads; ++h)
        slot_of[(std::size_t(s) * kHeads + std::size_t(h)) * 64 + std::size_t(first)] = slots[std::size_t(h)];
      for (float& x : inc) x = static_cast<float>(rng() % 8) / 8.0f;
      for (float& x : q) x = static_cast<float>(rng() % 16) / 16.0f - 0.5f;
      observe(a, s);
      observe(b, s);
      std::vector<kv::slot_move> moves(std::size_t(kHeads) * cap);
      std::vector<std::int32_t> counts(kHeads, -1);
      const std::int32_t freed = a.evict(s);
      CHECK(b.evict_to(s, a.budget(), moves.data(), counts.data()) == (freed > 0 ? 1 : 0));
      evictions += freed;
      if constexpr (greedy) {
        CHECK(model.greedy_observe_evict(s, in, [&](std::int32_t h) {
          for (std::int32_t slot = 0; slot < cap; ++slot)
            if (model.head(s, h).pos[std::size_t(slot)] >= 0 && a.slots().position(s, h, slot) < 0) return slot;
          return -1;
        }));
      } else {
        model.observe_evict(s, [&](std::int32_t h, std::int32_t slot) { return inc[std::size_t(h * cap + slot)]; });
      }
      for (std::int32_t h = 0; h < kHeads; ++h) {
        CAPTURE(h);
        const kvtest::model_head& m = model.head(s, h);
        CHECK(counts[std::size_t(h)] == 0);
        CHECK(a.next_slot(s, h) == m.next);
        CHECK(b.next_slot(s, h) == m.next);
        for (std::int32_t slot = 0; slot < cap; ++slot) {
          CHECK(a.slots().position(s, h, slot) == m.pos[std::size_t(slot)]);
          CHECK(b.slots().position(s, h, slot) == m.pos[std::size_t(slot)]);
          if constexpr (greedy) {
            CHECK(close_error(a.score(s, h, slot), m.error[std::size_t(slot)]));
          } else {
            CHECK(a.score(s, h, slot) == m.score[std::size_t(slot)]);
          }
          CHECK(b.score(s, h, slot) == a.score(s, h, slot));
        }
      }
    }
  };
  const auto by_increments = [&](auto& p, std::int32_t s) {
    p.observe(s, kv::head_scores{kv::make_tensor_view<const float>(inc.data(), kHeads, cap)});
  };
  {
    kv::h2o_policy a(shape_of(cap), {5, 3}), b(shape_of(cap), {5, 3});
    drive(a, b, by_increments);
  }
  {
    kv::recent_window_policy a(shape_of(cap), {2, 6}), b(shape_of(cap), {2, 6});
    drive(a, b, by_increments);
  }
  {
    kv::random_policy a(shape_of(cap), {8, 1, 2, 99}), b(shape_of(cap), {8, 1, 2, 99});
    drive(a, b, by_increments);
  }
  {
    kv::exact_greedy_policy a(shape_of(cap), {8, 2, 1}), b(shape_of(cap), {8, 2, 1});
    std::vector<float> lse(std::size_t(kHeads) * kGroup, 0.0f);
    drive(a, b, [&](auto& p, std::int32_t s) {
      p.observe(s, kv::decode_queries<float>{kv::make_tensor_view<const float>(q.data(), kHeads * kGroup, kDim),
                                             kv::make_tensor_view<const float>(lse.data(), kHeads * kGroup), 0.5f},
                cache.view());
    });
  }
  MESSAGE("evict vs evict_to(budget) against the model: ", evictions, " evictions");
  CHECK(evictions > 100);
}

TEST_CASE("evict_to frees what repeated single evictions free and keeps the reference model's tokens (h2o, "
          "recent_window, exact_greedy)") {
  const std::int32_t cap = 20;
  std::vector<float> q(std::size_t(kHeads) * kGroup * kDim), lse(std::size_t(kHeads) * kGroup, 0.0f);
  // a: evict_to(target) at once; b: one victim per call. exact_greedy's
  // evict_to re-scores before every victim, so b's single rounds follow a's.
  // Each has its own cache; rows and increments follow positions, not slots.
  // a must also leave the reference model's slot table, scores and rows
  // (support/multi_token_reference.hpp).
  std::int64_t freed = 0;
  auto drive = [&](auto& a, auto& b) {
    CAPTURE(a.rule().victim);
    constexpr bool greedy = std::is_same_v<std::decay_t<decltype(a)>, kv::exact_greedy_policy>;
    kvtest::multi_token_model model(kSeqs, kHeads, cap, model_of(a.config()));
    kvtest::greedy_inputs in;
    in.group = kGroup;
    in.head_dim = kDim;
    in.key = [](std::int32_t p, std::int32_t h, std::int32_t d) { return row_value(p, h, d) / 64.0f; };
    in.value = [](std::int32_t p, std::int32_t h, std::int32_t d) { return -row_value(p, h, d) / 64.0f; };
    in.query = [&](std::int32_t, std::int32_t qh, std::int32_t d) { return q[std::size_t(qh) * kDim + std::size_t(d)]; };
    std::mt19937 rng(11);
    auto cache_a = kv::make_bhsd_cache<float>(kSeqs, kHeads, cap, kDim);
    auto cache_b = kv::make_bhsd_cache<float>(kSeqs, kHeads, cap, kDim);
    std::uint32_t salt = 0;
    const auto observe = [&](auto& p, auto& cache, std::int32_t s) {
      std::vector<float> inc(std::size_t(kHeads) * cap, 0.0f);
      for (std::int32_t h = 0; h < kHeads; ++h)
        for (std::int32_t slot = 0; slot < cap; ++slot) {
          const std::int32_t pos = p.slots().position(s, h, slot);
          if (pos >= 0) inc[std::size_t(h * cap + slot)] = static_cast<float>((pos * 7 + h * 3 + salt) % 8) / 8.0f;
        }
      if constexpr (std::is_same_v<std::decay_t<decltype(p)>, kv::exact_greedy_policy>)
        p.observe(s, kv::decode_queries<float>{kv::make_tensor_view<const float>(q.data(), kHeads * kGroup, kDim),
                                               kv::make_tensor_view<const float>(lse.data(), kHeads * kGroup), 0.5f},
                  cache.view());
      else
        p.observe(s, kv::head_scores{kv::make_tensor_view<const float>(inc.data(), kHeads, cap)});
    };
    const auto append = [&](auto& p, auto& cache, std::int32_t s, std::int32_t tokens) {
      std::vector<std::int32_t> slots(std::size_t(kHeads) * tokens);
      const std::int32_t first = p.append(s, tokens, slots.data());
      for (std::int32_t h = 0; h < kHeads; ++h)
        for (std::int32_t j = 0; j < tokens; ++j)
          for (std::int32_t d = 0; d < kDim; ++d) {
            cache.view().k_row(s, h, slots[std::size_t(h * tokens + j)])[d] = row_value(first + j, h, d) / 64.0f;
            cache.view().v_row(s, h, slots[std::size_t(h * tokens + j)])[d] = -row_value(first + j, h, d) / 64.0f;
          }
    };
    for (std::int32_t step = 0; step < 30; ++step) {
      const std::int32_t s = std::int32_t(rng() % kSeqs);
      const std::int32_t tokens = 1 + std::int32_t(rng() % 5);
      if (a.slots().count(s, 0) + tokens > cap) continue;
      append(a, cache_a, s, tokens);
      append(b, cache_b, s, tokens);
      std::vector<std::int32_t> model_slots;
      model.append(s, tokens, model_slots);
      salt = static_cast<std::uint32_t>(rng());
      for (float& x : q) x = static_cast<float>(rng() % 16) / 16.0f - 0.5f;
      observe(a, cache_a, s);
      observe(b, cache_b, s);
      const std::int32_t target = a.budget();
      for (std::int32_t h = 0; h < kHeads; ++h) freed += std::max(0, model.head(s, h).count - target);
      a.evict_to(s, target, cache_a.view());
      while (b.slots().count(s, 0) > target) {
        b.evict_to(s, b.slots().count(s, 0) - 1, cache_b.view());
      }
      for (std::int32_t h = 0; h < kHeads; ++h) CHECK(positions_of(a, s, h) == positions_of(b, s, h));
      std::vector<std::vector<kvtest::model_move>> model_moves;
      if constexpr (greedy) {
        model.greedy_observe(s, in);
        CHECK(model.greedy_evict_to(s, target, in, [&](std::int32_t h) { return positions_of(a, s, h); },
                                    model_moves));
      } else {
        model.observe(s, [&](std::int32_t h, std::int32_t slot) {
          const std::int32_t pos = model.head(s, h).pos[std::size_t(slot)];
          return static_cast<float>((std::uint32_t(pos) * 7 + std::uint32_t(h) * 3 + salt) % 8) / 8.0f;
        });
        model.evict_to(s, target);
      }
      for (std::int32_t h = 0; h < kHeads; ++h) {
        const kvtest::model_head& m = model.head(s, h);
        CHECK(a.next_slot(s, h) == m.next);
        for (std::int32_t slot = 0; slot < cap; ++slot) {
          const std::int32_t pos = m.pos[std::size_t(slot)];
          REQUIRE(a.slots().position(s, h, slot) == pos);
          if constexpr (greedy) CHECK(close_error(a.score(s, h, slot), m.error[std::size_t(slot)]));
          else CHECK(a.score(s, h, slot) == m.score[std::size_t(slot)]);
          if (pos >= 0)
            for (std::int32_t d = 0; d < kDim; ++d) {
              CHECK(cache_a.view().k_row(s, h, slot)[d] == row_value(pos, h, d) / 64.0f);
              CHECK(cache_a.view().v_row(s, h, slot)[d] == -row_value(pos, h, d) / 64.0f);
            }
        }
      }
    }
  };
  {
    kv::h2o_policy a(shape_of(cap), {6, 3}), b(shape_of(cap), {6, 3});
    drive(a, b);
  }
  {
    kv::recent_window_policy a(shape_of(cap), {2, 7}), b(shape_of(cap), {2, 7});
    drive(a, b);
  }
  {
    kv::exact_greedy_policy a(shape_of(cap), {9, 2, 1}), b(shape_of(cap), {9, 2, 1});
    drive(a, b);
  }
  MESSAGE("evict_to at once vs one at a time against the model: ", freed, " tokens freed");
  CHECK(freed > 60);
}

TEST_CASE("evict after evict_to decides on the moved slots, not on what observe found before") {
  // observe finds each head's victim in its pass over the scores; evict_to
  // then moves rows, so a following evict must not use that victim.
  kv::h2o_policy policy(shape_of(16), {6, 2});
  auto cache = kv::make_bhsd_cache<float>(kSeqs, kHeads, 16, kDim);
  std::vector<float> inc(std::size_t(kHeads) * 16);
  for (std::size_t i = 0; i < inc.size(); ++i) inc[i] = float((i * 5) % 7) / 8.0f;
  const kv::head_scores scores{kv::make_tensor_view<const float>(inc.data(), kHeads, 16)};
  policy.append(0, 12, nullptr);
  policy.observe(0, scores);
  CHECK(policy.evict_to(0, 9, cache.view()) == 3);  // target above the budget 8: rows move into the holes
  // The victim from scratch: the lowest (score, position) among the
  // unprotected tokens held now, the scores those observe gave each
  // position (slot p held position p before the rows moved).
  std::int32_t expected[kHeads], victims[kHeads];
  for (std::int32_t h = 0; h < kHeads; ++h) {
    std::int32_t best = -1;
    for (std::int32_t s = 0; s < 16; ++s) {
      const std::int32_t p = policy.slots().position(0, h, s);
      if (p < 0 || p >= policy.length(0) - 2) continue;  // free, or one of the recent 2
      CHECK(policy.score(0, h, s) == inc[std::size_t(h * 16 + p)]);
      const float score = inc[std::size_t(h * 16 + p)];
      if (best < 0) {
        best = s;
        continue;
      }
      const float best_score = inc[std::size_t(h * 16 + policy.slots().position(0, h, best))];
      if (score < best_score || (score == best_score && p < policy.slots().position(0, h, best))) best = s;
    }
    expected[h] = best;
  }
  CHECK(policy.evict(0, victims) == kHeads);  // 9 tokens, budget 8
  for (std::int32_t h = 0; h < kHeads; ++h) {
    CHECK(victims[h] == expected[h]);
    CHECK(policy.slots().position(0, h, victims[h]) == -1);
  }
}

TEST_CASE("random evict_to frees the step's lowest Philox priorities") {
  std::mt19937 rng(5);
  const std::int32_t cap = 24;
  const kv::random_config config{10, 2, 3, 1234};
  kv::random_policy policy(shape_of(cap), config);
  std::vector<float> inc(std::size_t(kHeads) * cap, 0.5f);
  for (std::int32_t step = 0; step < 30; ++step) {
    const std::int32_t b = std::int32_t(rng() % kSeqs), tokens = 1 + std::int32_t(rng() % 6);
    if (policy.slots().count(b, 0) + tokens > cap) continue;
    policy.append(b, tokens, nullptr);
    policy.observe(b, kv::head_scores{kv::make_tensor_view<const float>(inc.data(), kHeads, cap)});
    const std::int32_t length = policy.length(b);
    std::vector<std::set<std::int32_t>> expected;
    for (std::int32_t h = 0; h < kHeads; ++h) {
      std::set<std::int32_t> held = positions_of(policy, b, h);
      const std::int32_t surplus = std::int32_t(held.size()) - config.budget;
      std::vector<std::int32_t> candidates;
      for (std::int32_t p : held)
        if (p >= config.sinks && p < length - config.recent) candidates.push_back(p);
      if (surplus > 0)
        for (std::int32_t p : kvtest::random_victims(config.seed, std::uint64_t(b), h, length - 1, candidates,
                                                     std::size_t(surplus)))
          held.erase(p);
      expected.push_back(held);
    }
    policy.evict_to(b, config.budget, static_cast<kv::slot_move*>(std::vector<kv::slot_move>(kHeads * cap).data()),
                    std::vector<std::int32_t>(kHeads).data());
    for (std::int32_t h = 0; h < kHeads; ++h) CHECK(positions_of(policy, b, h) == expected[std::size_t(h)]);
  }
}

TEST_CASE("multi-token append and evict_to refuse bad input and change nothing") {
  kv::h2o_policy policy(shape_of(10), {4, 2});
  auto cache = kv::make_bhsd_cache<float>(kSeqs, kHeads, 10, kDim);
  policy.append(0, 7, nullptr);
  CHECK_THROWS_AS(policy.evict_to(0, 6, cache.view()), kv::state_error);  // not observed yet
  policy.skip_observe(0);
  const auto before = positions_of(policy, 0, 0);
  CHECK_THROWS_AS(policy.append(0, 4, nullptr), kv::out_of_range);  // 7 + 4 > capacity 10
  CHECK_THROWS_AS(policy.append(0, 0, nullptr), kv::out_of_range);
  CHECK_THROWS_AS(policy.evict_to(0, 1, cache.view()), kv::budget_error);  // below recent = 2
  CHECK_THROWS_AS(policy.evict_to(0, 11, cache.view()), kv::budget_error);
  CHECK_THROWS_AS(policy.evict_to(kSeqs, 6, cache.view()), kv::out_of_range);
  std::vector<kv::slot_move> no_moves;  // data() is null
  std::vector<std::int32_t> move_counts(kHeads);
  CHECK_THROWS_AS(policy.evict_to(0, 6, no_moves.data(), move_counts.data()), kv::invalid_argument);
  CHECK(positions_of(policy, 0, 0) == before);
  CHECK(policy.slots().count(0, 0) == 7);
  CHECK(policy.length(0) == 7);
  // exact_greedy refuses evict_to before the step was observed.
  kv::exact_greedy_policy oracle(shape_of(10), {6, 1, 1});
  oracle.append(1, 8, nullptr);
  CHECK_THROWS_AS(oracle.evict_to(1, 6, cache.view()), kv::state_error);
  CHECK(oracle.slots().count(1, 0) == 8);
}

/// Slot table and scores of sequence b, every head: what a refused call must leave as it was.
template <class Policy>
std::vector<float> head_state(const Policy& p, std::int32_t b) {
  std::vector<float> out;
  for (std::int32_t h = 0; h < kHeads; ++h) {
    out.push_back(float(p.slots().count(b, h)));
    out.push_back(float(p.next_slot(b, h)));
    for (std::int32_t s = 0; s < p.shape().capacity; ++s) {
      out.push_back(float(p.slots().position(b, h, s)));
      out.push_back(p.score(b, h, s));
    }
  }
  return out;
}

/// The number of free slots below one past the highest occupied slot.
template <class Policy>
std::int32_t holes_of(const Policy& p, std::int32_t b, std::int32_t h) {
  std::int32_t span = 0, holes = 0;
  for (std::int32_t s = 0; s < p.shape().capacity; ++s)
    if (p.slots().position(b, h, s) >= 0) span = s + 1;
  for (std::int32_t s = 0; s < span; ++s) holes += p.slots().position(b, h, s) < 0;
  return holes;
}

template <class Policy>
void check_one_evict_a_step(Policy policy) {
  // Regression (fuzzing, issue 12): after a multi-token append a second
  // evict in the same step freed another slot and left two holes, one of
  // which no append would ever fill.
  const std::int32_t cap = 16, budget = policy.budget();
  std::vector<float> inc(std::size_t(kHeads) * cap);
  for (std::size_t i = 0; i < inc.size(); ++i) inc[i] = float((i * 7) % 11) / 16.0f;
  const kv::head_scores scores{kv::make_tensor_view<const float>(inc.data(), kHeads, cap)};
  policy.append(0, budget + 3, nullptr);  // three above the budget, no hole
  policy.observe(0, scores);
  CHECK(policy.evict(0) == kHeads);  // the step's one victim per head
  for (std::int32_t h = 0; h < kHeads; ++h) CHECK(holes_of(policy, 0, h) == 1);
  const std::vector<float> before = head_state(policy, 0);
  CHECK_THROWS_WITH_AS(policy.evict(0), doctest::Contains("evict_to"), kv::state_error);
  CHECK(head_state(policy, 0) == before);
  // evict_to frees the rest and closes the hole.
  std::vector<kv::slot_move> moves(std::size_t(kHeads) * cap);
  std::vector<std::int32_t> counts(kHeads);
  CHECK(policy.evict_to(0, budget, moves.data(), counts.data()) == 2);
  for (std::int32_t h = 0; h < kHeads; ++h) {
    CHECK(policy.slots().count(0, h) == budget);
    CHECK(holes_of(policy, 0, h) <= 1);
  }
  // A single-token step still evicts once, and a second evict is a no-op.
  policy.append(0);
  policy.observe(0, scores);
  CHECK(policy.evict(0) == kHeads);
  CHECK(policy.evict(0) == 0);
  for (std::int32_t h = 0; h < kHeads; ++h) CHECK(holes_of(policy, 0, h) <= 1);
}

TEST_CASE("evict frees one token a step: after a multi-token append a second evict is refused") {
  SUBCASE("h2o") { check_one_evict_a_step(kv::h2o_policy(shape_of(16), {4, 2})); }
  SUBCASE("recent_window") { check_one_evict_a_step(kv::recent_window_policy(shape_of(16), {2, 4})); }
  SUBCASE("random") { check_one_evict_a_step(kv::random_policy(shape_of(16), {6, 1, 1, 99})); }
}

TEST_CASE("batched observe + evict refuses an input narrower than a head's tokens after a multi-token append") {
  // Regression (fuzzing, issue 12): the argument check asks for budget + 1
  // columns, but batched_append_tokens may take a head beyond that, and
  // observe read past the end of the input.
  const kv::policy_shape shape = shape_of(12);
  const kv::h2o_config config{3, 2};  // budget 5: 6 columns pass the argument check
  std::vector<unsigned char> memory(kv::batch_state_bytes<kv::h2o_policy>(shape, config));
  const kv::batch_state_view st = kv::make_batch_state<kv::h2o_policy>(memory.data(), memory.size(), shape, config);
  kv::init_batch_state(st);
  std::uint64_t status = kv::batch_status_clear;
  kv::batched_append_tokens(st, kv::active_set::all(), 9, &status);
  REQUIRE(status == kv::batch_status_clear);
  const std::vector<unsigned char> before = memory;
  std::vector<float> narrow(std::size_t(kSeqs) * kHeads * 6, 0.125f);
  const kv::batch_head_scores six{kv::make_tensor_view<const float>(narrow.data(), kSeqs, kHeads, 6)};
  std::vector<std::int32_t> victims(std::size_t(kSeqs) * kHeads, 7);
  kv::batched_observe_evict(st, kv::active_set::all(), six, victims.data(), &status);
  const kv::batch_status s = kv::batch_status::unpack(status);
  CHECK(s.code == kv::batch_code::narrow_input);
  CHECK(s.sequence == 0);
  CHECK(s.head == 0);
  CHECK(s.index == 9);  // the tokens the head holds
  CHECK(memory == before);  // every head refused, nothing changed
  for (std::int32_t v : victims) CHECK(v == -1);
  CHECK_THROWS_AS(kv::throw_if_error(status), kv::invalid_argument);
  // With a column for every token the same step goes through.
  std::vector<float> wide(std::size_t(kSeqs) * kHeads * 9, 0.125f);
  status = kv::batch_status_clear;
  kv::batched_observe_evict(st, kv::active_set::all(),
                            kv::batch_head_scores{kv::make_tensor_view<const float>(wide.data(), kSeqs, kHeads, 9)},
                            victims.data(), &status);
  CHECK(status == kv::batch_status_clear);
  CHECK(st.slots.counts[0] == 8);
}

namespace {

/// A K/V element of the batched streams: a hash of (position, head, d,
/// which) on a 1/32 grid in [-1, 1], so every token has a row of its own and
/// exact_greedy's errors rarely tie.
float hashed_value(std::int32_t position, std::int32_t h, std::int32_t d, std::uint32_t which) {
  std::uint32_t x = std::uint32_t(position) * 0x9E3779B1u ^ std::uint32_t(h) * 0x85EBCA77u ^
                    std::uint32_t(d) * 0xC2B2AE3Du ^ which * 0x27D4EB2Fu;
  x ^= x >> 15;
  x *= 0x2C1B3C6Du;
  x ^= x >> 12;
  return static_cast<float>(std::int32_t(x % 65u) - 32) / 32.0f;
}

struct parity_totals {
  std::int64_t steps = 0, freed = 0, moves = 0, near_ties = 0, greedy_rounds = 0;
};

/// Runs the batched host backend through multi-token steps on a cache of
/// dtype T and layout `layout`, against the reference model
/// (support/multi_token_reference.hpp) written from the definitions: after
/// every call the slot tables (positions, counts, next slots) must be the
/// model's, the scores the model's bit for bit (exact_greedy's within 1e-6
/// of its long-double errors), every occupied slot's K/V rows the rows of
/// its position, and on the odd steps (evict_to's moves form, the test
/// moving the rows) the moves the model's refill. exact_greedy observes
/// queries (batched_observe_evict records every appended row) and its
/// batched evict_to re-scores with them.
template <class Policy, class T>
void run_batched_parity(kvtest::layout_kind layout, const typename kv::policy_traits<Policy>::config_type& config,
                        std::uint32_t seed, parity_totals& tot) {
  constexpr bool greedy = std::is_same_v<Policy, kv::exact_greedy_policy>;
  const std::int32_t cap = 16;
  const kv::policy_shape shape = shape_of(cap);
  const kv::history_extent history = greedy ? kv::history_extent{128, kDim} : kv::history_extent{};
  kvtest::multi_token_model model(kSeqs, kHeads, cap, model_of(config));
  const std::int32_t budget = model_of(config).budget;
  std::vector<unsigned char> memory(kv::batch_state_bytes<Policy>(shape, config, history));
  const kv::batch_state_view st = kv::make_batch_state<Policy>(memory.data(), memory.size(), shape, config, history);
  kv::init_batch_state(st);
  std::mt19937 rng(seed);
  // The K/V rows of (position, head), as T holds them.
  const auto key_of = [&](std::int32_t p, std::int32_t h, std::int32_t d) {
    return kv::from_float<T>(hashed_value(p, h, d, seed));
  };
  const auto value_of = [&](std::int32_t p, std::int32_t h, std::int32_t d) {
    return kv::from_float<T>(hashed_value(p, h, d, ~seed));
  };
  kvtest::with_cache<T>(layout, kSeqs, kHeads, cap, kDim, 4, [&](auto view) {
    std::vector<float> inc(std::size_t(kSeqs) * kHeads * cap);
    std::vector<float> q(std::size_t(kSeqs) * kHeads * kGroup * kDim), lse(std::size_t(kSeqs) * kHeads * kGroup);
    const kv::batch_queries<float> queries{kv::make_tensor_view<const float>(q.data(), kSeqs, kHeads * kGroup, kDim),
                                           kv::make_tensor_view<const float>(lse.data(), kSeqs, kHeads * kGroup),
                                           0.5f};
    kvtest::greedy_inputs in;
    in.group = kGroup;
    in.head_dim = kDim;
    in.scale = 0.5L;
    in.key = [&](std::int32_t p, std::int32_t h, std::int32_t d) { return kv::to_float(key_of(p, h, d)); };
    in.value = [&](std::int32_t p, std::int32_t h, std::int32_t d) { return kv::to_float(value_of(p, h, d)); };
    in.query = [&](std::int32_t b, std::int32_t qh, std::int32_t d) {
      return q[(std::size_t(b) * kHeads * kGroup + std::size_t(qh)) * kDim + std::size_t(d)];
    };
    std::vector<kv::slot_move> moves(std::size_t(kSeqs) * kHeads * cap);
    std::vector<std::int32_t> move_counts(std::size_t(kSeqs) * kHeads, -1), victims(std::size_t(kSeqs) * kHeads, -2);
    std::uint64_t status = kv::batch_status_clear;
    // Rows each sequence appended since its last observe (exact_greedy's
    // history records them at the observe).
    std::vector<std::int32_t> unobserved(std::size_t(kSeqs), 0);
    const auto check_state = [&](const char* after) {
      CAPTURE(std::string(after));
      kvtest::check_slot_invariants(st);
      for (std::int32_t b = 0; b < kSeqs; ++b) {
        CAPTURE(b);
        REQUIRE(st.slots.lengths[b] == model.length(b));
        for (std::int32_t h = 0; h < kHeads; ++h) {
          CAPTURE(h);
          const kvtest::model_head& m = model.head(b, h);
          const std::int64_t bh = st.head_index(b, h);
          REQUIRE(st.slots.counts[bh] == m.count);
          CHECK(st.slots.next_slots[bh] == m.next);
          if constexpr (greedy) CHECK(st.history.rows[bh] == model.length(b) - unobserved[std::size_t(b)]);
          for (std::int32_t s = 0; s < cap; ++s) {
            CAPTURE(s);
            const std::int32_t p = m.pos[std::size_t(s)];
            REQUIRE(st.slots.positions_of(b, h)[s] == p);
            if constexpr (greedy) {
              if (p >= 0)
                CHECK_MESSAGE(close_error(st.scores_of(b, h)[s], m.error[std::size_t(s)]), "library ",
                              double(st.scores_of(b, h)[s]), ", model ", double(m.error[std::size_t(s)]));
              else CHECK(st.scores_of(b, h)[s] == 0.0f);
            } else {
              CHECK(st.scores_of(b, h)[s] == m.score[std::size_t(s)]);
            }
            if (p < 0) continue;
            for (std::int32_t d = 0; d < kDim; ++d) {
              const T k = key_of(p, h, d), v = value_of(p, h, d);
              CHECK(kvtest::same_bits(view.k_row(b, h, s) + d, &k, 1));
              CHECK(kvtest::same_bits(view.v_row(b, h, s) + d, &v, 1));
            }
          }
        }
      }
    };
    for (std::int32_t step = 0; step < 25; ++step) {
      CAPTURE(step);
      const std::int32_t tokens = 1 + std::int32_t(rng() % 4);
      std::vector<std::uint8_t> flags(kSeqs, 0);
      for (std::int32_t b = 0; b < kSeqs; ++b)
        flags[std::size_t(b)] = model.head(b, 0).count + tokens <= cap && rng() % 4 != 0;
      const auto active = kv::active_set::of_flags(flags.data());
      kv::batched_append_tokens(st, active, tokens, &status);
      for (std::int32_t b = 0; b < kSeqs; ++b) {
        if (!flags[std::size_t(b)]) continue;
        std::vector<std::int32_t> slots;
        const std::int32_t first = model.append(b, tokens, slots);
        unobserved[std::size_t(b)] = tokens;
        for (std::int32_t h = 0; h < kHeads; ++h)  // the engine writes the rows where the model says
          for (std::int32_t j = 0; j < tokens; ++j)
            for (std::int32_t d = 0; d < kDim; ++d) {
              const std::int32_t s = slots[std::size_t(h * tokens + j)];
              view.k_row(b, h, s)[d] = key_of(first + j, h, d);
              view.v_row(b, h, s)[d] = value_of(first + j, h, d);
            }
      }
      REQUIRE(status == kv::batch_status_clear);
      check_state("append");
      for (float& x : inc) x = static_cast<float>(rng() % 8) / 8.0f;
      for (float& x : q) x = static_cast<float>(rng() % 33) / 16.0f - 1.0f;
      if constexpr (greedy) {
        kv::batched_observe_evict(st, active, queries, view, victims.data(), &status);
      } else {
        kv::batched_observe_evict(
            st, active, kv::batch_head_scores{kv::make_tensor_view<const float>(inc.data(), kSeqs, kHeads, cap)},
            victims.data(), &status);
      }
      REQUIRE(status == kv::batch_status_clear);
      std::fill(unobserved.begin(), unobserved.end(), 0);  // every appended row recorded
      for (std::int32_t b = 0; b < kSeqs; ++b) {
        if (!flags[std::size_t(b)]) continue;
        if constexpr (greedy) {
          CHECK(model.greedy_observe_evict(b, in, [&](std::int32_t h) { return victims[std::size_t(b * kHeads + h)]; }));
        } else {
          model.observe_evict(b, [&](std::int32_t h, std::int32_t s) {
            return inc[(std::size_t(b) * kHeads + std::size_t(h)) * cap + std::size_t(s)];
          });
        }
        for (std::int32_t h = 0; h < kHeads; ++h)  // the freed slot of each head, or -1
          CHECK(victims[std::size_t(b * kHeads + h)] == model.last_victims()[std::size_t(h)]);
      }
      check_state("observe + evict");
      const std::int32_t target = budget - std::int32_t(rng() % 2);
      std::vector<std::vector<std::vector<kvtest::model_move>>> want_moves(kSeqs);
      if (step % 2 == 0) {
        if constexpr (greedy) kv::batched_evict_to(st, active, target, queries, view, nullptr, &status);
        else kv::batched_evict_to(st, active, target, view, nullptr, &status);
      } else {
        if constexpr (greedy) kv::batched_evict_to(st, active, target, queries, moves.data(), move_counts.data(), &status);
        else kv::batched_evict_to(st, active, target, moves.data(), move_counts.data(), &status);
      }
      REQUIRE(status == kv::batch_status_clear);
      for (std::int32_t b = 0; b < kSeqs; ++b) {
        if (!flags[std::size_t(b)]) continue;
        for (std::int32_t h = 0; h < kHeads; ++h)
          tot.freed += std::max(0, model.head(b, h).count - target);
        if constexpr (greedy) {
          CHECK(model.greedy_evict_to(
              b, target, in,
              [&](std::int32_t h) {
                std::set<std::int32_t> kept;
                for (std::int32_t s = 0; s < cap; ++s)
                  if (st.slots.positions_of(b, h)[s] >= 0) kept.insert(st.slots.positions_of(b, h)[s]);
                return kept;
              },
              want_moves[std::size_t(b)]));
        } else {
          want_moves[std::size_t(b)] = model.evict_to(b, target);
        }
        for (std::int32_t h = 0; h < kHeads; ++h) {
          const std::vector<kvtest::model_move>& want = want_moves[std::size_t(b)][std::size_t(h)];
          tot.moves += std::int64_t(want.size());
          if (step % 2 == 0) continue;
          // The moves form: the model's refill, which the test (the engine) carries out.
          const std::int64_t bh = st.head_index(b, h);
          REQUIRE(move_counts[std::size_t(bh)] == std::int32_t(want.size()));
          for (std::size_t i = 0; i < want.size(); ++i) {
            const kv::slot_move m = moves[std::size_t(bh) * cap + i];
            CHECK(m.from == want[i].from);
            CHECK(m.to == want[i].to);
            std::copy_n(view.k_row(b, h, m.from), kDim, view.k_row(b, h, m.to));
            std::copy_n(view.v_row(b, h, m.from), kDim, view.v_row(b, h, m.to));
          }
        }
      }
      check_state("evict_to");
      ++tot.steps;
    }
  });
  tot.near_ties += model.near_ties();
  tot.greedy_rounds += model.greedy_rounds();
}

template <class T>
void batched_parity_all_layouts(parity_totals (&tot)[4]) {
  for (const auto layout : kvtest::all_layouts)
    for (std::uint32_t seed = 1; seed <= 3; ++seed) {
      CAPTURE(std::string(kvtest::name(layout)));
      CAPTURE(seed);
      run_batched_parity<kv::h2o_policy, T>(layout, {6, 3}, seed, tot[0]);
      run_batched_parity<kv::recent_window_policy, T>(layout, {2, 7}, seed, tot[1]);
      run_batched_parity<kv::random_policy, T>(layout, {9, 1, 2, 77}, seed, tot[2]);
      run_batched_parity<kv::exact_greedy_policy, T>(layout, {9, 2, 1}, seed, tot[3]);
    }
}

}  // namespace

TEST_CASE("batched multi-token append, observe + evict and evict_to equal the reference model, every dtype x layout") {
  parity_totals tot[4];
  batched_parity_all_layouts<float>(tot);
  batched_parity_all_layouts<kv::half>(tot);
  batched_parity_all_layouts<kv::bfloat16>(tot);
  const char* names[4] = {"h2o", "recent_window", "random", "exact_greedy"};
  for (int i = 0; i < 4; ++i) {
    MESSAGE(std::string(names[i]), ": ", tot[i].steps, " steps against the model, ", tot[i].freed, " tokens freed by evict_to, ",
            tot[i].moves, " rows moved by the refill",
            i == 3 ? ", greedy rounds scored: " + std::to_string(tot[i].greedy_rounds) +
                         ", near ties followed: " + std::to_string(tot[i].near_ties)
                   : std::string());
    CHECK(tot[i].freed > 100);
    CHECK(tot[i].moves > 50);
  }
}

TEST_CASE("batched evict_to writes the moves and counts of the active sequences only") {
  // The CUDA test once replayed an inactive sequence's count (an earlier
  // call's) as moves: the contract is that those entries are not written.
  const kv::policy_shape shape = shape_of(12);
  const kv::h2o_config config{5, 2};
  std::vector<unsigned char> memory(kv::batch_state_bytes<kv::h2o_policy>(shape, config));
  const kv::batch_state_view st = kv::make_batch_state<kv::h2o_policy>(memory.data(), memory.size(), shape, config);
  kv::init_batch_state(st);
  std::uint64_t status = kv::batch_status_clear;
  kv::batched_append_tokens(st, kv::active_set::all(), 10, &status);
  std::vector<float> inc(std::size_t(kSeqs) * kHeads * 12);
  for (std::size_t i = 0; i < inc.size(); ++i) inc[i] = static_cast<float>((i * 7) % 11) / 8.0f;
  kv::batched_observe_evict(st, kv::active_set::all(),
                            kv::batch_head_scores{kv::make_tensor_view<const float>(inc.data(), kSeqs, kHeads, 12)},
                            nullptr, &status);
  REQUIRE(status == kv::batch_status_clear);
  const kv::slot_move sentinel{-7, -7};
  std::vector<kv::slot_move> moves(std::size_t(kSeqs) * kHeads * 12, sentinel);
  std::vector<std::int32_t> counts(std::size_t(kSeqs) * kHeads, -7);
  const std::int32_t list[] = {1};
  kv::batched_evict_to(st, kv::active_set::of_list(list, 1), 7, moves.data(), counts.data(), &status);
  REQUIRE(status == kv::batch_status_clear);
  for (std::int32_t b = 0; b < kSeqs; ++b)
    for (std::int32_t h = 0; h < kHeads; ++h) {
      CAPTURE(b);
      CAPTURE(h);
      const std::int64_t bh = st.head_index(b, h);
      CHECK(st.slots.counts[bh] == (b == 1 ? 7 : 9));
      if (b != 1) CHECK(counts[std::size_t(bh)] == -7);
      else CHECK((counts[std::size_t(bh)] >= 1 && counts[std::size_t(bh)] <= 3));
      const std::int32_t written = b == 1 ? counts[std::size_t(bh)] : 0;
      for (std::int32_t i = 0; i < 12; ++i) {
        const kv::slot_move m = moves[std::size_t(bh) * 12 + std::size_t(i)];
        if (i < written) CHECK((m.from >= 7 && m.from < 10 && m.to >= 0 && m.to < 7));  // 10 slots used, one a hole
        else CHECK((m.from == -7 && m.to == -7));
      }
    }
}

TEST_CASE("batched evict_to: an unobserved head is refused and left unchanged; exact_greedy takes the queries") {
  const kv::policy_shape shape = shape_of(12);
  const kv::h2o_config config{5, 2};
  std::vector<unsigned char> memory(kv::batch_state_bytes<kv::h2o_policy>(shape, config));
  const kv::batch_state_view st = kv::make_batch_state<kv::h2o_policy>(memory.data(), memory.size(), shape, config);
  kv::init_batch_state(st);
  std::uint64_t status = kv::batch_status_clear;
  kv::batched_append_tokens(st, kv::active_set::all(), 10, &status);
  CHECK(status == kv::batch_status_clear);
  kv::batched_append_tokens(st, kv::active_set::all(), 3, &status);  // 13 > capacity 12
  CHECK(kv::batch_status::unpack(status).code == kv::batch_code::over_capacity);
  CHECK(st.slots.counts[0] == 10);
  status = kv::batch_status_clear;
  std::vector<kv::slot_move> moves(std::size_t(kSeqs) * kHeads * 12);
  std::vector<std::int32_t> counts(std::size_t(kSeqs) * kHeads, -1);
  kv::batched_evict_to(st, kv::active_set::all(), 7, moves.data(), counts.data(), &status);
  CHECK(kv::batch_status::unpack(status).code == kv::batch_code::not_observed);
  CHECK(st.slots.counts[0] == 10);
  CHECK_THROWS_AS(kv::batched_evict_to(st, kv::active_set::all(), 1, moves.data(), counts.data(), &status),
                  kv::budget_error);

  // exact_greedy: the overloads without queries refuse it, the ones with
  // queries refuse the other policies.
  const kv::exact_greedy_config eg{6, 1, 1};
  const kv::history_extent hist{32, kDim};
  std::vector<unsigned char> eg_memory(kv::batch_state_bytes<kv::exact_greedy_policy>(shape, eg, hist));
  const kv::batch_state_view eg_state =
      kv::make_batch_state<kv::exact_greedy_policy>(eg_memory.data(), eg_memory.size(), shape, eg, hist);
  kv::init_batch_state(eg_state);
  auto cache = kv::make_bhsd_cache<float>(kSeqs, kHeads, 12, kDim);
  std::mt19937 rng(3);
  for (auto& x : cache.k_storage()) x = static_cast<float>(rng() % 33) / 16.0f - 1.0f;
  for (auto& x : cache.v_storage()) x = static_cast<float>(rng() % 33) / 16.0f - 1.0f;
  std::vector<float> q(std::size_t(kSeqs) * kHeads * kGroup * kDim, 0.25f), lse(std::size_t(kSeqs) * kHeads * kGroup);
  const kv::batch_queries<float> queries{kv::make_tensor_view<const float>(q.data(), kSeqs, kHeads * kGroup, kDim),
                                         kv::make_tensor_view<const float>(lse.data(), kSeqs, kHeads * kGroup), 0.5f};
  CHECK_THROWS_WITH_AS(kv::batched_evict_to(eg_state, kv::active_set::all(), 6, moves.data(), counts.data(), &status),
                       doctest::Contains("batch_queries"), kv::invalid_argument);
  CHECK_THROWS_WITH_AS(kv::batched_evict_to(eg_state, kv::active_set::all(), 6, cache.view(), nullptr, &status),
                       doctest::Contains("batch_queries"), kv::invalid_argument);
  CHECK_THROWS_AS(kv::batched_evict_to(st, kv::active_set::all(), 7, queries, moves.data(), counts.data(), &status),
                  kv::invalid_argument);
  CHECK_THROWS_AS(kv::batched_evict_to(st, kv::active_set::all(), 7, queries, cache.view(), nullptr, &status),
                  kv::invalid_argument);

  // Snapshot of everything evict_to may change, to prove refusals change nothing.
  const auto snapshot = [&] {
    std::vector<float> out;
    for (std::int32_t b = 0; b < kSeqs; ++b)
      for (std::int32_t h = 0; h < kHeads; ++h) {
        const std::int64_t bh = eg_state.head_index(b, h);
        out.push_back(float(eg_state.slots.counts[bh]));
        out.push_back(float(eg_state.slots.next_slots[bh]));
        for (std::int32_t s = 0; s < 12; ++s) {
          out.push_back(float(eg_state.slots.positions_of(b, h)[s]));
          out.push_back(eg_state.scores_of(b, h)[s]);
        }
      }
    out.insert(out.end(), cache.k_storage().begin(), cache.k_storage().end());
    return out;
  };
  status = kv::batch_status_clear;
  kv::batched_append_tokens(eg_state, kv::active_set::all(), 9, &status);
  REQUIRE(status == kv::batch_status_clear);
  std::vector<float> before = snapshot();
  kv::batched_evict_to(eg_state, kv::active_set::all(), 6, queries, cache.view(), nullptr, &status);
  CHECK(kv::batch_status::unpack(status).code == kv::batch_code::not_observed);
  CHECK(snapshot() == before);
  status = kv::batch_status_clear;
  kv::batched_observe_evict(eg_state, kv::active_set::all(), queries, cache.view(), nullptr, &status);
  REQUIRE(status == kv::batch_status_clear);
  CHECK(eg_state.history.rows[0] == 9);  // all nine appended rows recorded
  CHECK(eg_state.slots.counts[0] == 8);  // observe + evict freed one above the budget
  before = snapshot();
  // Arguments: a bad target, queries of the wrong shape, null moves.
  CHECK_THROWS_AS(kv::batched_evict_to(eg_state, kv::active_set::all(), 1, queries, cache.view(), nullptr, &status),
                  kv::budget_error);
  const kv::batch_queries<float> narrow{
      kv::make_tensor_view<const float>(q.data(), kSeqs, kHeads * kGroup, kDim - 1),
      kv::make_tensor_view<const float>(lse.data(), kSeqs, kHeads * kGroup), 0.5f};
  CHECK_THROWS_AS(kv::batched_evict_to(eg_state, kv::active_set::all(), 6, narrow, cache.view(), nullptr, &status),
                  kv::invalid_argument);
  const kv::batch_queries<float> one_head{kv::make_tensor_view<const float>(q.data(), kSeqs, kHeads, kDim),
                                          kv::make_tensor_view<const float>(lse.data(), kSeqs, kHeads), 0.5f};
  CHECK_THROWS_AS(kv::batched_evict_to(eg_state, kv::active_set::all(), 6, one_head, moves.data(), counts.data(),
                                       &status),
                  kv::invalid_argument);
  CHECK_THROWS_AS(kv::batched_evict_to(eg_state, kv::active_set::all(), 6, queries, nullptr, counts.data(), &status),
                  kv::invalid_argument);
  CHECK(status == kv::batch_status_clear);
  CHECK(snapshot() == before);
  // A non-finite query of sequence 1, query head 3 (KV head 1): that head is
  // refused and unchanged, the others step.
  q[(std::size_t(1) * kHeads * kGroup + 3) * kDim + 2] = std::numeric_limits<float>::infinity();
  kv::batched_evict_to(eg_state, kv::active_set::all(), 6, queries, cache.view(), nullptr, &status);
  const kv::batch_status refused = kv::batch_status::unpack(status);
  CHECK(refused.code == kv::batch_code::non_finite_query);
  CHECK(refused.sequence == 1);
  CHECK(refused.head == 1);
  CHECK(refused.index == 3);
  CHECK(eg_state.slots.counts[eg_state.head_index(1, 1)] == 8);
  CHECK(eg_state.slots.counts[eg_state.head_index(1, 0)] == 6);
  CHECK(eg_state.slots.counts[eg_state.head_index(0, 1)] == 6);

  // exact_greedy never reads the LSE (it scores with its own softmax over
  // the history): queries without one are taken, as by the per-sequence
  // call; h2o's queries input needs it and the refusal names it.
  q[(std::size_t(1) * kHeads * kGroup + 3) * kDim + 2] = 0.25f;
  const kv::batch_queries<float> no_lse{kv::make_tensor_view<const float>(q.data(), kSeqs, kHeads * kGroup, kDim), {},
                                        0.5f};
  status = kv::batch_status_clear;
  kv::batched_evict_to(eg_state, kv::active_set::all(), 5, no_lse, cache.view(), nullptr, &status);
  CHECK(status == kv::batch_status_clear);
  for (std::int32_t b = 0; b < kSeqs; ++b)
    for (std::int32_t h = 0; h < kHeads; ++h) CHECK(eg_state.slots.counts[eg_state.head_index(b, h)] == 5);
  const std::vector<float> h2o_before(st.scores_of(0, 0), st.scores_of(0, 0) + 12);
  CHECK_THROWS_WITH_AS(kv::batched_observe_evict(st, kv::active_set::all(), no_lse, cache.view(), nullptr, &status),
                       doctest::Contains("'lse'"), kv::invalid_argument);
  CHECK(std::vector<float>(st.scores_of(0, 0), st.scores_of(0, 0) + 12) == h2o_before);
}
