// The batched host backend against the per-sequence policies, which
// test_policies_bruteforce and test_exact_greedy hold to from-scratch
// references: on seeded streams for every policy x input kind x dtype x
// layout x GQA group {1, 4, 8}, with ragged batches (idle sequences, active
// lists and flags), both must end every step with the same slot table, the
// same victims, bitwise the same scores and the same K/V bytes. Then the
// batched semantics of their own: the status word, the size query, reset.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "kvevict/kvevict.hpp"
#include "support/batch_streams.hpp"
#include "support/caches.hpp"
#include "support/state_invariants.hpp"
#include "support/h2o_draws.hpp"

namespace {

using namespace kvevict;
using kvtest::input_kind;
using kvtest::layout_kind;

template <class Policy>
typename policy_traits<Policy>::config_type draw_config(std::mt19937& rng, std::int32_t& budget) {
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  if constexpr (std::is_same_v<Policy, h2o_policy>) {
    const h2o_config c = kvtest::draw_h2o_config(pick, 4, 4);
    budget = static_cast<std::int32_t>(c.budget());
    return c;
  } else if constexpr (std::is_same_v<Policy, recent_window_policy>) {
    recent_window_config c{pick(0, 3), pick(1, 5)};
    budget = c.sinks + c.window;
    return c;
  } else if constexpr (std::is_same_v<Policy, random_policy>) {
    random_config c{pick(2, 8), 0, 0, std::uint64_t(rng())};
    c.sinks = pick(0, 1);
    c.recent = pick(0, c.budget - 1 - c.sinks);
    budget = c.budget;
    return c;
  } else {
    exact_greedy_config c;
    c.budget = pick(2, 6);
    c.recent = pick(0, c.budget - 1);
    c.sinks = pick(0, c.budget - 1 - c.recent);
    budget = c.budget;
    return c;
  }
}

template <class T>
const T* row_ptr(const std::vector<T>& v, std::int32_t b, std::int32_t rows, std::int32_t cols) {
  return v.data() + std::size_t(b) * rows * cols;
}

// Per-sequence observe with the input of kind `kind` for sequence b.
template <class Policy, class T, class View>
void observe_one(Policy& p, const kvtest::batch_step<T>& st, const kvtest::batch_dims& dm, input_kind kind,
                 std::int32_t b, const View& view) {
  const std::int32_t Hq = dm.q_heads(), H = dm.heads, W = dm.width(), D = dm.head_dim;
  const auto lse = make_tensor_view<const float>(row_ptr(st.lse, b, Hq, 1), Hq);
  if constexpr (std::is_same_v<Policy, exact_greedy_policy>) {
    p.observe(b, decode_queries<float>{make_tensor_view<const float>(row_ptr(st.q, b, Hq, D), Hq, D), lse, st.scale},
              view);
  } else {
    switch (kind) {
      case input_kind::probs:
        p.observe(b, decode_probs{make_tensor_view<const float>(row_ptr(st.probs, b, Hq, W), Hq, W)});
        break;
      case input_kind::head_scores:
        p.observe(b, head_scores{make_tensor_view<const float>(row_ptr(st.increments, b, H, W), H, W)});
        break;
      case input_kind::logits:
        p.observe(b, decode_logits{make_tensor_view<const float>(row_ptr(st.logits, b, Hq, W), Hq, W), lse, st.scale});
        break;
      case input_kind::queries:
        p.observe(b, decode_queries<float>{make_tensor_view<const float>(row_ptr(st.q, b, Hq, D), Hq, D), lse, st.scale},
                  view);
        break;
    }
  }
}

// The batched observe + evict of the same step.
template <class Policy, class T, class View>
void observe_batched(batched_policy<Policy>& p, const kvtest::batch_step<T>& st, const kvtest::batch_dims& dm,
                     input_kind kind, const View& view, std::int32_t* victims) {
  const std::int32_t B = dm.seqs, Hq = dm.q_heads(), H = dm.heads, W = dm.width(), D = dm.head_dim;
  const auto lse = make_tensor_view<const float>(st.lse.data(), B, Hq);
  const active_set active = st.active_set();
  const batch_queries<float> queries{make_tensor_view<const float>(st.q.data(), B, Hq, D), lse, st.scale};
  if (std::is_same_v<Policy, exact_greedy_policy> || kind == input_kind::queries) {
    p.observe_evict(queries, view, active, victims);
  } else if (kind == input_kind::probs) {
    p.observe_evict(batch_probs{make_tensor_view<const float>(st.probs.data(), B, Hq, W)}, active, victims);
  } else if (kind == input_kind::head_scores) {
    p.observe_evict(batch_head_scores{make_tensor_view<const float>(st.increments.data(), B, H, W)}, active, victims);
  } else {
    p.observe_evict(batch_logits{make_tensor_view<const float>(st.logits.data(), B, Hq, W), lse, st.scale}, active,
                    victims);
  }
}

struct totals {
  std::int64_t streams = 0, steps = 0, evictions = 0, head_states = 0;
};

template <class Policy, class T>
void run_stream(std::uint32_t seed, layout_kind layout, std::int32_t group, input_kind kind, totals& tot) {
  std::mt19937 rng(seed);
  std::int32_t budget = 0;
  const auto config = draw_config<Policy>(rng, budget);
  kvtest::batch_dims dm;
  dm.seqs = std::uniform_int_distribution<int>(1, 4)(rng);
  dm.heads = std::uniform_int_distribution<int>(1, 2)(rng);
  dm.group = group;
  dm.head_dim = std::uniform_int_distribution<int>(0, 1)(rng) ? 8 : 12;
  dm.capacity = budget + 1 + std::uniform_int_distribution<int>(0, 2)(rng);
  const std::int32_t page = std::uniform_int_distribution<int>(1, 4)(rng);
  const std::int32_t steps = std::uniform_int_distribution<int>(10, 30)(rng);
  const policy_shape shape{dm.seqs, dm.heads, dm.q_heads(), dm.capacity};
  const history_extent history{steps + 1, dm.head_dim};
  Policy single(shape, config);
  batched_policy<Policy> batched(shape, config, history);
  const std::int32_t B = dm.seqs, H = dm.heads, D = dm.head_dim;
  kvtest::with_cache<T>(layout, B, H, dm.capacity, D, page, [&](const auto& view_a) {
    kvtest::with_cache<T>(layout, B, H, dm.capacity, D, page, [&](const auto& view_b) {
      for (std::int32_t step = 0; step < steps; ++step) {
        CAPTURE(step);
        const kvtest::batch_step<T> st = kvtest::draw_step<T>(rng, dm, 0.25);
        if constexpr (std::is_same_v<Policy, random_policy>) {
          if (step == steps / 2 && B > 1) {  // a new request with a stream of its own on sequence 1
            const std::int32_t one = 1;
            const std::uint64_t stream = 1000 + seed;
            single.reset(1, stream);
            batched.reset(active_set::of_list(&one, 1), &stream);
          }
        }
        std::vector<std::int32_t> want(std::size_t(B) * H, -1), got(want.size(), -1);
        for (std::int32_t b = 0; b < B; ++b) {
          if (!st.active(b)) continue;
          std::vector<std::int32_t> slots(static_cast<std::size_t>(H));
          for (std::int32_t h = 0; h < H; ++h) slots[std::size_t(h)] = single.next_slot(b, h);
          scatter(view_a, b, slots.data(), make_tensor_view<const T>(row_ptr(st.k_new, b, H, D), H, D),
                  make_tensor_view<const T>(row_ptr(st.v_new, b, H, D), H, D));
          single.append(b);
        }
        batched.append(view_b, batch_rows<T>{make_tensor_view<const T>(st.k_new.data(), B, H, D)},
                       batch_rows<T>{make_tensor_view<const T>(st.v_new.data(), B, H, D)}, st.active_set());
        for (std::int32_t b = 0; b < B; ++b) {
          if (!st.active(b)) continue;
          observe_one(single, st, dm, kind, b, view_a);
          single.evict(b, &want[std::size_t(b) * H]);
        }
        observe_batched(batched, st, dm, kind, view_b, got.data());
        REQUIRE(batched.status_word() == batch_status_clear);
        CHECK(got == want);
        const batch_state_view& s = batched.state();
        kvtest::check_slot_invariants(s);
        for (std::int32_t b = 0; b < B; ++b) {
          REQUIRE(s.slots.lengths[b] == single.length(b));
          for (std::int32_t h = 0; h < H; ++h) {
            const std::int64_t bh = s.head_index(b, h);
            REQUIRE(s.slots.counts[bh] == single.slots().count(b, h));
            CHECK(s.slots.next_slots[bh] == single.next_slot(b, h));
            for (std::int32_t slot = 0; slot < dm.capacity; ++slot) {
              const std::int32_t p = single.slots().position(b, h, slot);
              REQUIRE(s.slots.positions_of(b, h)[slot] == p);
              if (p < 0) continue;
              CHECK(std::memcmp(&s.scores_of(b, h)[slot], &single.scores_of(b, h)[slot], sizeof(float)) == 0);
              CHECK(kvtest::same_bits(view_a.k_row(b, h, slot), view_b.k_row(b, h, slot), D));
              CHECK(kvtest::same_bits(view_a.v_row(b, h, slot), view_b.v_row(b, h, slot), D));
            }
            ++tot.head_states;
          }
        }
        for (std::int32_t x : want) tot.evictions += x >= 0;
        ++tot.steps;
      }
    });
  });
  ++tot.streams;
}

template <class Policy>
void run_policy(const char* name, std::initializer_list<input_kind> kinds, int seeds_per_combo) {
  totals tot;
  std::uint32_t seed = 1;
  for (input_kind kind : kinds)
    for (layout_kind layout : kvtest::all_layouts)
      for (std::int32_t group : {1, 4, 8})
        for (int i = 0; i < seeds_per_combo; ++i, ++seed) {
          CAPTURE(seed);
          CAPTURE(std::string(kvtest::name(kind)));
          CAPTURE(std::string(kvtest::name(layout)));
          CAPTURE(group);
          switch (seed % 3) {
            case 0: run_stream<Policy, float>(seed, layout, group, kind, tot); break;
            case 1: run_stream<Policy, half>(seed, layout, group, kind, tot); break;
            default: run_stream<Policy, bfloat16>(seed, layout, group, kind, tot); break;
          }
        }
  MESSAGE(std::string(name), ": ", tot.streams, " streams, ", tot.steps, " steps, ", tot.evictions,
          " evictions, ", tot.head_states, " (sequence, head) states compared");
  CHECK(tot.evictions > 1000);
}

constexpr std::initializer_list<input_kind> kAllInputs = {input_kind::probs, input_kind::head_scores,
                                                          input_kind::logits, input_kind::queries};

}  // namespace

