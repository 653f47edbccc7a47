// Regression tests of the batched API's reliability (docs/reliability.md):
// malformed views and active sets are refused before anything changes,
// refused data names a (sequence, head) that the call left unchanged, and
// the status word can neither hide a refusal nor keep one after the
// documented retry. Each test case reproduces one defect of an independent
// bad-input battery. "Unchanged" is every byte of the state memory where a
// call must write nothing, and the state without its scratch where a
// refused observe may have written the spare score buffer.
#include <doctest/doctest.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "kvevict/kvevict.hpp"

namespace {

using namespace kvevict;

/// A batched state in memory of the test's own, so "unchanged" can mean
/// every byte of it.
template <class Policy>
struct layer {
  std::vector<unsigned char> memory;
  batch_state_view st;
  std::uint64_t status = batch_status_clear;

  layer(const policy_shape& shape, const typename policy_traits<Policy>::config_type& config,
        const history_extent& history = {})
      : memory(batch_state_bytes<Policy>(shape, config, history)) {
    st = make_batch_state<Policy>(memory.data(), memory.size(), shape, config, history);
    init_batch_state(st);
  }
  batch_status take_status() {
    const batch_status s = batch_status::unpack(status);
    status = batch_status_clear;
    return s;
  }
};

/// What a batched state holds apart from its scratch (the spare score
/// buffer, victim_scratch), which a refused observe may write: slot table,
/// current scores, flags, streams.
std::vector<unsigned char> visible_state(const batch_state_view& st) {
  std::vector<unsigned char> out;
  const auto add = [&out](const void* p, std::size_t bytes) {
    const auto* c = static_cast<const unsigned char*>(p);
    out.insert(out.end(), c, c + bytes);
  };
  const std::size_t heads = std::size_t(st.num_seqs()) * std::size_t(st.num_heads());
  add(st.slots.positions, heads * std::size_t(st.capacity()) * sizeof(std::int32_t));
  add(st.slots.counts, heads * sizeof(std::int32_t));
  add(st.slots.next_slots, heads * sizeof(std::int32_t));
  add(st.slots.lengths, std::size_t(st.num_seqs()) * sizeof(std::int32_t));
  add(st.score_buffer, heads);
  add(st.appended, heads);
  if (st.streams) add(st.streams, std::size_t(st.num_seqs()) * sizeof(std::uint64_t));
  for (std::int32_t b = 0; b < st.num_seqs(); ++b)
    for (std::int32_t h = 0; h < st.num_heads(); ++h)
      add(st.scores_of(b, h), std::size_t(st.capacity()) * sizeof(float));
  return out;
}

/// The message throw_if_error gives for `word` (empty when it does not throw).
std::string message_of(std::uint64_t word) {
  try {
    throw_if_error(word, "test");
  } catch (const error& e) {
    return e.what();
  }
  return {};
}

}  // namespace

