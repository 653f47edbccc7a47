#pragma once
// Test support: softmax attention in quadruple precision (__float128 where
// the compiler has it, long double otherwise), written from the definition,
// as the reference for the exact-greedy error and its bound.
#include <cmath>
#include <cstdint>
#include <map>
#include <vector>

namespace kvtest {

#if defined(__SIZEOF_FLOAT128__)
using wide = __float128;
inline constexpr double wide_epsilon = 1.93e-34;  // 2^-112
#else
using wide = long double;
inline constexpr double wide_epsilon = 1.1e-19;  // x87 extended; degrades gracefully elsewhere
#endif

/// exp in `wide`: x = k ln2 + r, Taylor series of exp(r) to 1e-45, times 2^k.
inline wide wide_exp(wide x) {
  const wide ln2 = wide(0.6931471805599453) + wide(2.3190468138462996e-17);
  const double kd = std::floor(static_cast<double>(x / ln2) + 0.5);
  const long k = static_cast<long>(kd);
  const wide r = x - wide(kd) * ln2;
  wide term = 1, sum = 1;
  for (int n = 1; n < 40; ++n) {
    term = term * r / wide(n);
    sum += term;
  }
  wide scale = 1, base = k >= 0 ? wide(2) : wide(0.5);
  for (unsigned long e = static_cast<unsigned long>(k >= 0 ? k : -k); e; e >>= 1) {
    if (e & 1) scale *= base;
    base *= base;
  }
  return sum * scale;
}

using rows_map = std::map<std::int32_t, std::vector<float>>;  // position -> row

/// Softmax attention of q over the positions `set`, from scratch in wide.
inline std::vector<wide> wide_attention(const std::vector<float>& q, const rows_map& keys, const rows_map& values,
                                        const std::vector<std::int32_t>& set, double scale) {
  std::vector<wide> logit;
  wide m = 0;
  for (std::size_t j = 0; j < set.size(); ++j) {
    wide l = 0;
    for (std::size_t i = 0; i < q.size(); ++i) l += wide(q[i]) * wide(keys.at(set[j])[i]);
    logit.push_back(l * wide(scale));
    if (j == 0 || logit.back() > m) m = logit.back();
  }
  std::vector<wide> out(q.size(), wide(0));
  wide z = 0;
  for (std::size_t j = 0; j < set.size(); ++j) {
    const wide e = wide_exp(logit[j] - m);
    z += e;
    for (std::size_t i = 0; i < q.size(); ++i) out[i] += e * wide(values.at(set[j])[i]);
  }
  for (wide& x : out) x /= z;
  return out;
}

/// The exact-greedy error of evicting v from `cached` for one query, as the
/// definition states it: || out(cached \ {v}) - out(history) ||^2, each
/// output recomputed from scratch. Also returns w, the weight that the
/// history puts on the tokens missing from cached \ {v}.
struct wide_error {
  double error = 0.0;
  double weight_missing = 0.0;
};

inline wide_error wide_leave_one_out(const std::vector<float>& q, const rows_map& keys, const rows_map& values,
                                     const std::vector<std::int32_t>& cached, std::int32_t v, double scale) {
  std::vector<std::int32_t> history, rest;
  for (const auto& kv : keys) history.push_back(kv.first);
  for (std::int32_t p : cached)
    if (p != v) rest.push_back(p);
  const std::vector<wide> full = wide_attention(q, keys, values, history, scale);
  const std::vector<wide> without = wide_attention(q, keys, values, rest, scale);
  wide sq = 0;
  for (std::size_t i = 0; i < q.size(); ++i) sq += (without[i] - full[i]) * (without[i] - full[i]);
  // w = Z(missing) / Z(history), each exp in the frame of the history's max.
  wide m = 0, z_all = 0, z_missing = 0;
  std::vector<wide> logit;
  for (std::size_t j = 0; j < history.size(); ++j) {
    wide l = 0;
    for (std::size_t i = 0; i < q.size(); ++i) l += wide(q[i]) * wide(keys.at(history[j])[i]);
    logit.push_back(l * wide(scale));
    if (j == 0 || logit.back() > m) m = logit.back();
  }
  for (std::size_t j = 0; j < history.size(); ++j) {
    const wide e = wide_exp(logit[j] - m);
    z_all += e;
    bool in_rest = false;
    for (std::int32_t p : rest) in_rest = in_rest || p == history[j];
    if (!in_rest) z_missing += e;
  }
  return {static_cast<double>(sq), static_cast<double>(z_missing / z_all)};
}

}  // namespace kvtest
