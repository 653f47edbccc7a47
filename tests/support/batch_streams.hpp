#pragma once
// Test support: seeded random decode streams for the batched API. Each step
// draws which sequences step (a list or flags, some idle), the new K/V rows,
// and every score input at once (probabilities, per-head increments, logits
// and queries with LSE), so one driver can feed any input kind to two
// implementations and compare them.
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "kvevict/batch/inputs.hpp"
#include "kvevict/dtype/convert.hpp"
#include "kvevict/score_inputs.hpp"
#include "support/caches.hpp"

namespace kvtest {

enum class input_kind { probs, head_scores, logits, queries };
inline constexpr input_kind all_inputs[] = {input_kind::probs, input_kind::head_scores, input_kind::logits,
                                            input_kind::queries};

inline const char* name(input_kind k) {
  switch (k) {
    case input_kind::probs: return "probs";
    case input_kind::head_scores: return "head_scores";
    case input_kind::logits: return "logits";
    case input_kind::queries: return "queries";
  }
  return "?";
}

/// The sizes of one stream.
struct batch_dims {
  std::int32_t seqs = 1, heads = 1, group = 1, head_dim = 8, capacity = 8;
  std::int32_t width() const { return capacity; }  // slot dimension of the inputs
  std::int32_t q_heads() const { return heads * group; }
};

/// Everything one step may need; T is the K/V dtype.
template <class T>
struct batch_step {
  std::vector<std::int32_t> list;     // active sequences when use_list
  std::vector<std::uint8_t> flags;    // [B] otherwise
  bool use_list = false;
  std::vector<T> k_new, v_new;        // [B][H][D]
  std::vector<float> probs, logits;   // [B][Hq][W]
  std::vector<float> increments;      // [B][H][W]
  std::vector<float> lse;             // [B][Hq]
  std::vector<float> q;               // [B][Hq][D]
  float scale = 0.25f;

  bool active(std::int32_t b) const {
    if (!use_list) return flags[std::size_t(b)] != 0;
    for (std::int32_t x : list)
      if (x == b) return true;
    return false;
  }
  kvevict::active_set active_set() const {
    return use_list ? kvevict::active_set::of_list(list.data(), std::int32_t(list.size()))
                    : kvevict::active_set::of_flags(flags.data());
  }
};

/// Draws a step. Values sit on grids that every dtype represents exactly;
/// probabilities include exact ties and zeros.
template <class T>
batch_step<T> draw_step(std::mt19937& rng, const batch_dims& dm, double idle) {
  batch_step<T> st;
  const std::int32_t B = dm.seqs, H = dm.heads, Hq = dm.q_heads(), W = dm.width(), D = dm.head_dim;
  std::uniform_real_distribution<double> u(0.0, 1.0);
  st.use_list = u(rng) < 0.5;
  st.flags.assign(std::size_t(B), 0);
  for (std::int32_t b = 0; b < B; ++b)
    if (u(rng) >= idle) {
      st.flags[std::size_t(b)] = 1;
      st.list.push_back(b);
    }
  std::shuffle(st.list.begin(), st.list.end(), rng);
  st.k_new.resize(std::size_t(B) * H * D);
  st.v_new.resize(st.k_new.size());
  for (T& x : st.k_new) x = random_value<T>(rng);
  for (T& x : st.v_new) x = random_value<T>(rng);
  st.probs.resize(std::size_t(B) * Hq * W);
  for (float& x : st.probs) x = u(rng) < 0.2 ? 0.25f : static_cast<float>(std::pow(u(rng), 4.0));
  st.logits.resize(st.probs.size());
  for (float& x : st.logits) x = static_cast<float>(std::floor(u(rng) * 64.0) / 8.0 - 4.0);
  st.increments.resize(std::size_t(B) * H * W);
  for (float& x : st.increments) x = static_cast<float>(std::floor(u(rng) * 16.0) / 16.0 - 0.25);
  st.lse.resize(std::size_t(B) * Hq);
  for (float& x : st.lse) x = static_cast<float>(1.0 + 2.0 * u(rng));
  st.q.resize(std::size_t(B) * Hq * D);
  for (float& x : st.q) x = static_cast<float>(std::floor(u(rng) * 32.0) / 16.0 - 1.0);
  return st;
}

}  // namespace kvtest
