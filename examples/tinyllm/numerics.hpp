#pragma once
// Arithmetic choices of the engine. The defaults are plain float; llama_cpp()
// rounds where llama.cpp's CPU backend rounds (with its default f16 KV cache
// and no flash attention), so that a cross-check against llama.cpp compares
// the models rather than the arithmetic. This small model is sensitive to
// such rounding: llama.cpp itself, switched from an f16 to an f32 KV cache,
// changes ~5% of its top-1 predictions on our text.
#include <cmath>
#include <cstdint>

#include <kvevict/dtype/half.hpp>

namespace tinyllm {

struct numerics {
  bool q8_activations = false;  ///< round activations like a Q8 block before quantised matmuls
  bool f16_attention = false;   ///< K/V, queries and attention weights rounded to half precision

  static numerics llama_cpp() { return {true, true}; }
};

/// x rounded to the nearest half-precision value (as a float).
inline float round_to_half(float x) noexcept { return kvevict::half_to_float(kvevict::float_to_half(x)); }

inline void round_to_half(float* x, std::int64_t n) noexcept {
  for (std::int64_t i = 0; i < n; ++i) x[i] = round_to_half(x[i]);
}

}  // namespace tinyllm
