// A decode-time scoring rule added from outside the library, the way
// docs/design.md ("Adding a scoring rule") says a rule is added: its input
// struct, its score_source specialization (the per-slot rule) and its
// require_input (the argument checks), about 40 lines, and nothing else.
// With that registration the rule runs through the batched host API and
// the per-sequence API (and the CUDA launchers, which take the same
// score_source). The example rule is value norms: a slot scores ||v||_2
// of its cached value row, replacing its score each step, so h2o with
// decay 0 evicts the unprotected token whose value contributes least to
// any attention output (the observation behind value-aware token pruning,
// Guo et al., 2024). Checked here against a real-drop reference in
// double, on both APIs, and its refusal of a NaN value row.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "kvevict/kvevict.hpp"
#include "support/caches.hpp"

namespace rule {

// ---- the registration (everything a new rule costs beside its tests) ----

/// The input: the cached values.
template <class T, class Layout>
struct value_norms {
  kvevict::kv_view<T, Layout> cache;
};

/// Its argument checks, found by argument-dependent lookup: a cache that
/// matches the state, and a rule whose score the input may replace.
template <class T, class Layout>
void require_input(const kvevict::detail::site& w, const kvevict::batch_state_view& st,
                   const value_norms<T, Layout>& in) {
  kvevict::detail::require_cache(w, st, in.cache);
  kvevict::detail::require_replacing_decay(w, "value_norms", st.rule.victim == kvevict::victim_rule::lowest_score,
                                           st.rule.decay);
}

}  // namespace rule

namespace kvevict {

/// Its per-slot rule: ||v||_2 of the cached value row, in kvevict's fixed
/// dot-product order; a norm that is not finite refuses the head.
template <class T, class Layout>
struct score_source<rule::value_norms<T, Layout>> {
  static constexpr int items = 1;
  static constexpr int min_blocks = 2;
  rule::value_norms<T, Layout> in;
  std::int32_t group_size;
  group_reduce reduce;

  KVEVICT_HOST_DEVICE std::int32_t columns() const noexcept { return in.cache.capacity; }
  KVEVICT_HOST_DEVICE std::uint64_t check_head_share(std::int32_t, std::int32_t, std::int32_t,
                                                     std::int32_t) const noexcept {
    return head_check::none;
  }
  template <int N>
  KVEVICT_HOST_DEVICE void fold_items(std::int32_t b, std::int32_t h, const std::int32_t (&s)[N],
                                      slot_increment (&inc)[N]) const noexcept {
    for (int u = 0; u < N; ++u) inc[u] = increment(b, h, s[u]);
  }
  KVEVICT_HOST_DEVICE slot_increment increment(std::int32_t b, std::int32_t h, std::int32_t s) const noexcept {
    slot_increment out;
    if (!row_is_mapped(in.cache, b, s)) {
      out.code = batch_code::bad_page;
      return out;
    }
    out.value = -key_norm_score(in.cache.v_row(b, h, s), in.cache.head_dim, in.cache.v_scale(h));
    if (classify_input(out.value, false) != batch_code::ok) out.code = batch_code::non_finite_kv;
    return out;
  }
};

}  // namespace kvevict

