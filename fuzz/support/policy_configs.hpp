#pragma once
// Policy configurations and shapes decoded from the input: small budgets
// and shapes (so an input runs in well under a millisecond or so), now and
// then invalid (negative parts, protected tokens filling the budget, an
// out-of-range group_reduce, a capacity without the spare slot, query heads
// that are not a multiple of the KV heads).
#include <algorithm>
#include <cstdint>
#include <limits>

#include "fuzz_input.hpp"
#include "kvevict/policy/exact_greedy.hpp"
#include "kvevict/policy/h2o.hpp"
#include "kvevict/policy/random.hpp"
#include "kvevict/policy/recent_window.hpp"

namespace kvfuzz {

/// The largest capacity the harness builds: prompts stay within one
/// 64-row chunk of the canonical column sum.
constexpr std::int32_t max_capacity = 64;

inline std::int32_t budget_part(fuzz_input& in) { return in.one_in(32) ? -in.range(1, 2) : in.range(0, 6); }

inline kvevict::h2o_config decode_config(fuzz_input& in, kvevict::h2o_config*) {
  kvevict::h2o_config c;
  c.heavy = budget_part(in);
  c.recent = budget_part(in);
  c.reduce = in.one_in(32) ? static_cast<kvevict::group_reduce>(in.range(3, 255))
                           : static_cast<kvevict::group_reduce>(in.range(0, 2));
  c.sinks = in.one_in(3) ? budget_part(in) / 2 : 0;
  // Decays whose powers are exact in float (so the brute force may weigh
  // prompt rows with std::pow), now and then one the constructor refuses.
  const float decays[] = {1.0f, 1.0f, 0.5f, 0.25f, 0.0f};
  const float refused[] = {-0.5f, 1.5f, std::numeric_limits<float>::quiet_NaN()};
  c.decay = in.one_in(48) ? refused[in.range(0, 2)] : decays[in.range(0, 4)];
  return c;
}
inline kvevict::recent_window_config decode_config(fuzz_input& in, kvevict::recent_window_config*) {
  kvevict::recent_window_config c;
  c.sinks = budget_part(in);
  c.window = budget_part(in);
  return c;
}
inline kvevict::random_config decode_config(fuzz_input& in, kvevict::random_config*) {
  kvevict::random_config c;
  c.budget = in.range(1, 12);
  c.sinks = budget_part(in) / 2;
  c.recent = budget_part(in) / 2;
  c.seed = in.u64();
  return c;
}
inline kvevict::exact_greedy_config decode_config(fuzz_input& in, kvevict::exact_greedy_config*) {
  kvevict::exact_greedy_config c;
  c.budget = in.range(1, 12);
  c.recent = budget_part(in) / 2;
  c.sinks = budget_part(in) / 2;
  return c;
}

template <class Policy>
typename kvevict::policy_traits<Policy>::config_type decode_config(fuzz_input& in) {
  return decode_config(in, static_cast<typename kvevict::policy_traits<Policy>::config_type*>(nullptr));
}

/// The budget a config asks for (heavy + recent, sinks + window, or budget),
/// in 64 bits; it may be invalid.
inline std::int64_t config_budget(const kvevict::h2o_config& c) { return c.budget(); }
inline std::int64_t config_budget(const kvevict::recent_window_config& c) { return c.budget(); }
inline std::int64_t config_budget(const kvevict::random_config& c) { return c.budget; }
inline std::int64_t config_budget(const kvevict::exact_greedy_config& c) { return c.budget; }

/// A shape for `budget`: up to 3 sequences, 3 KV heads, groups of up to 4.
inline kvevict::policy_shape decode_shape(fuzz_input& in, std::int64_t budget) {
  kvevict::policy_shape s;
  s.num_seqs = in.range(1, 3);
  s.num_kv_heads = in.range(1, 3);
  s.num_q_heads = s.num_kv_heads * in.range(1, 4);
  if (in.one_in(32)) s.num_q_heads += 1;  // not a multiple (unless it happens to be)
  if (in.one_in(64)) s.num_seqs = in.range(-1, 0);
  const std::int64_t wanted = budget + 1 + in.range(0, 6);
  s.capacity = std::int32_t(std::clamp<std::int64_t>(wanted, 1, max_capacity));
  if (in.one_in(32)) s.capacity = std::int32_t(std::clamp<std::int64_t>(budget, 0, max_capacity));  // no spare slot
  return s;
}

}  // namespace kvfuzz
