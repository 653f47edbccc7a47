// The one-launch decode step on the host (batched_step): the contract of
// docs/semantics.md, "Batched steps", says it is batched_append followed by
// batched_observe_evict over the sequences that appended, with append's
// whole-sequence refusal. Checked here three ways:
//   - on seeded streams with bad values, full heads, refusals and the
//     retries and evict_to calls that recover from them, against a twin
//     state driven by the two calls: every array, victim and status word
//     equal after every step (the decisions themselves are checked against
//     brute force in test_batched_host, "one launch");
//   - the refusal and its status word, written out by hand;
//   - the row marks the CUDA kernel reads instead of other rows' slots
//     (state.hpp, row_marks), after every kind of call, 1 and 70 heads.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <algorithm>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kvevict/kvevict.hpp"
#include "support/state_invariants.hpp"

namespace {

using namespace kvevict;

template <class Policy>
struct raw_state {
  std::vector<unsigned char> memory;
  batch_state_view view;
  raw_state(const policy_shape& shape, const typename policy_traits<Policy>::config_type& c)
      : memory(batch_state_bytes<Policy>(shape, c)), view(make_batch_state<Policy>(memory.data(), memory.size(), shape, c)) {
    init_batch_state(view);
  }
};

template <class T>
void require_same_array(const T* a, const T* b, std::int64_t n, const char* what) {
  CAPTURE(std::string(what));
  if (n <= 0) return;
  REQUIRE(std::memcmp(a, b, sizeof(T) * std::size_t(n)) == 0);
}

/// Every array of two states of the same shape, bit for bit.
void require_same_state(const batch_state_view& a, const batch_state_view& b) {
  const std::int64_t heads = std::int64_t{a.num_seqs()} * a.num_heads(), slots = heads * a.capacity();
  require_same_array(a.slots.positions, b.slots.positions, slots, "positions");
  require_same_array(a.slots.counts, b.slots.counts, heads, "counts");
  require_same_array(a.slots.next_slots, b.slots.next_slots, heads, "next_slots");
  require_same_array(a.slots.lengths, b.slots.lengths, a.num_seqs(), "lengths");
  require_same_array(a.scores, b.scores, 2 * slots, "scores (both buffers)");
  require_same_array(a.score_buffer, b.score_buffer, heads, "score_buffer");
  require_same_array(a.appended, b.appended, heads, "appended");
  require_same_array(a.marks.lengths, b.marks.lengths, heads, "marks.lengths");
  require_same_array(a.marks.full, b.marks.full, 2 * std::int64_t{a.num_seqs()} * a.marks.words, "marks.full");
  if (a.streams) require_same_array(a.streams, b.streams, a.num_seqs(), "streams");
}

enum class input { probs, head_scores, logits };

/// One step's inputs over `width` slot columns, on grids every sum
/// represents; with probability `bad`, one (b, h) gets a bad value.
struct step_inputs {
  std::int32_t B, H, Hq, W;
  std::vector<float> probs, increments, logits, lse;