namespace {

namespace kv = kvevict;
using kvtest::layout_kind;

constexpr std::int32_t kSeqs = 2, kHeads = 2, kDim = 8;
constexpr double kMargin = 1e-5;  // far above a float norm's rounding, far below the values' spread

template <class T>
double norm_of(const T* v) {
  double sq = 0;
  for (std::int32_t e = 0; e < kDim; ++e) sq += double(kv::to_float(v[e])) * kv::to_float(v[e]);
  return std::sqrt(sq);
}

/// One API's stream against the reference: per (sequence, head) a map
/// position -> ||v|| in double; each step the victim is the lowest (norm,
/// position) outside the protection, and where the library's differs the
/// two must be a near-tie (counted).
template <class T, bool Batched>
void run_stream(layout_kind layout, std::uint32_t seed, std::int64_t& evictions, std::int64_t& near_ties) {
  std::mt19937 rng(seed);
  const std::int32_t kept = 2 + std::int32_t(rng() % 4), recent = std::int32_t(rng() % 3), sinks = std::int32_t(rng() % 2);
  const std::int32_t budget = kept + recent + sinks, cap = budget + 1 + std::int32_t(rng() % 3);
  const kv::h2o_config config = kv::key_norm_config(kept, recent, sinks);
  const kv::policy_shape shape{kSeqs, kHeads, kHeads, cap};
  kv::h2o_policy single(shape, config);
  kv::batched_policy<kv::h2o_policy> batch(shape, config);
  std::vector<std::map<std::int32_t, double>> ref(std::size_t(kSeqs) * kHeads);
  kvtest::with_cache<T>(layout, kSeqs, kHeads, cap, kDim, 2, [&](auto view) {
    using input = rule::value_norms<T, std::decay_t<decltype(view.layout)>>;
    for (std::int32_t step = 0; step < 40; ++step) {
      CAPTURE(step);
      const kv::batch_state_view& sv = Batched ? batch.state() : single.state();
      for (std::int32_t b = 0; b < kSeqs; ++b) {
        for (std::int32_t h = 0; h < kHeads; ++h) {
          T* v = view.v_row(b, h, sv.slots.next_slots[sv.head_index(b, h)]);
          for (std::int32_t e = 0; e < kDim; ++e) v[e] = kvtest::random_value<T>(rng);
          ref[std::size_t(b) * kHeads + h][sv.slots.lengths[b]] = norm_of(v);
        }
        if (!Batched) {
          single.append(b);
          single.observe(b, input{view});  // the per-sequence API takes the new rule as it is
          single.evict(b);
        }
      }
      if (Batched) {
        batch.append();
        batch.observe_evict(input{view});
        batch.check();
      }
      for (std::int32_t b = 0; b < kSeqs; ++b)
        for (std::int32_t h = 0; h < kHeads; ++h) {
          auto& r = ref[std::size_t(b) * kHeads + h];
          const std::int32_t length = sv.slots.lengths[b];
          std::map<std::int32_t, std::int32_t> cached;  // position -> slot
          for (std::int32_t s = 0; s < cap; ++s)
            if (sv.slots.positions_of(b, h)[s] >= 0) cached[sv.slots.positions_of(b, h)[s]] = s;
          for (const auto& [p, s] : cached)  // every score is ||v|| of its row
            CHECK(std::abs(double(sv.scores_of(b, h)[s]) - r.at(p)) < kMargin);
          if (std::int32_t(r.size()) <= budget) {
            CHECK(cached.size() == r.size());
            continue;
          }
          std::int32_t want = -1, dropped = -1;
          for (const auto& [p, n] : r) {
            if (!cached.count(p)) dropped = p;
            if (p < sinks || p >= length - recent) continue;
            if (want < 0 || n < r.at(want)) want = p;  // ascending positions: the older on a tie
          }
          REQUIRE(dropped >= 0);
          CHECK(cached.size() + 1 == r.size());
          if (dropped != want) {
            CHECK(std::abs(r.at(dropped) - r.at(want)) <= kMargin);
            ++near_ties;
          }
          r.erase(dropped);
          ++evictions;
        }
    }
  });
}

}  // namespace

TEST_CASE("a rule registered outside the library (value norms) runs through both APIs, equal to a reference") {
  std::int64_t evictions = 0, near_ties = 0;
  for (const layout_kind layout : kvtest::all_layouts)
    for (std::uint32_t seed = 1; seed <= 3; ++seed) {
      CAPTURE(kvtest::name(layout));
      CAPTURE(seed);
      run_stream<float, false>(layout, seed, evictions, near_ties);
      run_stream<kv::bfloat16, true>(layout, seed + 10, evictions, near_ties);
      run_stream<kv::half, false>(layout, seed + 20, evictions, near_ties);
      run_stream<float, true>(layout, seed + 30, evictions, near_ties);
    }
  MESSAGE("evictions: ", evictions, ", near-ties decided the other way: ", near_ties);
  CHECK(evictions > 500);
  CHECK(near_ties * 100 < evictions);
}

TEST_CASE("a registered rule's refusals: its argument checks, and a NaN row named by the status on both APIs") {
  const kv::policy_shape shape{kSeqs, kHeads, kHeads, 8};
  auto cache = kv::make_bhsd_cache<float>(kSeqs, kHeads, 8, kDim);
  std::mt19937 rng(3);
  for (float& x : cache.v_storage()) x = kvtest::random_value<float>(rng);
  const rule::value_norms<float, kv::strided_layout> values{cache.view()};
  // Its require_input: a rule that accumulates scores is refused (decay 1).
  kv::h2o_policy accumulating(shape, kv::h2o_config{3, 1});
  accumulating.append(0);
  CHECK_THROWS_WITH_AS(accumulating.observe(0, values), doctest::Contains("value_norms"), kv::invalid_argument);
  CHECK(accumulating.awaiting_observe(0));
  // A NaN value: the per-sequence call throws naming (sequence, head, slot)
  // and changes nothing; the batched call refuses that head alone.
  kv::h2o_policy single(shape, kv::key_norm_config(3, 1));
  kv::batched_policy<kv::h2o_policy> batch(shape, kv::key_norm_config(3, 1));
  single.append(1);
  batch.append();
  cache.view().v_row(1, 1, 0)[2] = std::numeric_limits<float>::quiet_NaN();
  CHECK_THROWS_WITH_AS(single.observe(1, values), doctest::Contains("at sequence 1, head 1, index 0"),
                       kv::non_finite_error);
  CHECK(single.awaiting_observe(1));
  CHECK(single.score(1, 0, 0) == 0.0f);  // head 0 was good, but the sequence moves as a whole
  batch.observe_evict(values);
  const kv::batch_status s = kv::batch_status::unpack(batch.status_word());
  CHECK(s.code == kv::batch_code::non_finite_kv);
  CHECK(s.sequence == 1);
  CHECK(s.head == 1);
  CHECK(s.index == 0);
  CHECK(batch.state().appended[batch.state().head_index(1, 1)] == 1);  // refused: still waiting
  CHECK(batch.state().appended[batch.state().head_index(1, 0)] == 0);  // the others stepped
}
