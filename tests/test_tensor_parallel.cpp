// Tensor parallelism (docs/integration.md, "Tensor and pipeline
// parallelism"): a layer's 8 KV heads split 1, 2, 4 and 8 ways, each shard
// an independent batched policy over its heads (with their whole query
// groups) and its own part of the inputs, must decide what the unsharded
// layer decides. For every policy and decode input (h2o's rules on
// probabilities, per-head increments, logits, queries, key norms and
// KeyDiff; recent window; random, whose draws are keyed by the layer-wide
// head; exact greedy) and every layout, seeded streams run prefill, decode
// steps with idle sequences, a new random request stream, and evict_to;
// after each call every shard's slot table, scores and victims equal the
// unsharded layer's heads bit for bit, and at the end so do the K/V bytes.
// The unsharded layer is itself held to brute force in test_batched_host
// and test_batched_prefill; this test is about the split. A shard that
// forgets its first_kv_head draws other victims, which the random cases
// catch.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <type_traits>
#include <vector>

#include "kvevict/kvevict.hpp"
#include "support/batch_streams.hpp"
#include "support/decode_inputs.hpp"

namespace {

using namespace kvevict;

constexpr std::int32_t B = 3, H = 8, group = 2, Hq = H * group, D = 8;
constexpr std::int32_t shard_counts[] = {1, 2, 4, 8};

using kvtest::decode_input;

template <class View>
View shard_of(View view, std::int32_t first, std::int32_t heads) {
  // Every layout maps head h at h * stride_head: a shard is the same
  // buffers from its first head on.
  view.k += first * view.layout.stride_head;
  view.v += first * view.layout.stride_head;
  view.num_heads = heads;
  return view;
}

/// One layer split `shards` ways: a policy and a cache per shard (the
/// caches hold every head; shard s reads and writes its own).
template <class Policy, class Cache>
struct split_layer {
  std::int32_t shards = 1;
  std::vector<batched_policy<Policy>> parts;
  Cache cache;

