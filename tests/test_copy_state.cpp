// copy_state (batch/copy_state.hpp): a state moved to another capacity makes
// the decisions of the state it came from. Each policy compresses ragged
// prompts in a state sized for them (random with request streams of its
// own), takes 0 to 5 decode steps there (so KeyDiff's anchors are live and
// the score buffers alternate), is copied to a state of budget + 1 slots
// (with the K/V rows of slots [0, budget + 1)), and both continue with the
// same random decode steps; after every step the two slot tables, scores
// and victims must be equal and the large state must hold nothing beyond
// budget + 1. The large state itself is checked against brute force in
// test_batched_prefill and test_batched_host; this test is about the move.
// Bad moves are refused by name with dst unchanged.
#include <doctest/doctest.h>

#include <kvevict/kvevict.hpp>

#include <cstring>
#include <tuple>
#include <random>
#include <vector>

using namespace kvevict;

namespace {

constexpr std::int32_t B = 3, H = 2, Hq = 4, D = 8, budget = 7, big = 40;
const std::int32_t prompt_tokens[B] = {31, 12, 5};  // above, above and below the budget

enum class rule_kind { h2o, tova_key_diff, recent_window, random };

template <class Policy>
batched_policy<Policy> make(const policy_shape& shape, rule_kind kind) {
  if constexpr (std::is_same_v<Policy, h2o_policy>) {
    if (kind == rule_kind::tova_key_diff) return {shape, key_norm_config(budget - 3, 2, 1), key_diff_extent(D)};
    h2o_config c;
    c.heavy = budget - 4, c.recent = 3, c.sinks = 1, c.decay = 0.9f;
    return {shape, c};
  } else if constexpr (std::is_same_v<Policy, recent_window_policy>) {
    return {shape, recent_window_config{2, budget - 2}};
  } else {
    return {shape, random_config{budget, 1, 2, 77}};
  }
}

std::vector<float> random_values(std::mt19937& rng, std::size_t n) {
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> x(n);
  for (float& v : x) v = u(rng);
  return x;
}

// The prompts' keys and values in slots [0, L) of `cache`.
void fill_prompts(std::mt19937& rng, kv_cache<float, strided_layout>& cache) {
  const auto view = cache.view();
  for (std::int32_t b = 0; b < B; ++b)
    for (std::int32_t h = 0; h < H; ++h)
      for (std::int32_t s = 0; s < prompt_tokens[b]; ++s) {
        const std::vector<float> k = random_values(rng, D), v = random_values(rng, D);
        std::memcpy(view.k_row(b, h, s), k.data(), sizeof(float) * D);
        std::memcpy(view.v_row(b, h, s), v.data(), sizeof(float) * D);
      }
}

template <class Policy>
void prefill(batched_policy<Policy>& p, rule_kind kind, std::mt19937& rng, kv_cache<float, strided_layout>& cache) {
  const prompt_lengths prompts{prompt_tokens, big};
  std::uint64_t status = batch_status_clear;
  if (kind == rule_kind::h2o) {
    std::vector<float> sums(std::size_t(B) * Hq * big);
    std::uniform_real_distribution<float> u(0.0f, 3.0f);
    for (float& x : sums) x = u(rng);
    batched_prefill(p.state(), active_set::all(), prompts,
                    batch_prefill_sums{make_tensor_view<const float>(sums.data(), B, Hq, big)}, cache.view(), nullptr,
                    &status);
  } else if (kind == rule_kind::tova_key_diff) {
    batched_prefill(p.state(), active_set::all(), prompts, key_diff<float, strided_layout>{cache.view()}, nullptr,
                    &status);
  } else {
    batched_prefill(p.state(), active_set::all(), prompts, cache.view(), nullptr, &status);
  }
  REQUIRE(status == batch_status_clear);
}

// One decode step of both states with the same new rows and attention
// (each state's probabilities laid out over its own capacity).
template <class Policy>
void step(batched_policy<Policy>& p, rule_kind kind, kv_cache<float, strided_layout>& cache,
          const std::vector<float>& k, const std::vector<float>& v, const std::vector<float>& attention,
          std::vector<std::int32_t>& victims) {
  const std::int32_t cap = cache.capacity();
  p.append(cache.view(), batch_rows<float>{make_tensor_view<const float>(k.data(), B, H, D)},
           batch_rows<float>{make_tensor_view<const float>(v.data(), B, H, D)});
  p.check();
  if (kind == rule_kind::tova_key_diff) {
    p.observe_evict(key_diff<float, strided_layout>{cache.view()}, active_set::all(), victims.data());
  } else {
    std::vector<float> probs(std::size_t(B) * Hq * cap, 0.0f);  // attention(b, q, slot) for slots < budget + 1
    for (std::int32_t b = 0; b < B; ++b)
      for (std::int32_t q = 0; q < Hq; ++q)
        for (std::int32_t s = 0; s <= budget; ++s)
          probs[(std::size_t(b) * Hq + q) * cap + s] = attention[(std::size_t(b) * Hq + q) * (budget + 1) + s];
    p.observe_evict(batch_probs{make_tensor_view<const float>(probs.data(), B, Hq, cap)}, active_set::all(),
                    victims.data());
  }
  p.check();
}

// The two states agree: slot tables and scores over [0, budget + 1), and the
// large one holds nothing above.
void require_same(const batch_state_view& large, const batch_state_view& small) {
  for (std::int32_t b = 0; b < B; ++b) {
    REQUIRE(large.slots.lengths[b] == small.slots.lengths[b]);
    for (std::int32_t h = 0; h < H; ++h) {
      const std::int64_t bh = large.head_index(b, h);
      REQUIRE(large.slots.counts[bh] == small.slots.counts[bh]);
      REQUIRE(large.slots.next_slots[bh] == small.slots.next_slots[bh]);
      for (std::int32_t s = 0; s < big; ++s) {
        const std::int32_t want = s <= budget ? small.slots.positions_of(b, h)[s] : -1;
        REQUIRE(large.slots.positions_of(b, h)[s] == want);
        if (s <= budget) REQUIRE(large.scores_of(b, h)[s] == small.scores_of(b, h)[s]);
      }
    }
  }
}

template <class Policy>
void continue_after_move(rule_kind kind, std::uint32_t seed) {
  std::mt19937 rng(seed);
  const policy_shape large_shape{B, H, Hq, big}, small_shape{B, H, Hq, budget + 1};
  auto large = make<Policy>(large_shape, kind);
  auto small = make<Policy>(small_shape, kind);
  auto large_cache = make_bhsd_cache<float>(B, H, big, D);
  auto small_cache = make_bhsd_cache<float>(B, H, budget + 1, D);
  const std::uint64_t streams[B] = {seed * 1000003ull, 17, 99};
  large.reset(active_set::all(), streams);
  fill_prompts(rng, large_cache);
  prefill(large, kind, rng, large_cache);
  std::vector<std::int32_t> large_victims(std::size_t(B) * H), small_victims(std::size_t(B) * H);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  const auto random_step = [&] {
    const std::vector<float> k = random_values(rng, std::size_t(B) * H * D), v = random_values(rng, std::size_t(B) * H * D);
    std::vector<float> attention(std::size_t(B) * Hq * (budget + 1));
    for (float& a : attention) a = u(rng);
    return std::make_tuple(k, v, attention);
  };
  for (std::uint32_t t = 0; t < seed % 6; ++t) {  // before the move, in the large state alone
    const auto [k, v, attention] = random_step();
    step(large, kind, large_cache, k, v, attention, large_victims);
  }
  copy_state(large.state(), small.state());
  for (std::int32_t b = 0; b < B; ++b)  // the engine's part: the kept rows
    for (std::int32_t h = 0; h < H; ++h)
      for (std::int32_t s = 0; s <= budget; ++s) {
        std::memcpy(small_cache.view().k_row(b, h, s), large_cache.view().k_row(b, h, s), sizeof(float) * D);
        std::memcpy(small_cache.view().v_row(b, h, s), large_cache.view().v_row(b, h, s), sizeof(float) * D);
      }
  require_same(large.state(), small.state());
  std::int32_t evictions = 0;
  for (std::int32_t t = 0; t < 25; ++t) {
    const auto [k, v, attention] = random_step();
    step(large, kind, large_cache, k, v, attention, large_victims);
    step(small, kind, small_cache, k, v, attention, small_victims);
    REQUIRE(large_victims == small_victims);
    for (std::int32_t x : small_victims) evictions += x >= 0;
    require_same(large.state(), small.state());
  }
  CHECK(evictions > 0);  // the steps did evict
}

}  // namespace

