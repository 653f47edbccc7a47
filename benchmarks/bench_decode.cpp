// Host decode step (append + observe + evict, one victim per (sequence, KV
// head), zero K/V bytes moved) per policy, per input kind and per API, with
// its three baselines in the same binary:
//
// - fused_loop: the practical limit, a minimal loop that adds the
//   group-reduced increments to the scores and tracks the minimum
//   (score, position) key outside the recent window in one pass;
// - memcpy of the bytes the h2o step must at least touch (the memory roof);
// - reference_realdrop: a transcription of the reference Python step
//   (top-k + sort of the kept indices + gather of the whole K/V cache).
//
// One item = one (sequence, KV head) step. Bytes = the inputs the step must
// read plus the per-slot state it must read and write (score read + write,
// position read: 12 bytes a slot). Every slot is occupied (N = the
// scenario's slots, budget N - 1), recent window 64, 4 sinks where a policy
// has sinks. The cache is filled by one multi-token append of N tokens, so
// positions sit in slot order but for the slots reused since; a linear pass's
// cost does not depend on that order.
#include "bench_common.hpp"

#include <cstring>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#include <limits>
#include <numeric>
#include <stdexcept>
#include <type_traits>

namespace {

using namespace kvevict;
using kvbench::distribution;
using kvbench::scenario;

constexpr std::int64_t kStateBytesPerSlot = 3 * sizeof(float);  // score read + write, position read

// ---- inputs of one step for the whole batch, laid out [B][heads][N] ----

// probs_shared: every sequence observes the same [Hq][N] probabilities, which
// then stay in the caches (what this project's earlier benchmark and the
// issue's anchors measured): the step's compute cost without the memory
// traffic of fresh inputs. Its bytes count the shared rows once.
enum class input_kind { probs, probs_shared, head_scores, logits };
const char* name_of(input_kind k) {
  switch (k) {
    case input_kind::probs: return "probs";
    case input_kind::probs_shared: return "probs_shared";
    case input_kind::head_scores: return "head_scores";
    case input_kind::logits: return "logits";
  }
  return "?";
}

using kvbench::step_inputs;

step_inputs make_inputs(const scenario& sc, input_kind kind, distribution d) {
  using kvbench::step_values;
  const step_values values = kind == input_kind::head_scores ? step_values::increments
                             : kind == input_kind::logits    ? step_values::logits
                                                             : step_values::probabilities;
  return kvbench::make_step_inputs(sc, kind == input_kind::probs_shared ? 1 : sc.seqs, values, d);
}

// The per-sequence API's input for sequence b.
struct per_sequence_input {
  const step_inputs& in;
  const scenario& sc;
  input_kind kind;
  template <class Policy>
  void observe(Policy& p, std::int32_t b) const {
    const std::int32_t source = kind == input_kind::probs_shared ? 0 : b;
    const float* rows = in.values.data() + std::size_t(source) * in.rows_per_seq * sc.slots;
    const auto view = make_tensor_view<const float>(rows, in.rows_per_seq, sc.slots);
    switch (kind) {
      case input_kind::probs:
      case input_kind::probs_shared: p.observe(b, decode_probs{view}); break;
      case input_kind::head_scores: p.observe(b, head_scores{view}); break;
      case input_kind::logits:
        p.observe(b, decode_logits{view, make_tensor_view<const float>(in.lse.data() + std::size_t(b) * sc.q_heads(),
                                                                         sc.q_heads())});
        break;
    }
  }
};

// ---- the policies under test, each with the decode shape of docs/benchmarks.md ----

struct h2o_setup {
  using policy = h2o_policy;
  static constexpr const char* name = "h2o";
  static h2o_config config(std::int32_t budget) { return {budget - kvbench::kRecent, kvbench::kRecent}; }
};
/// TOVA: h2o with decay 0 (and h2o's sum over the group, so the two rows
/// differ only in the decayed update).
struct tova_setup {
  using policy = h2o_policy;
  static constexpr const char* name = "tova";
  static h2o_config config(std::int32_t budget) {
    h2o_config c = h2o_setup::config(budget);
    c.decay = 0.0f;
    return c;
  }
};
struct recent_window_setup {
  using policy = recent_window_policy;
  static constexpr const char* name = "recent_window";
  static recent_window_config config(std::int32_t budget) { return {kvbench::kSinks, budget - kvbench::kSinks}; }
};
struct random_setup {
  using policy = random_policy;
  static constexpr const char* name = "random";
  static random_config config(std::int32_t budget) { return {budget, kvbench::kSinks, kvbench::kRecent, 7}; }
};

policy_shape shape_of(const scenario& sc) { return {sc.seqs, sc.kv_heads, sc.q_heads(), sc.slots}; }

// Per-sequence API: append + observe + evict for every sequence.
template <class Setup>
void per_sequence_step(benchmark::State& state, scenario sc, input_kind kind, distribution d) {
  typename Setup::policy policy(shape_of(sc), Setup::config(sc.slots - 1));
  const step_inputs in = make_inputs(sc, kind, d);
  const per_sequence_input input{in, sc, kind};
  for (std::int32_t b = 0; b < sc.seqs; ++b) {  // fill: N tokens, then the first eviction
    policy.append(b, sc.slots, nullptr);
    input.observe(policy, b);
    policy.evict(b);
  }
  for (auto _ : state)
    for (std::int32_t b = 0; b < sc.seqs; ++b) {
      policy.append(b);
      input.observe(policy, b);
      benchmark::DoNotOptimize(policy.evict(b));
    }
  kvbench::report(state, sc.heads_total(), in.bytes + sc.slots_total() * kStateBytesPerSlot);
}

// Batched host API: one append and one fused observe_evict for the batch.
template <class Setup>
void batched_step(benchmark::State& state, scenario sc, input_kind kind, distribution d) {
  batched_policy<typename Setup::policy, device::host> layer(shape_of(sc), Setup::config(sc.slots - 1));
  const step_inputs in = make_inputs(sc, kind, d);
  const auto values = make_tensor_view<const float>(in.values.data(), sc.seqs, in.rows_per_seq, sc.slots);
  const auto lse = make_tensor_view<const float>(in.lse.data(), sc.seqs, sc.q_heads());
  const auto observe_evict = [&] {
    switch (kind) {
      case input_kind::probs: layer.observe_evict(batch_probs{values}); break;
      case input_kind::head_scores: layer.observe_evict(batch_head_scores{values}); break;
      case input_kind::logits: layer.observe_evict(batch_logits{values, lse}); break;
      case input_kind::probs_shared: throw std::logic_error("probs_shared is per-sequence only");
    }
  };
  std::uint64_t status = batch_status_clear;
  batched_append_tokens(layer.state(), active_set::all(), sc.slots, &status);  // fill
  throw_if_error(status, "fill");
  observe_evict();
  layer.check();
  for (auto _ : state) {
    layer.append();
    observe_evict();
    benchmark::DoNotOptimize(layer.status_word());
  }
  layer.check();
  kvbench::report(state, sc.heads_total(), in.bytes + sc.slots_total() * kStateBytesPerSlot);
}

// ---- the queries path: logits recomputed from q and the cached keys ----

// Bytes: the cached keys of every occupied slot (the dominant read), the
// queries, and the per-slot state. An fp8 cache (codes with a K scale of
// 0.5 per layer, as an engine's) takes bf16 queries.
template <class T>
using query_type_t = std::conditional_t<is_fp8_v<T>, bfloat16, T>;

template <class T>
struct queries_fixture {
  using Q = query_type_t<T>;
  scenario sc;
  kv_cache<T, strided_layout> cache;
  std::vector<Q> q;
  std::vector<float> lse;
  std::int64_t bytes;