TEST_CASE("batched host h2o equals the per-sequence h2o, every input x dtype x layout x GQA") {
  run_policy<h2o_policy>("h2o", kAllInputs, 12);
}
TEST_CASE("batched host recent_window equals the per-sequence policy") {
  run_policy<recent_window_policy>("recent_window", kAllInputs, 6);
}
TEST_CASE("batched host random equals the per-sequence policy, request streams included") {
  run_policy<random_policy>("random", kAllInputs, 8);
}
TEST_CASE("batched host exact_greedy equals the per-sequence oracle") {
  run_policy<exact_greedy_policy>("exact_greedy", {input_kind::queries}, 20);
}

namespace {

// A snapshot of everything a batched state holds for one (b, h).
struct head_snapshot {
  std::vector<std::int32_t> positions;
  std::vector<float> scores;
  std::int32_t count, next, length;
  bool operator==(const head_snapshot& o) const {
    return positions == o.positions && count == o.count && next == o.next && length == o.length &&
           std::memcmp(scores.data(), o.scores.data(), scores.size() * sizeof(float)) == 0;
  }
};

head_snapshot snapshot_of(const batch_state_view& s, std::int32_t b, std::int32_t h) {
  head_snapshot out;
  for (std::int32_t slot = 0; slot < s.capacity(); ++slot) {
    const std::int32_t p = s.slots.positions_of(b, h)[slot];
    out.positions.push_back(p);
    out.scores.push_back(p >= 0 ? s.scores_of(b, h)[slot] : 0.0f);  // free slots' scores are unspecified
  }
  out.count = s.slots.counts[s.head_index(b, h)];
  out.next = s.slots.next_slots[s.head_index(b, h)];
  out.length = s.slots.lengths[b];
  return out;
}

}  // namespace