TEST_CASE("status word: a bad prompt length is reported as the length, a bad list entry by its position and value") {
  layer<recent_window_policy> l(policy_shape{3, 2, 2, 8}, recent_window_config{1, 3});
  auto cache = make_bhsd_cache<float>(3, 2, 8, 4);
  SUBCASE("a negative prompt length") {
    const std::int32_t lengths[3] = {4, -3, 5};
    const std::vector<unsigned char> before = l.memory;
    const std::int32_t one = 1;
    batched_prefill(l.st, active_set::of_list(&one, 1), prompt_lengths{lengths, 8}, cache.view(), nullptr,
                    &l.status);
    CHECK(l.memory == before);
    const std::string message = message_of(l.status);
    const batch_status s = l.take_status();
    CHECK(s.code == batch_code::bad_length);
    CHECK(s.sequence == 1);
    CHECK(s.index == -3);  // not 2^26 - 3
    CHECK(message.find("index -3 (the prompt length)") != std::string::npos);
  }
  SUBCASE("a prompt length beyond what the word holds reads as the largest index, never as a small one") {
    const std::int32_t lengths[3] = {4, (1 << 26) + 5, 5};
    const std::int32_t one = 1;
    batched_prefill(l.st, active_set::of_list(&one, 1), prompt_lengths{lengths, 8}, cache.view(), nullptr,
                    &l.status);
    const batch_status s = l.take_status();
    CHECK(s.code == batch_code::bad_length);
    CHECK(s.index == batch_status_limits::max_index);
  }
  SUBCASE("a list entry outside [0, num_seqs): its position and its value, no sequence") {
    const std::int32_t list[3] = {0, 2, 7};
    l.status = batch_status_clear;
    batched_append(l.st, active_set::of_list(list, 3), &l.status);
    const std::string message = message_of(l.status);
    const batch_status s = l.take_status();
    CHECK(s.code == batch_code::bad_sequence);
    CHECK(s.entry == 2);
    CHECK(s.index == 7);
    CHECK(s.sequence == -1);
    CHECK(s.head == -1);
    CHECK(message.find("active-list entry 2") != std::string::npos);
    CHECK(message.find("is 7") != std::string::npos);
    CHECK(message.find("sequence 2") == std::string::npos);  // the position is not a sequence
    CHECK(l.st.slots.lengths[0] == 1);  // the good entries stepped
    CHECK(l.st.slots.lengths[2] == 1);
    const std::int32_t negative[1] = {-4};
    batched_append(l.st, active_set::of_list(negative, 1), &l.status);
    const batch_status n = l.take_status();
    CHECK(n.entry == 0);
    CHECK(n.index == -4);
  }
}

TEST_CASE("active list: a repeated sequence index steps nothing and is reported, on every batched call") {
  // 3 sequences x 2 heads, h2o budget 3 (1 heavy + 2 recent), capacity 6.
  layer<h2o_policy> l(policy_shape{3, 2, 2, 6}, h2o_config{1, 2});
  auto cache = make_bhsd_cache<float>(3, 2, 6, 2);
  const std::vector<float> k(3 * 2 * 2, 1.0f), v(3 * 2 * 2, 2.0f), probs(3 * 2 * 6, 0.125f);
  const batch_rows<float> k_new{make_tensor_view<const float>(k.data(), 3, 2, 2)};
  const batch_rows<float> v_new{make_tensor_view<const float>(v.data(), 3, 2, 2)};
  const batch_probs in{make_tensor_view<const float>(probs.data(), 3, 2, 6)};
  const std::int32_t twice[2] = {1, 1}, mixed[3] = {0, 2, 0};
  const auto refused = [&](std::int32_t sequence, std::int32_t position) {
    const batch_status s = l.take_status();
    CHECK(s.code == batch_code::repeated_sequence);
    CHECK(s.sequence == sequence);
    CHECK(s.index == position);  // the first entry that repeats an earlier one
    CHECK(s.entry == position);
  };
  SUBCASE("append, with and without the scatter, and append_tokens: the sequence does not grow at all") {
    std::vector<unsigned char> before = l.memory;
    const std::vector<float> k_before = cache.k_storage();
    batched_append(l.st, active_set::of_list(twice, 2), cache.view(), k_new, v_new, &l.status);
    CHECK(l.memory == before);  // not two tokens, not one
    CHECK(cache.k_storage() == k_before);
    refused(1, 1);
    batched_append(l.st, active_set::of_list(twice, 2), &l.status);
    CHECK(l.memory == before);
    refused(1, 1);
    batched_append_tokens(l.st, active_set::of_list(twice, 2), 2, &l.status);
    CHECK(l.memory == before);  // not four tokens
    refused(1, 1);
    batched_append(l.st, active_set::of_list(mixed, 3), &l.status);  // sequence 2 steps, 0 does not
    CHECK(l.st.slots.lengths[0] == 0);
    CHECK(l.st.slots.lengths[1] == 0);
    CHECK(l.st.slots.lengths[2] == 1);
    refused(0, 2);
    CHECK_THROWS_AS(throw_if_error(pack_status(0, 0, 2, batch_code::repeated_sequence)), invalid_argument);
  }
  SUBCASE("observe + evict and evict_to leave the sequence as it was, without a misleading second-visit code") {
    for (int step = 0; step < 2; ++step) {
      batched_append(l.st, active_set::all(), &l.status);
      batched_observe_evict(l.st, active_set::all(), in, nullptr, &l.status);
    }
    batched_append(l.st, active_set::all(), &l.status);
    REQUIRE(l.status == batch_status_clear);
    const std::vector<unsigned char> before = l.memory;
    batched_observe_evict(l.st, active_set::of_list(twice, 2), in, nullptr, &l.status);
    CHECK(l.memory == before);
    refused(1, 1);  // not not_appended: the first visit did not step either
    batched_observe_evict(l.st, active_set::all(), in, nullptr, &l.status);
    REQUIRE(l.status == batch_status_clear);
    const std::vector<unsigned char> observed = l.memory;
    REQUIRE(l.st.slots.counts[l.st.head_index(1, 0)] == 3);  // above the target: evict_to would change it
    batched_evict_to(l.st, active_set::of_list(twice, 2), 2, cache.view(), nullptr, &l.status);
    CHECK(l.memory == observed);
    refused(1, 1);
  }
  SUBCASE("prefill of a repeated sequence does not run (the second visit would say not_empty)") {
    layer<recent_window_policy> w(policy_shape{3, 2, 2, 6}, recent_window_config{1, 2});
    const std::int32_t lengths[3] = {5, 5, 5};
    const std::vector<unsigned char> before = w.memory;
    batched_prefill(w.st, active_set::of_list(twice, 2), prompt_lengths{lengths, 6}, cache.view(), nullptr,
                    &w.status);
    CHECK(w.memory == before);
    const batch_status s = w.take_status();
    CHECK(s.code == batch_code::repeated_sequence);
    CHECK(s.sequence == 1);
  }
  SUBCASE("reset, which has no status word, throws naming the entry") {
    const std::vector<unsigned char> before = l.memory;
    const std::uint64_t streams[2] = {5, 7};
    try {
      reset_batch_sequences(l.st, active_set::of_list(twice, 2), streams);
      FAIL("a repeated entry was accepted");
    } catch (const invalid_argument& e) {
      CHECK(std::string(e.what()).find("'active.list[1]'") != std::string::npos);
    }
    CHECK(l.memory == before);
  }
}

