// Key-norm scoring (key_norms, key_norm_config): the policy keeps the keys of
// the smallest L2 norm beside the sinks and the recent window. Checked
// against references written here from the definition (decode: evict the
// unprotected key of the largest norm, the older on a tie; prefill: keep
// the smallest norms, the newer on a tie), per sequence and batched, over
// every dtype and layout; then the refusals.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kvevict/kvevict.hpp"
#include "support/caches.hpp"

namespace kv = kvevict;
using kvtest::layout_kind;

namespace {

constexpr std::int32_t kSeqs = 2, kHeads = 2, kDim = 16;

/// One cached token of the reference: its position and the squared norm of
/// its key (exact: random_value's grid makes every square and sum exact in
/// double and in float, so the summation order cannot matter).
struct ref_token {
  std::int32_t position;
  double squares;
};

/// The reference's step for one (b, h): drop the unprotected token of the
/// largest norm (the lowest position on a tie) while above the budget.
void reference_evict(std::vector<ref_token>& tokens, std::int32_t budget, std::int32_t sinks, std::int32_t recent,
                     std::int32_t length) {
  if (std::int32_t(tokens.size()) <= budget) return;
  auto victim = tokens.end();
  for (auto it = tokens.begin(); it != tokens.end(); ++it) {
    if (it->position < sinks || it->position >= length - recent) continue;
    if (victim == tokens.end() || it->squares > victim->squares ||
        (it->squares == victim->squares && it->position < victim->position))
      victim = it;
  }
  REQUIRE(victim != tokens.end());
  tokens.erase(victim);
}

template <class T, class Layout>
kv::key_norms<T, Layout> norms_of(const kv::kv_view<T, Layout>& view) {
  return kv::key_norms<T, Layout>{view};
}

template <class T>
double squares_of(const T* k) {
  double s = 0;
  for (std::int32_t d = 0; d < kDim; ++d) s += double(kv::to_float(k[d])) * double(kv::to_float(k[d]));
  return s;
}

/// A per-sequence key-norm policy and a batched state of one drawn
/// configuration: kept in [min_kept, min_kept + 4], recent below `recents`,
/// sinks below 3, capacity budget + 1 plus fewer than `spares`.
struct key_norm_pair {
  std::int32_t kept, recent, sinks;
  kv::h2o_config config;
  std::int32_t budget, cap;
  kv::policy_shape shape;
  kv::h2o_policy single;
  std::vector<unsigned char> memory;
  kv::batch_state_view st;

