// SnapKV prefill (policy/snapkv.hpp): the prompt scored by its last `window`
// rows' attention, pooled along positions, folded over the group; the
// window, the sinks and the recent tokens kept, the rest of the budget by
// score. Checked against a reference written here from the definition
// (probabilities on a grid of 1/64, decays that are powers of two: every
// window sum is exact, so the reference may sum in any order), per sequence
// and batched, over every dtype, layout, group, pooling and width; then the
// logits and queries inputs against the probabilities they stand for, and
// the refusals.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kvevict/kvevict.hpp"
#include "support/caches.hpp"

namespace kv = kvevict;
using kvtest::layout_kind;

namespace {

constexpr std::int32_t kSeqs = 2, kHeads = 2, kDim = 8;

/// One drawn configuration: an h2o policy (decay 1, 1/2 or 0) whose budget
/// holds the window beside the sinks, its batched twin, the snap
/// parameters and the prompt lengths (at least the window, mostly above
/// the budget).
struct snap_setup {
  kv::snap_window snap;
  std::int32_t group, heavy, recent, sinks, budget, cap;
  kv::h2o_config config;
  kv::policy_shape shape;
  kv::h2o_policy single;
  std::vector<unsigned char> memory;
  kv::batch_state_view st;
  std::vector<std::int32_t> lengths;

  static kv::snap_window draw_snap(std::mt19937& rng) {
    kv::snap_window s;
    s.window = 1 + std::int32_t(rng() % 6);
    s.pool_width = 1 + 2 * std::int32_t(rng() % 4);
    s.pooling = rng() % 2 ? kv::snap_pooling::max : kv::snap_pooling::mean;
    return s;
  }
  static kv::h2o_config make_config(std::mt19937& rng, std::int32_t heavy, std::int32_t recent, std::int32_t sinks) {
    kv::h2o_config c;
    c.heavy = heavy;
    c.recent = recent;
    c.sinks = sinks;
    const kv::group_reduce reduces[] = {kv::group_reduce::sum, kv::group_reduce::mean, kv::group_reduce::max};
    c.reduce = reduces[rng() % 3];
    const float decays[] = {1.0f, 0.5f, 0.0f};
    c.decay = decays[rng() % 3];
    return c;
  }

