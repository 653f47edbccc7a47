// fp8 caches read as numbers (docs/semantics.md, "fp8 caches"): every path
// that reads cached keys or values (h2o by queries + LSE, key norms and
// KeyDiff, at decode and in prefill; SnapKV's window queries; exact
// greedy's decode and prefill) on an fp8 cache with its scales (E4M3 and
// E5M2; one scale per layer or per KV head; every layout) must decide what
// the same path decides on a float cache holding code x scale. Codes,
// scales and queries are drawn on grids where every product and partial
// sum is exact in float, so the two caches' chunk orders (16 codes against
// 4 floats per 16-byte chunk) give the same bits; KeyDiff's anchor is not
// on a grid, so its streams use head_dim 4 (one chunk either way). The
// float paths are held to brute force in test_batched_host,
// test_batched_prefill, test_key_norm, test_key_diff*, test_snapkv and
// test_exact_greedy, and attention_logit's fp8 order to its definition in
// test_decode_rules. The scales (not powers of two) make a path that skips
// one fail. Then the refusals: a bad scale is a status word with the head
// unchanged, on every key-reading call; scale arrays missing from an fp8
// view, or given to a float one, are refused by name.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <type_traits>
#include <vector>

#include "kvevict/kvevict.hpp"
#include "support/batch_streams.hpp"
#include "support/decode_inputs.hpp"

namespace {

using namespace kvevict;
using kvtest::decode_input;

constexpr std::int32_t B = 2, H = 3, group = 2, Hq = H * group;

/// Values every fp8 format holds exactly, so code = from_float(value).
constexpr float grid[] = {0.0f, 0.25f, -0.25f, 0.5f, -0.5f, 0.75f, -0.75f, 1.0f, -1.0f, 1.5f, -1.5f, 2.0f, -2.0f};

/// Scales of head h: multiples of 1/4 that are not powers of two.
struct scale_set {
  std::vector<float> k, v;
  float k_of(std::int32_t h) const { return k[k.size() > 1 ? std::size_t(h) : 0]; }
  float v_of(std::int32_t h) const { return v[v.size() > 1 ? std::size_t(h) : 0]; }
};
scale_set draw_scales(bool per_head) {
  if (per_head) return {{0.75f, 1.5f, 2.25f}, {1.25f, 2.5f, 0.75f}};
  return {{2.25f}, {1.25f}};
}

/// The fp8 layer and its float twin: the same policy, caches holding code
/// and code x scale.
template <class Policy, class Code, class FloatCache, class CodeCache>
struct twin {
  batched_policy<Policy> as_float, as_code;
  FloatCache floats;
  CodeCache codes;
  scale_set scales;
  std::int32_t D;