  key_norm_pair(std::mt19937& rng, std::int32_t group, std::int32_t min_kept, std::uint32_t recents,
                std::uint32_t spares)
      : kept(min_kept + std::int32_t(rng() % 5)),
        recent(std::int32_t(rng() % recents)),
        sinks(std::int32_t(rng() % 3)),
        config(kv::key_norm_config(kept, recent, sinks)),
        budget(kept + recent + sinks),
        cap(budget + 1 + std::int32_t(rng() % spares)),
        shape{kSeqs, kHeads, kHeads * group, cap},
        single(shape, config),
        memory(kv::batch_state_bytes<kv::h2o_policy>(shape, config)),
        st(kv::make_batch_state<kv::h2o_policy>(memory.data(), memory.size(), shape, config)) {
    kv::init_batch_state(st);
  }
};

template <class T>
void run_stream(layout_kind layout, std::int32_t group, std::uint32_t seed) {
  std::mt19937 rng(seed);
  key_norm_pair pair(rng, group, 2, 4, 3);
  const std::int32_t kept = pair.kept, recent = pair.recent, sinks = pair.sinks, budget = pair.budget, cap = pair.cap;
  CAPTURE(kept);
  CAPTURE(recent);
  CAPTURE(sinks);
  kv::h2o_policy& single = pair.single;
  const kv::batch_state_view& st = pair.st;
  std::vector<std::vector<ref_token>> ref(std::size_t(kSeqs) * kHeads);
  std::vector<T> k_new(std::size_t(kSeqs) * kHeads * kDim), v_new(k_new.size());
  std::vector<std::uint8_t> flags(kSeqs);
  std::int64_t evictions = 0;
  kvtest::with_cache<T>(layout, kSeqs, kHeads, cap, kDim, 2, [&](auto view_a) {
    kvtest::with_cache<T>(layout, kSeqs, kHeads, cap, kDim, 2, [&](auto view_b) {
      for (std::int32_t step = 0; step < 40; ++step) {
        for (auto& f : flags) f = rng() % 4 != 0;
        for (T& x : k_new)  // even seeds: keys of -1, 0 and 1, whose norms tie often
          x = seed % 2 ? kvtest::random_value<T>(rng) : kv::from_float<T>(float(std::int32_t(rng() % 3) - 1));
        for (T& x : v_new) x = kvtest::random_value<T>(rng);
        // Per sequence: the engine writes the rows at next_slot, then append,
        // observe, evict; the reference appends and drops.
        for (std::int32_t b = 0; b < kSeqs; ++b) {
          if (!flags[std::size_t(b)]) continue;
          for (std::int32_t h = 0; h < kHeads; ++h) {
            const std::int32_t s = single.next_slot(b, h);
            const T* k = &k_new[(std::size_t(b) * kHeads + h) * kDim];
            std::copy_n(k, kDim, view_a.k_row(b, h, s));
            std::copy_n(&v_new[(std::size_t(b) * kHeads + h) * kDim], kDim, view_a.v_row(b, h, s));
            ref[std::size_t(b) * kHeads + h].push_back({single.length(b), squares_of(k)});
          }
          single.append(b);
          single.observe(b, kv::key_norms<T, decltype(view_a.layout)>{view_a});
          evictions += single.evict(b) > 0;
          for (std::int32_t h = 0; h < kHeads; ++h)
            reference_evict(ref[std::size_t(b) * kHeads + h], budget, sinks, recent, single.length(b));
        }
        // Batched: append with the scatter, observe + evict from the same keys.
        std::uint64_t status = kv::batch_status_clear;
        const auto active = kv::active_set::of_flags(flags.data());
        const kv::batch_rows<T> k_rows{kv::make_tensor_view<const T>(k_new.data(), kSeqs, kHeads, kDim)};
        const kv::batch_rows<T> v_rows{kv::make_tensor_view<const T>(v_new.data(), kSeqs, kHeads, kDim)};
        kv::batched_append(st, active, view_b, k_rows, v_rows, &status);
        kv::batched_observe_evict(st, active, kv::key_norms<T, decltype(view_b.layout)>{view_b}, nullptr, &status);
        REQUIRE(status == kv::batch_status_clear);
        for (std::int32_t b = 0; b < kSeqs; ++b)
          for (std::int32_t h = 0; h < kHeads; ++h) {
            CAPTURE(step);
            CAPTURE(b);
            CAPTURE(h);
            const auto& want = ref[std::size_t(b) * kHeads + h];
            std::vector<std::int32_t> got;
            for (std::int32_t s = 0; s < cap; ++s) {
              const std::int32_t p = single.slots().position(b, h, s);
              CHECK(st.slots.positions_of(b, h)[s] == p);  // batched == per sequence, slot for slot
              CHECK(st.scores_of(b, h)[s] == single.score(b, h, s));
              if (p < 0) continue;
              got.push_back(p);
              const auto it = std::find_if(want.begin(), want.end(), [&](const ref_token& t) { return t.position == p; });
              REQUIRE(it != want.end());
              // -||k||: the exact square root of an exact sum, rounded once.
              CHECK(single.score(b, h, s) == -static_cast<float>(std::sqrt(it->squares)));
            }
            CHECK(got.size() == want.size());
          }
      }
    });
  });
  CHECK(evictions > 0);
}

template <class T>
void all_layouts() {
  for (const layout_kind layout : kvtest::all_layouts)
    for (const std::int32_t group : {1, 4})
      for (std::uint32_t seed = 1; seed <= 3; ++seed) {
        CAPTURE(kvtest::name(layout));
        CAPTURE(group);
        CAPTURE(seed);
        run_stream<T>(layout, group, seed);
      }
}

}  // namespace