  snap_setup(std::mt19937& rng, std::int32_t group_size)
      : snap(draw_snap(rng)),
        group(group_size),
        heavy(snap.window + std::int32_t(rng() % 5)),
        recent(std::int32_t(rng() % 4)),
        sinks(std::int32_t(rng() % 3)),
        budget(sinks + heavy + recent),
        cap(budget + 1 + std::int32_t(rng() % 14)),
        config(make_config(rng, heavy, recent, sinks)),
        shape{kSeqs, kHeads, kHeads * group_size, cap},
        single(shape, config),
        memory(kv::batch_state_bytes<kv::h2o_policy>(shape, config)),
        st(kv::make_batch_state<kv::h2o_policy>(memory.data(), memory.size(), shape, config)) {
    kv::init_batch_state(st);
    for (std::int32_t b = 0; b < kSeqs; ++b)
      lengths.push_back(rng() % 4 ? std::min(cap, budget + 1 + std::int32_t(rng() % std::uint32_t(cap - budget)))
                                  : snap.window + std::int32_t(rng() % std::uint32_t(cap - snap.window + 1)));
  }
  std::int32_t q_heads() const { return kHeads * group; }
};

/// Window probabilities [B][Hq][w][cap] on the 1/64 grid (zeros above each
/// row's diagonal, which the library ignores anyway).
std::vector<float> draw_window_probs(std::mt19937& rng, const snap_setup& s) {
  const std::int32_t w = s.snap.window;
  std::vector<float> probs(std::size_t(kSeqs) * s.q_heads() * w * s.cap, 0.0f);
  for (std::int32_t b = 0; b < kSeqs; ++b)
    for (std::int32_t q = 0; q < s.q_heads(); ++q)
      for (std::int32_t r = 0; r < w; ++r)
        for (std::int32_t p = 0; p <= s.lengths[std::size_t(b)] - w + r; ++p)
          probs[((std::size_t(b) * s.q_heads() + q) * w + r) * s.cap + p] = float(rng() % 17) / 64.0f;
  return probs;
}

/// The reference keep set and scores of (b, h), from the definition.
struct reference_head {
  std::vector<std::int32_t> keep;  // ascending
  std::vector<float> score;        // [L]
};

reference_head reference(const snap_setup& s, const std::vector<float>& probs, std::int32_t b, std::int32_t h,
                         std::int64_t& cut_ties) {
  const std::int32_t L = s.lengths[std::size_t(b)], w = s.snap.window, first = L - w, g = s.group;
  const std::int32_t radius = s.snap.pool_width / 2;
  const auto prob = [&](std::int32_t q, std::int32_t r, std::int32_t p) {
    return probs[((std::size_t(b) * s.q_heads() + q) * w + r) * s.cap + p];
  };
  reference_head out;
  out.score.assign(std::size_t(L), 0.0f);
  std::vector<std::vector<float>> pooled(std::size_t(g), std::vector<float>(std::size_t(L), 0.0f));
  for (std::int32_t j = 0; j < g; ++j) {
    const std::int32_t q = h * g + j;
    std::vector<float> sum(std::size_t(L), 0.0f);
    for (std::int32_t p = 0; p < L; ++p)
      for (std::int32_t i = std::max(p, first); i < L; ++i)  // exact on the grid: any order
        sum[std::size_t(p)] += prob(q, i - first, p) * std::pow(s.config.decay, float(L - 1 - i));
    for (std::int32_t p = 0; p < L; ++p) {
      if (p >= first) {
        pooled[std::size_t(j)][std::size_t(p)] = sum[std::size_t(p)];
        continue;
      }
      float best = 0.0f, total = 0.0f;  // positions outside [0, first) pad with zeros
      for (std::int32_t c = p - radius; c <= p + radius; ++c) {
        const float x = c >= 0 && c < first ? sum[std::size_t(c)] : 0.0f;
        best = std::max(best, x);
        total += x;
      }
      pooled[std::size_t(j)][std::size_t(p)] =
          s.snap.pooling == kv::snap_pooling::max ? best : total / float(s.snap.pool_width);
    }
  }
  for (std::int32_t p = 0; p < L; ++p) {
    float acc = 0.0f;  // the group fold: ascending query heads from +0
    for (std::int32_t j = 0; j < g; ++j) {
      const float x = pooled[std::size_t(j)][std::size_t(p)];
      acc = s.config.reduce == kv::group_reduce::max ? std::max(acc, x) : acc + x;
    }
    out.score[std::size_t(p)] = s.config.reduce == kv::group_reduce::mean ? acc / float(g) : acc;
  }
  if (L <= s.budget) {
    for (std::int32_t p = 0; p < L; ++p) out.keep.push_back(p);
    return out;
  }
  const std::int32_t protect = std::max(s.recent, w), lo = std::min(s.sinks, L), hi = std::max(lo, L - protect);
  std::vector<std::int32_t> between;
  for (std::int32_t p = 0; p < L; ++p) (p < lo || p >= hi ? out.keep : between).push_back(p);
  const std::size_t take = std::size_t(s.budget - lo - (L - hi));
  std::sort(between.begin(), between.end(), [&](std::int32_t x, std::int32_t y) {  // higher (score, position) first
    const float a = out.score[std::size_t(x)], c = out.score[std::size_t(y)];
    return a != c ? a > c : x > y;
  });
  if (between.size() > take && take > 0 &&
      out.score[std::size_t(between[take - 1])] == out.score[std::size_t(between[take])])
    ++cut_ties;
  out.keep.insert(out.keep.end(), between.begin(), between.begin() + std::ptrdiff_t(take));
  std::sort(out.keep.begin(), out.keep.end());
  return out;
}

/// Fills both caches with the same drawn rows and returns a copy of the
/// keys by (b, h, position), for checking the moved rows.
template <class ViewA, class ViewB>
std::vector<float> fill_caches(std::mt19937& rng, const snap_setup& s, ViewA& a, ViewB& c) {
  using T = std::remove_cv_t<std::remove_reference_t<decltype(*a.k_row(0, 0, 0))>>;
  std::vector<float> keys(std::size_t(kSeqs) * kHeads * s.cap * kDim);
  for (std::int32_t b = 0; b < kSeqs; ++b)
    for (std::int32_t h = 0; h < kHeads; ++h)
      for (std::int32_t p = 0; p < s.lengths[std::size_t(b)]; ++p)
        for (std::int32_t d = 0; d < kDim; ++d) {
          const T k = kvtest::random_value<T>(rng), v = kvtest::random_value<T>(rng);
          a.k_row(b, h, p)[d] = c.k_row(b, h, p)[d] = k;
          a.v_row(b, h, p)[d] = c.v_row(b, h, p)[d] = v;
          keys[((std::size_t(b) * kHeads + h) * s.cap + p) * kDim + d] = kv::to_float(k);
        }
  return keys;
}

template <class T>
void run_probs(layout_kind layout, std::int32_t group, std::uint32_t seed, std::int64_t& cut_ties) {
  std::mt19937 rng(seed);
  snap_setup s(rng, group);
  CAPTURE(s.snap.window);
  CAPTURE(s.snap.pool_width);
  CAPTURE(int(s.snap.pooling));
  CAPTURE(s.budget);
  CAPTURE(s.recent);
  CAPTURE(s.sinks);
  CAPTURE(s.config.decay);
  CAPTURE(int(s.config.reduce));
  const std::vector<float> probs = draw_window_probs(rng, s);
  const std::int32_t w = s.snap.window, Hq = s.q_heads();
  kvtest::with_cache<T>(layout, kSeqs, kHeads, s.cap, kDim, 2, [&](auto view_a) {
    kvtest::with_cache<T>(layout, kSeqs, kHeads, s.cap, kDim, 2, [&](auto view_b) {
      const std::vector<float> keys = fill_caches(rng, s, view_a, view_b);
      std::vector<std::int32_t> reclaim(kSeqs, -1);
      std::uint64_t status = kv::batch_status_clear;
      kv::batched_prefill(s.st, kv::active_set::all(), kv::prompt_lengths{s.lengths.data(), s.cap},
                          kv::batch_window_probs{kv::make_tensor_view<const float>(probs.data(), kSeqs, Hq, w, s.cap),
                                                 s.snap},
                          view_b, reclaim.data(), &status);
      REQUIRE(status == kv::batch_status_clear);
      for (std::int32_t b = 0; b < kSeqs; ++b) {
        const std::int32_t L = s.lengths[std::size_t(b)];
        CAPTURE(L);
        const float* mine = probs.data() + std::size_t(b) * Hq * w * s.cap;
        const kv::prefill_result r =
            s.single.prefill(b, L, kv::window_probs{kv::make_tensor_view<const float>(mine, Hq, w, s.cap), s.snap},
                             view_a);
        CHECK(reclaim[std::size_t(b)] == r.reclaimable_pages);
        for (std::int32_t h = 0; h < kHeads; ++h) {
          CAPTURE(h);
          const reference_head want = reference(s, probs, b, h, cut_ties);
          REQUIRE(r.kept == std::int32_t(want.keep.size()));
          for (std::int32_t slot = 0; slot < s.cap; ++slot) {
            const std::int32_t p = slot < r.kept ? want.keep[std::size_t(slot)] : -1;
            CHECK(s.single.slots().position(b, h, slot) == p);
            CHECK(s.st.slots.positions_of(b, h)[slot] == p);
            CHECK(s.st.scores_of(b, h)[slot] == s.single.score(b, h, slot));
            if (p < 0) continue;
            CHECK(s.single.score(b, h, slot) == want.score[std::size_t(p)]);
            for (std::int32_t d = 0; d < kDim; ++d)
              CHECK(kv::to_float(view_a.k_row(b, h, slot)[d]) == keys[((std::size_t(b) * kHeads + h) * s.cap + p) * kDim + d]);
            CHECK(kvtest::same_bits(view_a.k_row(b, h, slot), view_b.k_row(b, h, slot), kDim));
            CHECK(kvtest::same_bits(view_a.v_row(b, h, slot), view_b.v_row(b, h, slot), kDim));
          }
        }
      }
    });
  });
}

}  // namespace