TEST_CASE("batched status: a bad (b, h) is left unchanged, the rest of the batch steps, the lowest offender is kept") {
  // 3 sequences x 2 heads x 1 query head per head, budget 3 (h2o 1 + 2), capacity 4.
  const std::int32_t B = 3, H = 2, cap = 4;
  batched_policy<h2o_policy> layer(policy_shape{B, H, H, cap}, h2o_config{1, 2});
  std::vector<float> probs(std::size_t(B) * H * cap, 0.125f);
  const auto view = make_tensor_view<const float>(probs.data(), B, H, cap);
  for (int step = 0; step < 4; ++step) {  // fill to budget + 1 and evict once
    layer.append();
    probs[std::size_t(step)] = 0.5f;  // (b 0, h 0): position `step` gets more weight
    layer.observe_evict(batch_probs{view});
  }
  layer.check();
  const batch_state_view& s = layer.state();
  layer.append();
  const head_snapshot b1h0 = snapshot_of(s, 1, 0), b2h1 = snapshot_of(s, 2, 1), b0h0 = snapshot_of(s, 0, 0);
  probs[std::size_t((1 * H + 0) * cap + 2)] = std::nanf("");      // (1, 0) slot 2: NaN
  probs[std::size_t((2 * H + 1) * cap + 1)] = -0.5f;               // (2, 1) slot 1: negative
  std::vector<std::int32_t> victims(std::size_t(B) * H, 99);
  layer.observe_evict(batch_probs{view}, active_set::all(), victims.data());
  CHECK(snapshot_of(s, 1, 0) == b1h0);
  CHECK(snapshot_of(s, 2, 1) == b2h1);
  CHECK_FALSE(snapshot_of(s, 0, 0) == b0h0);  // a good head stepped: it evicted
  CHECK(s.slots.counts[s.head_index(0, 0)] == 3);
  CHECK(s.slots.counts[s.head_index(1, 1)] == 3);
  CHECK(victims[std::size_t(1 * H + 0)] == -1);
  CHECK(victims[std::size_t(0 * H + 0)] >= 0);
  const batch_status st = batch_status::unpack(layer.status_word());
  CHECK(st.code == batch_code::nan_input);  // the lowest (b, h, slot) of the two
  CHECK(st.sequence == 1);
  CHECK(st.head == 0);
  CHECK(st.index == 2);
  CHECK_THROWS_AS(layer.check(), non_finite_error);
  CHECK(layer.status_word() == batch_status_clear);  // check() clears it

  SUBCASE("the unchanged head still holds budget + 1: append refuses the whole sequence") {
    probs[std::size_t((1 * H + 0) * cap + 2)] = 0.25f;
    const head_snapshot b1h1 = snapshot_of(s, 1, 1);
    const std::int32_t one = 1;
    layer.append(active_set::of_list(&one, 1));
    CHECK(snapshot_of(s, 1, 1) == b1h1);  // head 1 had room but the sequence moves as a whole
    CHECK(batch_status::unpack(layer.status_word()).code == batch_code::no_free_slot);
    CHECK_THROWS_AS(layer.check(), state_error);
    layer.observe_evict(batch_probs{view}, active_set::of_list(&one, 1));  // the repaired input: (1, 0) catches up
    CHECK(batch_status::unpack(layer.status_word()).code == batch_code::not_appended);  // (1, 1) was not appended
    CHECK(s.slots.counts[s.head_index(1, 0)] == 3);
  }
  SUBCASE("observe + evict twice without an append is refused; the heads that were appended catch up") {
    probs[std::size_t((1 * H + 0) * cap + 2)] = 0.25f;
    probs[std::size_t((2 * H + 1) * cap + 1)] = 0.25f;
    const head_snapshot b0h0_now = snapshot_of(s, 0, 0);
    layer.observe_evict(batch_probs{view});
    const batch_status again = batch_status::unpack(layer.status_word());
    CHECK(again.code == batch_code::not_appended);
    CHECK(again.sequence == 0);
    CHECK(again.head == 0);
    CHECK(snapshot_of(s, 0, 0) == b0h0_now);
    CHECK(s.slots.counts[s.head_index(1, 0)] == 3);
    CHECK(s.slots.counts[s.head_index(2, 1)] == 3);
  }
  SUBCASE("a list entry that is not a sequence index is reported by its position in the list and its value") {
    const std::int32_t list[2] = {0, 7};
    layer.append(active_set::of_list(list, 2));
    const batch_status bad = batch_status::unpack(layer.status_word());
    CHECK(bad.code == batch_code::bad_sequence);
    CHECK(bad.entry == 1);
    CHECK(bad.index == 7);
    CHECK_THROWS_AS(layer.check(), out_of_range);
  }
}

