#pragma once
// KeyDiff (Park et al., "KeyDiff: Key Similarity-Based KV Cache Eviction
// for Long-Context LLM Inference in Resource-Constrained Environments",
// 2025; docs/policies.md, "KeyDiff"): keep the keys least similar to the
// mean direction of the cached keys of their head, scored from the K rows
// alone (no attention input), as kvpress's KeyDiffPress does at prefill.
//
// For the keys k_p of one (sequence, KV head), p in [0, L):
//
//   n(k)     = k / ||k||_2              (0 for a zero key)
//   anchor   = sum over p of n(k_p)     (the mean's direction: the count
//                                        does not change a cosine)
//   u        = anchor / ||anchor||
//   score(p) = -cos(k_p, anchor) = -(u . k_p) / ||k_p||
//                                        (0 when either norm is 0)
//
// so the lowest score is the key most like the others and the keep set
// takes the highest (score, position). The anchor is summed exactly: each
// component of n(k) is rounded once to a multiple of 2^-32 and added as a
// 64-bit integer, so the sum does not depend on the order of its terms and
// a GPU may add them with atomics in any order and get the host's bits.
// Everything else is float in kvevict's fixed dot-product order
// (attention_logit), correctly rounded division and square root. The
// functions are KVEVICT_HOST_DEVICE: the per-sequence prefill, the batched
// host backend and the CUDA kernel call them.
#include <cmath>
#include <cstdint>

#include "kvevict/config.hpp"
#include "kvevict/detail/reproducible_math.hpp"
#include "kvevict/dtype/convert.hpp"
#include "kvevict/kv_view.hpp"
#include "kvevict/policy/decode_rules.hpp"

namespace kvevict {

/// Fixed-point scale of the anchor's components: 2^32, so a component of a
/// unit vector loses nothing above 2^-32 and 2^31 of them fit an int64.
inline constexpr float key_diff_anchor_scale = 4294967296.0f;

/// ||k||_2 of a key row in float (key_norm_score's order and rounding);
/// `scale`: the row's kv_value scale, as everywhere below.
template <class K>
KVEVICT_HOST_DEVICE inline float key_length(const K* k, std::int32_t head_dim, float scale) noexcept {
  return -key_norm_score(k, head_dim, scale);
}

/// Component e of n(k) as the anchor adds it: k[e] / norm, correctly
/// rounded, times 2^32 (exact), rounded to the nearest integer (ties to
/// even). norm is key_length(k); a zero key adds 0.
template <class K>
KVEVICT_HOST_DEVICE inline std::int64_t key_diff_unit(const K* k, std::int32_t e, float scale, float norm) noexcept {
  if (norm == 0.0f) return 0;
  const float unit = detail::mul(detail::div(kv_value(k[e], scale), norm), key_diff_anchor_scale);
#if defined(__CUDA_ARCH__)
  return __float2ll_rn(unit);
#else
  return std::llrint(unit);
#endif
}

/// The anchor's float component from its fixed-point sum: the sum of the
/// unit keys' components (float(sum) rounded to nearest, times 2^-32
/// exactly), at most L in size, so its squares cannot overflow.
KVEVICT_HOST_DEVICE inline float key_diff_anchor_value(std::int64_t sum) noexcept {
#if defined(__CUDA_ARCH__)
  const float x = __ll2float_rn(sum);
#else
  const float x = static_cast<float>(sum);
#endif
  return detail::mul(x, 1.0f / key_diff_anchor_scale);
}

/// ||anchor|| in float from its components (contiguous).
KVEVICT_HOST_DEVICE inline float key_diff_anchor_length(const float* anchor, std::int32_t head_dim) noexcept {
  const float squares = attention_logit(anchor, 1, anchor, head_dim);
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(squares);
#else
  return std::sqrt(squares);
#endif
}

/// Component e of the unit anchor u = anchor / ||anchor|| (0 when the
/// anchor is 0: every key was 0).
KVEVICT_HOST_DEVICE inline float key_diff_unit_anchor(float component, float length) noexcept {
  return length == 0.0f ? 0.0f : detail::div(component, length);
}

/// score(p) of the header for key row k of norm key_length(k) against the
/// unit anchor u: -(u . k) / ||k|| (0 for a zero key or a zero anchor,
/// never -0). Not
/// finite when the key's norm is not: the callers check key_length first
/// and report non_finite_kv.
template <class K>
KVEVICT_HOST_DEVICE inline float key_diff_score(const K* k, const float* unit_anchor, std::int32_t head_dim,
                                                float scale, float norm) noexcept {
  if (norm == 0.0f) return 0.0f;
  const float cosine = detail::div(attention_logit_rows(unit_anchor, 1, k, head_dim, scale), norm);  // 16-byte loads
  return cosine == 0.0f ? 0.0f : -cosine;
}

/// The same with the key's norm computed here.
template <class K>
KVEVICT_HOST_DEVICE inline float key_diff_score(const K* k, const float* unit_anchor, std::int32_t head_dim,
                                                float scale) noexcept {
  return key_diff_score(k, unit_anchor, head_dim, scale, key_length(k, head_dim, scale));
}

/// unit[e] = u_e from the anchor's fixed-point sums, by the pieces above.
KVEVICT_HOST_DEVICE inline void key_diff_unit_anchor_from(const std::int64_t* sums, std::int32_t head_dim,
                                                          float* unit) noexcept {
  for (std::int32_t e = 0; e < head_dim; ++e) unit[e] = key_diff_anchor_value(sums[e]);
  const float length = key_diff_anchor_length(unit, head_dim);
  for (std::int32_t e = 0; e < head_dim; ++e) unit[e] = key_diff_unit_anchor(unit[e], length);
}

/// sums += sign * n(k) for key row k of norm key_length(k) (sign +1 adds a
/// token, -1 removes it).
template <class K>
KVEVICT_HOST_DEVICE inline void key_diff_accumulate(std::int64_t* sums, const K* k, std::int32_t head_dim, float scale,
                                                    float norm, std::int64_t sign) noexcept {
  for (std::int32_t e = 0; e < head_dim; ++e) sums[e] += sign * key_diff_unit(k, e, scale, norm);
}

namespace detail {

/// The host's scores of keys p in [0, L) of (b, h) into out[0, L): the
/// anchor summed over every key, then each key's score. Returns the first
/// position whose key norm is not finite (nothing written), or -1.
/// sums and unit hold head_dim elements.
template <class T, class Layout>
std::int32_t key_diff_scores(const kv_view<T, Layout>& cache, std::int32_t b, std::int32_t h, std::int32_t length,
                             std::int64_t* sums, float* unit, float* out) {
  const std::int32_t d = cache.head_dim;
  const float scale = cache.k_scale(h);
  for (std::int32_t e = 0; e < d; ++e) sums[e] = 0;
  for (std::int32_t p = 0; p < length; ++p) {
    const T* k = cache.k_row(b, h, p);
    const float norm = key_length(k, d, scale);
    if (!std::isfinite(norm)) return p;
    key_diff_accumulate(sums, k, d, scale, norm, 1);
  }
  key_diff_unit_anchor_from(sums, d, unit);
  for (std::int32_t p = 0; p < length; ++p) out[p] = key_diff_score(cache.k_row(b, h, p), unit, d, scale);
  return -1;
}

}  // namespace detail
}  // namespace kvevict