TEST_CASE("key-norm keeps the keys of the smallest norm: per sequence and batched equal a real-drop reference") {
  all_layouts<float>();
  all_layouts<kv::half>();
  all_layouts<kv::bfloat16>();
}

namespace {

/// Prefill by key norms: per sequence and batched from the same prompt keys,
/// against the reference keep set (the first sinks, the last recent, and
/// the `kept` of the smallest norm between, the newer on a tie: the
/// prefill's (score, position) order keeps the higher key).
template <class T>
void run_prefill(layout_kind layout, std::int32_t group, std::uint32_t seed, std::int64_t& cut_ties) {
  std::mt19937 rng(seed);
  key_norm_pair pair(rng, group, 1, 3, 12);
  const std::int32_t kept = pair.kept, recent = pair.recent, sinks = pair.sinks, budget = pair.budget, cap = pair.cap;
  CAPTURE(kept);
  CAPTURE(recent);
  CAPTURE(sinks);
  kv::h2o_policy& single = pair.single;
  const kv::batch_state_view& st = pair.st;
  std::vector<std::int32_t> lengths(kSeqs);
  for (auto& l : lengths)  // mostly above the budget, where the norms decide
    l = rng() % 4 ? budget + 1 + std::int32_t(rng() % std::uint32_t(cap - budget)) : 1 + std::int32_t(rng() % std::uint32_t(cap));
  kvtest::with_cache<T>(layout, kSeqs, kHeads, cap, kDim, 2, [&](auto view_a) {
    kvtest::with_cache<T>(layout, kSeqs, kHeads, cap, kDim, 2, [&](auto view_b) {
      std::vector<std::vector<double>> squares(std::size_t(kSeqs) * kHeads);
      for (std::int32_t b = 0; b < kSeqs; ++b)
        for (std::int32_t h = 0; h < kHeads; ++h)
          for (std::int32_t p = 0; p < lengths[std::size_t(b)]; ++p) {
            for (std::int32_t d = 0; d < kDim; ++d) {
              const T k = seed % 2 ? kvtest::random_value<T>(rng) : kv::from_float<T>(float(std::int32_t(rng() % 3) - 1));
              const T v = kvtest::random_value<T>(rng);
              view_a.k_row(b, h, p)[d] = view_b.k_row(b, h, p)[d] = k;
              view_a.v_row(b, h, p)[d] = view_b.v_row(b, h, p)[d] = v;
            }
            squares[std::size_t(b) * kHeads + h].push_back(squares_of(view_a.k_row(b, h, p)));
          }
      std::vector<std::int32_t> reclaim(kSeqs, -1);
      std::uint64_t status = kv::batch_status_clear;
      kv::batched_prefill(st, kv::active_set::all(), kv::prompt_lengths{lengths.data(), cap},
                          norms_of(view_b), reclaim.data(), &status);
      REQUIRE(status == kv::batch_status_clear);
      for (std::int32_t b = 0; b < kSeqs; ++b) {
        const std::int32_t length = lengths[std::size_t(b)];
        CAPTURE(length);
        const kv::prefill_result r = single.prefill(b, length, norms_of(view_a));
        CHECK(reclaim[std::size_t(b)] == r.reclaimable_pages);
        for (std::int32_t h = 0; h < kHeads; ++h) {
          const auto& sq = squares[std::size_t(b) * kHeads + h];
          std::vector<std::int32_t> want;
          if (length <= budget) {
            for (std::int32_t p = 0; p < length; ++p) want.push_back(p);
          } else {
            std::vector<std::int32_t> between;
            for (std::int32_t p = 0; p < length; ++p)
              (p < sinks || p >= length - recent ? want : between).push_back(p);
            std::sort(between.begin(), between.end(), [&](std::int32_t x, std::int32_t y) {
              return sq[std::size_t(x)] != sq[std::size_t(y)] ? sq[std::size_t(x)] < sq[std::size_t(y)] : x > y;
            });
            if (std::int32_t(between.size()) > kept &&
                sq[std::size_t(between[std::size_t(kept) - 1])] == sq[std::size_t(between[std::size_t(kept)])])
              ++cut_ties;  // the tie rule decides who stays
            want.insert(want.end(), between.begin(), between.begin() + kept);
            std::sort(want.begin(), want.end());
          }
          CAPTURE(h);
          REQUIRE(r.kept == std::int32_t(want.size()));
          for (std::int32_t s = 0; s < cap; ++s) {
            const std::int32_t p = s < r.kept ? want[std::size_t(s)] : -1;
            CHECK(single.slots().position(b, h, s) == p);  // compacted, ascending
            CHECK(st.slots.positions_of(b, h)[s] == p);
            CHECK(st.scores_of(b, h)[s] == single.score(b, h, s));
            if (p >= 0) CHECK(single.score(b, h, s) == -static_cast<float>(std::sqrt(sq[std::size_t(p)])));
          }
          for (std::int32_t s = 0; s < r.kept; ++s) {
            CHECK(kvtest::same_bits(view_a.k_row(b, h, s), view_b.k_row(b, h, s), kDim));
            CHECK(kvtest::same_bits(view_a.v_row(b, h, s), view_b.v_row(b, h, s), kDim));
          }
        }
      }
    });
  });
}

}  // namespace