TEST_CASE("SnapKV prefill keeps the window, the sinks and the best pooled window scores: per sequence and batched") {
  std::int64_t cut_ties = 0;
  for (const layout_kind layout : kvtest::all_layouts)
    for (const std::int32_t group : {1, 4})
      for (std::uint32_t seed = 1; seed <= 8; ++seed) {
        CAPTURE(kvtest::name(layout));
        CAPTURE(group);
        CAPTURE(seed);
        run_probs<float>(layout, group, seed, cut_ties);
        run_probs<kv::half>(layout, group, seed + 100, cut_ties);
        run_probs<kv::bfloat16>(layout, group, seed + 200, cut_ties);
      }
  CHECK(cut_ties > 10);  // the grid ties often: the (score, position) order is exercised
}

TEST_CASE("snap_pool pads with zeros and divides the mean by the width, as PyTorch's pooling does") {
  const float sums[] = {4.0f, 1.0f, 2.0f, 8.0f, 3.0f, 5.0f};  // L = 6, window 2: positions 0..3 pool, 4..5 do not
  const auto sum = [&](std::int32_t j) { return sums[j]; };
  const kv::snap_window max3{2, 3, kv::snap_pooling::max}, mean3{2, 3, kv::snap_pooling::mean};
  CHECK(kv::snap_pool(max3, 0, 6, sum) == 4.0f);
  CHECK(kv::snap_pool(max3, 2, 6, sum) == 8.0f);
  CHECK(kv::snap_pool(max3, 3, 6, sum) == 8.0f);  // its right neighbour is in the window: padding, not 3
  CHECK(kv::snap_pool(max3, 4, 6, sum) == 3.0f);  // window positions keep their own sum
  CHECK(kv::snap_pool(mean3, 0, 6, sum) == 5.0f / 3.0f);
  CHECK(kv::snap_pool(mean3, 3, 6, sum) == 10.0f / 3.0f);
  CHECK(kv::snap_pool(mean3, 5, 6, sum) == 5.0f);
  const kv::snap_window one{2, 1, kv::snap_pooling::mean};
  CHECK(kv::snap_pool(one, 1, 6, sum) == 1.0f);
  CHECK(kv::snap_window::paper().window == 32);
  CHECK(kv::snap_window::paper().pool_width == 7);
  CHECK(kv::snap_window::paper().pooling == kv::snap_pooling::max);
  CHECK(kv::snap_window::kvpress().window == 64);
  CHECK(kv::snap_window::kvpress().pool_width == 5);
  CHECK(kv::snap_window::kvpress().pooling == kv::snap_pooling::mean);
}