TEST_CASE("state view: a null victim_scratch is refused where the call would write through it") {
  std::vector<float> probs(2 * 1 * 4, 0.25f);
  const batch_probs in{make_tensor_view<const float>(probs.data(), 2, 1, 4)};
  const auto refused = [](auto call, const std::vector<unsigned char>& memory) {
    const std::vector<unsigned char> before = memory;
    try {
      call();
      FAIL("a null state.victim_scratch was accepted");
    } catch (const invalid_argument& e) {
      CHECK(std::string(e.what()).find("'state.victim_scratch'") != std::string::npos);
    }
    CHECK(memory == before);
  };
  SUBCASE("random's observe + evict needs none (its victim is a minimum of keys) and runs the same without it") {
    layer<random_policy> l(policy_shape{2, 1, 1, 4}, random_config{2, 0, 0, 9});
    layer<random_policy> twin(policy_shape{2, 1, 1, 4}, random_config{2, 0, 0, 9});
    batch_state_view edited = l.st;
    edited.victim_scratch = nullptr;
    std::vector<std::int32_t> got(2), want(2);
    for (int step = 0; step < 5; ++step) {
      batched_append(edited, active_set::all(), &l.status);
      batched_append(twin.st, active_set::all(), &twin.status);
      batched_observe_evict(edited, active_set::all(), in, got.data(), &l.status);
      batched_observe_evict(twin.st, active_set::all(), in, want.data(), &twin.status);
      CHECK(got == want);
    }
    CHECK(l.status == batch_status_clear);
    CHECK(visible_state(l.st) == visible_state(twin.st));
  }
  SUBCASE("evict_to of every policy refills its holes through it") {
    layer<h2o_policy> l(policy_shape{2, 1, 1, 4}, h2o_config{1, 1});
    auto cache = make_bhsd_cache<float>(2, 1, 4, 2);
    for (int step = 0; step < 2; ++step) {
      batched_append(l.st, active_set::all(), &l.status);
      batched_observe_evict(l.st, active_set::all(), in, nullptr, &l.status);
    }
    REQUIRE(l.status == batch_status_clear);
    batch_state_view edited = l.st;
    edited.victim_scratch = nullptr;
    std::vector<slot_move> moves(2 * 4);
    std::vector<std::int32_t> counts(2);
    refused([&] { batched_evict_to(edited, active_set::all(), 1, cache.view(), nullptr, &l.status); }, l.memory);
    refused([&] { batched_evict_to(edited, active_set::all(), 1, moves.data(), counts.data(), &l.status); },
            l.memory);
  }
}