  step_inputs(std::mt19937& rng, std::int32_t B_, std::int32_t H_, std::int32_t g, std::int32_t W_, double bad)
      : B(B_), H(H_), Hq(H_ * g), W(W_) {
    auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
    probs.resize(std::size_t(B) * Hq * W);
    logits.resize(probs.size());
    increments.resize(std::size_t(B) * H * W);
    lse.assign(std::size_t(B) * Hq, 0.0f);
    for (float& x : probs) x = 0.125f * float(pick(0, 4));
    for (float& x : logits) x = -0.5f * float(pick(0, 8));
    for (float& x : increments) x = 0.25f * float(pick(-4, 4));
    if (std::uniform_real_distribution<double>(0, 1)(rng) < bad) {
      const std::int32_t b = pick(0, B - 1), h = pick(0, H - 1), s = pick(0, W - 1);
      const float values[] = {std::nanf(""), -0.25f, INFINITY};
      const float v = values[pick(0, 2)];
      for (std::int32_t q = h * g; q < (h + 1) * g; ++q) {
        probs[(std::size_t(b) * Hq + q) * W + std::size_t(s)] = v;
        logits[(std::size_t(b) * Hq + q) * W + std::size_t(s)] = v == -0.25f ? NAN : v;
      }
      increments[(std::size_t(b) * H + h) * W + std::size_t(s)] = v == -0.25f ? INFINITY : v;
    }
  }
};

/// calls f(in) with the input of kind k.
template <class F>
void with_input(const step_inputs& x, input k, F f) {
  switch (k) {
    case input::probs: return f(batch_probs{make_tensor_view<const float>(x.probs.data(), x.B, x.Hq, x.W)});
    case input::head_scores:
      return f(batch_head_scores{make_tensor_view<const float>(x.increments.data(), x.B, x.H, x.W)});
    default:
      return f(batch_logits{make_tensor_view<const float>(x.logits.data(), x.B, x.Hq, x.W),
                            make_tensor_view<const float>(x.lse.data(), x.B, x.Hq), 0.5f});
  }
}

template <class Policy>
typename policy_traits<Policy>::config_type draw_config(std::mt19937& rng) {
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  if constexpr (std::is_same_v<Policy, h2o_policy>) {
    h2o_config c{pick(0, 2), pick(1, 3)};
    c.sinks = pick(0, 1);
    c.reduce = static_cast<group_reduce>(pick(0, 2));
    c.decay = pick(0, 1) ? 1.0f : 0.5f;
    return c;
  } else if constexpr (std::is_same_v<Policy, recent_window_policy>) {
    return recent_window_config{pick(0, 2), pick(1, 4)};
  } else {
    random_config c{pick(2, 5), 0, 0, std::uint64_t(rng())};
    c.sinks = pick(0, 1);
    return c;
  }
}

struct step_totals {
  std::int64_t steps = 0, refused = 0, failed_heads = 0, evictions = 0;
};

/// One stream: `one` runs batched_step, `two` the two calls, and after each
/// step both are equal; refused sequences are recovered by a retry of the
/// failed heads or an evict_to, on both.
template <class Policy>
void run_twin_stream(std::uint32_t seed, input kind, step_totals& tot) {
  std::mt19937 rng(seed);
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  const auto config = draw_config<Policy>(rng);
  const std::int32_t B = pick(1, 4), H = pick(1, 3), g = kind == input::head_scores ? 1 : pick(1, 2);
  const std::int32_t budget = policy_traits<Policy>::rule(config, "test").budget;
  const policy_shape shape{B, H, H * g, budget + 1 + pick(0, 2)};
  raw_state<Policy> one(shape, config), two(shape, config);
  const std::int32_t W = shape.capacity;
  for (std::int32_t step = 0; step < 40; ++step) {
    CAPTURE(step);
    std::vector<std::uint8_t> flags(static_cast<std::size_t>(B));
    for (auto& f : flags) f = pick(0, 4) != 0;
    const active_set active = active_set::of_flags(flags.data());
    const step_inputs x(rng, B, H, g, W, 0.2);
    std::vector<std::int32_t> victims_one(std::size_t(B) * H, 7), victims_two(std::size_t(B) * H, 7);
    std::uint64_t status_one = batch_status_clear, status_two = batch_status_clear;
    with_input(x, kind, [&](const auto& in) {
      batched_step(one.view, active, in, victims_one.data(), &status_one);
      std::vector<std::int32_t> before(two.view.slots.lengths, two.view.slots.lengths + B);
      batched_append(two.view, active, &status_two);
      std::vector<std::int32_t> appended;
      for (std::int32_t b = 0; b < B; ++b) {
        if (two.view.slots.lengths[b] != before[std::size_t(b)]) appended.push_back(b);
        else if (flags[std::size_t(b)])
          for (std::int32_t h = 0; h < H; ++h) victims_two[std::size_t(b) * H + h] = -1;
      }
      batched_observe_evict(two.view, active_set::of_list(appended.data(), std::int32_t(appended.size())), in,
                            victims_two.data(), &status_two);
      tot.refused += std::int64_t(std::count(flags.begin(), flags.end(), 1)) - std::int64_t(appended.size());
    });
    CHECK(status_one == status_two);
    CHECK(victims_one == victims_two);
    require_same_state(one.view, two.view);
    kvtest::check_slot_invariants(one.view);
    for (std::int32_t v : victims_one) tot.evictions += v >= 0;
    if (status_one != batch_status_clear) {
      ++tot.failed_heads;
      // Recover on both: a retry of the heads still waiting (good input), or evict_to.
      const step_inputs good(rng, B, H, g, W, 0.0);
      std::uint64_t s1 = batch_status_clear, s2 = batch_status_clear;
      if (pick(0, 1)) {
        with_input(good, kind, [&](const auto& in) {
          batched_observe_evict(one.view, active_set::all().as_retry(), in, nullptr, &s1);
          batched_observe_evict(two.view, active_set::all().as_retry(), in, nullptr, &s2);
        });
      } else {
        std::vector<slot_move> moves(std::size_t(B) * H * W);
        std::vector<std::int32_t> counts(std::size_t(B) * H);
        batched_evict_to(one.view, active_set::all(), budget, moves.data(), counts.data(), &s1);
        batched_evict_to(two.view, active_set::all(), budget, moves.data(), counts.data(), &s2);
      }
      CHECK(s1 == s2);
      require_same_state(one.view, two.view);
      kvtest::check_slot_invariants(one.view);
    }
    ++tot.steps;
  }
}

template <class Policy>
void run_twin(const char* name) {
  step_totals tot;
  std::uint32_t seed = 100;
  for (input kind : {input::probs, input::head_scores, input::logits})
    for (int i = 0; i < 25; ++i, ++seed) {
      CAPTURE(seed);
      CAPTURE(int(kind));
      run_twin_stream<Policy>(seed, kind, tot);
    }
  MESSAGE(std::string(name), ": ", tot.steps, " steps, ", tot.refused, " sequences refused, ", tot.failed_heads,
          " steps with a status, ", tot.evictions, " evictions");
  CHECK(tot.refused > 20);
  CHECK(tot.evictions > 200);
}

}  // namespace

