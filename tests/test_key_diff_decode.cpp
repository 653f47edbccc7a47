// KeyDiff at decode time (key_diff_anchor.hpp): every step each cached key
// scores -cos(k, anchor), the anchor the sum of the unit keys cached now,
// and the victim is the unprotected key most like the others. Checked
// against a real-drop reference written here from the definition in double
// precision (it recomputes the anchor from its cached keys every step);
// where the library's victim differs, the two must be a near-tie in the
// reference's scores (counted), and the reference follows the library.
// The batched host backend gives the per-sequence bits; the running anchor
// gives the bits of a fresh count; bad input is refused and changes
// nothing.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "kvevict/kvevict.hpp"
#include "support/caches.hpp"

namespace kv = kvevict;
using kvtest::layout_kind;

namespace {

constexpr std::int32_t kSeqs = 2, kHeads = 2, kDim = 16;
constexpr double kMargin = 1e-5;  // float rounding of a cosine is far below this

struct ref_token {
  std::int32_t position;
  std::vector<double> key;
};

/// -cos(k, sum of the unit keys of `tokens`) for each token, in double (0
/// for a zero key or a zero anchor).
std::vector<double> reference_scores(const std::vector<ref_token>& tokens) {
  std::vector<double> anchor(kDim, 0.0), norms;
  for (const ref_token& t : tokens) {
    double sq = 0;
    for (double x : t.key) sq += x * x;
    norms.push_back(std::sqrt(sq));
    if (sq > 0)
      for (std::int32_t e = 0; e < kDim; ++e) anchor[std::size_t(e)] += t.key[std::size_t(e)] / norms.back();
  }
  double alen = 0;
  for (double x : anchor) alen += x * x;
  alen = std::sqrt(alen);
  std::vector<double> score(tokens.size(), 0.0);
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    if (norms[i] == 0 || alen == 0) continue;
    double dot = 0;
    for (std::int32_t e = 0; e < kDim; ++e) dot += tokens[i].key[std::size_t(e)] * anchor[std::size_t(e)];
    score[i] = -dot / (norms[i] * alen);
  }
  return score;
}

template <class T>
std::vector<double> key_of(const T* k) {
  std::vector<double> out(kDim);
  for (std::int32_t e = 0; e < kDim; ++e) out[std::size_t(e)] = kv::to_float(k[e]);
  return out;
}

/// Keys around a common direction (what makes KeyDiff matter), one in 16 zero.
template <class T>
void draw_keys(std::mt19937& rng, const std::vector<float>& bias, std::vector<T>& keys) {
  for (std::size_t row = 0; row < keys.size() / kDim; ++row) {
    const bool zero = rng() % 16 == 0;
    for (std::int32_t e = 0; e < kDim; ++e)
      keys[row * kDim + std::size_t(e)] =
          zero ? kv::from_float<T>(0.0f)
               : kv::from_float<T>(bias[std::size_t(e)] + kv::to_float(kvtest::random_value<T>(rng)) / 2);
  }
}

