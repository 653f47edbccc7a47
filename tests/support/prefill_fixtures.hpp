#pragma once
// Test support for the batched prefill tests, host (test_batched_prefill)
// and CUDA (test_cuda_prefill): random prompt batches and policy configs, so
// both draw the same kinds of cases, and a sequence's state as bytes.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <type_traits>
#include <vector>

#include "kvevict/batch/inputs.hpp"
#include "kvevict/batch/prefill.hpp"
#include "kvevict/batch/state.hpp"
#include "kvevict/policy/h2o.hpp"
#include "kvevict/policy/random.hpp"
#include "kvevict/policy/recent_window.hpp"
#include "kvevict/dtype/convert.hpp"
#include "kvevict/score_inputs.hpp"
#include "support/h2o_draws.hpp"

namespace kvtest {

enum class prefill_input { probs, sums, queries, none };

inline const char* name(prefill_input k) {
  switch (k) {
    case prefill_input::probs: return "probs";
    case prefill_input::sums: return "sums";
    case prefill_input::queries: return "queries";
    case prefill_input::none: return "none";
  }
  return "?";
}

/// Every input of one batched prefill call, in host memory; values beyond a
/// prompt (rows and columns >= L, the upper triangle) are NaN, so reading
/// them would be caught.
struct prompt_batch {
  std::int32_t B = 1, H = 1, g = 1, D = 8, cap = 8, M = 8;
  std::vector<std::int32_t> lengths;
  std::vector<float> probs;  // [B][Hq][M][M]
  std::vector<float> sums;   // [B][Hq][M]
  std::vector<float> q;      // [B][Hq][M][D]
  std::vector<float> lse;    // [B][Hq][M]
  float scale = 0.25f;
  kvevict::lse_base base = kvevict::lse_base::natural;
  std::vector<std::uint8_t> active;  // [B]
  std::vector<std::int32_t> list;
  bool use_list = false;