  /// Row (b, h, slot) of K (or V) set to grid values xs.
  void set_row(bool key, std::int32_t b, std::int32_t h, std::int32_t slot, const float* xs) {
    const float s = key ? scales.k_of(h) : scales.v_of(h);
    float* f = key ? floats.view().k_row(b, h, slot) : floats.view().v_row(b, h, slot);
    Code* c = key ? codes.view().k_row(b, h, slot) : codes.view().v_row(b, h, slot);
    for (std::int32_t d = 0; d < D; ++d) {
      f[d] = xs[d] * s;  // exact: both are short multiples of 1/4
      c[d] = from_float<Code>(xs[d]);
    }
  }
  void require_same() const {
    for (std::int32_t b = 0; b < B; ++b) kvtest::require_same_sequence(as_code.state(), b, as_float.state(), b);
  }
  /// Every row of the fp8 cache is worth its float twin's.
  void require_same_rows(std::int32_t capacity) {
    for (std::int32_t b = 0; b < B; ++b)
      for (std::int32_t h = 0; h < H; ++h)
        for (std::int32_t slot = 0; slot < capacity; ++slot)
          for (std::int32_t d = 0; d < D; ++d) {
            const auto c = codes.view();
            const auto f = floats.view();
            REQUIRE(dequantize(c.k_row(b, h, slot)[d], scales.k_of(h)) == f.k_row(b, h, slot)[d]);
            REQUIRE(dequantize(c.v_row(b, h, slot)[d], scales.v_of(h)) == f.v_row(b, h, slot)[d]);
          }
  }
};

/// Queries on a grid of 1/16 in [-1, 1] (exact products with the keys).
std::vector<float> grid_queries(std::mt19937& rng, std::size_t n) {
  std::uniform_int_distribution<int> q(-16, 16);
  std::vector<float> out(n);
  for (float& x : out) x = float(q(rng)) / 16.0f;
  return out;
}

/// The prompt's compression through the path the input reads keys by.
template <class Policy, class View>
std::uint64_t prefill(const batched_policy<Policy>& p, decode_input in, const View& view, const prompt_lengths& lengths,
                      const std::vector<float>& q, const std::vector<float>& lse, bool window, std::int32_t D) {
  using T = typename View::element_type;
  using Layout = typename View::layout_type;
  std::uint64_t status = batch_status_clear;
  const auto all = active_set::all();
  const std::int32_t L = lengths.max_length;
  if constexpr (std::is_same_v<Policy, exact_greedy_policy>) {
    const batch_queries<float> last{make_tensor_view<const float>(q.data(), B, Hq, D),
                                    make_tensor_view<const float>(lse.data(), B, Hq), 0.25f};
    batched_prefill(p.state(), all, lengths, last, view, nullptr, &status);
  } else if (in == decode_input::key_norms) {
    batched_prefill(p.state(), all, lengths, key_norms<T, Layout>{view}, nullptr, &status);
  } else if (in == decode_input::key_diff) {
    batched_prefill(p.state(), all, lengths, key_diff<T, Layout>{view}, nullptr, &status);
  } else if (window) {  // SnapKV: the last 2 rows look at the prompt
    batch_window_queries<float> w;
    w.q = make_tensor_view<const float>(q.data(), B, Hq, 2, D);
    w.lse = make_tensor_view<const float>(lse.data(), B, Hq, 2);
    w.scale = 0.25f;
    w.snap = snap_window{2, 3, snap_pooling::max};
    batched_prefill(p.state(), all, lengths, w, view, nullptr, &status);
  } else {
    batch_prefill_queries<float> pq;
    pq.q = make_tensor_view<const float>(q.data(), B, Hq, L, D);
    pq.lse = make_tensor_view<const float>(lse.data(), B, Hq, L);
    pq.scale = 0.25f;
    batched_prefill(p.state(), all, lengths, pq, view, nullptr, &status);
  }
  return status;
}

template <class Policy, class Code, class MakeCache>
void run_stream(std::uint32_t seed, decode_input in, MakeCache make_cache) {
  std::mt19937 rng(seed);
  const auto config = kvtest::draw_config<Policy>(rng, in);
  const std::int32_t budget = policy_traits<Policy>::rule(config).budget;
  const std::int32_t D = in == decode_input::key_diff ? 4 : 16;
  const decode_rule rule = policy_traits<Policy>::rule(config);
  const bool window = seed % 3 == 0 && rule.budget >= 2 + rule.protect.sinks;  // SnapKV keeps its window
  std::int32_t prompts[B];
  for (std::int32_t& L : prompts) L = std::uniform_int_distribution<int>(2, budget + 5)(rng);
  const std::int32_t capacity = budget + 8, steps = 16;
  const history_extent history = kvtest::history_of<Policy>(in, capacity + steps + 1, D);
  auto floats = make_cache(float{}, capacity, D);
  auto codes = make_cache(Code{}, capacity, D);
  const scale_set scales = draw_scales(seed % 2 == 1);
  codes.set_scales(scales.k, scales.v);
  twin<Policy, Code, decltype(floats), decltype(codes)> t{
      batched_policy<Policy>(policy_shape{B, H, Hq, capacity}, config, history),
      batched_policy<Policy>(policy_shape{B, H, Hq, capacity}, config, history),
      std::move(floats), std::move(codes), scales, D};
  const auto both = [&](auto&& f) {
    f(t.as_float, t.floats.view());
    f(t.as_code, t.codes.view());
  };
  std::uniform_int_distribution<int> pick(0, int(std::size(grid)) - 1);
  std::vector<float> row(static_cast<std::size_t>(D));
  const auto draw_row = [&] {
    for (float& x : row) x = grid[pick(rng)];
  };

  // The prompt, then its compression.
  for (std::int32_t b = 0; b < B; ++b)
    for (std::int32_t h = 0; h < H; ++h)
      for (std::int32_t slot = 0; slot < prompts[b]; ++slot)
        for (bool key : {true, false}) {
          draw_row();
          t.set_row(key, b, h, slot, row.data());
        }
  const std::int32_t L = std::max(prompts[0], prompts[1]);
  const prompt_lengths lengths{prompts, L};
  const std::vector<float> q = grid_queries(rng, std::size_t(B) * Hq * L * D);
  std::vector<float> lse(std::size_t(B) * Hq * L);
  for (float& x : lse) x = 1.0f + float(pick(rng)) / 8.0f;
  both([&](auto& p, const auto& view) {
    REQUIRE(prefill(p, in, view, lengths, q, lse, window, D) == batch_status_clear);
  });
  t.require_same();

  kvtest::batch_dims dm;
  dm.seqs = B, dm.heads = H, dm.group = group, dm.head_dim = D, dm.capacity = capacity;
  std::vector<float> k_new(std::size_t(B) * H * D), v_new(k_new.size());
  std::vector<Code> k_codes(k_new.size()), v_codes(k_new.size());
  for (std::int32_t step = 0; step < steps; ++step) {
    CAPTURE(step);
    kvtest::batch_step<float> st = kvtest::draw_step<float>(rng, dm, 0.25);
    st.q = grid_queries(rng, st.q.size());
    for (std::int32_t b = 0; b < B; ++b)
      for (std::int32_t h = 0; h < H; ++h)
        for (std::int32_t d = 0; d < D; ++d) {
          const std::size_t i = (std::size_t(b) * H + h) * D + std::size_t(d);
          const float k = grid[pick(rng)], v = grid[pick(rng)];
          k_codes[i] = from_float<Code>(k), v_codes[i] = from_float<Code>(v);
          k_new[i] = k * scales.k_of(h), v_new[i] = v * scales.v_of(h);
        }
    std::vector<std::int32_t> victims_float(std::size_t(B) * H, -2), victims_code(victims_float.size(), -2);
    t.as_float.append(t.floats.view(), batch_rows<float>{make_tensor_view<const float>(k_new.data(), B, H, D)},
                      batch_rows<float>{make_tensor_view<const float>(v_new.data(), B, H, D)}, st.active_set());
    t.as_code.append(t.codes.view(), batch_rows<Code>{make_tensor_view<const Code>(k_codes.data(), B, H, D)},
                     batch_rows<Code>{make_tensor_view<const Code>(v_codes.data(), B, H, D)}, st.active_set());
    const decode_input observed = std::is_same_v<Policy, exact_greedy_policy> ? decode_input::queries : in;
    kvtest::observe_step(t.as_float, st, dm, observed, t.floats.view(), 0, victims_float.data());
    kvtest::observe_step(t.as_code, st, dm, observed, t.codes.view(), 0, victims_code.data());
    REQUIRE(t.as_float.status_word() == batch_status_clear);
    REQUIRE(t.as_code.status_word() == batch_status_clear);
    REQUIRE(victims_code == victims_float);
    t.require_same();
  }
  t.require_same_rows(capacity);
}

template <class Policy>
void run_all(const std::vector<decode_input>& inputs) {
  std::uint32_t seed = 1;
  for (decode_input in : inputs)
    for (int round = 0; round < 6; ++round, ++seed) {
      CAPTURE(int(in));
      CAPTURE(seed);
      const auto run = [&](auto make) {
        if (seed % 2) run_stream<Policy, fp8_e4m3>(seed, in, make);
        else run_stream<Policy, fp8_e5m2>(seed, in, make);
      };
      run([](auto tag, std::int32_t cap, std::int32_t D) { return make_bhsd_cache<decltype(tag)>(B, H, cap, D); });
      run([](auto tag, std::int32_t cap, std::int32_t D) { return make_bshd_cache<decltype(tag)>(B, H, cap, D); });
      run([](auto tag, std::int32_t cap, std::int32_t D) {
        return make_paged_cache<decltype(tag)>(B, H, cap, D, 3, page_order::nhd);
      });
      run([](auto tag, std::int32_t cap, std::int32_t D) {
        return make_paged_cache<decltype(tag)>(B, H, cap, D, 4, page_order::hnd);
      });
    }
}

}  // namespace