TEST_CASE("input views: negative strides, a zero stride on an extent above 1, overflowing strides are refused") {
  layer<h2o_policy> l(policy_shape{2, 1, 1, 4}, h2o_config{1, 2});
  batched_append(l.st, active_set::all(), &l.status);
  std::vector<float> probs(2 * 1 * 4, 0.25f);
  const std::vector<unsigned char> before = l.memory;
  const auto refused = [&](const tensor_view<const float, 3>& view, const char* arg) {
    CAPTURE(arg);
    try {
      batched_observe_evict(l.st, active_set::all(), batch_probs{view}, nullptr, &l.status);
      FAIL("the view was accepted");
    } catch (const invalid_argument& e) {
      CHECK(std::string(e.what()).find(arg) != std::string::npos);
    }
    CHECK(l.memory == before);
    CHECK(l.status == batch_status_clear);
  };
  // The buffer holds sequence 1 first: a negative sequence stride reads sequence 0 before it.
  refused(make_strided_view<const float, 3>(probs.data() + 4, {2, 1, 4}, {-4, 4, 1}), "'probs.strides[0]'");
  refused(make_strided_view<const float, 3>(probs.data(), {2, 1, 4}, {4, 4, 0}), "'probs.strides[2]'");
  refused(make_strided_view<const float, 3>(probs.data(), {2, 1, 4}, {std::int64_t{1} << 62, 4, 1}),
          "'probs.strides[0]'");
  refused(make_strided_view<const float, 3>(probs.data(), {2, 1, 4}, {4, 4, std::numeric_limits<std::int64_t>::min()}),
          "'probs.strides[2]'");
  // A dimension of extent 1 may have any non-negative stride (it is never stepped).
  batched_observe_evict(l.st, active_set::all(),
                        batch_probs{make_strided_view<const float, 3>(probs.data(), {2, 1, 4}, {4, 0, 1})}, nullptr,
                        &l.status);
  CHECK(l.status == batch_status_clear);

  SUBCASE("the K/V rows of append and the per-sequence inputs are checked by the same rule") {
    auto cache = make_bhsd_cache<float>(2, 1, 4, 2);
    const std::vector<float> rows(2 * 2, 1.0f);
    const batch_rows<float> good{make_tensor_view<const float>(rows.data(), 2, 1, 2)};
    const batch_rows<float> backwards{make_strided_view<const float, 3>(rows.data() + 2, {2, 1, 2}, {-2, 2, 1})};
    const std::vector<unsigned char> appended = l.memory;
    CHECK_THROWS_AS(batched_append(l.st, active_set::all(), cache.view(), backwards, good, &l.status),
                    invalid_argument);
    CHECK(l.memory == appended);
    h2o_policy p(policy_shape{1, 1, 1, 4}, h2o_config{1, 2});
    p.append(0);
    const decode_probs negative{make_strided_view<const float, 2>(probs.data() + 3, {1, 4}, {4, -1})};
    CHECK_THROWS_WITH_AS(p.observe(0, negative), doctest::Contains("'probs.strides[1]'"), invalid_argument);
    p.observe(0, decode_probs{make_tensor_view<const float>(probs.data(), 1, 4)});  // still due: nothing changed
  }
}