TEST_CASE("key-norm prefill keeps the sinks, the recent window and the smallest norms: per sequence and batched") {
  std::int64_t cut_ties = 0;
  for (const layout_kind layout : kvtest::all_layouts)
    for (const std::int32_t group : {1, 4})
      for (std::uint32_t seed = 1; seed <= 6; ++seed) {
        CAPTURE(kvtest::name(layout));
        CAPTURE(group);
        CAPTURE(seed);
        run_prefill<float>(layout, group, seed, cut_ties);
        run_prefill<kv::half>(layout, group, seed + 10, cut_ties);
        run_prefill<kv::bfloat16>(layout, group, seed + 20, cut_ties);
      }
  CHECK(cut_ties > 10);
}

TEST_CASE("key_norm_score is -||k|| in float, the same bits for every dtype of the same values") {
  std::mt19937 rng(4);
  for (int i = 0; i < 200; ++i) {
    const std::int32_t d = 1 + std::int32_t(rng() % 300);
    std::vector<float> f(static_cast<std::size_t>(d));
    std::vector<kv::bfloat16> bf(f.size());
    std::vector<kv::half> hf(f.size());
    double squares = 0;
    for (std::int32_t j = 0; j < d; ++j) {
      bf[std::size_t(j)] = kvtest::random_value<kv::bfloat16>(rng);
      f[std::size_t(j)] = kv::to_float(bf[std::size_t(j)]);
      hf[std::size_t(j)] = kv::from_float<kv::half>(f[std::size_t(j)]);
      squares += double(f[std::size_t(j)]) * f[std::size_t(j)];
    }
    const float want = -static_cast<float>(std::sqrt(squares));  // exact squares: one rounding
    CHECK(kv::key_norm_score(f.data(), d, 1.0f) == want);
    CHECK(kv::key_norm_score(bf.data(), d, 1.0f) == want);
    CHECK(kv::key_norm_score(hf.data(), d, 1.0f) == want);
  }
  const float big[2] = {3e19f, 3e19f};  // squares overflow float
  CHECK(std::isinf(kv::key_norm_score(big, 2, 1.0f)));
}

