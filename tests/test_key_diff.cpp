// KeyDiff prefill (key_diff.hpp): keep the prompt keys least similar, by
// cosine, to the sum of the unit keys of their head. Checked against a
// reference written here from the definition in double precision: the
// library's keep set must be the reference's wherever the reference's
// scores are apart by more than a float rounding margin (near-ties may go
// either way, and are counted), its scores within that margin of the
// reference's; per sequence and batched give the same bits; over every
// dtype, layout and group; then the exact pieces and the refusals.
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

/// The reference scores of (b, h): -cos(k_p, sum of unit keys), in double.
template <class View>
std::vector<double> reference_scores(const View& view, std::int32_t b, std::int32_t h, std::int32_t length) {
  std::vector<double> anchor(kDim, 0.0), norms(static_cast<std::size_t>(length));
  for (std::int32_t p = 0; p < length; ++p) {
    double sq = 0;
    for (std::int32_t e = 0; e < kDim; ++e) sq += std::pow(double(kv::to_float(view.k_row(b, h, p)[e])), 2);
    norms[std::size_t(p)] = std::sqrt(sq);
    if (sq > 0)
      for (std::int32_t e = 0; e < kDim; ++e) anchor[std::size_t(e)] += kv::to_float(view.k_row(b, h, p)[e]) / norms[std::size_t(p)];
  }
  double alen = 0;
  for (double x : anchor) alen += x * x;
  alen = std::sqrt(alen);
  std::vector<double> score(std::size_t(length), 0.0);
  for (std::int32_t p = 0; p < length; ++p) {
    if (norms[std::size_t(p)] == 0 || alen == 0) continue;
    double dot = 0;
    for (std::int32_t e = 0; e < kDim; ++e) dot += kv::to_float(view.k_row(b, h, p)[e]) * anchor[std::size_t(e)];
    score[std::size_t(p)] = -dot / (norms[std::size_t(p)] * alen);
  }
  return score;
}