namespace {

/// What one prefill left: every slot's position and score, and the moved keys.
struct prefill_outcome {
  std::vector<std::int32_t> positions;
  std::vector<float> scores;
  std::vector<float> keys;

  bool operator==(const prefill_outcome& o) const {
    return positions == o.positions && keys == o.keys &&
           std::equal(scores.begin(), scores.end(), o.scores.begin(), o.scores.end(),
                      [](float a, float b) { return std::memcmp(&a, &b, sizeof a) == 0; });
  }
};

template <class View>
prefill_outcome outcome_of(const kv::batch_state_view& st, const View& view, std::int32_t cap) {
  prefill_outcome o;
  for (std::int32_t b = 0; b < kSeqs; ++b)
    for (std::int32_t h = 0; h < kHeads; ++h)
      for (std::int32_t s = 0; s < cap; ++s) {
        o.positions.push_back(st.slots.positions_of(b, h)[s]);
        o.scores.push_back(st.scores_of(b, h)[s]);
        for (std::int32_t d = 0; d < kDim; ++d) o.keys.push_back(kv::to_float(view.k_row(b, h, s)[d]));
      }
  return o;
}

template <class View>
prefill_outcome outcome_of(const kv::h2o_policy& p, const View& view, std::int32_t cap) {
  prefill_outcome o;
  for (std::int32_t b = 0; b < kSeqs; ++b)
    for (std::int32_t h = 0; h < kHeads; ++h)
      for (std::int32_t s = 0; s < cap; ++s) {
        o.positions.push_back(p.slots().position(b, h, s));
        o.scores.push_back(p.score(b, h, s));
        for (std::int32_t d = 0; d < kDim; ++d) o.keys.push_back(kv::to_float(view.k_row(b, h, s)[d]));
      }
  return o;
}

/// The three inputs of one drawn prompt: queries on a grid, their logits
/// (attention_logit against the cached keys) and probabilities
/// (probability_from_logit), [B][Hq][w][...]. Each input run per sequence
/// and batched must leave the same bits as the probabilities it stands for.
template <class T>
void run_inputs(layout_kind layout, std::int32_t group, std::uint32_t seed) {
  std::mt19937 draw(seed);
  const snap_setup shape_of(draw, group);  // the draws every run repeats
  const std::int32_t w = shape_of.snap.window, Hq = shape_of.q_heads(), cap = shape_of.cap;
  const float scale = 0.5f;
  const kv::lse_base base = seed % 2 ? kv::lse_base::natural : kv::lse_base::base2;
  std::vector<prefill_outcome> outcomes;
  kvtest::with_cache<T>(layout, kSeqs, kHeads, cap, kDim, 2, [&](auto keys_view) {
    std::mt19937 rng(seed + 7);
    std::vector<float> q(std::size_t(kSeqs) * Hq * w * kDim), lse(std::size_t(kSeqs) * Hq * w);
    std::vector<float> logits(std::size_t(kSeqs) * Hq * w * cap, 0.0f), probs(logits.size(), 0.0f);
    for (float& x : q) x = kvtest::random_value<float>(rng);
    for (float& x : lse) x = float(std::int32_t(rng() % 9)) / 4.0f;
    std::vector<std::vector<float>> rows;  // every cache's rows, drawn once
    for (std::int32_t b = 0; b < kSeqs; ++b)
      for (std::int32_t h = 0; h < kHeads; ++h)
        for (std::int32_t p = 0; p < cap; ++p)
          for (std::int32_t d = 0; d < kDim; ++d) {
            keys_view.k_row(b, h, p)[d] = kvtest::random_value<T>(rng);
            keys_view.v_row(b, h, p)[d] = kvtest::random_value<T>(rng);
          }
    for (std::int32_t b = 0; b < kSeqs; ++b)
      for (std::int32_t qh = 0; qh < Hq; ++qh)
        for (std::int32_t r = 0; r < w; ++r) {
          const std::size_t row = (std::size_t(b) * Hq + qh) * w + r;
          for (std::int32_t p = 0; p <= shape_of.lengths[std::size_t(b)] - w + r; ++p) {
            const float logit = kv::attention_logit(&q[row * kDim], 1, keys_view.k_row(b, qh / group, p), kDim);
            logits[row * cap + p] = logit;
            probs[row * cap + p] = kv::probability_from_logit(logit, scale, lse[row], base);
          }
        }
    for (int input = 0; input < 3; ++input)
      for (int batched = 0; batched < 2; ++batched) {
        CAPTURE(input);
        CAPTURE(batched);
        std::mt19937 again(seed);
        snap_setup s(again, group);
        kvtest::with_cache<T>(layout, kSeqs, kHeads, cap, kDim, 2, [&](auto view) {
          for (std::int32_t b = 0; b < kSeqs; ++b)
            for (std::int32_t h = 0; h < kHeads; ++h)
              for (std::int32_t p = 0; p < cap; ++p)
                for (std::int32_t d = 0; d < kDim; ++d) {
                  view.k_row(b, h, p)[d] = keys_view.k_row(b, h, p)[d];
                  view.v_row(b, h, p)[d] = keys_view.v_row(b, h, p)[d];
                }
          if (batched) {
            std::uint64_t status = kv::batch_status_clear;
            const kv::prompt_lengths prompts{s.lengths.data(), cap};
            const auto all = kv::active_set::all();
            const auto lse4 = kv::make_tensor_view<const float>(lse.data(), kSeqs, Hq, w);
            if (input == 0)
              kv::batched_prefill(s.st, all, prompts,
                                  kv::batch_window_probs{kv::make_tensor_view<const float>(probs.data(), kSeqs, Hq, w, cap), s.snap},
                                  view, nullptr, &status);
            if (input == 1)
              kv::batched_prefill(s.st, all, prompts,
                                  kv::batch_window_logits{kv::make_tensor_view<const float>(logits.data(), kSeqs, Hq, w, cap),
                                                          lse4, scale, base, s.snap},
                                  view, nullptr, &status);
            if (input == 2)
              kv::batched_prefill(s.st, all, prompts,
                                  kv::batch_window_queries<float>{kv::make_tensor_view<const float>(q.data(), kSeqs, Hq, w, kDim),
                                                                  lse4, scale, base, s.snap},
                                  view, nullptr, &status);
            REQUIRE(status == kv::batch_status_clear);
            outcomes.push_back(outcome_of(s.st, view, cap));
            return;
          }
          for (std::int32_t b = 0; b < kSeqs; ++b) {
            const std::int32_t L = s.lengths[std::size_t(b)];
            const std::size_t at = std::size_t(b) * Hq * w;
            const auto lse2 = kv::make_tensor_view<const float>(lse.data() + at, Hq, w);
            if (input == 0)
              s.single.prefill(b, L, kv::window_probs{kv::make_tensor_view<const float>(probs.data() + at * cap, Hq, w, cap), s.snap},
                               view);
            if (input == 1)
              s.single.prefill(b, L,
                               kv::window_logits{kv::make_tensor_view<const float>(logits.data() + at * cap, Hq, w, cap), lse2,
                                                 scale, base, s.snap},
                               view);
            if (input == 2)
              s.single.prefill(b, L,
                               kv::window_queries<float>{kv::make_tensor_view<const float>(q.data() + at * kDim, Hq, w, kDim),
                                                         lse2, scale, base, s.snap},
                               view);
          }
          outcomes.push_back(outcome_of(s.single, view, cap));
        });
      }
  });
  REQUIRE(outcomes.size() == 6);
  for (std::size_t i = 1; i < outcomes.size(); ++i) {
    CAPTURE(i);
    CHECK(outcomes[i] == outcomes[0]);
  }
}

}  // namespace

