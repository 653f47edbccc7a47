#pragma once
// KeyDiff at decode time (docs/policies.md, "KeyDiff"): every step each
// cached key of (sequence, KV head) is scored against the anchor of the
// keys cached now, so the anchor must follow the cache. Summing it afresh
// would read every key twice a step; instead the anchor is kept running:
// the fixed-point sum of key_diff.hpp is exact and order-free, so adding
// the new keys' unit vectors and subtracting the victim's gives, bit for
// bit, the sum a fresh count would give. Per step that costs O(head_dim)
// per new or evicted token, and the scores one pass over the keys.
//
// The running sum covers the cached tokens whose position is below `upto`
// (the tokens appended since then are added by the next refresh). Any
// change of the cached set that does not pass through here (an eviction
// decided on other scores, evict_to, prefill, reset) marks it stale
// (upto = -1), and the next refresh counts every cached key once: the same
// bits again. The functions are KVEVICT_HOST_DEVICE and serve the
// batched host backend (and through it h2o_policy) and the CUDA kernels.
#include <cstdint>

#include "kvevict/config.hpp"
#include "kvevict/kv_view.hpp"
#include "kvevict/policy/key_diff.hpp"
#include "kvevict/policy/policy_shape.hpp"

namespace kvevict {

/// The running anchors of a batch: per (sequence, KV head) the anchor's
/// fixed-point sum, the unit anchor of the current step, and how far the
/// sum reaches.
struct key_anchor_view {
  std::int64_t* sums = nullptr;   ///< [B][H][head_dim]: the unit keys of the anchored tokens, times 2^32
  float* units = nullptr;         ///< [B][H][head_dim]: u = anchor / ||anchor|| of the current step
  std::int32_t* upto = nullptr;   ///< [B][H]: sums cover the cached positions below it; -1: stale
  std::int32_t num_heads = 0;
  std::int32_t head_dim = 0;

  KVEVICT_HOST_DEVICE std::int64_t index(std::int32_t b, std::int32_t h) const noexcept {
    return std::int64_t{b} * num_heads + h;
  }
  KVEVICT_HOST_DEVICE std::int64_t* sums_of(std::int32_t b, std::int32_t h) const noexcept {
    return sums + index(b, h) * head_dim;
  }
  KVEVICT_HOST_DEVICE float* units_of(std::int32_t b, std::int32_t h) const noexcept {
    return units + index(b, h) * head_dim;
  }
  /// The first position a refresh of (b, h) adds: 0 when stale (every cached token).
  KVEVICT_HOST_DEVICE std::int32_t first_new(std::int32_t b, std::int32_t h) const noexcept {
    const std::int32_t u = upto[index(b, h)];
    return u < 0 ? 0 : u;
  }
};

namespace detail {

/// Brings (b, h)'s anchor up to the cached tokens (slots [0, width) with
/// `positions`; a free slot holds -1) and writes its unit anchor: adds the
/// keys of positions >= first_new, or counts every cached key when stale.
/// Returns the lowest slot among those whose page is unmapped or whose key
/// norm is not finite, or 0 when a scale is bad (nothing changed: the
/// caller's score pass refuses the head for it), or -1.
KVEVICT_EXEC_CHECK_DISABLE
template <class T, class Layout>
KVEVICT_HOST_DEVICE std::int32_t refresh_key_anchor(const key_anchor_view& a, const kv_view<T, Layout>& cache,
                                                    std::int32_t b, std::int32_t h, const std::int32_t* positions,
                                                    std::int32_t width, std::int32_t length) noexcept {
  const std::int32_t first = a.first_new(b, h), d = a.head_dim;
  if (kv_scale_problem(cache, b, h) != batch_status_clear) return 0;  // the score pass's head check names it
  const float scale = cache.k_scale(h);
  for (std::int32_t s = 0; s < width; ++s)
    if (positions[s] >= first && (!row_is_mapped(cache, b, s) ||
                                  classify_input(key_length(cache.k_row(b, h, s), d, scale), false) != batch_code::ok))
      return s;
  std::int64_t* sums = a.sums_of(b, h);
  if (a.upto[a.index(b, h)] < 0)
    for (std::int32_t e = 0; e < d; ++e) sums[e] = 0;
  for (std::int32_t s = 0; s < width; ++s)
    if (positions[s] >= first) {
      const T* k = cache.k_row(b, h, s);
      key_diff_accumulate(sums, k, d, scale, key_length(k, d, scale), 1);
    }
  a.upto[a.index(b, h)] = length;
  key_diff_unit_anchor_from(sums, d, a.units_of(b, h));
  return -1;
}

}  // namespace detail

/// Takes the key in slot s of (b, h) out of its anchor (an eviction the
/// refresh counted; the row is still in the cache, no K/V byte moves).
KVEVICT_EXEC_CHECK_DISABLE
template <class T, class Layout>
KVEVICT_HOST_DEVICE void remove_from_key_anchor(const key_anchor_view& a, const kv_view<T, Layout>& cache,
                                                std::int32_t b, std::int32_t h, std::int32_t s) noexcept {
  const T* k = cache.k_row(b, h, s);
  const float scale = cache.k_scale(h);
  key_diff_accumulate(a.sums_of(b, h), k, a.head_dim, scale, key_length(k, a.head_dim, scale), -1);
}

}  // namespace kvevict