template <class T>
void run_stream(layout_kind layout, std::int32_t group, std::uint32_t seed, std::int64_t& near_ties,
                std::int64_t& evictions) {
  std::mt19937 rng(seed);
  const std::int32_t kept = 2 + std::int32_t(rng() % 5), recent = std::int32_t(rng() % 3),
                     sinks = std::int32_t(rng() % 3);
  const std::int32_t budget = kept + recent + sinks, cap = budget + 1 + std::int32_t(rng() % 3);
  CAPTURE(kept);
  CAPTURE(recent);
  CAPTURE(sinks);
  const kv::h2o_config config = kv::key_norm_config(kept, recent, sinks);
  const kv::policy_shape shape{kSeqs, kHeads, kHeads * group, cap};
  kv::h2o_policy single(shape, config);
  std::vector<unsigned char> memory(kv::batch_state_bytes<kv::h2o_policy>(shape, config, kv::key_diff_extent(kDim)));
  const auto st = kv::make_batch_state<kv::h2o_policy>(memory.data(), memory.size(), shape, config,
                                                       kv::key_diff_extent(kDim));
  kv::init_batch_state(st);
  std::vector<std::vector<ref_token>> ref(std::size_t(kSeqs) * kHeads);
  std::vector<T> k_new(std::size_t(kSeqs) * kHeads * kDim), v_new(k_new.size());
  std::vector<float> bias(kDim);
  for (float& x : bias) x = kv::to_float(kvtest::random_value<T>(rng));
  std::vector<std::uint8_t> flags(kSeqs);
  kvtest::with_cache<T>(layout, kSeqs, kHeads, cap, kDim, 2, [&](auto view_a) {
    kvtest::with_cache<T>(layout, kSeqs, kHeads, cap, kDim, 2, [&](auto view_b) {
      using A = kv::key_diff<T, std::decay_t<decltype(view_a.layout)>>;
      using B = kv::key_diff<T, std::decay_t<decltype(view_b.layout)>>;
      for (std::int32_t step = 0; step < 48; ++step) {
        CAPTURE(step);
        for (auto& f : flags) f = rng() % 4 != 0;
        if (step == 24) {  // a reset: the next step counts the anchor afresh
          single.reset(1);
          const std::int32_t one[] = {1};
          kv::reset_batch_sequences(st, kv::active_set::of_list(one, 1));
          ref[2].clear();
          ref[3].clear();
        }
        draw_keys(rng, bias, k_new);
        for (T& x : v_new) x = kvtest::random_value<T>(rng);
        for (std::int32_t b = 0; b < kSeqs; ++b) {
          if (!flags[std::size_t(b)]) continue;
          for (std::int32_t h = 0; h < kHeads; ++h) {
            const std::int32_t s = single.next_slot(b, h);
            const T* k = &k_new[(std::size_t(b) * kHeads + h) * kDim];
            std::copy_n(k, kDim, view_a.k_row(b, h, s));
            std::copy_n(&v_new[(std::size_t(b) * kHeads + h) * kDim], kDim, view_a.v_row(b, h, s));
            ref[std::size_t(b) * kHeads + h].push_back({single.length(b), key_of(k)});
          }
          single.append(b);
          single.observe(b, A{view_a});
          evictions += single.evict(b) > 0;
        }
        std::uint64_t status = kv::batch_status_clear;
        const auto active = kv::active_set::of_flags(flags.data());
        const kv::batch_rows<T> k_rows{kv::make_tensor_view<const T>(k_new.data(), kSeqs, kHeads, kDim)};
        const kv::batch_rows<T> v_rows{kv::make_tensor_view<const T>(v_new.data(), kSeqs, kHeads, kDim)};
        kv::batched_append(st, active, view_b, k_rows, v_rows, &status);
        kv::batched_observe_evict(st, active, B{view_b}, nullptr, &status);
        REQUIRE(status == kv::batch_status_clear);
        for (std::int32_t b = 0; b < kSeqs; ++b)
          for (std::int32_t h = 0; h < kHeads; ++h) {
            CAPTURE(b);
            CAPTURE(h);
            auto& tokens = ref[std::size_t(b) * kHeads + h];
            const std::vector<double> want = reference_scores(tokens);
            std::vector<char> cached(tokens.size(), 0);
            for (std::int32_t s = 0; s < cap; ++s) {
              const std::int32_t p = single.slots().position(b, h, s);
              CHECK(st.slots.positions_of(b, h)[s] == p);  // batched == per sequence, bit for bit
              const float a = single.score(b, h, s), c = st.scores_of(b, h)[s];
              CHECK(std::memcmp(&a, &c, sizeof a) == 0);
              if (p < 0) continue;
              const auto it = std::find_if(tokens.begin(), tokens.end(), [&](const ref_token& t) { return t.position == p; });
              REQUIRE(it != tokens.end());
              const std::size_t i = std::size_t(it - tokens.begin());
              cached[i] = 1;
              // The step's score, against the anchor before the eviction.
              if (flags[std::size_t(b)]) CHECK(std::abs(double(a) - want[i]) < kMargin);
            }
            if (!flags[std::size_t(b)] || std::int32_t(tokens.size()) <= budget) {
              CHECK(std::count(cached.begin(), cached.end(), 1) == std::int32_t(tokens.size()));
              continue;
            }
            // The reference's victim: the lowest (score, position) outside the protection.
            const std::int32_t length = single.length(b);
            std::size_t victim = tokens.size(), dropped = tokens.size();
            for (std::size_t i = 0; i < tokens.size(); ++i) {
              if (!cached[i]) {
                CHECK(dropped == tokens.size());  // exactly one token left
                dropped = i;
              }
              const std::int32_t p = tokens[i].position;
              if (p < sinks || p >= length - recent) continue;
              if (victim == tokens.size() || want[i] < want[victim]) victim = i;  // ascending positions: older first
            }
            REQUIRE(dropped < tokens.size());
            if (dropped != victim) {  // only a near-tie may go the other way
              CHECK(std::abs(want[dropped] - want[victim]) <= kMargin);
              const std::int32_t p = tokens[dropped].position;
              CHECK(!(p < sinks || p >= length - recent));
              ++near_ties;
            }
            tokens.erase(tokens.begin() + std::ptrdiff_t(dropped));
          }
      }
    });
  });
}

}  // namespace

