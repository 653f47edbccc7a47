#pragma once
// What the demos measure and print: attention as an engine's kernel computes
// it (float), the error and attention mass each policy keeps against the
// full cache, and the results table.
#include <kvevict/kvevict.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "demo_options.hpp"
#include "demo_workload.hpp"

namespace demo {

/// Softmax attention of q over `n` rows given by row(j); writes the weights
/// to probs[j] and returns the output in out. Everything in float, as an
/// engine's kernel would accumulate.
template <class Row>
void attend(const float* q, std::int32_t n, std::int32_t d, float scale, Row row, float* probs, float* out,
            const std::int32_t* skip_free = nullptr) {
  float m = -INFINITY;
  for (std::int32_t j = 0; j < n; ++j) {
    if (skip_free && skip_free[j] < 0) continue;
    const auto* k = row(j, true);
    float acc[8] = {};  // independent partial sums, so the loop vectorises
    std::int32_t i = 0;
    for (; i + 8 <= d; i += 8)
      for (std::int32_t u = 0; u < 8; ++u) acc[u] += q[i + u] * kvevict::to_float(k[i + u]);
    for (; i < d; ++i) acc[0] += q[i] * kvevict::to_float(k[i]);
    probs[j] = (((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]))) * scale;
    m = std::max(m, probs[j]);
  }
  float z = 0.0f;
  for (std::int32_t j = 0; j < n; ++j) {
    if (skip_free && skip_free[j] < 0) {
      probs[j] = 0.0f;
      continue;
    }
    probs[j] = std::exp(probs[j] - m);
    z += probs[j];
  }
  std::fill_n(out, d, 0.0f);
  for (std::int32_t j = 0; j < n; ++j) {
    if (probs[j] == 0.0f) continue;
    probs[j] /= z;
    const auto* v = row(j, false);
    for (std::int32_t i = 0; i < d; ++i) out[i] += probs[j] * kvevict::to_float(v[i]);
  }
}

struct metrics {
  double err_sum = 0.0, err_max = 0.0, mass_sum = 0.0, seconds = 0.0;
  std::int64_t samples = 0, steps = 0;
};

/// The lengths of the ragged batch: sequence b is 5% shorter than b - 1,
/// and at least budget + 2 so every sequence evicts.
inline std::vector<std::int32_t> ragged_lengths(const options& o) {
  std::vector<std::int32_t> length(static_cast<std::size_t>(o.seqs));
  for (std::int32_t b = 0; b < o.seqs; ++b)
    length[std::size_t(b)] = std::max(o.budget_tokens() + 2, o.steps - o.steps * b / 20);
  return length;
}

/// The K/V bytes of the full cache: every token of every sequence.
inline std::size_t full_bytes(const options& o, std::size_t element_size) {
  std::size_t bytes = 0;
  for (std::int32_t len : ragged_lengths(o)) bytes += std::size_t(len) * o.heads * o.head_dim * 2 * element_size;
  return bytes;
}

/// The workload and the full cache it would fill: step(b, t) produces
/// sequence b's token t (K/V rows of every head, as the dtype rounds them,
/// and the group's queries) and the full cache's attention for its queries.
template <class T>
class full_reference {
 public:
  explicit full_reference(const options& o)
      : o_(o), length_(ragged_lengths(o)), scale_(1.0f / std::sqrt(static_cast<float>(o.head_dim))) {
    workload_config wc;
    wc.head_dim = o.head_dim;
    wc.seed = o.seed;
    for (std::int32_t b = 0; b < o.seqs; ++b)
      for (std::int32_t h = 0; h < o.heads; ++h) streams_.emplace_back(wc, b, h, length_[std::size_t(b)]);
    const std::size_t rows = std::size_t(o.seqs) * o.heads * o.steps;
    k_.resize(rows * o.head_dim);
    v_.resize(k_.size());
    const std::size_t q_rows = std::size_t(o.seqs) * o.heads * o.group;
    new_k.resize(std::size_t(o.seqs) * o.heads * o.head_dim);
    new_v.resize(new_k.size());
    q.resize(q_rows * o.head_dim);
    out.resize(q.size());
    probs.resize(q_rows * o.steps);
    kf_.resize(std::size_t(o.head_dim));
    vf_.resize(kf_.size());
  }

  float scale() const noexcept { return scale_; }
  const std::vector<std::int32_t>& lengths() const noexcept { return length_; }