template <class T>
void run_prefill(layout_kind layout, std::int32_t group, std::uint32_t seed, std::int64_t& near_ties) {
  std::mt19937 rng(seed);
  const std::int32_t heavy = 1 + std::int32_t(rng() % 6), recent = std::int32_t(rng() % 3),
                     sinks = std::int32_t(rng() % 3);
  const std::int32_t budget = sinks + heavy + recent, cap = budget + 1 + std::int32_t(rng() % 20);
  CAPTURE(heavy);
  CAPTURE(recent);
  CAPTURE(sinks);
  kv::h2o_config config;
  config.heavy = heavy;
  config.recent = recent;
  config.sinks = sinks;
  const kv::policy_shape shape{kSeqs, kHeads, kHeads * group, cap};
  kv::h2o_policy single(shape, config);
  std::vector<unsigned char> memory(kv::batch_state_bytes<kv::h2o_policy>(shape, config));
  const auto st = kv::make_batch_state<kv::h2o_policy>(memory.data(), memory.size(), shape, config);
  kv::init_batch_state(st);
  std::vector<std::int32_t> lengths(kSeqs);
  for (auto& l : lengths) l = rng() % 4 ? budget + 1 + std::int32_t(rng() % std::uint32_t(cap - budget)) : 1 + std::int32_t(rng() % std::uint32_t(cap));
  kvtest::with_cache<T>(layout, kSeqs, kHeads, cap, kDim, 2, [&](auto view_a) {
    kvtest::with_cache<T>(layout, kSeqs, kHeads, cap, kDim, 2, [&](auto view_b) {
      // Keys around a common direction (what makes KeyDiff matter), some zero.
      std::vector<float> bias(kDim);
      for (float& x : bias) x = kv::to_float(kvtest::random_value<T>(rng));
      for (std::int32_t b = 0; b < kSeqs; ++b)
        for (std::int32_t h = 0; h < kHeads; ++h)
          for (std::int32_t p = 0; p < lengths[std::size_t(b)]; ++p) {
            const bool zero = rng() % 16 == 0;
            for (std::int32_t d = 0; d < kDim; ++d) {
              const T k = zero ? kv::from_float<T>(0.0f)
                               : kv::from_float<T>(bias[std::size_t(d)] + kv::to_float(kvtest::random_value<T>(rng)) / 2);
              view_a.k_row(b, h, p)[d] = view_b.k_row(b, h, p)[d] = k;
              view_a.v_row(b, h, p)[d] = view_b.v_row(b, h, p)[d] = kvtest::random_value<T>(rng);
            }
          }
      std::vector<std::vector<double>> want(std::size_t(kSeqs) * kHeads);
      for (std::int32_t b = 0; b < kSeqs; ++b)
        for (std::int32_t h = 0; h < kHeads; ++h)
          want[std::size_t(b) * kHeads + h] = reference_scores(view_a, b, h, lengths[std::size_t(b)]);
      std::vector<float> original_k;  // by (b, h, p): to check the moved rows
      for (std::int32_t b = 0; b < kSeqs; ++b)
        for (std::int32_t h = 0; h < kHeads; ++h)
          for (std::int32_t p = 0; p < cap; ++p)
            for (std::int32_t d = 0; d < kDim; ++d) original_k.push_back(kv::to_float(view_a.k_row(b, h, p)[d]));
      std::vector<std::int32_t> reclaim(kSeqs, -1);
      std::uint64_t status = kv::batch_status_clear;
      kv::batched_prefill(st, kv::active_set::all(), kv::prompt_lengths{lengths.data(), cap},
                          kv::key_diff<T, std::decay_t<decltype(view_b.layout)>>{view_b}, reclaim.data(), &status);
      REQUIRE(status == kv::batch_status_clear);
      for (std::int32_t b = 0; b < kSeqs; ++b) {
        const std::int32_t L = lengths[std::size_t(b)];
        CAPTURE(L);
        const kv::prefill_result r =
            single.prefill(b, L, kv::key_diff<T, std::decay_t<decltype(view_a.layout)>>{view_a});
        CHECK(reclaim[std::size_t(b)] == r.reclaimable_pages);
        REQUIRE(r.kept == std::min(L, budget));
        for (std::int32_t h = 0; h < kHeads; ++h) {
          CAPTURE(h);
          const auto& ref = want[std::size_t(b) * kHeads + h];
          std::vector<char> kept(std::size_t(L), 0);
          for (std::int32_t s = 0; s < cap; ++s) {
            const std::int32_t p = single.slots().position(b, h, s);
            CHECK(st.slots.positions_of(b, h)[s] == p);
            const float a = single.score(b, h, s), c = st.scores_of(b, h)[s];
            CHECK(std::memcmp(&a, &c, sizeof a) == 0);
            CHECK((s < r.kept) == (p >= 0));
            if (p < 0) continue;
            if (s > 0) CHECK(p > single.slots().position(b, h, s - 1));  // ascending
            kept[std::size_t(p)] = 1;
            CHECK(std::abs(double(a) - ref[std::size_t(p)]) < kMargin);
            for (std::int32_t d = 0; d < kDim; ++d)
              CHECK(kv::to_float(view_a.k_row(b, h, s)[d]) == original_k[((std::size_t(b) * kHeads + h) * cap + p) * kDim + d]);
            CHECK(kvtest::same_bits(view_a.k_row(b, h, s), view_b.k_row(b, h, s), kDim));
            CHECK(kvtest::same_bits(view_a.v_row(b, h, s), view_b.v_row(b, h, s), kDim));
          }
          if (L <= budget) continue;
          // The protected ends are kept; between them the kept ones score at
          // least as high as the dropped ones, up to the margin.
          double lowest_kept = 1e9, highest_dropped = -1e9;
          for (std::int32_t p = 0; p < L; ++p) {
            const bool protect = p < sinks || p >= L - recent;
            if (protect) {
              CHECK(kept[std::size_t(p)] == 1);
              continue;
            }
            if (kept[std::size_t(p)]) lowest_kept = std::min(lowest_kept, ref[std::size_t(p)]);
            else highest_dropped = std::max(highest_dropped, ref[std::size_t(p)]);
          }
          CHECK(lowest_kept >= highest_dropped - kMargin);
          if (std::abs(lowest_kept - highest_dropped) <= kMargin) ++near_ties;
        }
      }
    });
  });
}

}  // namespace

TEST_CASE("KeyDiff prefill keeps the keys least similar to their head's mean direction: per sequence and batched") {
  std::int64_t near_ties = 0;
  for (const layout_kind layout : kvtest::all_layouts)
    for (const std::int32_t group : {1, 4})
      for (std::uint32_t seed = 1; seed <= 8; ++seed) {
        CAPTURE(kvtest::name(layout));
        CAPTURE(group);
        CAPTURE(seed);
        run_prefill<float>(layout, group, seed, near_ties);
        run_prefill<kv::half>(layout, group, seed + 100, near_ties);
        run_prefill<kv::bfloat16>(layout, group, seed + 200, near_ties);
      }
  CHECK(near_ties > 0);  // equal keys (zero keys, repeated rows) tie: the (score, position) order decides
  MESSAGE("near-ties decided by position: ", near_ties);
}

