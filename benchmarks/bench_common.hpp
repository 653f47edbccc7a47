#pragma once
// What every benchmark family shares: the scenarios S0-S5 of
// docs/benchmarks.md, the score distributions, input generators, the names
// the report groups by, and which scenarios a default run skips.
//
// Names are family/method/input/scenario/keep/distribution/dtype, e.g.
// decode/h2o/probs/S1/evict1/powerlaw/f32, so scripts/bench_report.py can
// pair every row with its baseline of the same scenario. Each benchmark says
// what one item is; bytes/s counts the bytes the operation must at least
// touch, so a fraction of the memory roof reads off the same run.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "kvevict/kvevict.hpp"

namespace kvbench {

/// One scenario of docs/benchmarks.md: B sequences x KV heads (each with
/// `group` query heads) x N slots, bf16 K/V of head_dim.
struct scenario {
  const char* name;
  std::int32_t seqs, kv_heads, group, slots, head_dim;
  /// Too big for a default run on a 2-core machine (hundreds of MiB of
  /// inputs, tens of ms per step): registered only with KVEVICT_BENCH_LARGE=1.
  bool large;

  std::int32_t q_heads() const noexcept { return kv_heads * group; }
  std::int64_t heads_total() const noexcept { return std::int64_t{seqs} * kv_heads; }
  std::int64_t slots_total() const noexcept { return heads_total() * slots; }
};

inline const std::vector<scenario>& scenarios() {
  static const std::vector<scenario> all = {
      {"S0", 24, 32, 1, 820, 128, false},     // the paper's FlexGen setting
      {"S1", 64, 8, 4, 4096, 128, false},     // many short segments
      {"S2", 16, 8, 4, 32768, 128, true},     // segments about a GPU's SM count
      {"S3", 1, 8, 4, 131072, 128, true},     // few long segments
      {"S4", 32, 32, 1, 8192, 64, true},      // head_dim 64
      {"S5", 1, 8, 4, 1024, 128, false},      // latency
      {"L8", 64, 8, 4, 16384, 128, true},     // many long segments: 8M slots, the largest roof anchor
  };
  return all;
}

inline bool large_runs_enabled() {
  const char* v = std::getenv("KVEVICT_BENCH_LARGE");
  return v && *v && std::string(v) != "0";
}

/// The scenarios a family registers: the default ones, plus the large ones
/// when asked for.
inline std::vector<scenario> selected_scenarios() {
  std::vector<scenario> out;
  for (const scenario& s : scenarios())
    if (!s.large || large_runs_enabled()) out.push_back(s);
  return out;
}

/// Benchmarks that need a K/V cache keep it under 256 MiB (S1's whole bf16
/// cache is 1 GiB, two of them 2 GiB): they run on the first sequences of
/// the scenario only. Every (b, h) does the same work, and items/s stays per
/// (b, h) or per token, so the figures compare with the full batch's.
inline scenario cache_slice(scenario sc, std::size_t element_bytes) {
  const std::size_t per_seq = std::size_t(2) * sc.kv_heads * sc.slots * sc.head_dim * element_bytes;
  const std::size_t limit = std::size_t(256) << 20;
  sc.seqs = std::max<std::int32_t>(1, std::min<std::int32_t>(sc.seqs, std::int32_t(limit / per_seq)));
  return sc;
}

/// Shapes of a decode step (docs/benchmarks.md): every slot occupied,
/// recent window 64, 4 sinks for the policies that have sinks.
constexpr std::int32_t kRecent = 64;
constexpr std::int32_t kSinks = 4;

/// Score distributions. Power law: a few heavy hitters, most mass tiny (as
/// attention is). Uniform: no structure, every slot alike. Near ties: values
/// a few ulps apart, so the (score, position) order decides on positions.
enum class distribution { powerlaw, uniform, neartie };

inline const char* name_of(distribution d) {
  switch (d) {
    case distribution::powerlaw: return "powerlaw";
    case distribution::uniform: return "uniform";
    case distribution::neartie: return "neartie";
  }
  return "?";
}
constexpr distribution kDistributions[] = {distribution::powerlaw, distribution::uniform, distribution::neartie};

/// n values in [0, 1/row] shaped like one attention row of `row` slots, so
/// that sums over a group and over many steps stay far from overflow.
inline std::vector<float> probabilities(std::size_t n, std::int32_t row, distribution d, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  std::uniform_int_distribution<int> ulps(0, 3);
  std::vector<float> p(n);
  const float scale = 1.0f / float(row);
  for (float& x : p) switch (d) {
      case distribution::powerlaw: x = std::pow(u(rng), 8.0f) * scale; break;
      case distribution::uniform: x = u(rng) * scale; break;
      case distribution::neartie: x = std::nextafter(scale, 1.0f) + float(ulps(rng)) * 1e-7f * scale; break;
    }
  return p;
}

/// What one decode step's input holds: probabilities ([Hq] rows), per-KV-head
/// increments ([Hkv] rows, each a distribution over N / group so that it
/// weighs as a folded group does), or logits (log of the probabilities, with
/// LSE 0) and their LSE.
enum class step_values { probabilities, increments, logits };

/// One decode step's input for `seqs` sequences, [seqs][rows][N], shared by
/// the host and CUDA decode families.
struct step_inputs {
  std::vector<float> values;  // probabilities, increments or logits
  std::vector<float> lse;     // [B][Hq], zeros: logit = log(probability)
  std::int32_t rows_per_seq = 0;
  std::int64_t bytes = 0;     // values + lse read
};

inline step_inputs make_step_inputs(const scenario& sc, std::int32_t seqs, step_values kind, distribution d) {
  step_inputs in;
  const bool increments = kind == step_values::increments;
  in.rows_per_seq = increments ? sc.kv_heads : sc.q_heads();
  const std::size_t n = std::size_t(seqs) * in.rows_per_seq * sc.slots;
  in.values = probabilities(n, increments ? sc.slots / sc.group : sc.slots, d, 1);
  if (kind == step_values::logits) {
    for (float& x : in.values) x = std::log(std::max(x, 1e-30f));
    in.lse.assign(std::size_t(sc.seqs) * sc.q_heads(), 0.0f);
  }
  in.bytes = std::int64_t(in.values.size() * sizeof(float) + in.lse.size() * sizeof(float));
  return in;
}

/// Scores for a selection: the same shapes, plus distinct-enough spreads.
inline std::vector<float> scores(std::size_t n, distribution d, std::uint32_t seed) {
  return probabilities(n, 1, d, seed);
}

/// A permutation of [0, n): positions as slots hold them after slot reuse.
inline std::vector<std::int32_t> shuffled_positions(std::int32_t n, std::uint32_t seed) {
  std::vector<std::int32_t> pos(std::size_t(n), 0);
  for (std::int32_t i = 0; i < n; ++i) pos[std::size_t(i)] = i;
  std::shuffle(pos.begin(), pos.end(), std::mt19937(seed));
  return pos;
}

template <class T>
const char* dtype_name();
template <>
inline const char* dtype_name<float>() { return "f32"; }
template <>
inline const char* dtype_name<kvevict::half>() { return "f16"; }
template <>
inline const char* dtype_name<kvevict::bfloat16>() { return "bf16"; }
template <>
inline const char* dtype_name<kvevict::fp8_e4m3>() { return "fp8e4m3"; }
template <>
inline const char* dtype_name<kvevict::fp8_e5m2>() { return "fp8e5m2"; }

template <class T>
std::vector<T> random_rows(std::size_t n, float bound, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-bound, bound);
  std::vector<T> out(n);
  for (T& x : out) x = kvevict::from_float<T>(u(rng));
  return out;
}

/// family/method/input/scenario/keep/distribution/dtype.
inline std::string bench_name(const std::string& family, const std::string& method, const std::string& input,
                              const std::string& scenario, const std::string& keep, const std::string& dist,
                              const std::string& dtype) {
  return family + "/" + method + "/" + input + "/" + scenario + "/" + keep + "/" + dist + "/" + dtype;
}

/// The keep sizes of selections, prefill and evict_to: 20% and 50% of N.
struct keep_fraction {
  const char* name;
  int percent;
  std::int32_t of(std::int32_t n) const noexcept { return std::int32_t(std::int64_t{n} * percent / 100); }
};
constexpr keep_fraction kKeeps[] = {{"keep20", 20}, {"keep50", 50}};

/// Reports items (what one item is, per family) and the bytes an
/// iteration must at least touch.
inline void report(benchmark::State& state, std::int64_t items_per_iteration, std::int64_t bytes_per_iteration) {
  state.SetItemsProcessed(state.iterations() * items_per_iteration);
  state.SetBytesProcessed(state.iterations() * bytes_per_iteration);
}

}  // namespace kvbench