TEST_CASE("batched status: retrying a refused head with corrected input equals a run that never failed") {
  const std::int32_t B = 3, H = 2, cap = 5;
  batched_policy<h2o_policy> failed(policy_shape{B, H, H, cap}, h2o_config{2, 2});
  batched_policy<h2o_policy> clean(policy_shape{B, H, H, cap}, h2o_config{2, 2});
  std::vector<float> probs(std::size_t(B) * H * cap);
  const auto view = make_tensor_view<const float>(probs.data(), B, H, cap);
  const std::int32_t one = 1;
  for (int step = 0; step < 12; ++step) {
    for (std::size_t i = 0; i < probs.size(); ++i) probs[i] = float((i * 7 + std::size_t(step) * 3) % 11) / 16.0f;
    failed.append();
    clean.append();
    clean.observe_evict(batch_probs{view});
    if (step == 6) {  // (1, 0) gets a NaN first, then the corrected row for sequence 1 alone
      const float good = probs[std::size_t((1 * H + 0) * cap + 1)];
      probs[std::size_t((1 * H + 0) * cap + 1)] = std::nanf("");
      failed.observe_evict(batch_probs{view});
      CHECK_THROWS_AS(failed.check(), non_finite_error);
      probs[std::size_t((1 * H + 0) * cap + 1)] = good;
      failed.observe_evict(batch_probs{view}, active_set::of_list(&one, 1));
      // (1, 1) had stepped: a call that is not a retry (as_retry) reports that
      CHECK(batch_status::unpack(failed.status_word()).code == batch_code::not_appended);
      CHECK_THROWS_AS(failed.check(), state_error);
    } else {
      failed.observe_evict(batch_probs{view});
    }
    failed.check();
    clean.check();
    for (std::int32_t b = 0; b < B; ++b)
      for (std::int32_t h = 0; h < H; ++h) CHECK(snapshot_of(failed.state(), b, h) == snapshot_of(clean.state(), b, h));
  }
}