  explicit queries_fixture(const scenario& s)
      : sc(s), cache(make_bhsd_cache<T>(s.seqs, s.kv_heads, s.slots, s.head_dim)) {
    const auto view = cache.view();
    const std::vector<T> rows = kvbench::random_rows<T>(std::size_t(s.slots) * s.head_dim, 1.0f, 3);
    for (std::int32_t b = 0; b < s.seqs; ++b)
      for (std::int32_t h = 0; h < s.kv_heads; ++h)
        for (std::int32_t j = 0; j < s.slots; ++j) {
          std::copy_n(rows.data() + std::size_t(j) * s.head_dim, s.head_dim, view.k_row(b, h, j));
          std::copy_n(rows.data() + std::size_t(j) * s.head_dim, s.head_dim, view.v_row(b, h, j));
        }
    if constexpr (is_fp8_v<T>) cache.set_scales({0.5f}, {0.5f});
    q = kvbench::random_rows<Q>(std::size_t(s.seqs) * s.q_heads() * s.head_dim, 1.0f, 5);
    // |q . k| * scale <= sqrt(head_dim) with entries in [-1, 1]: an LSE above
    // that keeps every recomputed probability in (0, 1].
    lse.assign(std::size_t(s.seqs) * s.q_heads(), std::sqrt(float(s.head_dim)) + 1.0f);
    bytes = s.slots_total() * (std::int64_t(s.head_dim) * std::int64_t(sizeof(T)) + kStateBytesPerSlot) +
            std::int64_t(q.size() * sizeof(Q) + lse.size() * sizeof(float));
  }
  float scale() const { return 1.0f / std::sqrt(float(sc.head_dim)); }
  decode_queries<Q> of(std::int32_t b) const {
    return {make_tensor_view<const Q>(q.data() + std::size_t(b) * sc.q_heads() * sc.head_dim, sc.q_heads(),
                                      sc.head_dim),
            make_tensor_view<const float>(lse.data() + std::size_t(b) * sc.q_heads(), sc.q_heads()), scale()};
  }
  batch_queries<Q> batch() const {
    return {make_tensor_view<const Q>(q.data(), sc.seqs, sc.q_heads(), sc.head_dim),
            make_tensor_view<const float>(lse.data(), sc.seqs, sc.q_heads()), scale()};
  }
};

template <class Policy, class Config, class T>
void per_sequence_queries_step(benchmark::State& state, scenario sc, Config config) {
  queries_fixture<T> fx(sc);
  Policy policy(shape_of(sc), config);
  const auto view = fx.cache.view();
  for (std::int32_t b = 0; b < sc.seqs; ++b) {
    policy.append(b, sc.slots, nullptr);
    policy.observe(b, fx.of(b), view);
    policy.evict(b);
  }
  for (auto _ : state)
    for (std::int32_t b = 0; b < sc.seqs; ++b) {
      policy.append(b);
      policy.observe(b, fx.of(b), view);
      benchmark::DoNotOptimize(policy.evict(b));
    }
  kvbench::report(state, sc.heads_total(), fx.bytes);
}

template <class T>
void batched_queries_step(benchmark::State& state, scenario sc) {
  queries_fixture<T> fx(sc);
  batched_policy<h2o_policy, device::host> layer(shape_of(sc), h2o_setup::config(sc.slots - 1));
  std::uint64_t status = batch_status_clear;
  batched_append_tokens(layer.state(), active_set::all(), sc.slots, &status);
  throw_if_error(status, "fill");
  layer.observe_evict(fx.batch(), fx.cache.view());
  layer.check();
  for (auto _ : state) {
    layer.append();
    layer.observe_evict(fx.batch(), fx.cache.view());
    benchmark::DoNotOptimize(layer.status_word());
  }
  layer.check();
  kvbench::report(state, sc.heads_total(), fx.bytes);
}

// ---- the key-scored paths: key norms and KeyDiff, from the cached keys alone ----

// Bytes: the cached keys of every occupied slot and the per-slot state (no
// queries). Same protection as the h2o rows, decay 0 (key_norm_config).
// KeyDiff also keeps its running anchor (key_diff_extent): per step it adds
// the new key and subtracts the victim's, O(head_dim), beside the pass.
template <class T, template <class, class> class Keys>
void key_score_step(benchmark::State& state, scenario sc, bool batched) {
  queries_fixture<T> fx(sc);  // its cache; the queries go unused
  h2o_config config = h2o_setup::config(sc.slots - 1);
  config.decay = 0.0f;
  const auto view = fx.cache.view();
  const Keys<T, strided_layout> keys{view};
  const std::int64_t bytes =
      sc.slots_total() * (std::int64_t(sc.head_dim) * std::int64_t(sizeof(T)) + kStateBytesPerSlot);
  const history_extent extent =
      std::is_same_v<Keys<T, strided_layout>, key_diff<T, strided_layout>> ? key_diff_extent(sc.head_dim) : history_extent{};
  if (batched) {
    batched_policy<h2o_policy, device::host> layer(shape_of(sc), config, extent);
    std::uint64_t status = batch_status_clear;
    batched_append_tokens(layer.state(), active_set::all(), sc.slots, &status);
    throw_if_error(status, "fill");
    layer.observe_evict(keys);
    layer.check();
    for (auto _ : state) {
      layer.append();
      layer.observe_evict(keys);
      benchmark::DoNotOptimize(layer.status_word());
    }
    layer.check();
  } else {
    h2o_policy policy(shape_of(sc), config);
    for (std::int32_t b = 0; b < sc.seqs; ++b) {
      policy.append(b, sc.slots, nullptr);
      policy.observe(b, keys);
      policy.evict(b);
    }
    for (auto _ : state)
      for (std::int32_t b = 0; b < sc.seqs; ++b) {
        policy.append(b);
        policy.observe(b, keys);
        benchmark::DoNotOptimize(policy.evict(b));
      }
  }
  kvbench::report(state, sc.heads_total(), bytes);
}

// ---- baselines ----

// One (b, h) of the fused loop: one pass over the row adds the folded
// increments and takes the minimum score outside the recent window; a
// second pass over the same row, now in L1/L2, finds the oldest position
// with that score (the order's tie-break) and its slot. Written with SSE2
// intrinsics (every x86-64 has them): g++ vectorises neither a 64-bit key
// minimum nor a float minimum reduction without -ffast-math, and the
// baseline is meant to be the practical limit. Scores here are never NaN,
// and -0 == +0 as in the order. Group is a template parameter so the fold
// unrolls; n is a multiple of 4 in every scenario.
template <int Group>
std::size_t fused_row(float* s, const std::int32_t* pos, const float* inc, std::size_t n,
                      std::int32_t oldest_protected) {
#if defined(__SSE2__)
  const __m128 none = _mm_set1_ps(std::numeric_limits<float>::infinity());
  const __m128i protected_from = _mm_set1_epi32(oldest_protected);
  __m128 low = none;
  for (std::size_t j = 0; j < n; j += 4) {
    __m128 x = _mm_loadu_ps(inc + j);
    for (int g = 1; g < Group; ++g) x = _mm_add_ps(x, _mm_loadu_ps(inc + std::size_t(g) * n + j));
    const __m128 updated = _mm_add_ps(_mm_loadu_ps(s + j), x);
    _mm_storeu_ps(s + j, updated);
    const __m128 evictable = _mm_castsi128_ps(
        _mm_cmplt_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(pos + j)), protected_from));
    low = _mm_min_ps(low, _mm_or_ps(_mm_and_ps(evictable, updated), _mm_andnot_ps(evictable, none)));
  }
  low = _mm_min_ps(low, _mm_shuffle_ps(low, low, _MM_SHUFFLE(1, 0, 3, 2)));
  low = _mm_min_ps(low, _mm_shuffle_ps(low, low, _MM_SHUFFLE(2, 3, 0, 1)));
  std::int32_t oldest = std::numeric_limits<std::int32_t>::max();
  std::size_t slot = 0;
  for (std::size_t j = 0; j < n; j += 4) {
    int equal = _mm_movemask_ps(_mm_cmpeq_ps(_mm_loadu_ps(s + j), low));
    for (; equal; equal &= equal - 1) {  // rarely more than one lane in a row
      const std::size_t k = j + std::size_t(__builtin_ctz(unsigned(equal)));
      if (pos[k] < oldest_protected && pos[k] < oldest) {
        oldest = pos[k];
        slot = k;
      }
    }
  }
  return slot;