TEST_CASE("KeyDiff decode evicts the key most like the others: per sequence and batched equal a real-drop reference") {
  std::int64_t near_ties = 0, evictions = 0;
  for (const layout_kind layout : kvtest::all_layouts)
    for (const std::int32_t group : {1, 4})
      for (std::uint32_t seed = 1; seed <= 4; ++seed) {
        CAPTURE(kvtest::name(layout));
        CAPTURE(group);
        CAPTURE(seed);
        run_stream<float>(layout, group, seed, near_ties, evictions);
        run_stream<kv::half>(layout, group, seed + 100, near_ties, evictions);
        run_stream<kv::bfloat16>(layout, group, seed + 200, near_ties, evictions);
      }
  CHECK(evictions > 1000);
  MESSAGE("evictions: ", evictions, ", near-ties decided the other way: ", near_ties);
  CHECK(near_ties * 100 < evictions);
}

namespace {

/// Two per-sequence policies through the same calls, but B's anchors are
/// stale every step (evict_to instead of evict), so each of its refreshes
/// counts every cached key afresh: the running anchor of A must give the
/// same bits. The stream mixes a KeyDiff prefill, key-norm steps (an
/// eviction on other scores) and multi-token appends.
template <class T>
void running_equals_fresh(layout_kind layout, std::uint32_t seed, std::int64_t& steps) {
  std::mt19937 rng(seed);
  const std::int32_t kept = 2 + std::int32_t(rng() % 4), recent = std::int32_t(rng() % 3),
                     sinks = std::int32_t(rng() % 2);
  const std::int32_t budget = kept + recent + sinks, cap = budget + 6;
  const kv::h2o_config config = kv::key_norm_config(kept, recent, sinks);
  const kv::policy_shape shape{kSeqs, kHeads, kHeads, cap};
  kv::h2o_policy a(shape, config), b(shape, config);
  std::vector<float> bias(kDim);
  for (float& x : bias) x = kv::to_float(kvtest::random_value<T>(rng));
  kvtest::with_cache<T>(layout, kSeqs, kHeads, cap, kDim, 2, [&](auto view_a) {
    kvtest::with_cache<T>(layout, kSeqs, kHeads, cap, kDim, 2, [&](auto view_b) {
      using KeysA = kv::key_diff<T, std::decay_t<decltype(view_a.layout)>>;
      using KeysB = kv::key_diff<T, std::decay_t<decltype(view_b.layout)>>;
      using NormsA = kv::key_norms<T, std::decay_t<decltype(view_a.layout)>>;
      using NormsB = kv::key_norms<T, std::decay_t<decltype(view_b.layout)>>;
      std::vector<T> rows(std::size_t(kHeads) * cap * kDim);
      const auto write = [&](std::int32_t seq, std::int32_t h, std::int32_t slot, std::size_t from) {
        for (std::int32_t e = 0; e < kDim; ++e)
          view_a.k_row(seq, h, slot)[e] = view_b.k_row(seq, h, slot)[e] = rows[from * kDim + std::size_t(e)];
      };
      for (std::int32_t seq = 0; seq < kSeqs; ++seq) {  // sequence 0 starts from a KeyDiff prefill
        if (seq != 0) continue;
        const std::int32_t length = 1 + std::int32_t(rng() % std::uint32_t(cap));
        draw_keys(rng, bias, rows);
        for (std::int32_t h = 0; h < kHeads; ++h)
          for (std::int32_t p = 0; p < length; ++p) write(seq, h, p, std::size_t(h) * cap + p);
        a.prefill(seq, length, KeysA{view_a});
        b.prefill(seq, length, KeysB{view_b});
      }
      for (std::int32_t step = 0; step < 60; ++step) {
        CAPTURE(step);
        const std::int32_t seq = std::int32_t(rng() % kSeqs);
        const std::int32_t free = cap - a.slots().count(seq, 0);
        const std::int32_t tokens = rng() % 5 == 0 && free >= 3 ? 2 + std::int32_t(rng() % 2) : 1;
        draw_keys(rng, bias, rows);
        std::vector<std::int32_t> slots_a(std::size_t(kHeads) * tokens), slots_b(slots_a.size());
        a.append(seq, tokens, slots_a.data());
        b.append(seq, tokens, slots_b.data());
        REQUIRE(slots_a == slots_b);
        for (std::int32_t h = 0; h < kHeads; ++h)
          for (std::int32_t j = 0; j < tokens; ++j) write(seq, h, slots_a[std::size_t(h) * tokens + j], std::size_t(h) * tokens + j);
        const bool norms = rng() % 6 == 0;  // its eviction leaves the anchor stale
        if (norms) {
          a.observe(seq, NormsA{view_a});
          b.observe(seq, NormsB{view_b});
        } else {
          a.observe(seq, KeysA{view_a});
          b.observe(seq, KeysB{view_b});
        }
        if (tokens == 1 && a.slots().count(seq, 0) == budget + 1) a.evict(seq);
        else a.evict_to(seq, budget, view_a);
        b.evict_to(seq, budget, view_b);
        ++steps;
        for (std::int32_t h = 0; h < kHeads; ++h)
          for (std::int32_t s = 0; s < cap; ++s) {
            CHECK(a.slots().position(seq, h, s) == b.slots().position(seq, h, s));
            const float x = a.score(seq, h, s), y = b.score(seq, h, s);
            CHECK(std::memcmp(&x, &y, sizeof x) == 0);
          }
      }
    });
  });
}

}  // namespace