TEST_CASE("state view: out-of-range enum values and protections are refused where they enter, not read as a default") {
  layer<h2o_policy> l(policy_shape{1, 1, 1, 4}, h2o_config{1, 2});
  batched_append(l.st, active_set::all(), &l.status);
  const std::vector<float> probs(4, 0.25f);
  const batch_probs in{make_tensor_view<const float>(probs.data(), 1, 1, 4)};
  const std::vector<unsigned char> before = l.memory;
  const auto refused = [&](const batch_state_view& edited, const char* arg) {
    CAPTURE(arg);
    try {
      batched_observe_evict(edited, active_set::all(), in, nullptr, &l.status);
      FAIL("the edited state view was accepted");
    } catch (const invalid_argument& e) {
      CHECK(std::string(e.what()).find(arg) != std::string::npos);
    }
    CHECK_THROWS_AS(batched_append(edited, active_set::all(), &l.status), invalid_argument);
    CHECK(l.memory == before);
  };
  batch_state_view edited = l.st;
  edited.rule.reduce = static_cast<group_reduce>(9);  // folded as sum before
  refused(edited, "'state.rule.reduce'");
  edited = l.st;
  edited.rule.victim = static_cast<victim_rule>(7);  // "oldest" on one path, "lowest score" on another
  refused(edited, "'state.rule.victim'");
  for (const float decay : {1.5f, -0.25f, std::nanf(""), std::numeric_limits<float>::infinity()}) {
    edited = l.st;
    edited.rule.decay = decay;  // a score decay outside [0, 1] would grow scores without bound
    refused(edited, "'state.rule.decay'");
  }
  edited = l.st;
  edited.rule.protect.sinks = -1;
  refused(edited, "'state.rule.protect.sinks'");
  edited = l.st;
  edited.rule.protect.recent = -2;
  refused(edited, "'state.rule.protect.recent'");
  edited = l.st;
  edited.rule.protect = {2, 2};  // more protected than the budget of 3 keeps
  refused(edited, "'state.rule.protect'");

  SUBCASE("segmented_select's end") {
    const float scores[4] = {3, 1, 2, 0};
    segment_set keys;
    keys.scores = scores;
    keys.stride = 4;
    keys.max_length = 4;
    keys.num_segments = 1;
    std::int32_t indices[2] = {-7, -7};
    selection_output out;
    out.indices = indices;
    out.index_stride = 2;
    CHECK_THROWS_WITH_AS(segmented_select(keys, static_cast<select_end>(5), selection_count{2, nullptr}, out),
                         doctest::Contains("'end'"), invalid_argument);
    CHECK(indices[0] == -7);
    std::vector<unsigned char> workspace(segmented_select_workspace_bytes(keys));
    CHECK_THROWS_AS(segmented_select(workspace.data(), workspace.size(), keys, static_cast<select_end>(5),
                                     selection_count{2, nullptr}, out),
                    invalid_argument);
    CHECK(indices[0] == -7);
  }
}

TEST_CASE("segmented_select: strides whose last segment's offset does not fit are refused") {
  // Stride 2^62 floats: segment 1's offset wraps to segment 0's keys.
  const float scores[8] = {3, 1, 2, 0, 5, 4, 7, 6};
  segment_set keys;
  keys.scores = scores;
  keys.stride = std::int64_t{1} << 62;
  keys.max_length = 4;
  keys.num_segments = 2;
  std::int32_t indices[4] = {-7, -7, -7, -7};
  std::uint8_t mask[8] = {};
  selection_output out;
  out.indices = indices;
  out.index_stride = 2;
  const selection_count two{2, nullptr};
  CHECK_THROWS_WITH_AS(segmented_select(keys, select_end::top, two, out), doctest::Contains("'keys.stride'"),
                       invalid_argument);
  CHECK(indices[0] == -7);
  keys.stride = 4;
  out.index_stride = std::int64_t{1} << 62;
  CHECK_THROWS_WITH_AS(segmented_select(keys, select_end::top, two, out), doctest::Contains("'out.index_stride'"),
                       invalid_argument);
  out.index_stride = 2;
  out.mask = mask;
  out.mask_stride = std::numeric_limits<std::int64_t>::max();
  CHECK_THROWS_WITH_AS(segmented_select(keys, select_end::top, two, out), doctest::Contains("'out.mask_stride'"),
                       invalid_argument);
  // A negative index stride is refused even when nothing is selected.
  out.mask = nullptr;
  out.index_stride = -3;
  CHECK_THROWS_WITH_AS(segmented_select(keys, select_end::top, selection_count{0, nullptr}, out),
                       doctest::Contains("'out.index_stride'"), invalid_argument);
  CHECK(indices[0] == -7);
  // One segment: no offset beyond the first, any stride >= max_length fits.
  keys.num_segments = 1;
  keys.stride = std::int64_t{1} << 62;
  out.index_stride = 2;
  segmented_select(keys, select_end::top, two, out);
  CHECK(indices[0] == 0);
  CHECK(indices[1] == 2);
}