TEST_CASE("batched status: overflowing scores, bad pages in append, exact_greedy's history") {
  SUBCASE("a score that would overflow leaves the head unchanged") {
    batched_policy<h2o_policy> layer(policy_shape{1, 1, 1, 3}, h2o_config{1, 1});
    std::vector<float> inc = {3e38f, 1.0f, 0.0f};
    const auto view = make_tensor_view<const float>(inc.data(), 1, 1, 3);
    layer.append();
    layer.append();
    layer.observe_evict(batch_head_scores{view});
    layer.check();
    layer.append();
    const head_snapshot before = snapshot_of(layer.state(), 0, 0);
    layer.observe_evict(batch_head_scores{view});
    CHECK(snapshot_of(layer.state(), 0, 0) == before);
    const batch_status st = batch_status::unpack(layer.status_word());
    CHECK(st.code == batch_code::score_overflow);
    CHECK(st.index == 0);
  }
  SUBCASE("append with scatter refuses a next slot on a page outside the pool; nothing is written") {
    batched_policy<h2o_policy> layer(policy_shape{2, 1, 1, 4}, h2o_config{2, 1});
    auto cache = make_paged_cache<float>(2, 1, 4, 2, 2, page_order::nhd);
    const std::vector<float> k = {1, 2, 3, 4}, v = {5, 6, 7, 8};
    const batch_rows<float> kr{make_tensor_view<const float>(k.data(), 2, 1, 2)};
    const batch_rows<float> vr{make_tensor_view<const float>(v.data(), 2, 1, 2)};
    cache.page_table()[2] = 99;  // sequence 1, page 0
    const std::vector<float> k_before = cache.k_storage();
    layer.append(cache.view(), kr, vr);
    const batch_status st = batch_status::unpack(layer.status_word());
    CHECK(st.code == batch_code::bad_page);
    CHECK(st.sequence == 1);
    CHECK(layer.state().slots.lengths[1] == 0);
    CHECK(layer.state().slots.lengths[0] == 1);  // sequence 0 went ahead
    CHECK(cache.k_storage()[2] == k_before[2]);
    CHECK_THROWS_AS(layer.check(), out_of_range);
  }
  SUBCASE("exact_greedy: a step appended but not observed, and a sequence beyond max_tokens") {
    exact_greedy_config c;
    c.budget = 2;
    batched_policy<exact_greedy_policy> layer(policy_shape{1, 1, 1, 3}, c, history_extent{4, 2});
    auto cache = make_bhsd_cache<float>(1, 1, 3, 2);
    const std::vector<float> kv = {0.5f, -0.5f}, q = {1.0f, 0.0f}, lse = {0.0f};
    const batch_rows<float> rows{make_tensor_view<const float>(kv.data(), 1, 1, 2)};
    const batch_queries<float> in{make_tensor_view<const float>(q.data(), 1, 1, 2),
                                  make_tensor_view<const float>(lse.data(), 1, 1), 1.0f};
    layer.append(cache.view(), rows, rows);
    layer.append(cache.view(), rows, rows);  // two appends, one observe: both rows are still cached
    layer.observe_evict(in, cache.view());
    layer.check();
    CHECK(layer.state().history.rows[0] == 2);
    layer.reset(active_set::all());
    // A position that left the cache before it was recorded (an engine that
    // edited the slot table) would leave a gap in the history: refused.
    layer.append(cache.view(), rows, rows);
    layer.append(cache.view(), rows, rows);
    layer.state().slots.positions_of(0, 0)[1] = -1;  // position 1 gone, unrecorded
    layer.state().slots.counts[0] = 1;
    layer.observe_evict(in, cache.view());
    CHECK(batch_status::unpack(layer.status_word()).code == batch_code::history_gap);
    CHECK(layer.state().history.rows[0] == 0);
    CHECK_THROWS_AS(layer.check(), state_error);
    layer.reset(active_set::all());
    for (int t = 0; t < 4; ++t) {
      layer.append(cache.view(), rows, rows);
      layer.observe_evict(in, cache.view());
    }
    layer.check();
    CHECK(layer.state().history.rows[0] == 4);
    layer.append(cache.view(), rows, rows);  // position 4: beyond max_tokens = 4
    layer.observe_evict(in, cache.view());
    CHECK(batch_status::unpack(layer.status_word()).code == batch_code::history_full);
  }
}

