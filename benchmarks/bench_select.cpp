// Segmented selection (select/segmented_select.hpp): the k lowest (bottom,
// victims) or highest (top, a keep set) of one segment of N (score,
// position) keys, output as indices in ascending position order, against
// the standard library on the same keys in the same binary:
//
// - nth_element: introselect on (key, index) pairs, then a sort of the k
//   selected by position;
// - partial_sort: the k extreme pairs sorted by key, then by position;
// - sort: every pair sorted by key, then the k first by position.
//
// Each baseline builds the same 64-bit key of order.hpp (score, then
// position) and returns the same output, so the comparison is like for like.
// Positions are shuffled, as slots hold them after reuse. Every iteration
// selects in the next of several distinct segments (at least 48 MiB of keys
// in all, beyond the last-level cache), so no call finds its segment warm
// from the previous one.
//
// One item = one key examined (N per call). Bytes = the scores and positions
// read plus the k indices written.
#include "bench_common.hpp"

#include <utility>

namespace {

using namespace kvevict;
using kvbench::distribution;

constexpr std::size_t kKeyBytesInFlight = std::size_t(48) << 20;

struct segments {
  std::int32_t n, count;
  std::vector<float> scores;
  std::vector<std::int32_t> positions;

  segments(std::int32_t length, distribution d)
      : n(length),
        count(std::max<std::int32_t>(4, std::int32_t(kKeyBytesInFlight / (std::size_t(length) * 8)))),
        scores(kvbench::scores(std::size_t(count) * length, d, 11)) {
    positions.reserve(scores.size());
    for (std::int32_t i = 0; i < count; ++i) {
      const std::vector<std::int32_t> p = kvbench::shuffled_positions(length, std::uint32_t(100 + i));
      positions.insert(positions.end(), p.begin(), p.end());
    }
  }
  const float* scores_of(std::int32_t i) const { return scores.data() + std::size_t(i) * n; }
  const std::int32_t* positions_of(std::int32_t i) const { return positions.data() + std::size_t(i) * n; }
};

void report_select(benchmark::State& state, std::int32_t n, std::int32_t k) {
  kvbench::report(state, n, std::int64_t(n) * 8 + std::int64_t(k) * 4);
}

void kvevict_select(benchmark::State& state, std::int32_t n, std::int32_t k, select_end end, distribution d) {
  const segments seg(n, d);
  std::vector<std::int32_t> out(static_cast<std::size_t>(k));
  segment_set keys;
  keys.max_length = n;
  keys.stride = n;
  keys.num_segments = 1;
  std::vector<unsigned char> workspace(segmented_select_workspace_bytes(keys));
  const selection_output output{out.data(), k, nullptr, 0};
  std::int32_t i = 0;
  for (auto _ : state) {
    keys.scores = seg.scores_of(i);
    keys.positions = seg.positions_of(i);
    segmented_select(workspace.data(), workspace.size(), keys, end, selection_count{k}, output);
    benchmark::DoNotOptimize(out.data());
    i = (i + 1) % seg.count;
  }
  report_select(state, n, k);
}

enum class std_method { nth_element, partial_sort, sort };
const char* name_of(std_method m) {
  switch (m) {
    case std_method::nth_element: return "nth_element";
    case std_method::partial_sort: return "partial_sort";
    case std_method::sort: return "sort";
  }
  return "?";
}

void std_select(benchmark::State& state, std::int32_t n, std::int32_t k, select_end end, distribution d,
                std_method method) {
  const segments seg(n, d);
  std::vector<std::pair<std::uint64_t, std::int32_t>> pairs(static_cast<std::size_t>(n));  // (key, index)
  std::vector<std::int32_t> out(static_cast<std::size_t>(k));
  const std::uint64_t flip = end == select_end::top ? ~std::uint64_t{0} : 0;  // top: lowest of the complement
  const auto by_key = [](const auto& a, const auto& b) { return a.first < b.first; };
  const auto by_position = [flip](const auto& a, const auto& b) {
    return std::uint32_t(a.first ^ flip) < std::uint32_t(b.first ^ flip);
  };
  std::int32_t i = 0;
  for (auto _ : state) {
    const float* s = seg.scores_of(i);
    const std::int32_t* p = seg.positions_of(i);
    for (std::int32_t j = 0; j < n; ++j) pairs[std::size_t(j)] = {eviction_key(s[j], p[j]) ^ flip, j};
    const auto kth = pairs.begin() + k;
    switch (method) {
      case std_method::nth_element: std::nth_element(pairs.begin(), kth, pairs.end(), by_key); break;
      case std_method::partial_sort: std::partial_sort(pairs.begin(), kth, pairs.end(), by_key); break;
      case std_method::sort: std::sort(pairs.begin(), pairs.end(), by_key); break;
    }
    std::sort(pairs.begin(), kth, by_position);
    for (std::int32_t j = 0; j < k; ++j) out[std::size_t(j)] = pairs[std::size_t(j)].second;
    benchmark::DoNotOptimize(out.data());
    i = (i + 1) % seg.count;
  }
  report_select(state, n, k);
}

const int registered = [] {
  const std::int32_t lengths[] = {4096, 8192, 16384, 32768, 65536, 131072};
  const std::pair<select_end, const char*> ends[] = {{select_end::bottom, "bottom"}, {select_end::top, "top"}};
  for (std::int32_t n : lengths)
    for (const kvbench::keep_fraction& keep : kvbench::kKeeps)
      for (const auto& [end, end_name] : ends)
        for (distribution d : kvbench::kDistributions) {
          // Every distribution for bottom-k at 20% (the target's case); power
          // law elsewhere, to keep a default run short.
          const bool target_case = end == select_end::bottom && keep.percent == 20;
          if (!target_case && d != distribution::powerlaw) continue;
          const std::int32_t k = keep.of(n);
          const std::string scenario = "N" + std::to_string(n), dist = kvbench::name_of(d);
          benchmark::RegisterBenchmark(
              kvbench::bench_name("select", "kvevict", end_name, scenario, keep.name, dist, "f32").c_str(),
              kvevict_select, n, k, end, d)
              ->Unit(benchmark::kMicrosecond);
          for (std_method m : {std_method::nth_element, std_method::partial_sort, std_method::sort})
            benchmark::RegisterBenchmark(
                kvbench::bench_name("select", name_of(m), end_name, scenario, keep.name, dist, "f32").c_str(),
                std_select, n, k, end, d, m)
                ->Unit(benchmark::kMicrosecond);
        }
  return 0;
}();

}  // namespace

BENCHMARK_MAIN();