TEST_CASE("KeyDiff decode: the running anchor gives the bits of a fresh count, through prefill, key norms and evict_to") {
  std::int64_t steps = 0;
  for (const layout_kind layout : kvtest::all_layouts)
    for (std::uint32_t seed = 1; seed <= 4; ++seed) {
      CAPTURE(kvtest::name(layout));
      CAPTURE(seed);
      running_equals_fresh<float>(layout, seed, steps);
      running_equals_fresh<kv::half>(layout, seed + 10, steps);
      running_equals_fresh<kv::bfloat16>(layout, seed + 20, steps);
    }
  CHECK(steps > 1000);
}

TEST_CASE("KeyDiff decode refuses what it cannot score and changes nothing") {
  const std::int32_t cap = 8;
  const kv::policy_shape shape{kSeqs, kHeads, kHeads, cap};
  auto cache = kv::make_bhsd_cache<float>(kSeqs, kHeads, cap, kDim);
  std::mt19937 rng(5);
  for (float& x : cache.k_storage()) x = kvtest::random_value<float>(rng);
  const kv::key_diff<float, kv::strided_layout> keys{cache.view()};

  SUBCASE("per sequence") {
    kv::h2o_config accumulating = kv::key_norm_config(3, 1);
    accumulating.decay = 0.5f;
    kv::h2o_policy decaying(shape, accumulating);
    decaying.append(0);
    CHECK_THROWS_WITH_AS(decaying.observe(0, keys), doctest::Contains("decay"), kv::invalid_argument);
    CHECK(decaying.awaiting_observe(0));

    kv::h2o_policy policy(shape, kv::key_norm_config(3, 1));
    for (std::int32_t t = 0; t < 4; ++t) {
      policy.append(0);
      policy.observe(0, keys);
      policy.evict(0);
    }
    policy.append(0);  // position 4 in slot 4
    cache.view().k_row(0, 1, 4)[3] = std::numeric_limits<float>::quiet_NaN();
    std::vector<float> scores_before;
    for (std::int32_t h = 0; h < kHeads; ++h)
      for (std::int32_t s = 0; s < cap; ++s) scores_before.push_back(policy.score(0, h, s));
    CHECK_THROWS_WITH_AS(policy.observe(0, keys), doctest::Contains("||cache.k||[1][4]"), kv::non_finite_error);
    CHECK(policy.awaiting_observe(0));
    std::vector<float> scores_after;
    for (std::int32_t h = 0; h < kHeads; ++h)
      for (std::int32_t s = 0; s < cap; ++s) scores_after.push_back(policy.score(0, h, s));
    CHECK(scores_after == scores_before);
    CHECK(policy.slots().count(0, 0) == 5);
    cache.view().k_row(0, 1, 4)[3] = 1.0f;  // repaired: the step goes on
    policy.observe(0, keys);
    CHECK(policy.evict(0) == kHeads);
  }

  SUBCASE("batched") {
    const kv::h2o_config config = kv::key_norm_config(3, 1);
    std::vector<unsigned char> plain(kv::batch_state_bytes<kv::h2o_policy>(shape, config));
    const auto no_anchors = kv::make_batch_state<kv::h2o_policy>(plain.data(), plain.size(), shape, config);
    kv::init_batch_state(no_anchors);
    std::uint64_t status = kv::batch_status_clear;
    CHECK_THROWS_WITH_AS(kv::batched_observe_evict(no_anchors, kv::active_set::all(), keys, nullptr, &status),
                         doctest::Contains("key_diff_extent"), kv::invalid_argument);
    // recent_window ignores the extent (no anchors), and refuses key_diff as a rule that does not evict by score.
    const kv::recent_window_config window{4, 0};
    CHECK(kv::batch_state_bytes<kv::recent_window_policy>(shape, window, kv::key_diff_extent(kDim)) ==
          kv::batch_state_bytes<kv::recent_window_policy>(shape, window));
    std::vector<unsigned char> plain_window(kv::batch_state_bytes<kv::recent_window_policy>(shape, window));
    const auto window_state =
        kv::make_batch_state<kv::recent_window_policy>(plain_window.data(), plain_window.size(), shape, window);
    kv::init_batch_state(window_state);
    CHECK_THROWS_WITH_AS(kv::batched_observe_evict(window_state, kv::active_set::all(), keys, nullptr, &status),
                         doctest::Contains("evicts by score"), kv::invalid_argument);
    CHECK_THROWS_WITH_AS(kv::batch_state_bytes<kv::h2o_policy>(shape, config, kv::history_extent{0, -1}),
                         doctest::Contains("history.head_dim"), kv::invalid_argument);
    std::vector<unsigned char> narrow(kv::batch_state_bytes<kv::h2o_policy>(shape, config, kv::key_diff_extent(8)));
    const auto other_dim = kv::make_batch_state<kv::h2o_policy>(narrow.data(), narrow.size(), shape, config,
                                                                kv::key_diff_extent(8));
    kv::init_batch_state(other_dim);
    CHECK_THROWS_WITH_AS(kv::batched_observe_evict(other_dim, kv::active_set::all(), keys, nullptr, &status),
                         doctest::Contains("in.cache.head_dim"), kv::invalid_argument);

    std::vector<unsigned char> memory(kv::batch_state_bytes<kv::h2o_policy>(shape, config, kv::key_diff_extent(kDim)));
    const auto st = kv::make_batch_state<kv::h2o_policy>(memory.data(), memory.size(), shape, config,
                                                         kv::key_diff_extent(kDim));
    kv::init_batch_state(st);
    for (std::int32_t t = 0; t < 5; ++t) {
      kv::batched_append(st, kv::active_set::all(), &status);
      if (t == 4) cache.view().k_row(1, 0, 4)[0] = std::numeric_limits<float>::infinity();
      kv::batched_observe_evict(st, kv::active_set::all(), keys, nullptr, &status);
    }
    const kv::batch_status got = kv::batch_status::unpack(status);
    CHECK(got.code == kv::batch_code::non_finite_kv);
    CHECK(got.sequence == 1);
    CHECK(got.head == 0);
    CHECK(got.index == 4);
    CHECK(st.slots.counts[st.head_index(1, 0)] == 5);  // refused: still waiting, nothing evicted
    CHECK(st.appended[st.head_index(1, 0)] == 1);
    CHECK(st.slots.counts[st.head_index(1, 1)] == 4);  // the other heads stepped
    CHECK(st.slots.counts[st.head_index(0, 0)] == 4);
  }
}