#else
  std::uint64_t best = ~std::uint64_t{0};
  std::size_t slot = 0;
  for (std::size_t j = 0; j < n; ++j) {
    float x = inc[j];
    for (int g = 1; g < Group; ++g) x += inc[std::size_t(g) * n + j];
    s[j] += x;
    const std::uint64_t key = pos[j] < oldest_protected ? eviction_key(s[j], pos[j]) : ~std::uint64_t{0};
    if (key < best) {
      best = key;
      slot = j;
    }
  }
  return slot;
#endif
}

// The practical limit of a decode step: per (b, h), a pass that adds the
// group-reduced increments and tracks the minimum (score, position) outside
// the recent window, then the victim's slot takes the next token (its score
// reset, its position the newest). No checks, no status: what the hardware
// does with the same bytes.
void fused_loop(benchmark::State& state, scenario sc, input_kind kind, distribution d) {
  const step_inputs in = make_inputs(sc, kind, d);
  const std::size_t n = std::size_t(sc.slots);
  std::vector<float> score(std::size_t(sc.slots_total()), 0.0f);
  std::vector<std::int32_t> position(score.size());
  std::vector<std::int32_t> length(std::size_t(sc.seqs), sc.slots);
  for (std::size_t i = 0; i < position.size(); ++i) position[i] = std::int32_t(i % n);
  const std::int32_t group = kind == input_kind::head_scores ? 1 : sc.group;
  const auto row = group == 4 ? fused_row<4> : group == 1 ? fused_row<1> : nullptr;
  if (!row) throw std::logic_error("fused_loop: group sizes 1 and 4 only");
  for (auto _ : state) {
    for (std::int32_t b = 0; b < sc.seqs; ++b) {
      const std::int32_t oldest_protected = length[std::size_t(b)] - kvbench::kRecent;
      for (std::int32_t h = 0; h < sc.kv_heads; ++h) {
        float* s = &score[(std::size_t(b) * sc.kv_heads + h) * n];
        std::int32_t* pos = &position[(std::size_t(b) * sc.kv_heads + h) * n];
        const std::size_t source = kind == input_kind::probs_shared ? 0 : std::size_t(b);
        const std::size_t slot =
            row(s, pos, &in.values[(source * in.rows_per_seq + std::size_t(h) * group) * n], n, oldest_protected);
        s[slot] = 0.0f;
        pos[slot] = length[std::size_t(b)];
      }
      ++length[std::size_t(b)];
    }
    benchmark::ClobberMemory();
  }
  kvbench::report(state, sc.heads_total(), in.bytes + sc.slots_total() * kStateBytesPerSlot);
}

