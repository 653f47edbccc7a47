#pragma once
// The objective of the exact-greedy oracle (docs/policies.md, "exact_greedy"):
// for one query q, the error of evicting cached token v is
//
//     E(v) = || out(G \ {v}) - out(H) ||^2,
//
// with G the cached tokens, H the whole history (G plus the evicted set X)
// and out(S) softmax attention over S. Computed as written, out(G \ {v})
// comes from subtracting v's term from sums over G and out(H) - out(G \ {v})
// is a difference of two nearly equal vectors: both cancel catastrophically
// when v (or X) holds almost all of the weight. Instead, with R = X + {v} the
// tokens missing from G \ {v}, H splits into G \ {v} and R, so
//
//     out(H) = (1 - w) out(G \ {v}) + w out(R),   w = Z(R) / Z(H),
//     E(v)   = w^2 || out(G \ {v}) - out(R) ||^2,
//
// where every normaliser is a sum of positive terms, each in the frame of
// its own largest logit (so the largest term is 1). The one subtraction left,
// Z(G) - e_v for v other than G's top token, loses at most a factor 2, since
// the top token's term 1 stays in it; for the top token itself the sums over
// G without it are kept apart. docs/policies.md states the resulting error
// bound. Everything is O((|H| + |G|) * head_dim) per query.
//
// The pieces below are KVEVICT_HOST_DEVICE and use reproducible_math.hpp, so
// the CUDA kernel evaluates the same expressions in the same order and gets
// the same bits as the host.
#include <cstddef>
#include <cstdint>

#include "kvevict/config.hpp"
#include "kvevict/detail/reproducible_math.hpp"
#include "kvevict/dtype/convert.hpp"