TEST_CASE("copy_state: a state moved to budget + 1 slots after prefill makes the same decisions") {
  for (std::uint32_t seed = 1; seed <= 20; ++seed) {
    CAPTURE(seed);
    continue_after_move<h2o_policy>(rule_kind::h2o, seed);
    continue_after_move<h2o_policy>(rule_kind::tova_key_diff, seed);  // KeyDiff's anchors move too
    continue_after_move<recent_window_policy>(rule_kind::recent_window, seed);
    continue_after_move<random_policy>(rule_kind::random, seed);  // and random's request streams
  }
}

TEST_CASE("copy_state: bad moves are refused by name and leave dst unchanged") {
  const policy_shape large_shape{B, H, Hq, big}, small_shape{B, H, Hq, budget + 1};
  auto large = make<h2o_policy>(large_shape, rule_kind::h2o);
  auto small = make<h2o_policy>(small_shape, rule_kind::h2o);
  // a whole prompt appended but not compressed: more tokens than budget + 1
  std::uint64_t status = batch_status_clear;
  batched_append_tokens(large.state(), active_set::all(), 20, &status);
  REQUIRE(status == batch_status_clear);
  const auto bytes_of = [](const batch_state_view& st) {
    return std::vector<std::int32_t>(st.slots.positions, st.slots.positions + std::size_t(B) * H * st.capacity());
  };
  const std::vector<std::int32_t> before = bytes_of(small.state());
  CHECK_THROWS_WITH_AS(copy_state(large.state(), small.state()),
                       doctest::Contains("argument 'dst.capacity' = 8 is below slot 8 of (b, h) = (0, 0)"),
                       invalid_argument);
  CHECK(bytes_of(small.state()) == before);

  h2o_config other;
  other.heavy = budget - 5, other.recent = 3, other.sinks = 2, other.decay = 0.9f;  // a sink for a heavy slot
  batched_policy<h2o_policy> different({B, H, Hq, budget + 1}, other);
  auto fresh = make<h2o_policy>(large_shape, rule_kind::h2o);
  CHECK_THROWS_WITH_AS(copy_state(fresh.state(), different.state()), doctest::Contains("argument 'dst.rule'"),
                       invalid_argument);
  auto other_shard = make<random_policy>({B, H, Hq, budget + 1, H}, rule_kind::random);  // another tensor-parallel shard
  auto first_shard = make<random_policy>(large_shape, rule_kind::random);
  CHECK_THROWS_WITH_AS(copy_state(first_shard.state(), other_shard.state()), doctest::Contains("argument 'dst.rule'"),
                       invalid_argument);
  auto fewer_heads = make<h2o_policy>({B, 1, Hq, budget + 1}, rule_kind::h2o);
  CHECK_THROWS_WITH_AS(copy_state(fresh.state(), fewer_heads.state()), doctest::Contains("argument 'num_heads' = 1"),
                       invalid_argument);
}