TEST_CASE("the documented retry after a refused head ends with a clear status and a clean run's state") {
  // docs/integration.md, "After a bad input": (1, 0) gets a NaN; the retry
  // with the corrected input for the sequence completes the step of the
  // refused head alone: the heads that stepped are skipped, not reported.
  const std::int32_t B = 3, H = 2, cap = 5;
  for (const bool retry_all : {false, true}) {
    CAPTURE(retry_all);
    batched_policy<h2o_policy> failed(policy_shape{B, H, H, cap}, h2o_config{2, 2});
    batched_policy<h2o_policy> clean(policy_shape{B, H, H, cap}, h2o_config{2, 2});
    std::vector<float> probs(std::size_t(B) * H * cap);
    const auto view = make_tensor_view<const float>(probs.data(), B, H, cap);
    const std::int32_t one = 1;
    for (int step = 0; step < 12; ++step) {
      CAPTURE(step);
      for (std::size_t i = 0; i < probs.size(); ++i) probs[i] = float((i * 7 + std::size_t(step) * 3) % 11) / 16.0f;
      failed.append();
      clean.append();
      std::vector<std::int32_t> want(std::size_t(B) * H, -9), got(want.size(), -9);
      clean.observe_evict(batch_probs{view}, active_set::all(), want.data());
      if (step == 6) {
        const std::size_t bad = std::size_t((1 * H + 0) * cap + 1);
        const float good = probs[bad];
        probs[bad] = std::nanf("");
        failed.observe_evict(batch_probs{view}, active_set::all(), got.data());
        CHECK_THROWS_AS(failed.check(), non_finite_error);
        probs[bad] = good;
        const active_set retry = retry_all ? active_set::all().as_retry() : active_set::of_list(&one, 1).as_retry();
        failed.observe_evict(batch_probs{view}, retry, got.data());
        CHECK(failed.status_word() == batch_status_clear);  // (1, 1) had stepped: skipped, not not_appended
      } else {
        failed.observe_evict(batch_probs{view}, active_set::all(), got.data());
      }
      CHECK_NOTHROW(failed.check());
      CHECK(got == want);  // a skipped head keeps the victim the first call reported
      const batch_state_view& f = failed.state();
      const batch_state_view& c = clean.state();
      for (std::int32_t b = 0; b < B; ++b)
        for (std::int32_t h = 0; h < H; ++h)
          for (std::int32_t s = 0; s < cap; ++s) {
            REQUIRE(f.slots.positions_of(b, h)[s] == c.slots.positions_of(b, h)[s]);
            if (f.slots.positions_of(b, h)[s] >= 0)
              CHECK(std::memcmp(&f.scores_of(b, h)[s], &c.scores_of(b, h)[s], sizeof(float)) == 0);
          }
    }
  }
}