TEST_CASE("KeyDiff decode, batched: evict_to that frees nothing still leaves the anchor stale (a rewritten key counts)") {
  // docs/policies.md: after an engine rewrites a cached key it calls reset or
  // evict_to, and the next step scores against the keys cached now. Here
  // evict_to frees nothing (the head holds exactly its target), so only the
  // anchor's staleness can bring the rewritten key in.
  constexpr std::int32_t dim = 4, cap = 8;
  const kv::policy_shape shape{1, 1, 1, cap};
  const kv::h2o_config config = kv::key_norm_config(3, 1, 1);  // budget 5
  std::vector<unsigned char> memory(kv::batch_state_bytes<kv::h2o_policy>(shape, config, kv::key_diff_extent(dim)));
  const auto st = kv::make_batch_state<kv::h2o_policy>(memory.data(), memory.size(), shape, config,
                                                       kv::key_diff_extent(dim));
  kv::init_batch_state(st);
  auto cache = kv::make_bhsd_cache<float>(1, 1, cap, dim);
  const kv::key_diff<float, kv::strided_layout> keys{cache.view()};
  std::mt19937 rng(11);
  std::normal_distribution<float> n(0.0f, 1.0f);
  const auto step = [&] {
    std::uint64_t status = kv::batch_status_clear;
    const std::int32_t s = st.slots.next_slots[0];
    float* k = cache.view().k_row(0, 0, s);
    for (std::int32_t e = 0; e < dim; ++e) k[e] = 1.0f + 0.5f * n(rng);  // around a common direction
    kv::batched_append(st, kv::active_set::all(), &status);
    kv::batched_observe_evict(st, kv::active_set::all(), keys, nullptr, &status);
    REQUIRE(status == kv::batch_status_clear);
  };
  for (std::int32_t t = 0; t < 8; ++t) step();
  REQUIRE(st.slots.counts[0] == 5);
  std::int32_t rewritten = -1;  // the oldest cached token that is not the sink
  for (std::int32_t s = 0; s < cap; ++s)
    if (st.slots.positions[s] > 0 && (rewritten < 0 || st.slots.positions[s] < st.slots.positions[rewritten]))
      rewritten = s;
  REQUIRE(rewritten >= 0);
  for (std::int32_t e = 0; e < dim; ++e) cache.view().k_row(0, 0, rewritten)[e] *= -1.0f;  // the engine rewrites it
  std::int32_t freed = -1;
  std::uint64_t status = kv::batch_status_clear;
  kv::batched_evict_to(st, kv::active_set::all(), 5, cache.view(), &freed, &status);
  REQUIRE(status == kv::batch_status_clear);
  CHECK(freed == 0);
  CHECK(st.anchors.upto[0] == -1);
  // The next step scores every cached key against the keys cached now.
  std::uint64_t s2 = kv::batch_status_clear;
  const std::int32_t s = st.slots.next_slots[0];
  for (std::int32_t e = 0; e < dim; ++e) cache.view().k_row(0, 0, s)[e] = 1.0f + 0.5f * n(rng);
  kv::batched_append(st, kv::active_set::all(), &s2);
  std::vector<ref_token> cached;
  std::vector<std::int32_t> slots;
  for (std::int32_t x = 0; x < cap; ++x)
    if (st.slots.positions[x] >= 0) {
      ref_token t{st.slots.positions[x], std::vector<double>(kDim, 0.0)};
      for (std::int32_t e = 0; e < dim; ++e) t.key[std::size_t(e)] = cache.view().k_row(0, 0, x)[e];
      cached.push_back(t);
      slots.push_back(x);
    }
  std::int32_t victim = -1;
  kv::batched_observe_evict(st, kv::active_set::all(), keys, &victim, &s2);
  REQUIRE(s2 == kv::batch_status_clear);
  const std::vector<double> want = reference_scores(cached);  // the definition, from scratch
  for (std::size_t i = 0; i < cached.size(); ++i) {
    CAPTURE(cached[i].position);
    if (slots[i] == victim) continue;  // freed: its score is discarded
    CHECK(std::abs(double(st.scores_of(0, 0)[slots[i]]) - want[i]) < kMargin);
  }
  // The victim by the definition: the lowest (score, position) outside sink 0 and the newest token.
  const std::int32_t length = st.slots.lengths[0];
  std::size_t best = cached.size();
  for (std::size_t i = 0; i < cached.size(); ++i) {
    const std::int32_t p = cached[i].position;
    if (p < 1 || p >= length - 1) continue;
    if (best == cached.size() || want[i] < want[best] || (want[i] == want[best] && p < cached[best].position)) best = i;
  }
  REQUIRE(best < cached.size());
  CHECK(victim == slots[best]);
}