namespace kvevict {

/// scale * (q . k) in double, four interleaved partial sums combined as
/// (s0 + s1) + (s2 + s3): the order every backend uses. q has stride
/// q_stride and any element type; k is a history row (float).
template <class Q>
KVEVICT_HOST_DEVICE KVEVICT_REPRODUCIBLE inline double history_logit(const Q* q, std::int64_t q_stride, const float* k,
                                                                     std::int32_t head_dim, float scale) noexcept {
  KVEVICT_FP_CONTRACT_OFF
  using detail::add;
  using detail::mul;
  double s[4] = {0.0, 0.0, 0.0, 0.0};
  std::int32_t i = 0;
  for (; i + 4 <= head_dim; i += 4)
    for (std::int32_t j = 0; j < 4; ++j) s[j] = add(s[j], mul(double(to_float(q[(i + j) * q_stride])), double(k[i + j])));
  for (; i < head_dim; ++i) s[0] = add(s[0], mul(double(to_float(q[i * q_stride])), double(k[i])));
  return mul(add(add(s[0], s[1]), add(s[2], s[3])), double(scale));
}

/// The softmax frames of one query over a history split into the cached set
/// G and the evicted set X. Each normaliser z_* is a sum of exp(logit - max)
/// over its set, in ascending position order; the matching numerators
/// (sums of exp(logit - max) * value, head_dim doubles each) live with the
/// caller: num_cached, num_rest, num_evicted.
struct leave_one_out_frames {
  double top_logit = -detail::infinity();      ///< max over G
  std::int32_t top = -1;                       ///< its smallest position
  double rest_logit = -detail::infinity();     ///< max over G without `top`
  double evicted_logit = -detail::infinity();  ///< max over X
  double z_cached = 0.0;   ///< over G, frame top_logit
  double z_rest = 0.0;     ///< over G without `top`, frame rest_logit
  double z_evicted = 0.0;  ///< over X, frame evicted_logit
};

namespace detail {

/// First pass: the maxima, for a token at `position` with `logit`.
KVEVICT_HOST_DEVICE inline void add_to_maxima(leave_one_out_frames& f, std::int32_t position, double logit,
                                              bool cached) noexcept {
  if (!cached) {
    if (logit > f.evicted_logit) f.evicted_logit = logit;
  } else if (f.top < 0 || logit > f.top_logit) {
    if (f.top >= 0) f.rest_logit = f.top_logit;  // the old top is the largest of the rest
    f.top_logit = logit;
    f.top = position;
  } else if (logit > f.rest_logit) {
    f.rest_logit = logit;
  }
}

}  // namespace detail

/// E(v) for the cached token at position v with `logit` and value row
/// `value`, given the frames and numerators of one query.
/// +inf when G = {v} (nothing would be left to attend to).
KVEVICT_HOST_DEVICE KVEVICT_REPRODUCIBLE inline double leave_one_out_error(
    const leave_one_out_frames& f, const double* num_cached, const double* num_rest, const double* num_evicted,
    std::int32_t v, double logit, const float* value, std::int32_t head_dim) noexcept {
  KVEVICT_FP_CONTRACT_OFF
  using detail::add;
  using detail::div;
  using detail::mul;
  using detail::sub;
  // out(G \ {v}) = num_g / z_g, in the frame of logit m_g.
  const bool top = v == f.top;
  if (top && f.z_rest == 0.0) return detail::infinity();
  const double e_v = top ? 0.0 : reproducible_exp(sub(logit, f.top_logit));
  const double z_g = top ? f.z_rest : sub(f.z_cached, e_v);
  const double m_g = top ? f.rest_logit : f.top_logit;
  // out(R), R = X + {v}: num_r = a * num_evicted + c * value over z_r, in frame m_r.
  double a = 0.0, c = 1.0, z_r = 1.0, m_r = logit;
  if (f.z_evicted > 0.0) {
    if (logit <= f.evicted_logit) {
      a = 1.0;
      c = reproducible_exp(sub(logit, f.evicted_logit));
      z_r = add(f.z_evicted, c);
      m_r = f.evicted_logit;
    } else {
      a = reproducible_exp(sub(f.evicted_logit, logit));
      z_r = add(mul(f.z_evicted, a), 1.0);
    }
  }
  // w = Z(R) / (Z(R) + Z(G \ {v})), both moved to the larger frame.
  double w;
  if (m_r >= m_g) {
    w = div(z_r, add(z_r, mul(z_g, reproducible_exp(sub(m_g, m_r)))));
  } else {
    const double zr = mul(z_r, reproducible_exp(sub(m_r, m_g)));
    w = div(zr, add(zr, z_g));
  }
  double sq = 0.0;
  for (std::int32_t i = 0; i < head_dim; ++i) {
    const double val = double(value[i]);
    const double num_g = top ? num_rest[i] : sub(num_cached[i], mul(e_v, val));
    const double out_g = div(num_g, z_g);
    const double out_r = div(add(mul(a, num_evicted[i]), mul(c, val)), z_r);
    const double diff = sub(out_g, out_r);
    sq = add(sq, mul(diff, diff));
  }
  return mul(mul(w, w), sq);
}

/// Scratch doubles leave_one_out_errors needs for a history of `rows` rows.
inline std::size_t leave_one_out_work_size(std::int32_t rows, std::int32_t head_dim) noexcept {
  return std::size_t(rows) + 3 * std::size_t(head_dim);
}

/// errors[j] += E(members[j]) for query q (stride q_stride), for the cached
/// positions members[0, n) (distinct, each below `rows`) of a history of
/// `rows` rows: keys and values are [rows][head_dim], row p holding position
/// p, and cached[p] != 0 exactly for the members. work:
/// leave_one_out_work_size doubles.
template <class Q>
KVEVICT_REPRODUCIBLE inline void leave_one_out_errors(const Q* q, std::int64_t q_stride, const float* keys,
                                                      const float* values, std::int32_t head_dim, float scale,
                                                      std::int32_t rows, const unsigned char* cached,
                                                      const std::int32_t* members, std::int32_t n, double* errors,
                                                      double* work) noexcept {
  KVEVICT_FP_CONTRACT_OFF
  using detail::add;
  using detail::mul;
  using detail::sub;
  double* logit = work;
  double* num_cached = work + rows;
  double* num_rest = num_cached + head_dim;
  double* num_evicted = num_rest + head_dim;
  leave_one_out_frames f;
  for (std::int32_t p = 0; p < rows; ++p) {
    logit[p] = history_logit(q, q_stride, keys + std::size_t(p) * head_dim, head_dim, scale);
    detail::add_to_maxima(f, p, logit[p], cached[p] != 0);
  }
  for (std::int32_t i = 0; i < head_dim; ++i) num_cached[i] = num_rest[i] = num_evicted[i] = 0.0;
  for (std::int32_t p = 0; p < rows; ++p) {  // ascending positions: the order every backend sums in
    const float* val = values + std::size_t(p) * head_dim;
    if (cached[p] == 0) {
      const double e = reproducible_exp(sub(logit[p], f.evicted_logit));
      f.z_evicted = add(f.z_evicted, e);
      for (std::int32_t i = 0; i < head_dim; ++i) num_evicted[i] = add(num_evicted[i], mul(e, double(val[i])));
      continue;
    }
    const double e = reproducible_exp(sub(logit[p], f.top_logit));
    f.z_cached = add(f.z_cached, e);
    for (std::int32_t i = 0; i < head_dim; ++i) num_cached[i] = add(num_cached[i], mul(e, double(val[i])));
    if (p == f.top) continue;
    const double r = reproducible_exp(sub(logit[p], f.rest_logit));
    f.z_rest = add(f.z_rest, r);
    for (std::int32_t i = 0; i < head_dim; ++i) num_rest[i] = add(num_rest[i], mul(r, double(val[i])));
  }
  for (std::int32_t j = 0; j < n; ++j) {
    const std::int32_t v = members[j];
    errors[j] = add(errors[j], leave_one_out_error(f, num_cached, num_rest, num_evicted, v, logit[v],
                                                   values + std::size_t(v) * head_dim, head_dim));
  }
}

}  // namespace kvevict