TEST_CASE("fp8 keys: h2o by queries, key norms and KeyDiff decide as on a float cache of code x scale") {
  run_all<h2o_policy>({decode_input::queries, decode_input::key_norms, decode_input::key_diff});
}

TEST_CASE("fp8 keys and values: exact greedy decides as on a float cache of code x scale") {
  run_all<exact_greedy_policy>({decode_input::queries});
}

// ---- refusals ----

namespace {

constexpr std::int32_t kDim = 8;
constexpr float bad_scales[] = {0.0f, -1.0f, std::numeric_limits<float>::quiet_NaN(),
                                std::numeric_limits<float>::infinity()};

/// An fp8 cache of grid rows and its view with scale arrays of our own
/// (kv_cache::set_scales refuses bad ones).
struct raw_scaled {
  kv_cache<fp8_e4m3, strided_layout> cache = make_bhsd_cache<fp8_e4m3>(B, H, 16, kDim);
  std::vector<float> k{0.75f, 1.5f, 2.25f}, v{1.25f, 2.5f, 0.75f};
  explicit raw_scaled(std::mt19937& rng) {
    std::uniform_int_distribution<int> pick(0, int(std::size(grid)) - 1);
    for (auto& x : cache.k_storage()) x = from_float<fp8_e4m3>(grid[pick(rng)]);
    for (auto& x : cache.v_storage()) x = from_float<fp8_e4m3>(grid[pick(rng)]);
  }
  kv_view<fp8_e4m3, strided_layout> view() {
    auto out = cache.view();
    out.scales = kv_scales{k.data(), v.data(), 1};
    return out;
  }
};

/// Head h of every sequence, as the next call must leave it.
std::vector<unsigned char> head_bytes(const batch_state_view& st, std::int32_t h) {
  std::vector<unsigned char> out;
  const auto add = [&](const void* p, std::size_t n) {
    const auto* c = static_cast<const unsigned char*>(p);
    out.insert(out.end(), c, c + n);
  };
  for (std::int32_t b = 0; b < B; ++b) {
    const std::int64_t x = st.head_index(b, h);
    add(st.slots.positions_of(b, h), sizeof(std::int32_t) * std::size_t(st.capacity()));
    add(st.scores_of(b, h), sizeof(float) * std::size_t(st.capacity()));
    add(&st.slots.counts[x], sizeof(std::int32_t));
    if (st.anchors.sums)
      add(st.anchors.sums + x * st.anchors.head_dim, sizeof(std::int64_t) * std::size_t(st.anchors.head_dim));
    if (st.history.keys) add(&st.history.rows[x], sizeof(std::int32_t));
  }
  return out;
}

/// Decode: a bad scale of head 1 (K: index 0, V: 1) refuses that head of
/// every sequence, as bad_kv_scale, and leaves it as it was.
template <class Policy>
void decode_refusal(decode_input in, std::int32_t which, float bad) {
  std::mt19937 rng(7);
  const auto config = kvtest::draw_config<Policy>(rng, in);
  const std::int32_t budget = policy_traits<Policy>::rule(config).budget;
  raw_scaled c(rng);
  batched_policy<Policy> p(policy_shape{B, H, Hq, 16}, config, kvtest::history_of<Policy>(in, 32, kDim));
  kvtest::batch_dims dm;
  dm.seqs = B, dm.heads = H, dm.group = group, dm.head_dim = kDim, dm.capacity = 16;
  std::vector<fp8_e4m3> rows(std::size_t(B) * H * kDim, from_float<fp8_e4m3>(0.5f));
  const batch_rows<fp8_e4m3> new_rows{make_tensor_view<const fp8_e4m3>(rows.data(), B, H, kDim)};
  std::vector<std::int32_t> victims(std::size_t(B) * H);
  for (std::int32_t step = 0; step <= budget + 2; ++step) {
    kvtest::batch_step<float> st = kvtest::draw_step<float>(rng, dm, 0.0);
    p.append(c.view(), new_rows, new_rows, active_set::all());
    const bool last = step == budget + 2;
    const std::vector<unsigned char> before = head_bytes(p.state(), 1);
    if (last) (which == 0 ? c.k : c.v)[1] = bad;
    kvtest::observe_step(p, st, dm, in, c.view(), 0, victims.data());
    if (!last) {
      REQUIRE(p.status_word() == batch_status_clear);
      continue;
    }
    CHECK(p.status_word() == pack_status(0, 1, which, batch_code::bad_kv_scale));
    CHECK(head_bytes(p.state(), 1) == before);
    CHECK_THROWS_WITH_AS(throw_if_error(p.status_word(), "observe_evict"), doctest::Contains("V scale"),
                         invalid_argument);
  }
}

/// Prefill: a bad scale of head 1 refuses every sequence whole.
template <class Policy>
void prefill_refusal(decode_input in, bool window, std::int32_t which, float bad) {
  std::mt19937 rng(11);
  auto config = kvtest::draw_config<Policy>(rng, in);
  while (policy_traits<Policy>::rule(config).budget < 2 + policy_traits<Policy>::rule(config).protect.sinks)
    config = kvtest::draw_config<Policy>(rng, in);  // SnapKV keeps its window of 2
  raw_scaled c(rng);
  batched_policy<Policy> p(policy_shape{B, H, Hq, 16}, config, kvtest::history_of<Policy>(in, 32, kDim));
  (which == 0 ? c.k : c.v)[1] = bad;
  std::int32_t prompts[B] = {12, 9};
  const std::vector<float> q = grid_queries(rng, std::size_t(B) * Hq * 12 * kDim);
  const std::vector<float> lse(std::size_t(B) * Hq * 12, 1.5f);
  const std::uint64_t status = prefill(p, in, c.view(), prompt_lengths{prompts, 12}, q, lse, window, kDim);
  CHECK(status == pack_status(0, 1, which, batch_code::bad_kv_scale));
  for (std::int32_t b = 0; b < B; ++b) CHECK(p.state().slots.lengths[b] == 0);
}

}  // namespace

