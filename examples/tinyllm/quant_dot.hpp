#pragma once
// Products of quantised weights with quantised activations, computed the way
// llama.cpp's CPU backend computes them: activations are rounded to 8-bit
// blocks (Q8_0, or Q8_1 which also carries the block sum for Q4_1's offset),
// and each block contributes d_w * d_x * sum(q_w * q_x) (+ m_w * s_x).
// Used when the engine mimics llama.cpp (numerics.hpp), because this small
// model amplifies rounding differences into visibly different predictions.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>

#include "tinyllm/numerics.hpp"
#include "tinyllm/quant.hpp"

namespace tinyllm {

/// Whether llama.cpp multiplies weights of type t with 8-bit activations.
inline bool rounds_activations(ggml_type t) noexcept {
  return t == ggml_type::q4_0 || t == ggml_type::q4_1 || t == ggml_type::q8_0;
}

/// 32 activations as Q8_1: x ~ q * d; s = d * sum(q). d and s are stored in
/// half precision, so they hold the rounded values.
struct q8_activations {
  float d = 0.0f, s = 0.0f;
  std::int8_t q[32] = {};
};

/// Rounds n activations (a multiple of 32) into n / 32 blocks: q = round(x *
/// 127 / max|x|), ties to even, as llama.cpp's vectorised quantiser does.
inline void quantize_q8(const float* x, std::int64_t n, q8_activations* out) {
  if (n % 32 != 0) throw format_error("quantize_q8: n = " + std::to_string(n) + " is not a multiple of 32");
  for (std::int64_t b = 0; b < n / 32; ++b) {
    const float* v = x + b * 32;
    float amax = 0.0f;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(v[j]));
    const float d = amax / 127.0f;
    const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
    int sum = 0;
    for (int j = 0; j < 32; ++j) {
      out[b].q[j] = static_cast<std::int8_t>(std::nearbyint(v[j] * id));
      sum += out[b].q[j];
    }
    out[b].d = round_to_half(d);
    out[b].s = round_to_half(d * static_cast<float>(sum));
  }
}

/// One row of n weights of type t (Q4_0, Q4_1 or Q8_0) against n / 32
/// activation blocks.
inline float dot_q8(ggml_type t, const std::uint8_t* row, const q8_activations* x, std::int64_t n) {
  float acc = 0.0f, offsets = 0.0f;
  const std::int64_t blocks = n / 32;
  switch (t) {
    case ggml_type::q4_0:
      for (std::int64_t b = 0; b < blocks; ++b) {
        block_q4_0 w;
        std::memcpy(&w, row + b * sizeof w, sizeof w);
        int sum = 0;
        for (int j = 0; j < 16; ++j)
          sum += ((w.qs[j] & 0x0F) - 8) * x[b].q[j] + ((w.qs[j] >> 4) - 8) * x[b].q[j + 16];
        acc += detail::half_bits_to_float(w.d) * x[b].d * static_cast<float>(sum);
      }
      return acc;
    case ggml_type::q4_1:
      for (std::int64_t b = 0; b < blocks; ++b) {
        block_q4_1 w;
        std::memcpy(&w, row + b * sizeof w, sizeof w);
        int sum = 0;
        for (int j = 0; j < 16; ++j) sum += (w.qs[j] & 0x0F) * x[b].q[j] + (w.qs[j] >> 4) * x[b].q[j + 16];
        acc += detail::half_bits_to_float(w.d) * x[b].d * static_cast<float>(sum);
        offsets += detail::half_bits_to_float(w.m) * x[b].s;
      }
      return acc + offsets;
    case ggml_type::q8_0:
      for (std::int64_t b = 0; b < blocks; ++b) {
        block_q8_0 w;
        std::memcpy(&w, row + b * sizeof w, sizeof w);
        int sum = 0;
        for (int j = 0; j < 32; ++j) sum += w.qs[j] * x[b].q[j];
        acc += detail::half_bits_to_float(w.d) * x[b].d * static_cast<float>(sum);
      }
      return acc;
    default:
      throw format_error(std::string("dot_q8: weights of type ") + type_name(t) + " are not quantised");
  }
}

}  // namespace tinyllm