// The memory roof: memcpy of the bytes the h2o probabilities step touches.
void memcpy_roof(benchmark::State& state, scenario sc) {
  const std::int64_t bytes =
      std::int64_t(sc.seqs) * sc.q_heads() * sc.slots * std::int64_t(sizeof(float)) + sc.slots_total() * kStateBytesPerSlot;
  std::vector<unsigned char> src(std::size_t(bytes), 1), dst(std::size_t(bytes), 0);
  for (auto _ : state) {
    std::memcpy(dst.data(), src.data(), src.size());
    benchmark::ClobberMemory();
  }
  kvbench::report(state, sc.heads_total(), bytes);
}

// The reference "real drop" of H2O's Python code, per (sequence, head):
// accumulate, take the top `heavy` of the older tokens plus the recent
// window, sort the kept indices, and gather K and V of every kept token into
// a fresh cache. Bytes: the whole bf16 cache read and written, plus
// probabilities and scores. At S1 the whole cache would take 4 GiB (two
// copies of K and V); every (b, h) does the same work, so it runs on the
// first `seqs_measured` sequences, enough to exceed the last-level cache,
// and items/s stays per (b, h) step.
void reference_realdrop(benchmark::State& state, scenario sc, std::int32_t seqs_measured) {
  sc.seqs = std::min(sc.seqs, seqs_measured);
  const std::int32_t budget = sc.slots - 1, recent = kvbench::kRecent, heavy = budget - recent;
  const std::size_t rows = std::size_t(sc.slots_total());
  std::vector<bfloat16> k(rows * sc.head_dim), v(k.size()), k2(k.size()), v2(k.size());
  std::vector<float> score(rows, 0.0f);
  const step_inputs in = make_inputs(sc, input_kind::probs, distribution::powerlaw);
  std::vector<std::int32_t> idx(std::size_t(sc.slots));
  const std::size_t n = std::size_t(sc.slots);
  for (auto _ : state) {
    for (std::int32_t bh = 0; bh < sc.seqs * sc.kv_heads; ++bh) {
      float* s = &score[std::size_t(bh) * n];
      const float* p = &in.values[std::size_t(bh) * sc.group * n];
      for (std::size_t j = 0; j < n; ++j)
        for (std::int32_t g = 0; g < sc.group; ++g) s[j] += p[std::size_t(g) * n + j];
      std::iota(idx.begin(), idx.end(), 0);
      const std::int32_t older = sc.slots - recent;
      std::nth_element(idx.begin(), idx.begin() + heavy, idx.begin() + older,
                       [s](std::int32_t a, std::int32_t c) { return s[a] > s[c]; });
      std::sort(idx.begin(), idx.begin() + heavy);
      std::copy(idx.begin() + older, idx.end(), idx.begin() + heavy);
      const std::size_t base = std::size_t(bh) * n * sc.head_dim;
      for (std::int32_t j = 0; j < budget; ++j) {
        const std::size_t from = base + std::size_t(idx[std::size_t(j)]) * sc.head_dim;
        const std::size_t to = base + std::size_t(j) * sc.head_dim;
        std::copy_n(&k[from], sc.head_dim, &k2[to]);
        std::copy_n(&v[from], sc.head_dim, &v2[to]);
      }
    }
    std::swap(k, k2);
    std::swap(v, v2);
    benchmark::ClobberMemory();
  }
  kvbench::report(state, sc.heads_total(),
                  in.bytes + sc.slots_total() * (2 * 2 * std::int64_t(sc.head_dim) * 2 + 2 * std::int64_t(sizeof(float))));
}