TEST_CASE("fp8 keys: a scale that is zero, negative, NaN or infinite refuses the head that reads it, unchanged") {
  for (float bad : bad_scales)
    for (std::int32_t which : {0, 1}) {
      CAPTURE(bad);
      CAPTURE(which);
      for (decode_input in : {decode_input::queries, decode_input::key_norms, decode_input::key_diff}) {
        CAPTURE(int(in));
        decode_refusal<h2o_policy>(in, which, bad);
        prefill_refusal<h2o_policy>(in, false, which, bad);
      }
      prefill_refusal<h2o_policy>(decode_input::queries, true, which, bad);  // SnapKV's window
      decode_refusal<exact_greedy_policy>(decode_input::queries, which, bad);
      prefill_refusal<exact_greedy_policy>(decode_input::queries, false, which, bad);
    }
}

TEST_CASE("fp8 views: scale arrays are required, well formed, and only on fp8 caches") {
  std::mt19937 rng(3);
  raw_scaled c(rng);
  batched_policy<h2o_policy> p(policy_shape{B, H, Hq, 16}, key_norm_config(4, 1, 1));
  const auto observe = [&](const auto& view) {
    using V = std::decay_t<decltype(view)>;
    p.observe_evict(key_norms<typename V::element_type, strided_layout>{view});
  };
  auto missing = c.view();
  missing.scales.k = nullptr;
  CHECK_THROWS_WITH_AS(observe(missing), doctest::Contains("view.scales.k"), invalid_argument);
  missing = c.view();
  missing.scales.v = nullptr;
  std::vector<fp8_e4m3> rows(std::size_t(B) * H * kDim);
  const batch_rows<fp8_e4m3> new_rows{make_tensor_view<const fp8_e4m3>(rows.data(), B, H, kDim)};
  CHECK_THROWS_WITH_AS(p.append(missing, new_rows, new_rows), doctest::Contains("view.scales.v"), invalid_argument);
  auto odd = c.view();
  odd.scales.per_head = 2;
  CHECK_THROWS_WITH_AS(observe(odd), doctest::Contains("view.scales.per_head"), invalid_argument);
  auto floats = make_bhsd_cache<float>(B, H, 16, kDim);
  auto scaled_floats = floats.view();
  scaled_floats.scales = c.view().scales;
  CHECK_THROWS_WITH_AS(observe(scaled_floats), doctest::Contains("view.scales"), invalid_argument);
  CHECK(p.state().slots.lengths[0] == 0);  // nothing ran

  // kv_cache keeps its own: counted per layer or per head, positive and finite.
  CHECK_THROWS_WITH_AS(c.cache.set_scales({1.0f, 2.0f}, {1.0f, 2.0f}), doctest::Contains("num_heads = 3"),
                       invalid_argument);
  CHECK_THROWS_WITH_AS(c.cache.set_scales({1.0f, 0.0f, 1.0f}, {1.0f, 1.0f, 1.0f}), doctest::Contains("k[1]"),
                       invalid_argument);
  CHECK_THROWS_WITH_AS(c.cache.set_scales({2.0f}, {-1.0f}), doctest::Contains("v[0]"), invalid_argument);
  CHECK_THROWS_WITH_AS(floats.set_scales({1.0f}, {1.0f}), doctest::Contains("fp8"), invalid_argument);
  c.cache.set_scales({0.5f}, {4.0f});
  CHECK(c.cache.view().k_scale(2) == 0.5f);
  CHECK(c.cache.view().v_scale(0) == 4.0f);
  CHECK(c.cache.view().scales.per_head == 0);
}