TEST_CASE("SnapKV from logits + LSE and from queries + LSE: the bits of the probabilities they stand for") {
  for (const layout_kind layout : kvtest::all_layouts)
    for (const std::int32_t group : {1, 4})
      for (std::uint32_t seed = 1; seed <= 4; ++seed) {
        CAPTURE(kvtest::name(layout));
        CAPTURE(group);
        CAPTURE(seed);
        run_inputs<float>(layout, group, seed);
        run_inputs<kv::half>(layout, group, seed + 100);
        run_inputs<kv::bfloat16>(layout, group, seed + 200);
      }
}

TEST_CASE("SnapKV refusals: bad parameters, a prompt shorter than the window, bad elements; nothing changes") {
  const std::int32_t cap = 12, w = 3;
  const kv::policy_shape shape{kSeqs, kHeads, kHeads * 2, cap};
  const kv::h2o_config config{4, 1, kv::group_reduce::sum, 1.0f, 1};  // budget 6
  auto cache = kv::make_bhsd_cache<float>(kSeqs, kHeads, cap, kDim);
  std::mt19937 rng(5);
  for (float& x : cache.k_storage()) x = kvtest::random_value<float>(rng);
  const std::vector<float> k_before = cache.k_storage();
  std::vector<float> probs(std::size_t(kSeqs) * 4 * w * cap, 1.0f / 64.0f);
  const auto per_seq = [&](const kv::snap_window& snap) {
    return kv::window_probs{kv::make_tensor_view<const float>(probs.data(), 4, snap.window, cap), snap};
  };
  kv::h2o_policy policy(shape, config);
  const kv::snap_window good{w, 3, kv::snap_pooling::max};
  CHECK_THROWS_WITH_AS(policy.prefill(0, 10, per_seq({0, 3, kv::snap_pooling::max}), cache.view()),
                       doctest::Contains("in.snap.window"), kv::out_of_range);
  CHECK_THROWS_WITH_AS(policy.prefill(0, 10, per_seq({6, 3, kv::snap_pooling::max}), cache.view()),
                       doctest::Contains("in.snap.window"), kv::budget_error);  // 6 + 1 sink > budget 6
  CHECK_THROWS_WITH_AS(policy.prefill(0, 10, per_seq({w, 4, kv::snap_pooling::max}), cache.view()),
                       doctest::Contains("in.snap.pool_width"), kv::out_of_range);
  CHECK_THROWS_WITH_AS(policy.prefill(0, 10, per_seq({w, 0, kv::snap_pooling::max}), cache.view()),
                       doctest::Contains("in.snap.pool_width"), kv::out_of_range);
  CHECK_THROWS_WITH_AS(policy.prefill(0, 10, per_seq({w, 3, static_cast<kv::snap_pooling>(7)}), cache.view()),
                       doctest::Contains("in.snap.pooling"), kv::invalid_argument);
  CHECK_THROWS_WITH_AS(policy.prefill(0, 2, per_seq(good), cache.view()), doctest::Contains("length"), kv::out_of_range);
  probs[(std::size_t(3) * w + 2) * cap + 5] = std::numeric_limits<float>::quiet_NaN();  // q 3, row 2, column 5
  CHECK_THROWS_WITH_AS(policy.prefill(0, 10, per_seq(good), cache.view()), doctest::Contains("probs[3][2][5]"),
                       kv::non_finite_error);
  CHECK(policy.length(0) == 0);  // nothing changed: a valid prefill still starts the sequence
  CHECK(cache.k_storage() == k_before);
  probs[(std::size_t(3) * w + 2) * cap + 5] = 1.0f / 64.0f;
  CHECK(policy.prefill(0, 10, per_seq(good), cache.view()).kept == 6);
  for (std::int32_t h = 0; h < kHeads; ++h)  // the window (positions 7..9) and the sink are kept
    for (std::int32_t s : {0, 3, 4, 5}) CHECK(policy.slots().position(0, h, s) == (s == 0 ? 0 : s + 4));

  // Batched: the parameters are argument errors; a short prompt and a bad
  // element are status words for their sequence, which is left unchanged.
  std::vector<unsigned char> memory(kv::batch_state_bytes<kv::h2o_policy>(shape, config));
  const auto st = kv::make_batch_state<kv::h2o_policy>(memory.data(), memory.size(), shape, config);
  kv::init_batch_state(st);
  std::vector<std::int32_t> lengths{10, 2};
  const kv::prompt_lengths prompts{lengths.data(), cap};
  std::uint64_t status = kv::batch_status_clear;
  const auto batched = [&](const kv::snap_window& snap) {
    return kv::batch_window_probs{kv::make_tensor_view<const float>(probs.data(), kSeqs, 4, snap.window, cap), snap};
  };
  auto fresh = kv::make_bhsd_cache<float>(kSeqs, kHeads, cap, kDim);
  fresh.k_storage() = k_before;
  CHECK_THROWS_WITH_AS(kv::batched_prefill(st, kv::active_set::all(), prompts, batched({w, 2, kv::snap_pooling::mean}),
                                           fresh.view(), nullptr, &status),
                       doctest::Contains("in.snap.pool_width"), kv::out_of_range);
  CHECK_THROWS_WITH_AS(kv::batched_prefill(st, kv::active_set::all(), kv::prompt_lengths{lengths.data(), 2},
                                           batched(good), fresh.view(), nullptr, &status),
                       doctest::Contains("in.snap.window"), kv::out_of_range);
  const kv::recent_window_config rw{1, 3};
  std::vector<unsigned char> m2(kv::batch_state_bytes<kv::recent_window_policy>(shape, rw));
  const auto st2 = kv::make_batch_state<kv::recent_window_policy>(m2.data(), m2.size(), shape, rw);
  kv::init_batch_state(st2);
  CHECK_THROWS_WITH_AS(kv::batched_prefill(st2, kv::active_set::all(), prompts, batched(good), fresh.view(), nullptr,
                                           &status),
                       doctest::Contains("in.snap"), kv::invalid_argument);
  CHECK(status == kv::batch_status_clear);
  kv::batched_prefill(st, kv::active_set::all(), prompts, batched(good), fresh.view(), nullptr, &status);
  kv::batch_status got = kv::batch_status::unpack(status);
  CHECK(got.code == kv::batch_code::bad_length);
  CHECK(got.sequence == 1);
  CHECK(got.index == 2);
  CHECK(st.slots.lengths[1] == 0);
  CHECK(st.slots.lengths[0] == 10);  // the other sequence was compressed
  CHECK(st.slots.positions_of(0, 1)[5] == 9);
  kv::init_batch_state(st);
  lengths = {10, 10};
  fresh.k_storage() = k_before;
  probs[((std::size_t(1) * 4 + 2) * w + 1) * cap + 4] = -1.0f / 64.0f;  // sequence 1, q 2 (head 1), row 1, column 4
  status = kv::batch_status_clear;
  kv::batched_prefill(st, kv::active_set::all(), prompts, batched(good), fresh.view(), nullptr, &status);
  got = kv::batch_status::unpack(status);
  CHECK(got.code == kv::batch_code::negative_probability);
  CHECK(got.sequence == 1);
  CHECK(got.head == 1);
  CHECK(got.index == 4);
  // A prefill leaves the whole sequence as it was, and says so.
  CHECK_THROWS_WITH_AS(kv::throw_if_error(status, "prefill"), doctest::Contains("(that sequence was left unchanged)"),
                       kv::invalid_argument);
  CHECK_THROWS_WITH_AS(kv::throw_if_error(status, "observe_evict"), doctest::Contains("(that head was left unchanged)"),
                       kv::invalid_argument);
  CHECK(st.slots.lengths[1] == 0);
  for (std::int32_t s = 0; s < cap; ++s) CHECK(st.slots.positions_of(1, 0)[s] == -1);
  for (std::int32_t p = 0; p < cap; ++p)  // sequence 1's rows did not move
    for (std::int32_t d = 0; d < kDim; ++d)
      CHECK(fresh.view().k_row(1, 0, p)[d] == cache.view().k_row(1, 0, p)[d]);
}
