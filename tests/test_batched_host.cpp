// The batched host backend against the brute-force reference
// (support/bruteforce_reference.hpp, the rules of docs/policies.md from
// scratch): on seeded streams for every policy x input kind x dtype (fp8
// included, with per-head scales) x layout x GQA group {1, 4, 8}, with
// ragged batches (idle sequences, active lists and flags) and random's
// request streams, every step must end with
// the reference's kept positions, victims, bitwise the same scores and the
// same K/V bytes. Each step's score increment is computed here from the
// input's definition (docs/semantics.md, "Scores"); for logits and queries
// one element's probability comes from the scalar rules attention_logit and
// probability_from_logit, which test_decode_rules holds to their own
// definitions. exact_greedy's batched API runs against its naive reference
// in test_exact_greedy. Then the batched semantics of their own: the status
// word, the size query, reset.
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
#include "support/bruteforce_reference.hpp"
#include "support/caches.hpp"
#include "support/state_invariants.hpp"
#include "support/h2o_draws.hpp"

namespace {

using namespace kvevict;
using kvtest::input_kind;
using kvtest::layout_kind;

template <class Policy>
auto draw_case(std::mt19937& rng) {
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  if constexpr (std::is_same_v<Policy, h2o_policy>) {
    return kvtest::h2o_case{kvtest::draw_h2o_config(pick, 4, 4)};
  } else if constexpr (std::is_same_v<Policy, recent_window_policy>) {
    return kvtest::recent_window_case{recent_window_config{pick(0, 3), pick(1, 5)}};
  } else {
    random_config c{pick(2, 8), 0, 0, std::uint64_t(rng())};
    c.sinks = pick(0, 1);
    c.recent = pick(0, c.budget - 1 - c.sinks);
    kvtest::random_case out;
    out.config = c;
    return out;
  }
}

template <class Case>
float decay_of(const Case& c) {
  if constexpr (std::is_same_v<Case, kvtest::h2o_case>) return c.config.decay;
  return 1.0f;
}
template <class Case>
group_reduce reduce_of(const Case& c) {
  if constexpr (std::is_same_v<Case, kvtest::h2o_case>) return c.config.reduce;
  return group_reduce::sum;
}

/// The batched observe + evict of one step with the input of kind `kind`;
/// with `one_launch`, the append and observe + evict in one call (step).
template <class Policy, class T, class View>
void observe_batched(batched_policy<Policy>& p, const kvtest::batch_step<T>& st, const kvtest::batch_dims& dm,
                     input_kind kind, const View& view, std::int32_t* victims, bool one_launch = false) {
  const std::int32_t B = dm.seqs, Hq = dm.q_heads(), H = dm.heads, W = dm.width(), D = dm.head_dim;
  const auto lse = make_tensor_view<const float>(st.lse.data(), B, Hq);
  const active_set active = st.active_set();
  if (one_launch) {
    REQUIRE(kind != input_kind::queries);
    if (kind == input_kind::probs)
      p.step(batch_probs{make_tensor_view<const float>(st.probs.data(), B, Hq, W)}, active, victims);
    else if (kind == input_kind::head_scores)
      p.step(batch_head_scores{make_tensor_view<const float>(st.increments.data(), B, H, W)}, active, victims);
    else
      p.step(batch_logits{make_tensor_view<const float>(st.logits.data(), B, Hq, W), lse, st.scale}, active, victims);
    return;
  }
  if (kind == input_kind::queries) {
    p.observe_evict(batch_queries<float>{make_tensor_view<const float>(st.q.data(), B, Hq, D), lse, st.scale}, view,
                    active, victims);
  } else if (kind == input_kind::probs) {
    p.observe_evict(batch_probs{make_tensor_view<const float>(st.probs.data(), B, Hq, W)}, active, victims);
  } else if (kind == input_kind::head_scores) {
    p.observe_evict(batch_head_scores{make_tensor_view<const float>(st.increments.data(), B, H, W)}, active, victims);
  } else {
    p.observe_evict(batch_logits{make_tensor_view<const float>(st.logits.data(), B, Hq, W), lse, st.scale}, active,
                    victims);
  }
}

/// What one step adds to the score of the token in `slot` of (b, h), from
/// the definition of each input (docs/semantics.md, "Scores"): the group
/// fold of the query heads' probabilities, or the head's own increment.
template <class T>
float increment(const kvtest::batch_step<T>& st, const kvtest::batch_dims& dm, input_kind kind, group_reduce reduce,
                std::int32_t b, std::int32_t h, std::int32_t slot, const std::vector<T>& key, float key_scale) {
  const std::int32_t Hq = dm.q_heads(), W = dm.width(), D = dm.head_dim, g = dm.group;
  if (kind == input_kind::head_scores) return st.increments[(std::size_t(b) * dm.heads + h) * W + slot];
  std::vector<float> xs;
  for (std::int32_t q = h * g; q < (h + 1) * g; ++q) {
    const std::size_t bq = std::size_t(b) * Hq + q;
    if (kind == input_kind::probs) {
      xs.push_back(st.probs[bq * W + slot]);
    } else if (kind == input_kind::logits) {
      xs.push_back(probability_from_logit(st.logits[bq * W + slot], st.scale, st.lse[bq], lse_base::natural));
    } else {  // an fp8 key is code x its head's scale (support/caches.hpp)
      const float logit = attention_logit(st.q.data() + bq * D, 1, key.data(), D, key_scale);
      xs.push_back(probability_from_logit(logit, st.scale, st.lse[bq], lse_base::natural));
    }
  }
  return kvtest::reduce_group(xs, reduce);
}

struct totals {
  std::int64_t streams = 0, steps = 0, evictions = 0, head_states = 0;
};

/// One seeded stream; with `one_launch` the engine writes each new token's
/// K/V rows to the next slots itself and one step call follows (queries
/// keep the two calls: the step takes no queries).
template <class Policy, class T>
void run_stream(std::uint32_t seed, layout_kind layout, std::int32_t group, input_kind kind, totals& tot,
                bool one_launch = false) {
  std::mt19937 rng(seed);
  auto ref_case = draw_case<Policy>(rng);
  const std::int32_t budget = ref_case.budget();
  const float decay = decay_of(ref_case);
  const group_reduce reduce = reduce_of(ref_case);
  kvtest::batch_dims dm;
  dm.seqs = std::uniform_int_distribution<int>(1, 4)(rng);
  dm.heads = std::uniform_int_distribution<int>(1, 2)(rng);
  dm.group = group;
  dm.head_dim = std::uniform_int_distribution<int>(0, 1)(rng) ? 8 : 12;
  dm.capacity = budget + 1 + std::uniform_int_distribution<int>(0, 2)(rng);
  const std::int32_t page = std::uniform_int_distribution<int>(1, 4)(rng);
  const std::int32_t steps = std::uniform_int_distribution<int>(10, 30)(rng);
  const std::int32_t B = dm.seqs, H = dm.heads, D = dm.head_dim;
  batched_policy<Policy> batched(policy_shape{B, H, dm.q_heads(), dm.capacity}, ref_case.config);
  std::vector<kvtest::ref_head<T>> ref(std::size_t(B) * H);  // [b * H + h]
  std::vector<std::int32_t> lengths(std::size_t(B), 0);
  const batch_state_view& s = batched.state();
  std::vector<std::int32_t> new_slots(std::size_t(B) * H, -1);  // one launch: where the engine wrote the new rows
  auto slot_of = [&](std::int32_t b, std::int32_t h, std::int32_t p) {
    if (one_launch && p == lengths[std::size_t(b)] - 1) return new_slots[std::size_t(b) * H + h];
    for (std::int32_t slot = 0; slot < dm.capacity; ++slot)
      if (s.slots.positions_of(b, h)[slot] == p) return slot;
    return -1;
  };
  kvtest::with_cache<T>(layout, B, H, dm.capacity, D, page, [&](const auto& view) {
    for (std::int32_t step = 0; step < steps; ++step) {
      CAPTURE(step);
      const kvtest::batch_step<T> st = kvtest::draw_step<T>(rng, dm, 0.25);
      if constexpr (std::is_same_v<Policy, random_policy>) {
        if (step == steps / 2 && B > 1) {  // a new request with a stream of its own on sequence 1
          const std::int32_t one = 1;
          const std::uint64_t stream = 1000 + seed;
          batched.reset(active_set::of_list(&one, 1), &stream);
          ref_case.streams[1] = stream;
          lengths[1] = 0;
          for (std::int32_t h = 0; h < H; ++h) ref[std::size_t(H + h)].clear();
        }
      }
      // The reference: each active sequence's new token at its next position.
      for (std::int32_t b = 0; b < B; ++b) {
        if (!st.active(b)) continue;
        for (std::int32_t h = 0; h < H; ++h) {
          kvtest::ref_token<T> t;
          const std::size_t row = (std::size_t(b) * H + h) * D;
          t.k.assign(st.k_new.begin() + std::ptrdiff_t(row), st.k_new.begin() + std::ptrdiff_t(row + D));
          t.v.assign(st.v_new.begin() + std::ptrdiff_t(row), st.v_new.begin() + std::ptrdiff_t(row + D));
          ref[std::size_t(b) * H + h].emplace(lengths[std::size_t(b)], std::move(t));
        }
        ++lengths[std::size_t(b)];
      }
      if (one_launch) {  // the engine's own append kernel: rows to next_slots, the state unchanged
        for (std::int32_t b = 0; b < B; ++b)
          for (std::int32_t h = 0; h < H && st.active(b); ++h) {
            const std::int32_t slot = s.slots.next_slots[s.head_index(b, h)];
            REQUIRE(slot >= 0);
            new_slots[std::size_t(b) * H + h] = slot;
            const std::size_t row = (std::size_t(b) * H + h) * D;
            std::memcpy(view.k_row(b, h, slot), st.k_new.data() + row, sizeof(T) * std::size_t(D));
            std::memcpy(view.v_row(b, h, slot), st.v_new.data() + row, sizeof(T) * std::size_t(D));
          }
      } else {
        batched.append(view, batch_rows<T>{make_tensor_view<const T>(st.k_new.data(), B, H, D)},
                       batch_rows<T>{make_tensor_view<const T>(st.v_new.data(), B, H, D)}, st.active_set());
        REQUIRE(batched.status_word() == batch_status_clear);
      }
      // Scores: decay * score (rounded) + this step's increment, per token;
      // the inputs are indexed by the slot the library put the token in.
      std::vector<std::vector<std::int32_t>> held(std::size_t(B) * H);  // slot of each position before evict
      for (std::int32_t b = 0; b < B; ++b) {
        if (!st.active(b)) continue;
        for (std::int32_t h = 0; h < H; ++h)
          for (auto& [p, tok] : ref[std::size_t(b) * H + h]) {
            const std::int32_t slot = slot_of(b, h, p);
            REQUIRE(slot >= 0);
            const volatile float decayed = decay * tok.score;
            tok.score = decayed + increment(st, dm, kind, reduce, b, h, slot, tok.k, view.k_scale(h));
          }
      }
      std::vector<std::int32_t> got(std::size_t(B) * H, -1);
      std::vector<std::vector<std::int32_t>> positions_before(std::size_t(B) * H);
      for (std::int32_t b = 0; b < B; ++b)
        for (std::int32_t h = 0; h < H; ++h) {
          std::vector<std::int32_t>& before = positions_before[std::size_t(b) * H + h];
          before.assign(s.slots.positions_of(b, h), s.slots.positions_of(b, h) + dm.capacity);
          if (one_launch && st.active(b)) before[std::size_t(new_slots[std::size_t(b) * H + h])] = lengths[std::size_t(b)] - 1;
        }
      observe_batched(batched, st, dm, kind, view, got.data(), one_launch);
      REQUIRE(batched.status_word() == batch_status_clear);
      // Evict: a head over its budget keeps what the rule keeps from scratch;
      // the victim slot is the one that held the dropped position.
      for (std::int32_t b = 0; b < B; ++b)
        for (std::int32_t h = 0; h < H; ++h) {
          kvtest::ref_head<T>& head = ref[std::size_t(b) * H + h];
          const std::int32_t victim = got[std::size_t(b) * H + h];
          if (!st.active(b) || std::int32_t(head.size()) <= budget) {
            CHECK(victim == -1);
            continue;
          }
          const std::vector<std::int32_t> keep = ref_case.keep(head, lengths[std::size_t(b)], b, h, 1);
          REQUIRE(std::int32_t(keep.size()) == budget);
          kvtest::ref_head<T> kept;
          for (std::int32_t p : keep) kept.emplace(p, head.at(p));
          std::int32_t dropped = -1;
          for (const auto& [p, tok] : head)
            if (!kept.count(p)) dropped = p;
          head = std::move(kept);
          REQUIRE(victim >= 0);
          CHECK(positions_before[std::size_t(b) * H + h][std::size_t(victim)] == dropped);
          ++tot.evictions;
        }
      // The library's state equals the reference's.
      kvtest::check_slot_invariants(s);
      for (std::int32_t b = 0; b < B; ++b) {
        REQUIRE(s.slots.lengths[b] == lengths[std::size_t(b)]);
        for (std::int32_t h = 0; h < H; ++h) {
          const kvtest::ref_head<T>& head = ref[std::size_t(b) * H + h];
          REQUIRE(s.slots.counts[s.head_index(b, h)] == std::int32_t(head.size()));
          for (std::int32_t slot = 0; slot < dm.capacity; ++slot) {
            const std::int32_t p = s.slots.positions_of(b, h)[slot];
            if (p < 0) continue;
            const auto it = head.find(p);
            REQUIRE_MESSAGE(it != head.end(), "the library keeps position ", p, " at b=", b, " h=", h);
            CHECK(std::memcmp(&s.scores_of(b, h)[slot], &it->second.score, sizeof(float)) == 0);
            CHECK(kvtest::same_bits(view.k_row(b, h, slot), it->second.k.data(), D));
            CHECK(kvtest::same_bits(view.v_row(b, h, slot), it->second.v.data(), D));
          }
          ++tot.head_states;
        }
      }
      ++tot.steps;
    }
  });
  ++tot.streams;
}

template <class Policy>
void run_policy(const char* name, int seeds_per_combo, bool one_launch = false) {
  totals tot;
  std::uint32_t seed = 1;
  for (input_kind kind : kvtest::all_inputs)
    for (layout_kind layout : kvtest::all_layouts)
      for (std::int32_t group : {1, 4, 8})
        for (int i = 0; i < seeds_per_combo && !(one_launch && kind == input_kind::queries); ++i, ++seed) {
          CAPTURE(seed);
          CAPTURE(std::string(kvtest::name(kind)));
          CAPTURE(std::string(kvtest::name(layout)));
          CAPTURE(group);
          switch (seed % 5) {
            case 0: run_stream<Policy, float>(seed, layout, group, kind, tot, one_launch); break;
            case 1: run_stream<Policy, half>(seed, layout, group, kind, tot, one_launch); break;
            case 2: run_stream<Policy, bfloat16>(seed, layout, group, kind, tot, one_launch); break;
            case 3: run_stream<Policy, fp8_e4m3>(seed, layout, group, kind, tot, one_launch); break;
            default: run_stream<Policy, fp8_e5m2>(seed, layout, group, kind, tot, one_launch); break;
          }
        }
  MESSAGE(std::string(name), ": ", tot.streams, " streams, ", tot.steps, " steps, ", tot.evictions,
          " evictions, ", tot.head_states, " (sequence, head) states compared");
  CHECK(tot.evictions > 1000);
}

}  // namespace

TEST_CASE("batched host h2o equals the brute-force reference, every input x dtype x layout x GQA") {
  run_policy<h2o_policy>("h2o", 12);
}
TEST_CASE("batched host recent_window equals first-sinks + last-window") {
  run_policy<recent_window_policy>("recent_window", 6);
}
TEST_CASE("batched host random equals the reference Philox draws, request streams included") {
  run_policy<random_policy>("random", 8);
}
TEST_CASE("one launch: batched_step equals the brute-force reference, every input x dtype x layout x GQA") {
  run_policy<h2o_policy>("h2o step", 2, true);
  run_policy<recent_window_policy>("recent_window step", 2, true);
  run_policy<random_policy>("random step", 2, true);
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
