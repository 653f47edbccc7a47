#pragma once
// The objective of the exact-greedy oracle (DESIGN §6), in double precision.
//
// For a query q, a cached set G and a target output O (attention over the
// whole history), the error of evicting v is
//     || (N - e_v * val_v) / (Z - e_v) - O ||^2,
// with e_s = exp(q . k_s * scale - m), Z = sum e_s and N = sum e_s * val_s over
// G. One pass builds Z and N, so all |G| errors cost O(|G| * head_dim) instead
// of recomputing |G| softmaxes (O(|G|^2 * head_dim)).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

namespace kvevict {

/// Scratch doubles the two functions below need.
inline std::size_t leave_one_out_work_size(std::int32_t rows, std::int32_t head_dim) noexcept {
  return std::size_t(rows) + std::size_t(head_dim);
}

namespace detail {
// Four independent partial sums: the oracle reads the whole history every
// step, and a single accumulator chain would serialise on its latency.
inline double scaled_dot(const float* q, const float* k, std::int32_t d, float scale) noexcept {
  double acc[4] = {0.0, 0.0, 0.0, 0.0};
  std::int32_t i = 0;
  for (; i + 4 <= d; i += 4)
    for (std::int32_t j = 0; j < 4; ++j) acc[j] += double(q[i + j]) * double(k[i + j]);
  for (; i < d; ++i) acc[0] += double(q[i]) * double(k[i]);
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) * double(scale);
}

// Unnormalised softmax terms over rows[0, n): e[j] = exp(logit_j - max) and
// num = sum_j e[j] * values[rows[j]]; returns Z = sum_j e[j].
inline double softmax_terms(const float* q, const float* keys, const float* values, std::int32_t head_dim,
                            float scale, const std::int32_t* rows, std::int32_t n, double* e, double* num) {
  double m = -std::numeric_limits<double>::infinity();
  for (std::int32_t j = 0; j < n; ++j) {
    e[j] = scaled_dot(q, keys + std::size_t(rows[j]) * head_dim, head_dim, scale);
    m = std::max(m, e[j]);
  }
  std::fill_n(num, head_dim, 0.0);
  double z = 0.0;
  for (std::int32_t j = 0; j < n; ++j) {
    e[j] = std::exp(e[j] - m);
    z += e[j];
    const float* v = values + std::size_t(rows[j]) * head_dim;
    for (std::int32_t i = 0; i < head_dim; ++i) num[i] += e[j] * v[i];
  }
  return z;
}
}  // namespace detail

/// out = softmax over rows r of (q . keys[r] * scale) applied to values[r];
/// rows are given by `rows` (indices into keys/values, each head_dim long).
/// work: leave_one_out_work_size(n, head_dim) doubles.
inline void attention_output(const float* q, const float* keys, const float* values, std::int32_t head_dim,
                             float scale, const std::int32_t* rows, std::int32_t n, double* out, double* work) {
  const double z = detail::softmax_terms(q, keys, values, head_dim, scale, rows, n, work, out);
  for (std::int32_t i = 0; i < head_dim; ++i) out[i] /= z;
}

/// errors[j] += || output(G \ {rows[j]}) - target ||^2 for query q, for every
/// member j of G = rows[0, n). Evicting the only member with non-zero weight
/// leaves an empty softmax: its error is +inf.
/// work: leave_one_out_work_size(n, head_dim) doubles.
inline void add_leave_one_out_errors(const float* q, const float* keys, const float* values, std::int32_t head_dim,
                                     float scale, const std::int32_t* rows, std::int32_t n, const double* target,
                                     double* errors, double* work) {
  double* e = work;
  double* num = work + n;
  const double z = detail::softmax_terms(q, keys, values, head_dim, scale, rows, n, e, num);
  for (std::int32_t j = 0; j < n; ++j) {
    const double rest = z - e[j];
    if (!(rest > 0.0)) {
      errors[j] = std::numeric_limits<double>::infinity();
      continue;
    }
    const float* v = values + std::size_t(rows[j]) * head_dim;
    double err = 0.0;
    for (std::int32_t i = 0; i < head_dim; ++i) {
      const double diff = (num[i] - e[j] * v[i]) / rest - target[i];
      err += diff * diff;
    }
    errors[j] += err;
  }
}

}  // namespace kvevict