// ---- registration ----

std::string name(const char* method, const std::string& input, const scenario& sc, distribution d,
                 const char* dtype) {
  return kvbench::bench_name("decode", method, input, sc.name, "evict1", kvbench::name_of(d), dtype);
}

benchmark::TimeUnit unit_of(const scenario& sc) {
  return sc.slots_total() > 1'000'000 ? benchmark::kMillisecond : benchmark::kMicrosecond;
}

template <class Setup>
void register_policy(const scenario& sc, input_kind kind, distribution d) {
  const std::string method = Setup::name;
  benchmark::RegisterBenchmark(name(method.c_str(), name_of(kind), sc, d, "f32").c_str(),
                               per_sequence_step<Setup>, sc, kind, d)
      ->Unit(unit_of(sc));
  benchmark::RegisterBenchmark(name((method + "_batched").c_str(), name_of(kind), sc, d, "f32").c_str(),
                               batched_step<Setup>, sc, kind, d)
      ->Unit(unit_of(sc));
}

template <class T>
void register_queries(const scenario& sc) {
  const std::string dtype = kvbench::dtype_name<T>();
  benchmark::RegisterBenchmark(name("h2o", "queries", sc, distribution::uniform, dtype.c_str()).c_str(),
                               per_sequence_queries_step<h2o_policy, h2o_config, T>, sc,
                               h2o_setup::config(sc.slots - 1))
      ->Unit(unit_of(sc));
  benchmark::RegisterBenchmark(name("h2o_batched", "queries", sc, distribution::uniform, dtype.c_str()).c_str(),
                               batched_queries_step<T>, sc)
      ->Unit(unit_of(sc));
  // Key-norm reads the same keys with no queries: its baseline is the rows
  // above; KeyDiff's (a second dot product per key) is key-norm.
  benchmark::RegisterBenchmark(name("key_norm", "keys", sc, distribution::uniform, dtype.c_str()).c_str(),
                               key_score_step<T, key_norms>, sc, false)
      ->Unit(unit_of(sc));
  benchmark::RegisterBenchmark(name("key_norm_batched", "keys", sc, distribution::uniform, dtype.c_str()).c_str(),
                               key_score_step<T, key_norms>, sc, true)
      ->Unit(unit_of(sc));
  benchmark::RegisterBenchmark(name("key_diff", "keys", sc, distribution::uniform, dtype.c_str()).c_str(),
                               key_score_step<T, key_diff>, sc, false)
      ->Unit(unit_of(sc));
  benchmark::RegisterBenchmark(name("key_diff_batched", "keys", sc, distribution::uniform, dtype.c_str()).c_str(),
                               key_score_step<T, key_diff>, sc, true)
      ->Unit(unit_of(sc));
}