TEST_CASE("KeyDiff decode, batched: a state view with null or mis-sized anchors is refused, not dereferenced") {
  constexpr std::int32_t cap = 8;
  const kv::policy_shape shape{kSeqs, kHeads, kHeads, cap};
  const kv::h2o_config config = kv::key_norm_config(3, 1);
  auto cache = kv::make_bhsd_cache<float>(kSeqs, kHeads, cap, kDim);
  const kv::key_diff<float, kv::strided_layout> keys{cache.view()};
  std::vector<unsigned char> memory(kv::batch_state_bytes<kv::h2o_policy>(shape, config, kv::key_diff_extent(kDim)));
  const auto st = kv::make_batch_state<kv::h2o_policy>(memory.data(), memory.size(), shape, config,
                                                       kv::key_diff_extent(kDim));
  kv::init_batch_state(st);
  std::uint64_t status = kv::batch_status_clear;
  kv::batched_append(st, kv::active_set::all(), &status);
  const auto refused = [&](kv::batch_state_view edited, const char* arg) {
    CAPTURE(arg);
    CHECK_THROWS_WITH_AS(kv::batched_observe_evict(edited, kv::active_set::all(), keys, nullptr, &status),
                         doctest::Contains(arg), kv::invalid_argument);
    CHECK(st.appended[0] == 1);  // nothing stepped
  };
  kv::batch_state_view v = st;
  v.anchors.sums = nullptr;
  refused(v, "'state.anchors.sums'");
  v = st;
  v.anchors.units = nullptr;
  refused(v, "'state.anchors.units'");
  v = st;
  v.anchors.num_heads = kHeads + 1;
  refused(v, "'state.anchors.num_heads'");
  v = st;
  v.anchors.num_heads = kHeads - 1;
  refused(v, "'state.anchors.num_heads'");
  // Every batched call checks the state: an append refuses the edited view too.
  CHECK_THROWS_WITH_AS(kv::batched_append(v, kv::active_set::all(), &status),
                       doctest::Contains("'state.anchors.num_heads'"), kv::invalid_argument);
  kv::batched_observe_evict(st, kv::active_set::all(), keys, nullptr, &status);  // the real view steps
  CHECK(status == kv::batch_status_clear);
  CHECK(st.appended[0] == 0);
}