TEST_CASE("batched_step equals append + observe_evict over the sequences that appended: h2o") {
  run_twin<h2o_policy>("h2o");
}
TEST_CASE("batched_step equals append + observe_evict over the sequences that appended: recent_window") {
  run_twin<recent_window_policy>("recent_window");
}
TEST_CASE("batched_step equals append + observe_evict over the sequences that appended: random") {
  run_twin<random_policy>("random");
}

TEST_CASE("batched_step refuses a sequence with a full head as a whole, naming the first full head") {
  // 2 sequences x 3 heads, h2o budget 2 (1 heavy + 1 recent), capacity 3.
  const std::int32_t B = 2, H = 3, cap = 3;
  raw_state<h2o_policy> st(policy_shape{B, H, H, cap}, h2o_config{1, 1});
  std::vector<float> probs(std::size_t(B) * H * cap, 0.25f);
  const batch_probs in{make_tensor_view<const float>(probs.data(), B, H, cap)};
  std::uint64_t status = batch_status_clear;
  for (int i = 0; i < 3; ++i) batched_step(st.view, active_set::all(), in, nullptr, &status);
  REQUIRE(status == batch_status_clear);
  for (std::int32_t bh = 0; bh < B * H; ++bh) REQUIRE(st.view.slots.counts[bh] == 2);
  // Step 4: (0, 1) and (0, 2) read a NaN; they keep budget + 1 tokens, no free slot.
  probs[std::size_t((0 * H + 1) * cap + 0)] = NAN;
  probs[std::size_t((0 * H + 2) * cap + 1)] = NAN;
  std::vector<std::int32_t> victims(std::size_t(B) * H, 9);
  batched_step(st.view, active_set::all(), in, victims.data(), &status);
  CHECK(batch_status::unpack(status).code == batch_code::nan_input);
  CHECK(batch_status::unpack(status).head == 1);
  CHECK(st.view.slots.next_slots[1] == -1);
  CHECK(st.view.slots.next_slots[2] == -1);
  CHECK(st.view.slots.counts[1] == 3);
  CHECK(victims[0] >= 0);  // (0, 0) stepped and evicted
  CHECK(victims[1] == -1);
  CHECK(victims[2] == -1);
  // Step 5: sequence 0 is refused whole (head 0 had room), sequence 1 steps.
  probs.assign(probs.size(), 0.25f);
  status = batch_status_clear;
  std::vector<std::vector<std::int32_t>> rows0;
  for (std::int32_t h = 0; h < H; ++h)
    rows0.emplace_back(st.view.slots.positions_of(0, h), st.view.slots.positions_of(0, h) + cap);
  const std::int32_t length1 = st.view.slots.lengths[1];
  batched_step(st.view, active_set::all(), in, victims.data(), &status);
  const batch_status refusal = batch_status::unpack(status);
  CHECK(refusal.code == batch_code::no_free_slot);
  CHECK(refusal.sequence == 0);
  CHECK(refusal.head == 1);
  CHECK(victims[0] == -1);
  CHECK(victims[1] == -1);
  CHECK(victims[2] == -1);
  CHECK(victims[3] >= 0);
  CHECK(st.view.slots.lengths[0] == 4);
  CHECK(st.view.slots.lengths[1] == length1 + 1);
  for (std::int32_t h = 0; h < H; ++h) {  // sequence 0's rows are as they were
    CHECK(st.view.slots.counts[st.view.head_index(0, h)] == (h == 0 ? 2 : 3));
    CHECK(std::vector<std::int32_t>(st.view.slots.positions_of(0, h), st.view.slots.positions_of(0, h) + cap) ==
          rows0[std::size_t(h)]);
  }
  kvtest::check_slot_invariants(st.view);
}