TEST_CASE("key_norms: a rule that accumulates is refused, a bad key is named, and nothing changes") {
  const kv::policy_shape shape{kSeqs, kHeads, kHeads, 8};
  auto cache = kv::make_bhsd_cache<float>(kSeqs, kHeads, 8, kDim);
  std::mt19937 rng(9);
  for (float& x : cache.k_storage()) x = kvtest::random_value<float>(rng);
  const kv::key_norms<float, kv::strided_layout> keys{cache.view()};

  // Per sequence: H2O's decay 1 would sum the norms of every step.
  kv::h2o_policy h2o(shape, kv::h2o_config{3, 2});
  h2o.append(0);
  CHECK_THROWS_WITH_AS(h2o.observe(0, keys), doctest::Contains("decay"), kv::invalid_argument);
  CHECK(h2o.awaiting_observe(0));  // the step is still due
  kv::recent_window_policy window(shape, kv::recent_window_config{1, 3});  // scores unused: any input
  window.append(0);
  CHECK_NOTHROW(window.observe(0, keys));
  kv::h2o_policy norms(shape, kv::key_norm_config(3, 2));
  norms.append(0);
  norms.append(1);
  cache.view().k_row(0, 1, 0)[5] = std::numeric_limits<float>::quiet_NaN();
  CHECK_THROWS_WITH_AS(norms.observe(0, keys), doctest::Contains("-||cache.k||[1][0]"), kv::non_finite_error);
  CHECK(norms.awaiting_observe(0));
  CHECK(norms.score(0, 0, 0) == 0.0f);
  CHECK_NOTHROW(norms.observe(1, keys));  // sequence 1's keys are finite
  CHECK(norms.score(1, 0, 0) < 0.0f);

  // Batched: the same refusal as an argument error; the bad key as a status
  // word naming (sequence, head, slot), that head left unchanged.
  const kv::h2o_config accumulate{3, 2};
  std::vector<unsigned char> m1(kv::batch_state_bytes<kv::h2o_policy>(shape, accumulate));
  const auto st1 = kv::make_batch_state<kv::h2o_policy>(m1.data(), m1.size(), shape, accumulate);
  kv::init_batch_state(st1);
  std::uint64_t status = kv::batch_status_clear;
  kv::batched_append(st1, kv::active_set::all(), &status);
  CHECK_THROWS_WITH_AS(kv::batched_observe_evict(st1, kv::active_set::all(), keys, nullptr, &status),
                       doctest::Contains("decay"), kv::invalid_argument);
  CHECK(st1.appended[0] == 1);
  const kv::h2o_config zero = kv::key_norm_config(3, 2);
  std::vector<unsigned char> m2(kv::batch_state_bytes<kv::h2o_policy>(shape, zero));
  const auto st2 = kv::make_batch_state<kv::h2o_policy>(m2.data(), m2.size(), shape, zero);
  kv::init_batch_state(st2);
  kv::batched_append(st2, kv::active_set::all(), &status);
  REQUIRE(status == kv::batch_status_clear);
  kv::batched_observe_evict(st2, kv::active_set::all(), keys, nullptr, &status);
  const kv::batch_status got = kv::batch_status::unpack(status);
  CHECK(got.code == kv::batch_code::non_finite_kv);
  CHECK(got.sequence == 0);
  CHECK(got.head == 1);
  CHECK(got.index == 0);
  CHECK(st2.appended[st2.head_index(0, 1)] == 1);  // refused: still awaiting its observe
  CHECK(st2.scores_of(0, 1)[0] == 0.0f);
  CHECK(st2.appended[st2.head_index(0, 0)] == 0);  // the other heads stepped
  CHECK(st2.scores_of(1, 1)[0] < 0.0f);

  // exact_greedy takes queries + LSE only: that is what its refusal says.
  const kv::exact_greedy_config eg{3, 1, 0};
  const kv::history_extent hist{16, kDim};
  std::vector<unsigned char> m3(kv::batch_state_bytes<kv::exact_greedy_policy>(shape, eg, hist));
  const auto st3 = kv::make_batch_state<kv::exact_greedy_policy>(m3.data(), m3.size(), shape, eg, hist);
  kv::init_batch_state(st3);
  CHECK_THROWS_WITH_AS(kv::batched_observe_evict(st3, kv::active_set::all(), keys, nullptr, &status),
                       doctest::Contains("queries + LSE"), kv::invalid_argument);
}