TEST_CASE("batched: the overflow, enum and allocation rules of the per-sequence API hold too") {
  SUBCASE("a group reduction or a score that overflows leaves the head unchanged; negative increments are allowed") {
    // Two query heads in one group: 3e38 + 3e38 is inf before any score is touched.
    batched_policy<h2o_policy> layer(policy_shape{1, 1, 2, 4}, h2o_config{2, 0});
    const std::vector<float> minus(4, -3e38f), huge(2 * 4, 3e38f), quarter(2 * 4, 0.25f);
    const batch_head_scores negative{make_tensor_view<const float>(minus.data(), 1, 1, 4)};
    layer.append();
    layer.observe_evict(negative);
    layer.check();
    CHECK(layer.state().scores_of(0, 0)[0] == -3e38f);
    layer.append();
    const head_snapshot before = snapshot_of(layer.state(), 0, 0);
    layer.observe_evict(negative);  // -3e38 - 3e38 = -inf
    CHECK(snapshot_of(layer.state(), 0, 0) == before);
    CHECK_THROWS_AS(layer.check(), non_finite_error);
    layer.observe_evict(batch_probs{make_tensor_view<const float>(huge.data(), 1, 2, 4)});
    CHECK(snapshot_of(layer.state(), 0, 0) == before);
    const batch_status st = batch_status::unpack(layer.status_word());
    CHECK(st.code == batch_code::score_overflow);
    CHECK(st.index == 0);
    CHECK_THROWS_AS(layer.check(), non_finite_error);
    layer.observe_evict(batch_probs{make_tensor_view<const float>(quarter.data(), 1, 2, 4)});  // the retry completes the step
    layer.check();
    CHECK(layer.state().scores_of(0, 0)[1] == 0.5f);
  }
  SUBCASE("out-of-range enum values") {
    h2o_config bad{2, 1};
    bad.reduce = static_cast<group_reduce>(9);
    CHECK_THROWS_AS(batch_state_bytes<h2o_policy>(policy_shape{1, 1, 1, 4}, bad), invalid_argument);
    batched_policy<h2o_policy> layer(policy_shape{1, 1, 1, 4}, h2o_config{2, 1});
    layer.append();
    const std::vector<float> logits(4, 0.0f), lse(1, 0.0f);
    batch_logits in{make_tensor_view<const float>(logits.data(), 1, 1, 4), make_tensor_view<const float>(lse.data(), 1, 1)};
    in.base = static_cast<lse_base>(5);
    const head_snapshot before = snapshot_of(layer.state(), 0, 0);
    CHECK_THROWS_AS(layer.observe_evict(in), invalid_argument);
    CHECK(snapshot_of(layer.state(), 0, 0) == before);
  }
  SUBCASE("a state above max_allocation_bytes is refused before allocating") {
    const policy_shape huge{1 << 19, 1 << 10, 1 << 10, 1 << 20};
    CHECK_THROWS_AS(batch_state_bytes<h2o_policy>(huge, h2o_config{2, 1}), invalid_argument);
    CHECK_THROWS_AS((batched_policy<h2o_policy>(huge, h2o_config{2, 1})), invalid_argument);
    // exact_greedy's history: 64 x 8 heads x 2^30 tokens x 128 floats, twice.
    CHECK_THROWS_AS(batch_state_bytes<exact_greedy_policy>(policy_shape{64, 8, 8, 1024}, exact_greedy_config{16, 1, 0},
                                                           history_extent{1 << 30, 128}),
                    invalid_argument);
  }
}