TEST_CASE("batched_step checks its arguments before anything changes") {
  raw_state<h2o_policy> st(policy_shape{2, 2, 4, 4}, h2o_config{1, 2});
  std::vector<float> probs(2 * 4 * 4, 0.25f);
  std::uint64_t status = batch_status_clear;
  const std::vector<unsigned char> before = st.memory;
  const batch_probs in{make_tensor_view<const float>(probs.data(), 2, 4, 4)};
  auto refused = [&](auto call, const char* fragment) {
    try {
      call();
      FAIL("not refused");
    } catch (const error& e) {
      const std::string what = e.what();
      CAPTURE(what);
      CHECK(what.find(fragment) != std::string::npos);
    }
    CHECK(st.memory == before);
  };
  refused([&] { batched_step(st.view, active_set::all().as_retry(), in, nullptr, &status); }, "retry");
  refused([&] { batched_step(st.view, active_set::all(), in, nullptr, nullptr); }, "status");
  const batch_probs narrow{make_tensor_view<const float>(probs.data(), 2, 3, 4)};
  refused([&] { batched_step(st.view, active_set::all(), narrow, nullptr, &status); }, "probs.extents[1]");
  batch_state_view no_marks = st.view;
  no_marks.marks.full = nullptr;
  refused([&] { batched_step(no_marks, active_set::all(), in, nullptr, &status); }, "state.marks.full");
  batch_state_view wrong_words = st.view;
  wrong_words.marks.words = 2;
  refused([&] { batched_step(wrong_words, active_set::all(), in, nullptr, &status); }, "state.marks.words");
  refused([&] { batched_append(wrong_words, active_set::all(), &status); }, "state.marks.words");
}

TEST_CASE("row marks: every call that sets next slots or lengths keeps them, 1 to 70 heads") {
  for (std::int32_t H : {1, 3, 64, 70}) {
    CAPTURE(H);
    std::mt19937 rng(static_cast<std::uint32_t>(H));
    auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
    const std::int32_t B = 3, budget = 3, cap = 8, prompt = 6;
    const policy_shape shape{B, H, H, cap};
    batched_policy<h2o_policy> p(shape, h2o_config{1, 2});
    const batch_state_view& st = p.state();
    kvtest::check_row_marks(st);
    auto cache = make_bhsd_cache<float>(B, H, cap, 4);
    std::uint64_t status = batch_status_clear;
    for (int op = 0; op < 60; ++op) {
      CAPTURE(op);
      std::vector<float> probs(std::size_t(B) * H * cap, 0.125f);
      if (pick(0, 5) == 0) probs[std::size_t(pick(0, B * H - 1)) * cap] = NAN;  // leaves a head full
      const batch_probs in{make_tensor_view<const float>(probs.data(), B, H, cap)};
      status = batch_status_clear;
      switch (pick(0, 7)) {
        case 0: batched_step(st, active_set::all(), in, nullptr, &status); break;
        case 1:
          batched_append(st, active_set::all(), &status);
          batched_observe_evict(st, active_set::all(), in, nullptr, &status);
          break;
        case 2: batched_observe_evict(st, active_set::all().as_retry(), in, nullptr, &status); break;
        case 3: {
          std::vector<slot_move> moves(std::size_t(B) * H * cap);
          std::vector<std::int32_t> counts(std::size_t(B) * H);
          batched_evict_to(st, active_set::all(), pick(2, budget), moves.data(), counts.data(), &status);
          break;
        }
        case 4: {
          // Several tokens, then evict frees one, then evict_to: to the
          // budget (a full head gets a free slot) or above it (every hole
          // refilled: a head with a free slot becomes full).
          batched_append_tokens(st, active_set::all(), pick(1, 3), &status);
          batched_observe_evict(st, active_set::all(), in, nullptr, &status);
          std::vector<slot_move> moves(std::size_t(B) * H * cap);
          std::vector<std::int32_t> counts(std::size_t(B) * H);
          if (pick(0, 3)) batched_evict_to(st, active_set::all(), pick(budget, budget + 1), moves.data(), counts.data(),
                                           &status);
          break;
        }
        case 5: {
          const std::int32_t dest = pick(0, B - 1), source = pick(0, B - 1);
          if (dest != source) p.fork(active_set::of_list(&dest, 1), &source);
          break;
        }
        case 6: {
          const std::int32_t b = pick(0, B - 1);
          p.reset(active_set::of_list(&b, 1));
          std::vector<std::int32_t> lengths(std::size_t(B), 0);
          lengths[std::size_t(b)] = prompt;
          std::vector<float> sums(std::size_t(B) * H * prompt, 0.5f);
          for (float& x : sums) x = 0.25f * float(pick(0, 8));
          batched_prefill(st, active_set::of_list(&b, 1), prompt_lengths{lengths.data(), prompt},
                          batch_prefill_sums{make_tensor_view<const float>(sums.data(), B, H, prompt)}, cache.view(),
                          nullptr, &status);
          break;
        }
        default: {
          batched_policy<h2o_policy> copy(shape, h2o_config{1, 2});
          copy_state(st, copy.state());
          kvtest::check_row_marks(copy.state());
          const std::int32_t b = pick(0, B - 1);
          p.reset(active_set::of_list(&b, 1));
          break;
        }
      }
      kvtest::check_row_marks(st);
    }
  }
}