  void step(std::int32_t b, std::int32_t t) {
    const std::int32_t H = o_.heads, D = o_.head_dim, L = o_.steps, g = o_.group;
    for (std::int32_t h = 0; h < H; ++h) {
      head_stream& st = streams_[std::size_t(b * H + h)];
      st.token(t, kf_.data(), vf_.data());
      T* nk = &new_k[(std::size_t(b) * H + h) * D];
      T* nv = &new_v[(std::size_t(b) * H + h) * D];
      for (std::int32_t i = 0; i < D; ++i) {
        nk[i] = kvevict::from_float<T>(kf_[std::size_t(i)]);
        nv[i] = kvevict::from_float<T>(vf_[std::size_t(i)]);
      }
      const std::size_t row = ((std::size_t(b) * H + h) * L + t) * D;
      std::copy_n(nk, D, &k_[row]);
      std::copy_n(nv, D, &v_[row]);
      for (std::int32_t j = 0; j < g; ++j) st.query(&q[(std::size_t(b) * H * g + h * g + j) * D]);
    }
    for (std::int32_t qh = 0; qh < H * g; ++qh) {
      const std::size_t base = (std::size_t(b) * H + qh / g) * L * D;
      const std::size_t bq = std::size_t(b) * H * g + qh;
      attend(
          &q[bq * D], t + 1, D, scale_,
          [&](std::int32_t p, bool key) -> const T* { return (key ? k_.data() : v_.data()) + base + std::size_t(p) * D; },
          &probs[bq * L], &out[bq * D]);
    }
  }

  // This step's data, by sequence: new_k / new_v [B][H][D], q and out
  // [B][Hq][D], probs [B][Hq][steps] (the full cache's attention weights).
  std::vector<T> new_k, new_v;
  std::vector<float> q, out, probs;

 private:
  options o_;
  std::vector<std::int32_t> length_;
  float scale_;
  std::vector<head_stream> streams_;
  std::vector<T> k_, v_;  // [B][H][steps][D]
  std::vector<float> kf_, vf_;
};

/// Adds one (sequence, query head) sample taken after the cache first
/// filled: the relative output error against the full cache, and the share
/// of the full cache's attention mass on the positions the policy holds.
template <class Held>
void add_sample(metrics& m, const float* out, const float* full_out, std::int32_t d, const float* full_probs,
                std::int32_t capacity, Held held_position) {
  double diff = 0.0, ref = 0.0, mass = 0.0;
  for (std::int32_t i = 0; i < d; ++i) {
    const double a = out[i], f = full_out[i];
    diff += (a - f) * (a - f);
    ref += f * f;
  }
  for (std::int32_t s = 0; s < capacity; ++s) {
    const std::int32_t p = held_position(s);
    if (p >= 0) mass += full_probs[p];
  }
  const double rel = std::sqrt(diff / ref);
  m.err_sum += rel;
  m.err_max = std::max(m.err_max, rel);
  m.mass_sum += mass;
  ++m.samples;
}

inline void print_header(const options& o, const char* dtype, const char* extra_column) {
  const std::vector<std::int32_t> length = ragged_lengths(o);
  std::printf("kvevict demo: %d sequences (%d..%d tokens) x %d KV heads x %d query heads, head_dim %d, %s, %s, "
              "budget %d tokens (%.0f%% of %d; h2o %d heavy + %d recent; recent_window 4 sinks)\n\n",
              o.seqs, length.back(), length.front(), o.heads, o.heads * o.group, o.head_dim, dtype, o.layout.c_str(),
              o.budget_tokens(), 100.0 * o.budget_tokens() / o.steps, o.steps, o.half_budget(), o.half_budget());
  std::printf("%-14s %12s %8s %14s %14s %16s %16s%s\n", "policy", "KV bytes", "% full", "mean rel err", "max rel err",
              "attention kept", "evict us/step", extra_column);
}

inline void print_full_row(std::size_t bytes) {
  std::printf("%-14s %12zu %7.1f%% %14.4f %14.4f %15.1f%% %16s\n", "full", bytes, 100.0, 0.0, 0.0, 100.0, "-");
}

inline void print_row(const std::string& name, std::size_t bytes, std::size_t full, const metrics& m,
                      const char* extra = "") {
  const double n = double(std::max<std::int64_t>(m.samples, 1));
  std::printf("%-14s %12zu %7.1f%% %14.4f %14.4f %15.1f%% %16.1f%s\n", name.c_str(), bytes,
              100.0 * double(bytes) / double(full), m.err_sum / n, m.err_max, 100.0 * m.mass_sum / n,
              1e6 * m.seconds / double(std::max<std::int64_t>(m.steps, 1)), extra);
}

inline void print_footer(const char* timing) {
  std::printf("\nerrors and attention kept are averaged over every (sequence, query head, step) after the cache "
              "first fills;\nevict us/step is %s.\n", timing);
}

}  // namespace demo