TEST_CASE("a retry still refuses a pending head's bad input, and only observe + evict takes one") {
  layer<h2o_policy> l(policy_shape{2, 1, 1, 4}, h2o_config{1, 2});
  std::vector<float> probs(2 * 4, 0.25f);
  const batch_probs in{make_tensor_view<const float>(probs.data(), 2, 1, 4)};
  batched_append(l.st, active_set::all(), &l.status);
  probs[4] = std::nanf("");  // sequence 1
  batched_observe_evict(l.st, active_set::all(), in, nullptr, &l.status);
  CHECK(l.take_status().sequence == 1);
  const std::vector<unsigned char> before = visible_state(l.st);
  batched_observe_evict(l.st, active_set::all().as_retry(), in, nullptr, &l.status);  // still NaN
  CHECK(visible_state(l.st) == before);
  const batch_status again = l.take_status();
  CHECK(again.code == batch_code::nan_input);
  CHECK(again.sequence == 1);
  // Without the retry the stepped head is a protocol error, as before.
  probs[4] = 0.25f;
  batched_observe_evict(l.st, active_set::all(), in, nullptr, &l.status);
  CHECK(l.take_status().code == batch_code::not_appended);
  CHECK(l.st.appended[l.st.head_index(1, 0)] == 0);  // but sequence 1 stepped
  // Append, evict_to, prefill and reset refuse a retry set: it means nothing there.
  const std::vector<unsigned char> stepped = l.memory;
  CHECK_THROWS_WITH_AS(batched_append(l.st, active_set::all().as_retry(), &l.status),
                       doctest::Contains("'active.retry'"), invalid_argument);
  CHECK_THROWS_AS(reset_batch_sequences(l.st, active_set::all().as_retry()), invalid_argument);
  CHECK(l.memory == stepped);
}

TEST_CASE("status word: a word initialised to 0 (or holding no known code) cannot pass for a clear one") {
  CHECK_FALSE(batch_status::unpack(0).ok());
  CHECK(batch_status::unpack(0).code == batch_code::bad_status_word);
  CHECK_THROWS_WITH_AS(throw_if_error(0), doctest::Contains("batch_status_clear"), invalid_argument);
  CHECK_THROWS_AS(throw_if_error(pack_status(2, 1, 3, batch_code::ok)), invalid_argument);
  CHECK_THROWS_AS(throw_if_error(pack_status(0, 0, 0, static_cast<batch_code>(40))), invalid_argument);
  CHECK_NOTHROW(throw_if_error(batch_status_clear));

  // A host call with such a word: the refusal cannot lower it, and the check says why.
  layer<h2o_policy> l(policy_shape{1, 1, 1, 4}, h2o_config{1, 2});
  std::vector<float> probs(4, std::nanf(""));
  l.status = 0;
  batched_append(l.st, active_set::all(), &l.status);
  const std::vector<unsigned char> before = visible_state(l.st);
  batched_observe_evict(l.st, active_set::all(), batch_probs{make_tensor_view<const float>(probs.data(), 1, 1, 4)},
                        nullptr, &l.status);
  CHECK(visible_state(l.st) == before);  // refused
  CHECK_THROWS_AS(throw_if_error(l.status), invalid_argument);  // was: no error at all
}

TEST_CASE("scatter: the rows' strides are checked by the same rule as every input view") {
  // scatter compares its rows' extents itself; a stride of 2^62 between
  // heads read far outside the rows.
  auto cache = make_bhsd_cache<float>(1, 2, 4, 2);
  const std::vector<float> rows(2 * 2, 1.0f);
  const std::int32_t slots[2] = {0, 0};
  const std::vector<float> k_before = cache.k_storage(), v_before = cache.v_storage();
  const auto good = make_tensor_view<const float>(rows.data(), 2, 2);
  const auto far = make_strided_view<const float, 2>(rows.data(), {2, 2}, {std::int64_t{1} << 62, 1});
  CHECK_THROWS_WITH_AS(scatter(cache.view(), 0, slots, far, good), doctest::Contains("'k_new.strides[0]'"),
                       invalid_argument);
  CHECK_THROWS_WITH_AS(
      scatter(cache.view(), 0, slots, make_strided_view<const float, 2>(rows.data() + 2, {2, 2}, {-2, 1}), good),
      doctest::Contains("'k_new.strides[0]'"), invalid_argument);
  CHECK_THROWS_WITH_AS(
      scatter(cache.view(), 0, slots, good, make_strided_view<const float, 2>(rows.data(), {2, 2}, {0, 1})),
      doctest::Contains("'v_new.strides[0]'"), invalid_argument);
  CHECK(cache.k_storage() == k_before);
  CHECK(cache.v_storage() == v_before);
}