TEST_CASE("KeyDiff's exact pieces: the anchor is an integer sum (any order), scores of known vectors") {
  // Unit components rounded to 2^-32: the sum is exact, so adding in any
  // order gives the same anchor.
  const float keys[3][4] = {{3, 4, 0, 0}, {0, 0, 1, 0}, {-3, -4, 0, 0}};
  std::int64_t forward[4] = {}, backward[4] = {};
  for (int p = 0; p < 3; ++p)
    for (int e = 0; e < 4; ++e) {
      forward[e] += kv::key_diff_unit(keys[p], e, 1.0f, kv::key_length(keys[p], 4, 1.0f));
      backward[e] += kv::key_diff_unit(keys[2 - p], e, 1.0f, kv::key_length(keys[2 - p], 4, 1.0f));
    }
  for (int e = 0; e < 4; ++e) CHECK(forward[e] == backward[e]);
  CHECK(forward[0] == 0);  // (0.6, 0.8) and (-0.6, -0.8) cancel exactly
  CHECK(forward[2] == std::int64_t{1} << 32);
  float unit[4];
  for (int e = 0; e < 4; ++e) unit[e] = kv::key_diff_anchor_value(forward[e]);
  const float length = kv::key_diff_anchor_length(unit, 4);
  CHECK(length == 1.0f);
  for (int e = 0; e < 4; ++e) unit[e] = kv::key_diff_unit_anchor(unit[e], length);
  CHECK(kv::key_diff_score(keys[1], unit, 4, 1.0f) == -1.0f);  // along the anchor: the most similar
  CHECK(kv::key_diff_score(keys[0], unit, 4, 1.0f) == 0.0f);   // orthogonal
  const float zero[4] = {0, 0, 0, 0};
  CHECK(kv::key_diff_score(zero, unit, 4, 1.0f) == 0.0f);
  const float opposite[4] = {0, 0, -2, 0};
  CHECK(kv::key_diff_score(opposite, unit, 4, 1.0f) == 1.0f);  // the least similar scores highest
  const float none[4] = {0, 0, 0, 0};
  CHECK(kv::key_diff_unit_anchor(0.0f, kv::key_diff_anchor_length(none, 4)) == 0.0f);
}

TEST_CASE("KeyDiff prefill refuses a key that is not finite and changes nothing") {
  const std::int32_t cap = 10;
  const kv::policy_shape shape{kSeqs, kHeads, kHeads, cap};
  const kv::h2o_config config{3, 1};
  auto cache = kv::make_bhsd_cache<float>(kSeqs, kHeads, cap, kDim);
  std::mt19937 rng(3);
  for (float& x : cache.k_storage()) x = kvtest::random_value<float>(rng);
  cache.view().k_row(1, 1, 6)[2] = std::numeric_limits<float>::infinity();
  const std::vector<float> before = cache.k_storage();
  const kv::key_diff<float, kv::strided_layout> keys{cache.view()};
  kv::h2o_policy policy(shape, config);
  CHECK_THROWS_WITH_AS(policy.prefill(1, 8, keys), doctest::Contains("||cache.k||[1][6]"), kv::non_finite_error);
  CHECK(policy.length(1) == 0);
  CHECK(cache.k_storage() == before);
  CHECK(policy.prefill(1, 6, keys).kept == 4);  // the bad key is past this prompt

  std::vector<unsigned char> memory(kv::batch_state_bytes<kv::h2o_policy>(shape, config));
  const auto st = kv::make_batch_state<kv::h2o_policy>(memory.data(), memory.size(), shape, config);
  kv::init_batch_state(st);
  std::vector<std::int32_t> lengths{9, 9};
  std::uint64_t status = kv::batch_status_clear;
  auto fresh = kv::make_bhsd_cache<float>(kSeqs, kHeads, cap, kDim);
  fresh.k_storage() = before;
  kv::batched_prefill(st, kv::active_set::all(), kv::prompt_lengths{lengths.data(), cap},
                      kv::key_diff<float, kv::strided_layout>{fresh.view()}, nullptr, &status);
  const kv::batch_status got = kv::batch_status::unpack(status);
  CHECK(got.code == kv::batch_code::non_finite_kv);
  CHECK(got.sequence == 1);
  CHECK(got.head == 1);
  CHECK(got.index == 6);
  CHECK(st.slots.lengths[1] == 0);
  CHECK(st.slots.lengths[0] == 9);  // sequence 0 was compressed
  for (std::int32_t p = 0; p < cap; ++p)
    for (std::int32_t d = 0; d < kDim; ++d) CHECK(fresh.view().k_row(1, 0, p)[d] == before[(std::size_t(1) * kHeads * cap + p) * kDim + d]);
}
