// Regression tests of the batched API's reliability (docs/reliability.md):
// malformed views and active sets are refused before anything changes,
// refused data names a (sequence, head) that the call left unchanged, and
// the status word can neither hide a refusal nor keep one after the
// documented retry. Each test case reproduces one defect of an independent
// bad-input battery; the state is compared byte for byte (the whole state
// memory) where a call must not have changed it.
#include <doctest/doctest.h>

#include <cmath>
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