const int registered = [] {
  for (const scenario& sc : kvbench::selected_scenarios()) {
    for (distribution d : kvbench::kDistributions) {
      register_policy<h2o_setup>(sc, input_kind::probs, d);
      benchmark::RegisterBenchmark(name("fused_loop", "probs", sc, d, "f32").c_str(), fused_loop, sc,
                                   input_kind::probs, d)
          ->Unit(unit_of(sc));
    }
    const distribution pl = distribution::powerlaw;
    register_policy<h2o_setup>(sc, input_kind::head_scores, pl);
    benchmark::RegisterBenchmark(name("h2o", "probs_shared", sc, pl, "f32").c_str(), per_sequence_step<h2o_setup>,
                                 sc, input_kind::probs_shared, pl)
        ->Unit(unit_of(sc));
    benchmark::RegisterBenchmark(name("fused_loop", "probs_shared", sc, pl, "f32").c_str(), fused_loop, sc,
                                 input_kind::probs_shared, pl)
        ->Unit(unit_of(sc));
    register_policy<h2o_setup>(sc, input_kind::logits, pl);
    register_policy<tova_setup>(sc, input_kind::probs, pl);
    register_policy<recent_window_setup>(sc, input_kind::probs, pl);
    register_policy<random_setup>(sc, input_kind::probs, pl);
    benchmark::RegisterBenchmark(name("fused_loop", "head_scores", sc, pl, "f32").c_str(), fused_loop, sc,
                                 input_kind::head_scores, pl)
        ->Unit(unit_of(sc));
    benchmark::RegisterBenchmark(name("memcpy", "probs", sc, pl, "f32").c_str(), memcpy_roof, sc)->Unit(unit_of(sc));
    benchmark::RegisterBenchmark(name("reference_realdrop", "probs", sc, pl, "bf16").c_str(), reference_realdrop, sc,
                                 8)
        ->Unit(unit_of(sc));
    // The queries path reads every cached key: at S5 by default (K and V of
    // the larger scenarios take 0.3-2 GiB per dtype), the rest when asked.
    if (sc.slots_total() <= 1'000'000 || kvbench::large_runs_enabled()) {
      register_queries<float>(sc);
      register_queries<half>(sc);
      register_queries<bfloat16>(sc);
      register_queries<fp8_e4m3>(sc);  // every key read as code x scale: the bf16 rows' twins
    }
    // exact_greedy evaluates every candidate's effect on the attention
    // output (O(N^2 head_dim) a step): at the latency scenario only.
    if (std::string(sc.name) == "S5") {
      const exact_greedy_config config{sc.slots - 1, kvbench::kRecent, kvbench::kSinks};
      benchmark::RegisterBenchmark(name("exact_greedy", "queries", sc, distribution::uniform, "bf16").c_str(),
                                   per_sequence_queries_step<exact_greedy_policy, exact_greedy_config, bfloat16>, sc,
                                   config)
          ->Unit(benchmark::kMillisecond);
    }
  }
  return 0;
}();

}  // namespace

BENCHMARK_MAIN();
