// Prefill compression with h2o: score a prompt of N tokens, keep budget =
// 20% or 50% of N per KV head (recent window 64) and compact the kept rows
// in position order into slots [0, budget) of the cache, per sequence
// (policy.prefill) and for the whole batch (batched_prefill), from column
// sums the engine computed or from the causal probability matrix; and
// SnapKV (the paper's preset: the last 32 rows, max pooling of width 7) from
// the window rows' probabilities; and KeyDiff from the cached prompt keys.
//
// Baselines: reference_keep_gather, the reference's prompt-time keep written
// plainly: fold the group's column sums, nth_element for the heavy of the
// older positions on (score, position) keys, sort the kept positions, and
// gather their K and V rows into a fresh buffer; reference_snapkv_gather,
// the same after SnapKV's scoring written plainly (window sums, max pool,
// group sum), from the same window probabilities as the snapkv rows;
// reference_key_diff_gather, KeyDiff's cosines to the mean unit key in
// plain float loops, then the same keep and gather.
//
// One item = one (sequence, KV head, prompt token) scored. Bytes = the input
// read plus the kept K and V rows read and written once (an upper bound of
// what compaction moves: rows already in place stay).
#include "bench_common.hpp"

#include <numeric>

namespace {

using namespace kvevict;
using kvbench::scenario;

struct prompt {
  scenario sc;
  std::int32_t budget;
  std::vector<float> sums;  // [B][Hq][N]: column sums of the prompt's probabilities