  std::int32_t heads() const { return H / shards; }
  auto view(std::int32_t s) { return shard_of(cache.view(), s * heads(), heads()); }
};

/// Shard s of `layer` holds what heads [s * heads, (s + 1) * heads) of the
/// unsharded layer hold.
template <class Policy, class Cache>
void require_same(const batched_policy<Policy>& whole, const split_layer<Policy, Cache>& layer) {
  const batch_state_view& w = whole.state();
  for (std::int32_t s = 0; s < layer.shards; ++s) {
    const batch_state_view& p = layer.parts[std::size_t(s)].state();
    for (std::int32_t b = 0; b < B; ++b) {
      REQUIRE(p.slots.lengths[b] == w.slots.lengths[b]);
      for (std::int32_t h = 0; h < layer.heads(); ++h) {
        const std::int32_t g = s * layer.heads() + h;
        CAPTURE(s);
        CAPTURE(b);
        CAPTURE(g);
        REQUIRE(p.slots.counts[p.head_index(b, h)] == w.slots.counts[w.head_index(b, g)]);
        REQUIRE(p.slots.next_slots[p.head_index(b, h)] == w.slots.next_slots[w.head_index(b, g)]);
        REQUIRE(std::memcmp(p.slots.positions_of(b, h), w.slots.positions_of(b, g), sizeof(std::int32_t) * w.capacity()) == 0);
        REQUIRE(std::memcmp(p.scores_of(b, h), w.scores_of(b, g), sizeof(float) * w.capacity()) == 0);
      }
    }
  }
}

template <class Cache>
void require_same_rows(const Cache& whole, const Cache& split, std::int32_t capacity) {
  const auto a = whole.view(), b = split.view();
  for (std::int32_t s = 0; s < B; ++s)
    for (std::int32_t h = 0; h < H; ++h)
      for (std::int32_t slot = 0; slot < capacity; ++slot) {
        REQUIRE(std::memcmp(a.k_row(s, h, slot), b.k_row(s, h, slot), sizeof(float) * D) == 0);
        REQUIRE(std::memcmp(a.v_row(s, h, slot), b.v_row(s, h, slot), sizeof(float) * D) == 0);
      }
}

template <class Policy, class MakeCache>
void run_stream(std::uint32_t seed, decode_input in, MakeCache make_cache) {
  std::mt19937 rng(seed);
  const auto config = kvtest::draw_config<Policy>(rng, in);
  constexpr bool greedy = std::is_same_v<Policy, exact_greedy_policy>;
  const std::int32_t budget = policy_traits<Policy>::rule(config).budget;
  std::int32_t prompts[B];
  for (std::int32_t& L : prompts) L = greedy ? 0 : std::uniform_int_distribution<int>(1, budget + 6)(rng);
  const std::int32_t capacity = budget + 8, steps = 24;
  const history_extent history = kvtest::history_of<Policy>(in, capacity + steps + 1, D);
  using Cache = decltype(make_cache(capacity));

  batched_policy<Policy> whole(policy_shape{B, H, Hq, capacity}, config, history);
  Cache whole_cache = make_cache(capacity);
  std::vector<split_layer<Policy, Cache>> layers;
  for (std::int32_t n : shard_counts) {
    split_layer<Policy, Cache> l{n, {}, make_cache(capacity)};
    for (std::int32_t s = 0; s < n; ++s)
      l.parts.emplace_back(policy_shape{B, H / n, Hq / n, capacity, s * (H / n)}, config, history);
    layers.push_back(std::move(l));
  }
  const auto for_all = [&](auto&& f) {  // f(policy, view, first head, heads)
    f(whole, whole_cache.view(), 0, H);
    for (auto& l : layers)
      for (std::int32_t s = 0; s < l.shards; ++s) f(l.parts[std::size_t(s)], l.view(s), s * l.heads(), l.heads());
  };
  const auto require_all_same = [&] {
    for (const auto& l : layers) require_same(whole, l);
  };
  const auto require_clear = [&] {
    for_all([&](auto& p, const auto&, std::int32_t, std::int32_t) { REQUIRE(p.status_word() == batch_status_clear); });
  };

  // The prompts' rows, the same in every cache; then prefill.
  std::uniform_int_distribution<int> grid(-64, 64);
  for (std::int32_t b = 0; b < B; ++b)
    for (std::int32_t h = 0; h < H; ++h)
      for (std::int32_t slot = 0; slot < prompts[b]; ++slot)
        for (std::int32_t d = 0; d < D; ++d) {
          const float k = float(grid(rng)) / 32.0f, v = float(grid(rng)) / 32.0f;
          whole_cache.view().k_row(b, h, slot)[d] = k;
          whole_cache.view().v_row(b, h, slot)[d] = v;
          for (auto& l : layers) {
            l.cache.view().k_row(b, h, slot)[d] = k;
            l.cache.view().v_row(b, h, slot)[d] = v;
          }
        }
  if constexpr (!greedy) {
    std::vector<float> sums(std::size_t(B) * Hq * capacity);
    std::uniform_real_distribution<float> u(0.0f, 3.0f);
    for (float& x : sums) x = std::floor(u(rng) * 8.0f) / 8.0f;  // with ties
    const prompt_lengths lengths{prompts, capacity};
    for_all([&](auto& p, const auto& view, std::int32_t first, std::int32_t heads) {
      using Layout = typename std::decay_t<decltype(view)>::layout_type;
      std::uint64_t status = batch_status_clear;
      const auto all = active_set::all();
      if constexpr (std::is_same_v<Policy, h2o_policy>) {
        if (in == decode_input::key_norms) {
          batched_prefill(p.state(), all, lengths, key_norms<float, Layout>{view}, nullptr, &status);
        } else if (in == decode_input::key_diff) {
          batched_prefill(p.state(), all, lengths, key_diff<float, Layout>{view}, nullptr, &status);
        } else {
          const auto full = make_tensor_view<const float>(sums.data(), B, Hq, capacity);
          batched_prefill(p.state(), all, lengths, batch_prefill_sums{kvtest::heads_of(full, first * group, heads * group)},
                          view, nullptr, &status);
        }
      } else {
        batched_prefill(p.state(), all, lengths, view, nullptr, &status);
      }
      if (status != batch_status_clear) throw_if_error(status, "prefill");
    });
    require_all_same();
  }

  kvtest::batch_dims dm;
  dm.seqs = B, dm.heads = H, dm.group = group, dm.head_dim = D, dm.capacity = capacity;
  for (std::int32_t step = 0; step < steps; ++step) {
    CAPTURE(step);
    const kvtest::batch_step<float> st = kvtest::draw_step<float>(rng, dm, 0.25);
    if (std::is_same_v<Policy, random_policy> && step == steps / 2) {  // a new request on sequence 1
      const std::int32_t one = 1;
      const std::uint64_t stream = 5000 + seed;
      for_all([&](auto& p, const auto&, std::int32_t, std::int32_t) { p.reset(active_set::of_list(&one, 1), &stream); });
    }
    std::vector<std::int32_t> want(std::size_t(B) * H, -2);
    for_all([&](auto& p, const auto& view, std::int32_t first, std::int32_t heads) {
      const auto rows = [&](const std::vector<float>& x) {
        return batch_rows<float>{kvtest::heads_of(make_tensor_view<const float>(x.data(), B, H, D), first, heads)};
      };
      p.append(view, rows(st.k_new), rows(st.v_new), st.active_set());
      std::vector<std::int32_t> victims(std::size_t(B) * heads, -2);
      kvtest::observe_step(p, st, dm, in, view, first, victims.data());
      for (std::int32_t b = 0; b < B; ++b)
        for (std::int32_t h = 0; h < heads; ++h) {
          std::int32_t& w = want[std::size_t(b) * H + first + h];
          if (heads == H) w = victims[std::size_t(b) * heads + h];  // the unsharded layer comes first
          else REQUIRE(victims[std::size_t(b) * heads + h] == w);
        }
    });
    require_clear();
    require_all_same();
    if (!greedy && step == 2 * steps / 3) {  // a multi-token eviction below the budget
      const protection protect = policy_traits<Policy>::rule(config).protect;
      const std::int32_t target = std::max({1, protect.sinks + protect.recent, budget - 2});
      std::vector<std::int32_t> freed_whole(std::size_t(B) * H);
      for_all([&](auto& p, const auto& view, std::int32_t first, std::int32_t heads) {
        std::uint64_t status = batch_status_clear;
        std::vector<std::int32_t> freed(std::size_t(B) * heads);
        batched_evict_to(p.state(), active_set::all(), target, view, freed.data(), &status);
        REQUIRE(status == batch_status_clear);
        for (std::int32_t b = 0; b < B; ++b)
          for (std::int32_t h = 0; h < heads; ++h) {
            if (heads == H) freed_whole[std::size_t(b) * H + h] = freed[std::size_t(b) * heads + h];
            else REQUIRE(freed[std::size_t(b) * heads + h] == freed_whole[std::size_t(b) * H + first + h]);
          }
      });
      require_all_same();
    }
  }
  for (const auto& l : layers) require_same_rows(whole_cache, l.cache, capacity);
}

template <class Policy>
void run_all(const std::vector<decode_input>& inputs) {
  std::uint32_t seed = 1;
  for (decode_input in : inputs)
    for (int round = 0; round < 3; ++round, ++seed) {
      CAPTURE(int(in));
      CAPTURE(seed);
      run_stream<Policy>(seed, in, [](std::int32_t cap) { return make_bhsd_cache<float>(B, H, cap, D); });
      run_stream<Policy>(seed, in, [](std::int32_t cap) { return make_bshd_cache<float>(B, H, cap, D); });
      run_stream<Policy>(seed, in, [](std::int32_t cap) {
        return make_paged_cache<float>(B, H, cap, D, 3, page_order::nhd);
      });
      run_stream<Policy>(seed, in, [](std::int32_t cap) {
        return make_paged_cache<float>(B, H, cap, D, 4, page_order::hnd);
      });
    }
}

}  // namespace