  std::int32_t Hq() const { return H * g; }
  kvevict::active_set active_set_of() const {
    return use_list ? kvevict::active_set::of_list(list.data(), std::int32_t(list.size()))
                    : kvevict::active_set::of_flags(active.data());
  }
  kvevict::prompt_lengths prompts() const { return {lengths.data(), M}; }
  std::size_t at(std::int32_t b, std::int32_t q_head, std::int32_t i, std::int32_t p) const {
    return ((std::size_t(b) * Hq() + q_head) * M + i) * M + p;
  }
  std::size_t row(std::int32_t b, std::int32_t q_head, std::int32_t i) const {
    return (std::size_t(b) * Hq() + q_head) * M + i;
  }
};

struct prompt_options {
  bool grid = false;    ///< probabilities on a grid of 1/256: sums exact in any order
  bool inputs = true;   ///< false: no probs and no queries (large shapes that use sums or none)
  const std::vector<std::int32_t>* lengths = nullptr;  ///< fixed prompt lengths (M = cap)
};

/// Ragged prompts: kept whole (L <= budget), the whole capacity, or any
/// length; M either the capacity or the longest prompt; about 80% of the
/// sequences active (sequence 0 always), as flags or a shuffled list.
inline prompt_batch draw_prompts(std::mt19937& rng, std::int32_t B, std::int32_t H, std::int32_t g, std::int32_t D,
                                 std::int32_t budget, std::int32_t cap, const prompt_options& options = {}) {
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  std::uniform_real_distribution<double> u(0.0, 1.0);
  prompt_batch d;
  d.B = B, d.H = H, d.g = g, d.D = D, d.cap = cap;
  d.lengths.resize(std::size_t(B));
  for (std::int32_t b = 0; b < B; ++b) {
    switch (pick(0, 3)) {
      case 0: d.lengths[std::size_t(b)] = pick(1, std::min(budget, cap)); break;
      case 1: d.lengths[std::size_t(b)] = cap; break;
      default: d.lengths[std::size_t(b)] = pick(1, cap); break;
    }
  }
  if (options.lengths) d.lengths = *options.lengths;
  d.M = pick(0, 1) || options.lengths ? cap : *std::max_element(d.lengths.begin(), d.lengths.end());
  const std::int32_t Hq = d.Hq(), M = d.M;
  const float nan = std::nanf("");
  d.probs.assign(options.inputs ? std::size_t(B) * Hq * M * M : 0, nan);
  d.sums.assign(std::size_t(B) * Hq * M, nan);
  d.q.assign(options.inputs ? std::size_t(B) * Hq * M * D : 0, nan);
  d.lse.assign(std::size_t(B) * Hq * M, nan);
  for (std::int32_t b = 0; b < B; ++b) {
    const std::int32_t L = d.lengths[std::size_t(b)];
    for (std::int32_t q = 0; q < Hq; ++q)
      for (std::int32_t i = 0; i < L; ++i) {
        if (options.inputs)
          for (std::int32_t p = 0; p <= i; ++p) {
            float x = u(rng) < 0.15 ? 0.25f : static_cast<float>(std::pow(u(rng), 4.0));
            if (options.grid) x = static_cast<float>(pick(0, 256)) / 256.0f;
            d.probs[d.at(b, q, i, p)] = x;
          }
        d.sums[d.row(b, q, i)] = u(rng) < 0.2 ? 1.5f : static_cast<float>(8.0 * std::pow(u(rng), 3.0));
        d.lse[d.row(b, q, i)] = static_cast<float>(1.0 + 3.0 * u(rng));
        if (options.inputs)
          for (std::int32_t e = 0; e < D; ++e)
            d.q[d.row(b, q, i) * D + e] = static_cast<float>(pick(0, 32)) / 16.0f - 1.0f;
      }
  }
  d.scale = pick(0, 1) ? 0.25f : 0.125f;
  d.base = pick(0, 1) ? kvevict::lse_base::natural : kvevict::lse_base::base2;
  d.use_list = pick(0, 1) == 1;
  d.active.assign(std::size_t(B), 0);
  for (std::int32_t b = 0; b < B; ++b)
    if (u(rng) < 0.8 || b == 0) {
      d.active[std::size_t(b)] = 1;
      d.list.push_back(b);
    }
  std::shuffle(d.list.begin(), d.list.end(), rng);
  return d;
}

/// x converted element by element to Q (query rows in the cache's dtype).
template <class Q>
std::vector<Q> converted(const std::vector<float>& x) {
  std::vector<Q> out(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) out[i] = kvevict::from_float<Q>(x[i]);
  return out;
}

/// A random config of h2o, recent_window or random; `budget` gets its budget.
template <class Policy>
typename kvevict::policy_traits<Policy>::config_type draw_prefill_config(std::mt19937& rng, std::int32_t& budget) {
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  if constexpr (std::is_same_v<Policy, kvevict::h2o_policy>) {
    const kvevict::h2o_config c = draw_h2o_config(pick, 8, 6);
    budget = static_cast<std::int32_t>(c.budget());
    return c;
  } else if constexpr (std::is_same_v<Policy, kvevict::recent_window_policy>) {
    kvevict::recent_window_config c{pick(0, 3), pick(1, 8)};
    budget = c.sinks + c.window;
    return c;
  } else {
    kvevict::random_config c{pick(2, 12), 0, 0, std::uint64_t(rng())};
    c.sinks = pick(0, std::min(2, c.budget - 1));
    c.recent = pick(0, c.budget - 1 - c.sinks);
    budget = c.budget;
    return c;
  }
}

/// Everything a batched state holds for sequence b, as bytes: slot tables,
/// both score buffers, counters and flags of its heads, its length and its
/// random stream.
inline std::vector<unsigned char> sequence_bytes(const kvevict::batch_state_view& st, std::int32_t b) {
  std::vector<unsigned char> out;
  auto put = [&](const void* p, std::size_t n) {
    const auto* c = static_cast<const unsigned char*>(p);
    out.insert(out.end(), c, c + n);
  };
  const std::size_t cap = static_cast<std::size_t>(st.capacity());
  for (std::int32_t h = 0; h < st.num_heads(); ++h) {
    const std::int64_t bh = st.head_index(b, h);
    put(st.slots.positions_of(b, h), cap * 4);
    put(st.buffer_of(b, h, 0), cap * 4);
    put(st.buffer_of(b, h, 1), cap * 4);
    put(&st.slots.counts[bh], 4);
    put(&st.slots.next_slots[bh], 4);
    put(&st.score_buffer[bh], 1);
    put(&st.appended[bh], 1);
  }
  put(&st.slots.lengths[b], 4);
  if (st.streams) put(&st.streams[b], 8);
  return out;
}

}  // namespace kvtest