  prompt(const scenario& s, const kvbench::keep_fraction& keep)
      : sc(s), budget(keep.of(s.slots)),
        sums(kvbench::probabilities(std::size_t(s.seqs) * s.q_heads() * s.slots, 1, kvbench::distribution::powerlaw, 2)) {}
  h2o_config config() const { return {budget - kvbench::kRecent, kvbench::kRecent}; }
  policy_shape shape() const { return {sc.seqs, sc.kv_heads, sc.q_heads(), sc.slots}; }
  template <class T>
  std::int64_t moved_bytes() const {
    return sc.heads_total() * budget * 2 * 2 * std::int64_t(sc.head_dim) * std::int64_t(sizeof(T));
  }
  std::int64_t items() const { return sc.slots_total(); }
  /// The prompt's keys, read once.
  template <class T>
  std::int64_t key_bytes() const {
    return sc.heads_total() * std::int64_t(sc.slots) * sc.head_dim * std::int64_t(sizeof(T));
  }
};

template <class T>
void per_sequence_sums(benchmark::State& state, scenario sc, kvbench::keep_fraction keep) {
  const prompt pr(kvbench::cache_slice(sc, sizeof(T)), keep);
  h2o_policy policy(pr.shape(), pr.config());
  auto cache = make_bhsd_cache<T>(pr.sc.seqs, sc.kv_heads, sc.slots, sc.head_dim);
  for (auto _ : state)
    for (std::int32_t b = 0; b < pr.sc.seqs; ++b) {
      policy.reset(b);
      const auto sums = make_tensor_view<const float>(pr.sums.data() + std::size_t(b) * sc.q_heads() * sc.slots,
                                                      sc.q_heads(), sc.slots);
      benchmark::DoNotOptimize(policy.prefill(b, sc.slots, prefill_column_sums{sums}, cache.view()));
    }
  kvbench::report(state, pr.items(), std::int64_t(pr.sums.size() * sizeof(float)) + pr.moved_bytes<T>());
}

template <class T>
void batched_sums(benchmark::State& state, scenario sc, kvbench::keep_fraction keep) {
  const prompt pr(kvbench::cache_slice(sc, sizeof(T)), keep);
  batched_policy<h2o_policy, device::host> layer(pr.shape(), pr.config());
  auto cache = make_bhsd_cache<T>(pr.sc.seqs, sc.kv_heads, sc.slots, sc.head_dim);
  const std::vector<std::int32_t> lengths(std::size_t(pr.sc.seqs), sc.slots);
  const batch_prefill_sums in{make_tensor_view<const float>(pr.sums.data(), pr.sc.seqs, sc.q_heads(), sc.slots)};
  std::uint64_t status = batch_status_clear;
  for (auto _ : state) {
    layer.reset(active_set::all());
    batched_prefill(layer.state(), active_set::all(), prompt_lengths{lengths.data(), sc.slots}, in, cache.view(),
                    nullptr, &status);
  }
  throw_if_error(status, "batched_prefill");
  kvbench::report(state, pr.items(), std::int64_t(pr.sums.size() * sizeof(float)) + pr.moved_bytes<T>());
}

// From the causal matrix [Hq][N][N] (the lower triangle is read): at S5
// only, where one sequence's matrix is 128 MiB.
void per_sequence_probs(benchmark::State& state, scenario sc, kvbench::keep_fraction keep) {
  const prompt pr(sc, keep);
  h2o_policy policy(pr.shape(), pr.config());
  auto cache = make_bhsd_cache<bfloat16>(sc.seqs, sc.kv_heads, sc.slots, sc.head_dim);
  const std::size_t n = std::size_t(sc.slots);
  const std::vector<float> probs =
      kvbench::probabilities(std::size_t(sc.q_heads()) * n * n, sc.slots, kvbench::distribution::powerlaw, 4);
  const auto view = make_tensor_view<const float>(probs.data(), sc.q_heads(), sc.slots, sc.slots);
  for (auto _ : state)
    for (std::int32_t b = 0; b < sc.seqs; ++b) {  // every sequence sees the same matrix
      policy.reset(b);
      benchmark::DoNotOptimize(policy.prefill(b, sc.slots, prefill_probs{view}, cache.view()));
    }
  const std::int64_t triangle = std::int64_t(sc.seqs) * sc.q_heads() * std::int64_t(n) * std::int64_t(n + 1) / 2;
  kvbench::report(state, pr.items(), triangle * std::int64_t(sizeof(float)) + pr.moved_bytes<bfloat16>());
}

/// The baselines' keep written plainly: the top `heavy` of positions
/// [0, older) by (score, position) with nth_element, sorted, then the
/// positions from `older` on; their K and V rows of head bh gathered into
/// k2 / v2. idx is scratch of score.size() entries.
template <class T>
void keep_and_gather(const std::vector<float>& score, std::int32_t heavy, std::int32_t older, std::int32_t budget,
                     std::int64_t bh, std::size_t d, const std::vector<T>& k, const std::vector<T>& v,
                     std::vector<std::int32_t>& idx, std::vector<T>& k2, std::vector<T>& v2) {
  const std::size_t n = score.size();
  std::iota(idx.begin(), idx.end(), 0);
  std::nth_element(idx.begin(), idx.begin() + heavy, idx.begin() + older, [&](std::int32_t a, std::int32_t c) {
    return eviction_key(score[std::size_t(a)], a) > eviction_key(score[std::size_t(c)], c);
  });
  std::sort(idx.begin(), idx.begin() + heavy);
  std::copy(idx.begin() + older, idx.end(), idx.begin() + heavy);
  for (std::int32_t j = 0; j < budget; ++j) {
    const std::size_t from = (std::size_t(bh) * n + std::size_t(idx[std::size_t(j)])) * d;
    const std::size_t to = (std::size_t(bh) * std::size_t(budget) + std::size_t(j)) * d;
    std::copy_n(&k[from], d, &k2[to]);
    std::copy_n(&v[from], d, &v2[to]);
  }
}

template <class T>
void reference_keep_gather(benchmark::State& state, scenario sc, kvbench::keep_fraction keep) {
  const prompt pr(kvbench::cache_slice(sc, sizeof(T)), keep);
  const std::size_t n = std::size_t(sc.slots), d = std::size_t(sc.head_dim);
  const std::size_t rows = std::size_t(pr.sc.heads_total()) * n;
  const std::vector<T> k = kvbench::random_rows<T>(rows * d, 1.0f, 8), v = k;
  std::vector<T> k2(std::size_t(pr.sc.heads_total()) * pr.budget * d), v2(k2.size());
  std::vector<float> score(n);
  std::vector<std::int32_t> idx(n);
  const std::int32_t heavy = pr.budget - kvbench::kRecent, older = sc.slots - kvbench::kRecent;
  for (auto _ : state) {
    for (std::int64_t bh = 0; bh < pr.sc.heads_total(); ++bh) {
      const float* sums = &pr.sums[std::size_t(bh) * sc.group * n];
      for (std::size_t j = 0; j < n; ++j) {
        float x = 0.0f;
        for (std::int32_t g = 0; g < sc.group; ++g) x += sums[std::size_t(g) * n + j];
        score[j] = x;
      }
      keep_and_gather(score, heavy, older, pr.budget, bh, d, k, v, idx, k2, v2);
    }
    benchmark::ClobberMemory();
  }
  kvbench::report(state, pr.items(), std::int64_t(pr.sums.size() * sizeof(float)) + pr.moved_bytes<T>());
}

// ---- SnapKV: the window's probabilities [B][Hq][32][N] ----

struct window_prompt {
  prompt pr;
  snap_window snap = snap_window::paper();
  std::vector<float> probs;  // [B][Hq][w][N]