TEST_CASE("batched state: size query, any alignment, arguments checked before anything changes") {
  const policy_shape shape{3, 2, 4, 9};
  const random_config config{6, 1, 1, 7};
  const std::size_t bytes = batch_state_bytes<random_policy>(shape, config);
  std::vector<unsigned char> memory(bytes + 1);
  // A misaligned base: the size includes the slack, the carve aligns.
  const batch_state_view s = make_batch_state<random_policy>(memory.data() + 1, bytes, shape, config);
  CHECK(reinterpret_cast<std::uintptr_t>(s.slots.positions) % 256 == 0);
  CHECK(reinterpret_cast<unsigned char*>(s.victim_scratch + 3 * 2 * 9) <= memory.data() + 1 + bytes);
  init_batch_state(s);
  CHECK(s.streams[2] == 2);
  CHECK(s.slots.positions_of(2, 1)[8] == -1);
  CHECK_THROWS_AS(make_batch_state<random_policy>(memory.data(), bytes - 1, shape, config), invalid_argument);
  CHECK_THROWS_AS(batch_state_bytes<random_policy>(policy_shape{3, 2, 4, 6}, config), budget_error);
  CHECK_THROWS_AS(batch_state_bytes<exact_greedy_policy>(shape, exact_greedy_config{4, 1, 0}), invalid_argument);

  std::uint64_t status = batch_status_clear;
  const std::vector<float> probs(3 * 4 * 9, 0.1f);
  batched_append(s, active_set::all(), &status);
  // Wrong extents: thrown before any (b, h) changes. A slot dimension is
  // checked per head against its tokens (narrow_input): here only no column
  // at all is wrong before the call.
  const std::int32_t length_before = s.slots.lengths[0];
  CHECK_THROWS_AS(batched_observe_evict(s, active_set::all(), batch_probs{make_tensor_view<const float>(probs.data(), 3, 4, 0)},
                                        nullptr, &status),
                  invalid_argument);
  CHECK_THROWS_AS(batched_observe_evict(s, active_set::all(), batch_probs{make_tensor_view<const float>(probs.data(), 3, 2, 9)},
                                        nullptr, &status),
                  invalid_argument);
  CHECK_THROWS_AS(batched_append(s, active_set::all(), nullptr), invalid_argument);
  CHECK_THROWS_AS(batched_append(s, active_set::of_list(nullptr, 2), &status), invalid_argument);
  CHECK(s.slots.lengths[0] == length_before);
  CHECK(s.appended[0] == 1);
  CHECK(status == batch_status_clear);
  // Streams on reset: validated first.
  const std::int32_t list[2] = {0, 2};
  const std::uint64_t bad[2] = {5, max_random_stream + 1};
  CHECK_THROWS_AS(reset_batch_sequences(s, active_set::of_list(list, 2), bad), out_of_range);
  CHECK(s.slots.lengths[0] == 1);
  const std::uint64_t good[2] = {5, 6};
  reset_batch_sequences(s, active_set::of_list(list, 2), good);
  CHECK(s.streams[0] == 5);
  CHECK(s.streams[2] == 6);
  CHECK(s.streams[1] == 1);
  CHECK(s.slots.lengths[0] == 0);
  CHECK(s.slots.lengths[1] == 1);
}
