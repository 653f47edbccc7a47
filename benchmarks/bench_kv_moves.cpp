// The two operations that move K/V rows, per dtype: scatter.hpp (one new
// token's K and V row into the slot each KV head chose) and compaction.hpp
// (kept rows into slots [0, n) in order, in place when the sources
// increase, through a workspace when they do not). Baseline: memcpy of the
// same bytes, row by row for scatter and in one block for compaction (the
// roof neither can beat).
//
// One item = one (sequence, KV head) row pair (K and V) moved. Bytes = the
// rows read and written once.
#include "bench_common.hpp"

#include <cstring>

namespace {

using namespace kvevict;
using kvbench::scenario;

template <class T>
std::int64_t row_pair_bytes(const scenario& sc) {
  return 2 * 2 * std::int64_t(sc.head_dim) * std::int64_t(sizeof(T));  // K and V, read and written
}

// One decode step's scatter for every sequence of the scenario, the slot of
// each head drawn at random (as evictions leave them).
template <class T>
void scatter_step(benchmark::State& state, scenario sc) {
  sc = kvbench::cache_slice(sc, sizeof(T));
  auto cache = make_bhsd_cache<T>(sc.seqs, sc.kv_heads, sc.slots, sc.head_dim);
  const std::vector<T> rows = kvbench::random_rows<T>(std::size_t(sc.kv_heads) * sc.head_dim, 1.0f, 9);
  const auto k_new = make_tensor_view<const T>(rows.data(), sc.kv_heads, sc.head_dim);
  std::vector<std::int32_t> slots(std::size_t(sc.heads_total()));
  std::mt19937 rng(10);
  for (std::int32_t& s : slots) s = std::int32_t(rng() % std::uint32_t(sc.slots));
  for (auto _ : state)
    for (std::int32_t b = 0; b < sc.seqs; ++b)
      scatter(cache.view(), b, &slots[std::size_t(b) * sc.kv_heads], k_new, k_new);
  kvbench::report(state, sc.heads_total(), sc.heads_total() * row_pair_bytes<T>(sc));
}

template <class T>
void scatter_memcpy(benchmark::State& state, scenario sc) {
  sc = kvbench::cache_slice(sc, sizeof(T));
  auto cache = make_bhsd_cache<T>(sc.seqs, sc.kv_heads, sc.slots, sc.head_dim);
  const auto view = cache.view();
  const std::vector<T> rows = kvbench::random_rows<T>(std::size_t(sc.kv_heads) * sc.head_dim, 1.0f, 9);
  std::vector<std::int32_t> slots(std::size_t(sc.heads_total()));
  std::mt19937 rng(10);
  for (std::int32_t& s : slots) s = std::int32_t(rng() % std::uint32_t(sc.slots));
  const std::size_t row_bytes = std::size_t(sc.head_dim) * sizeof(T);
  for (auto _ : state) {
    for (std::int32_t b = 0; b < sc.seqs; ++b)
      for (std::int32_t h = 0; h < sc.kv_heads; ++h) {
        const std::int32_t s = slots[std::size_t(b) * sc.kv_heads + h];
        std::memcpy(view.k_row(b, h, s), &rows[std::size_t(h) * sc.head_dim], row_bytes);
        std::memcpy(view.v_row(b, h, s), &rows[std::size_t(h) * sc.head_dim], row_bytes);
      }
    benchmark::ClobberMemory();
  }
  kvbench::report(state, sc.heads_total(), sc.heads_total() * row_pair_bytes<T>(sc));
}

// The kept keep% of N slots (a random subset) of every (b, h) into slots
// [0, n). Increasing sources move in place; shuffled ones (an engine's own
// order) go through the workspace.
template <class T>
void compaction(benchmark::State& state, scenario sc, kvbench::keep_fraction keep, bool increasing) {
  sc = kvbench::cache_slice(sc, sizeof(T));
  auto cache = make_bhsd_cache<T>(sc.seqs, sc.kv_heads, sc.slots, sc.head_dim);
  const std::int32_t n = keep.of(sc.slots);
  std::vector<std::int32_t> src = kvbench::shuffled_positions(sc.slots, 12);
  src.resize(std::size_t(n));
  if (increasing) std::sort(src.begin(), src.end());
  std::vector<T> workspace(compaction_workspace_elements(n, sc.head_dim));
  for (auto _ : state)
    for (std::int32_t b = 0; b < sc.seqs; ++b)
      for (std::int32_t h = 0; h < sc.kv_heads; ++h) compact(cache.view(), b, h, src.data(), n, workspace.data());
  kvbench::report(state, sc.heads_total() * n, sc.heads_total() * n * row_pair_bytes<T>(sc));
}

template <class T>
void compaction_memcpy(benchmark::State& state, scenario sc, kvbench::keep_fraction keep) {
  sc = kvbench::cache_slice(sc, sizeof(T));
  const std::int32_t n = keep.of(sc.slots);
  const std::size_t bytes = std::size_t(sc.heads_total()) * n * std::size_t(row_pair_bytes<T>(sc)) / 2;
  std::vector<unsigned char> src(bytes, 1), dst(bytes, 0);
  for (auto _ : state) {
    std::memcpy(dst.data(), src.data(), bytes);
    benchmark::ClobberMemory();
  }
  kvbench::report(state, sc.heads_total() * n, std::int64_t(2 * bytes));
}

template <class T>
void register_dtype(const scenario& sc) {
  const std::string dtype = kvbench::dtype_name<T>();
  const auto unit = sc.slots_total() > 1'000'000 ? benchmark::kMillisecond : benchmark::kMicrosecond;
  benchmark::RegisterBenchmark(
      kvbench::bench_name("scatter", "kvevict", "rows", sc.name, "evict1", "random", dtype).c_str(),
      scatter_step<T>, sc);
  benchmark::RegisterBenchmark(
      kvbench::bench_name("scatter", "memcpy", "rows", sc.name, "evict1", "random", dtype).c_str(),
      scatter_memcpy<T>, sc);
  for (const kvbench::keep_fraction& keep : kvbench::kKeeps) {
    benchmark::RegisterBenchmark(
        kvbench::bench_name("compaction", "kvevict", "increasing", sc.name, keep.name, "random", dtype).c_str(),
        compaction<T>, sc, keep, true)
        ->Unit(unit);
    benchmark::RegisterBenchmark(
        kvbench::bench_name("compaction", "kvevict", "shuffled", sc.name, keep.name, "random", dtype).c_str(),
        compaction<T>, sc, keep, false)
        ->Unit(unit);
    benchmark::RegisterBenchmark(
        kvbench::bench_name("compaction", "memcpy", "block", sc.name, keep.name, "random", dtype).c_str(),
        compaction_memcpy<T>, sc, keep)
        ->Unit(unit);
  }
}

const int registered = [] {
  for (const scenario& sc : kvbench::selected_scenarios()) {
    register_dtype<float>(sc);
    register_dtype<half>(sc);
    register_dtype<bfloat16>(sc);
    register_dtype<fp8_e4m3>(sc);  // an fp8 cache's rows move as bytes: the bf16 rows' twins
  }
  return 0;
}();

}  // namespace

BENCHMARK_MAIN();
