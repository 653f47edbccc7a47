// Host decode step: kvevict's h2o (score update + one victim per head, zero
// K/V bytes moved) against a faithful transcription of the reference
// real-drop step (top-k of the scores, sort the keep set, gather the whole
// cache into a fresh buffer), in the same binary. items/s counts
// (sequence, head) steps, so the ratio of the two rows is the speed-up.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "kvevict/kvevict.hpp"

namespace {

using namespace kvevict;

struct scenario {
  std::int32_t seqs, heads, slots, head_dim;
};
// Scenarios S0 (the paper's FlexGen setting) and S5 (latency) of docs/benchmarks.md.
constexpr scenario kS0{24, 32, 820, 128};
constexpr scenario kS5{1, 8, 1024, 128};

std::vector<float> random_probs(std::size_t n, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  std::vector<float> p(n);
  for (float& x : p) x = std::pow(u(rng), 8.0f) / 64.0f;  // power law
  return p;
}

void BM_kvevict_h2o_step(benchmark::State& state, scenario sc) {
  const std::int32_t budget = sc.slots - 1;
  h2o_policy policy({sc.seqs, sc.heads, sc.heads, sc.slots}, h2o_config{budget / 2, budget - budget / 2});
  const std::vector<float> probs = random_probs(std::size_t(sc.heads) * sc.slots, 1);
  const auto view = make_tensor_view<const float>(probs.data(), sc.heads, sc.slots);
  for (std::int32_t b = 0; b < sc.seqs; ++b)  // fill every sequence
    for (std::int32_t t = 0; t < sc.slots; ++t) {
      policy.append(b);
      policy.observe(b, decode_probs{view});
      policy.evict(b);
    }
  for (auto _ : state)
    for (std::int32_t b = 0; b < sc.seqs; ++b) {
      policy.append(b);
      policy.observe(b, decode_probs{view});
      benchmark::DoNotOptimize(policy.evict(b));
    }
  state.SetItemsProcessed(state.iterations() * sc.seqs * sc.heads);
}

// The same step through the batched host API (one call per phase for the
// whole batch), the host twin of the CUDA backend's launches.
void BM_kvevict_batched_h2o_step(benchmark::State& state, scenario sc) {
  const std::int32_t budget = sc.slots - 1;
  batched_policy<h2o_policy, device::host> layer({sc.seqs, sc.heads, sc.heads, sc.slots},
                                                 h2o_config{budget / 2, budget - budget / 2});
  const std::vector<float> one = random_probs(std::size_t(sc.heads) * sc.slots, 1);
  std::vector<float> probs;  // every sequence sees the same rows, as above
  for (std::int32_t b = 0; b < sc.seqs; ++b) probs.insert(probs.end(), one.begin(), one.end());
  const batch_probs in{make_tensor_view<const float>(probs.data(), sc.seqs, sc.heads, sc.slots)};
  for (std::int32_t t = 0; t < sc.slots; ++t) {  // fill every sequence
    layer.append();
    layer.observe_evict(in);
  }
  layer.check();
  for (auto _ : state) {
    layer.append();
    layer.observe_evict(in);
    benchmark::DoNotOptimize(layer.status_word());
  }
  layer.check();
  state.SetItemsProcessed(state.iterations() * sc.seqs * sc.heads);
}

// The reference "real drop" of H2O's Python code, per (sequence, head):
// accumulate, take the top-heavy of the older tokens plus the recent window,
// sort the kept indices, and gather K and V of every kept token into a new
// cache. Bytes moved per step: the whole cache.
void BM_reference_realdrop_step(benchmark::State& state, scenario sc) {
  const std::int32_t budget = sc.slots - 1, recent = budget - budget / 2, heavy = budget / 2;
  const std::size_t rows = std::size_t(sc.seqs) * sc.heads * sc.slots;
  std::vector<bfloat16> k(rows * sc.head_dim), v(k.size()), k2(k.size()), v2(k.size());
  std::vector<float> score(rows, 0.0f);
  const std::vector<float> probs = random_probs(std::size_t(sc.heads) * sc.slots, 1);
  std::vector<std::int32_t> idx(std::size_t(sc.slots));
  for (auto _ : state) {
    for (std::int32_t bh = 0; bh < sc.seqs * sc.heads; ++bh) {
      float* s = &score[std::size_t(bh) * sc.slots];
      const float* p = &probs[std::size_t(bh % sc.heads) * sc.slots];
      for (std::int32_t j = 0; j < sc.slots; ++j) s[j] += p[j];
      std::iota(idx.begin(), idx.end(), 0);
      const std::int32_t older = sc.slots - recent;
      std::nth_element(idx.begin(), idx.begin() + heavy, idx.begin() + older,
                       [s](std::int32_t a, std::int32_t c) { return s[a] > s[c]; });
      std::sort(idx.begin(), idx.begin() + heavy);
      std::copy(idx.begin() + older, idx.end(), idx.begin() + heavy);
      const std::size_t base = std::size_t(bh) * sc.slots * sc.head_dim;
      for (std::int32_t j = 0; j < budget; ++j) {
        std::copy_n(&k[base + std::size_t(idx[std::size_t(j)]) * sc.head_dim], sc.head_dim, &k2[base + std::size_t(j) * sc.head_dim]);
        std::copy_n(&v[base + std::size_t(idx[std::size_t(j)]) * sc.head_dim], sc.head_dim, &v2[base + std::size_t(j) * sc.head_dim]);
      }
    }
    std::swap(k, k2);
    std::swap(v, v2);
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(state.iterations() * sc.seqs * sc.heads);
}

}  // namespace

BENCHMARK_CAPTURE(BM_kvevict_h2o_step, S5, kS5)->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(BM_kvevict_batched_h2o_step, S5, kS5)->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(BM_reference_realdrop_step, S5, kS5)->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(BM_kvevict_h2o_step, S0, kS0)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_kvevict_batched_h2o_step, S0, kS0)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_reference_realdrop_step, S0, kS0)->Unit(benchmark::kMillisecond);

BENCHMARK_MAIN();
