#pragma once
// The scales of an fp8 K/V cache, as vLLM and TensorRT-LLM keep them: one K
// scale and one V scale per layer, or one per KV head. An element's value
// is its code times its scale (kv_value); the bytes were quantized with
// these scales, so they hold for the cache's whole life. Float caches take
// none: their elements are values.
#include <cstdint>

#include "kvevict/config.hpp"

namespace kvevict {

struct kv_scales {
  const float* k = nullptr;  ///< the K scale(s): k[0], or k[h] for KV head h of the view
  const float* v = nullptr;  ///< the V scale(s), as k
  std::int32_t per_head = 0;  ///< 0: one scale per layer (k[0], v[0]); 1: one per KV head of the view

  /// Where KV head h's scale sits in k and v.
  KVEVICT_HOST_DEVICE std::int32_t index(std::int32_t h) const noexcept { return per_head ? h : 0; }
  /// How many floats each of k and v points at.
  KVEVICT_HOST_DEVICE std::int32_t count(std::int32_t num_heads) const noexcept { return per_head ? num_heads : 1; }
};

/// A scale a cache can have been quantized with: positive and finite
/// (false for 0, a negative number, NaN and infinity).
KVEVICT_HOST_DEVICE inline bool is_valid_kv_scale(float s) noexcept { return s > 0.0f && s <= 3.40282347e38f; }

}  // namespace kvevict