TEST_CASE("tensor parallelism: h2o's shards decide as the unsharded layer, for every decode input") {
  run_all<h2o_policy>({decode_input::probs, decode_input::head_scores, decode_input::logits, decode_input::queries,
                       decode_input::key_norms, decode_input::key_diff});
}

TEST_CASE("tensor parallelism: recent window's shards decide as the unsharded layer") {
  run_all<recent_window_policy>({decode_input::probs});
}

TEST_CASE("tensor parallelism: random's shards draw what the unsharded layer draws (first_kv_head)") {
  run_all<random_policy>({decode_input::probs, decode_input::logits});
}

TEST_CASE("tensor parallelism: exact greedy's shards decide as the unsharded layer") {
  run_all<exact_greedy_policy>({decode_input::queries});
}

TEST_CASE("tensor parallelism: a shard's first_kv_head is checked") {
  random_config c{4, 0, 1, 9};
  CHECK_THROWS_WITH_AS(batched_policy<random_policy>(policy_shape{1, 2, 2, 8, -1}, c),
                       doctest::Contains("shape.first_kv_head"), out_of_range);
  CHECK_THROWS_WITH_AS(batched_policy<random_policy>(policy_shape{1, 2, 2, 8, INT32_MAX - 1}, c),
                       doctest::Contains("shape.first_kv_head"), out_of_range);
  CHECK_NOTHROW(batched_policy<random_policy>(policy_shape{1, 2, 2, 8, INT32_MAX - 2}, c));
}