  window_prompt(const scenario& s, const kvbench::keep_fraction& keep)
      : pr(s, keep),
        probs(kvbench::probabilities(std::size_t(s.seqs) * s.q_heads() * 32 * s.slots, s.slots,
                                     kvbench::distribution::powerlaw, 5)) {}
  std::int64_t read_bytes() const { return std::int64_t(probs.size() * sizeof(float)); }
};

template <class T>
void per_sequence_snapkv(benchmark::State& state, scenario sc, kvbench::keep_fraction keep) {
  const window_prompt wp(kvbench::cache_slice(sc, sizeof(T)), keep);
  const scenario& s = wp.pr.sc;
  h2o_policy policy(wp.pr.shape(), wp.pr.config());
  auto cache = make_bhsd_cache<T>(s.seqs, sc.kv_heads, sc.slots, sc.head_dim);
  const std::size_t per_seq = std::size_t(sc.q_heads()) * 32 * sc.slots;
  for (auto _ : state)
    for (std::int32_t b = 0; b < s.seqs; ++b) {
      policy.reset(b);
      const auto probs = make_tensor_view<const float>(wp.probs.data() + b * per_seq, sc.q_heads(), 32, sc.slots);
      benchmark::DoNotOptimize(policy.prefill(b, sc.slots, window_probs{probs, wp.snap}, cache.view()));
    }
  kvbench::report(state, wp.pr.items(), wp.read_bytes() + wp.pr.moved_bytes<T>());
}

template <class T>
void batched_snapkv(benchmark::State& state, scenario sc, kvbench::keep_fraction keep) {
  const window_prompt wp(kvbench::cache_slice(sc, sizeof(T)), keep);
  const scenario& s = wp.pr.sc;
  batched_policy<h2o_policy, device::host> layer(wp.pr.shape(), wp.pr.config());
  auto cache = make_bhsd_cache<T>(s.seqs, sc.kv_heads, sc.slots, sc.head_dim);
  const std::vector<std::int32_t> lengths(std::size_t(s.seqs), sc.slots);
  const batch_window_probs in{make_tensor_view<const float>(wp.probs.data(), s.seqs, sc.q_heads(), 32, sc.slots),
                              wp.snap};
  std::uint64_t status = batch_status_clear;
  for (auto _ : state) {
    layer.reset(active_set::all());
    batched_prefill(layer.state(), active_set::all(), prompt_lengths{lengths.data(), sc.slots}, in, cache.view(),
                    nullptr, &status);
  }
  throw_if_error(status, "batched_prefill");
  kvbench::report(state, wp.pr.items(), wp.read_bytes() + wp.pr.moved_bytes<T>());
}

template <class T>
void reference_snapkv_gather(benchmark::State& state, scenario sc, kvbench::keep_fraction keep) {
  const window_prompt wp(kvbench::cache_slice(sc, sizeof(T)), keep);
  const prompt& pr = wp.pr;
  const std::size_t n = std::size_t(sc.slots), d = std::size_t(sc.head_dim), w = 32;
  const std::size_t rows = std::size_t(pr.sc.heads_total()) * n;
  const std::vector<T> k = kvbench::random_rows<T>(rows * d, 1.0f, 8), v = k;
  std::vector<T> k2(std::size_t(pr.sc.heads_total()) * pr.budget * d), v2(k2.size());
  std::vector<float> sum(n), score(n);
  std::vector<std::int32_t> idx(n);
  const std::size_t first = n - w;
  const std::int32_t keep_window = std::max<std::int32_t>(kvbench::kRecent, 32);
  const std::int32_t heavy = pr.budget - keep_window, older = sc.slots - keep_window;
  for (auto _ : state) {
    for (std::int64_t bh = 0; bh < pr.sc.heads_total(); ++bh) {
      std::fill(score.begin(), score.end(), 0.0f);
      for (std::int32_t g = 0; g < sc.group; ++g) {
        const float* rows_of = &wp.probs[(std::size_t(bh) * sc.group + std::size_t(g)) * w * n];
        std::fill(sum.begin(), sum.end(), 0.0f);
        for (std::size_t r = 0; r < w; ++r)
          for (std::size_t j = 0; j <= first + r; ++j) sum[j] += rows_of[r * n + j];
        for (std::size_t j = 0; j < n; ++j) {
          float best = sum[j];
          if (j < first)
            for (std::size_t c = j > 3 ? j - 3 : 0; c <= std::min(j + 3, first - 1); ++c) best = std::max(best, sum[c]);
          score[j] += best;
        }
      }
      keep_and_gather(score, heavy, older, pr.budget, bh, d, k, v, idx, k2, v2);
    }
    benchmark::ClobberMemory();
  }
  kvbench::report(state, pr.items(), wp.read_bytes() + pr.moved_bytes<T>());
}

// ---- KeyDiff: the prompt keys in the cache, no attention input ----

template <class T>
void per_sequence_key_diff(benchmark::State& state, scenario sc, kvbench::keep_fraction keep) {
  const prompt pr(kvbench::cache_slice(sc, sizeof(T)), keep);
  h2o_policy policy(pr.shape(), pr.config());
  auto cache = make_bhsd_cache<T>(pr.sc.seqs, sc.kv_heads, sc.slots, sc.head_dim);
  cache.k_storage() = kvbench::random_rows<T>(cache.k_storage().size(), 1.0f, 9);
  const key_diff<T, strided_layout> in{cache.view()};
  for (auto _ : state)
    for (std::int32_t b = 0; b < pr.sc.seqs; ++b) {
      policy.reset(b);
      benchmark::DoNotOptimize(policy.prefill(b, sc.slots, in));
    }
  kvbench::report(state, pr.items(), pr.key_bytes<T>() + pr.moved_bytes<T>());  // the keys read once + the kept rows moved
}

template <class T>
void batched_key_diff(benchmark::State& state, scenario sc, kvbench::keep_fraction keep) {
  const prompt pr(kvbench::cache_slice(sc, sizeof(T)), keep);
  batched_policy<h2o_policy, device::host> layer(pr.shape(), pr.config());
  auto cache = make_bhsd_cache<T>(pr.sc.seqs, sc.kv_heads, sc.slots, sc.head_dim);
  cache.k_storage() = kvbench::random_rows<T>(cache.k_storage().size(), 1.0f, 9);
  const std::vector<std::int32_t> lengths(std::size_t(pr.sc.seqs), sc.slots);
  std::uint64_t status = batch_status_clear;
  for (auto _ : state) {
    layer.reset(active_set::all());
    batched_prefill(layer.state(), active_set::all(), prompt_lengths{lengths.data(), sc.slots},
                    key_diff<T, strided_layout>{cache.view()}, nullptr, &status);
  }
  throw_if_error(status, "batched_prefill");
  kvbench::report(state, pr.items(), pr.key_bytes<T>() + pr.moved_bytes<T>());
}

/// KeyDiff written plainly (kvpress's KeyDiffPress in loops): unit keys, their
/// mean, cosines in float, then the keep and gather of reference_keep_gather.
template <class T>
void reference_key_diff_gather(benchmark::State& state, scenario sc, kvbench::keep_fraction keep) {
  const prompt pr(kvbench::cache_slice(sc, sizeof(T)), keep);
  const std::size_t n = std::size_t(sc.slots), d = std::size_t(sc.head_dim);
  const std::vector<T> k = kvbench::random_rows<T>(std::size_t(pr.sc.heads_total()) * n * d, 1.0f, 9), v = k;
  std::vector<T> k2(std::size_t(pr.sc.heads_total()) * pr.budget * d), v2(k2.size());
  std::vector<float> score(n), norm(n), anchor(d);
  std::vector<std::int32_t> idx(n);
  const std::int32_t heavy = pr.budget - kvbench::kRecent, older = sc.slots - kvbench::kRecent;
  for (auto _ : state) {
    for (std::int64_t bh = 0; bh < pr.sc.heads_total(); ++bh) {
      const T* rows = &k[std::size_t(bh) * n * d];
      std::fill(anchor.begin(), anchor.end(), 0.0f);
      for (std::size_t j = 0; j < n; ++j) {
        float sq = 0.0f;
        for (std::size_t e = 0; e < d; ++e) sq += to_float(rows[j * d + e]) * to_float(rows[j * d + e]);
        norm[j] = std::sqrt(sq);
        for (std::size_t e = 0; e < d; ++e) anchor[e] += to_float(rows[j * d + e]) / norm[j];
      }
      float alen = 0.0f;
      for (float a : anchor) alen += a * a;
      alen = std::sqrt(alen);
      for (std::size_t j = 0; j < n; ++j) {
        float dot = 0.0f;
        for (std::size_t e = 0; e < d; ++e) dot += to_float(rows[j * d + e]) * anchor[e];
        score[j] = -dot / (norm[j] * alen);
      }
      keep_and_gather(score, heavy, older, pr.budget, bh, d, k, v, idx, k2, v2);
    }
    benchmark::ClobberMemory();
  }
  kvbench::report(state, pr.items(), pr.key_bytes<T>() + pr.moved_bytes<T>());
}

template <class T>
void register_dtype(const scenario& sc, const kvbench::keep_fraction& keep) {
  const auto name = [&](const char* method, const char* input) {
    return kvbench::bench_name("prefill", method, input, sc.name, keep.name, "powerlaw", kvbench::dtype_name<T>());
  };
  const auto unit = sc.slots_total() > 1'000'000 ? benchmark::kMillisecond : benchmark::kMicrosecond;
  benchmark::RegisterBenchmark(name("h2o", "column_sums").c_str(), per_sequence_sums<T>, sc, keep)->Unit(unit);
  benchmark::RegisterBenchmark(name("h2o_batched", "column_sums").c_str(), batched_sums<T>, sc, keep)->Unit(unit);
  benchmark::RegisterBenchmark(name("reference_keep_gather", "column_sums").c_str(), reference_keep_gather<T>, sc,
                               keep)
      ->Unit(unit);
  benchmark::RegisterBenchmark(name("snapkv", "window_probs").c_str(), per_sequence_snapkv<T>, sc, keep)->Unit(unit);
  benchmark::RegisterBenchmark(name("snapkv_batched", "window_probs").c_str(), batched_snapkv<T>, sc, keep)->Unit(unit);
  benchmark::RegisterBenchmark(name("reference_snapkv_gather", "window_probs").c_str(), reference_snapkv_gather<T>, sc,
                               keep)
      ->Unit(unit);
  benchmark::RegisterBenchmark(name("key_diff", "keys").c_str(), per_sequence_key_diff<T>, sc, keep)->Unit(unit);
  benchmark::RegisterBenchmark(name("key_diff_batched", "keys").c_str(), batched_key_diff<T>, sc, keep)->Unit(unit);
  benchmark::RegisterBenchmark(name("reference_key_diff_gather", "keys").c_str(), reference_key_diff_gather<T>, sc,
                               keep)
      ->Unit(unit);
}

/// KeyDiff over an fp8 cache (every key read as code x scale; kv_cache's
/// scale of 1): the bf16 rows' twins.
void register_fp8_key_diff(const scenario& sc, const kvbench::keep_fraction& keep) {
  const auto name = [&](const char* method) {
    return kvbench::bench_name("prefill", method, "keys", sc.name, keep.name, "powerlaw",
                               kvbench::dtype_name<fp8_e4m3>());
  };
  const auto unit = sc.slots_total() > 1'000'000 ? benchmark::kMillisecond : benchmark::kMicrosecond;
  benchmark::RegisterBenchmark(name("key_diff").c_str(), per_sequence_key_diff<fp8_e4m3>, sc, keep)->Unit(unit);
  benchmark::RegisterBenchmark(name("key_diff_batched").c_str(), batched_key_diff<fp8_e4m3>, sc, keep)->Unit(unit);
}

const int registered = [] {
  for (const scenario& sc : kvbench::selected_scenarios())
    for (const kvbench::keep_fraction& keep : kvbench::kKeeps) {
      register_dtype<bfloat16>(sc, keep);
      register_fp8_key_diff(sc, keep);
      if (std::string(sc.name) == "S5") {
        register_dtype<float>(sc, keep);
        register_dtype<half>(sc, keep);
        benchmark::RegisterBenchmark(
            kvbench::bench_name("prefill", "h2o", "probs", sc.name, keep.name, "powerlaw", "bf16").c_str(),
            per_sequence_probs, sc, keep)
            ->Unit(benchmark::kMillisecond);
      }
    }
  return 0;
}();

}  // namespace

BENCHMARK_MAIN();
