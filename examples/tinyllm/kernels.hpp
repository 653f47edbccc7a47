#pragma once
// The few numeric kernels a Llama decoder needs, on float activations.
// Written for clarity first; the only tuned loop is the dot product, whose
// fixed-width accumulator lets the compiler vectorise without -ffast-math
// (and keeps the summation order, hence the results, independent of it).
#include <cmath>
#include <cstddef>
#include <cstdint>

namespace tinyllm {

/// sum_i a[i] * b[i], summed in 16 interleaved lanes, then the lanes in order.
inline float dot(const float* a, const float* b, std::int64_t n) noexcept {
  constexpr int lanes = 16;
  float acc[lanes] = {};
  std::int64_t i = 0;
  for (; i + lanes <= n; i += lanes)
    for (int l = 0; l < lanes; ++l) acc[l] += a[i + l] * b[i + l];
  float tail = 0.0f;
  for (; i < n; ++i) tail += a[i] * b[i];
  float sum = 0.0f;
  for (int l = 0; l < lanes; ++l) sum += acc[l];
  return sum + tail;
}

/// y[j] = dot(w, x + j * n, n) for j < 4, bit for bit: one pass over w
/// serves four vectors (a matrix row against four sequences of a batch).
inline void dot4(const float* w, const float* x, std::int64_t n, float* y) noexcept {
  constexpr int lanes = 16;
  float acc[4][lanes] = {};
  const float* x0 = x;
  const float* x1 = x + n;
  const float* x2 = x + 2 * n;
  const float* x3 = x + 3 * n;
  std::int64_t i = 0;
  for (; i + lanes <= n; i += lanes)
    for (int l = 0; l < lanes; ++l) {
      const float wl = w[i + l];
      acc[0][l] += wl * x0[i + l];
      acc[1][l] += wl * x1[i + l];
      acc[2][l] += wl * x2[i + l];
      acc[3][l] += wl * x3[i + l];
    }
  for (int j = 0; j < 4; ++j) {
    float tail = 0.0f;
    for (std::int64_t t = i; t < n; ++t) tail += w[t] * x[j * n + t];
    float sum = 0.0f;
    for (int l = 0; l < lanes; ++l) sum += acc[j][l];
    y[j] = sum + tail;
  }
}

/// y += a * x
inline void axpy(float a, const float* x, float* y, std::int64_t n) noexcept {
  for (std::int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

/// out = x / sqrt(mean(x^2) + eps) * weight (RMSNorm, Zhang & Sennrich 2019).
inline void rms_norm(const float* x, const float* weight, float eps, float* out, std::int64_t n) noexcept {
  double sum = 0.0;
  for (std::int64_t i = 0; i < n; ++i) sum += double(x[i]) * x[i];
  const float inv = 1.0f / std::sqrt(static_cast<float>(sum / double(n)) + eps);
  for (std::int64_t i = 0; i < n; ++i) out[i] = x[i] * inv * weight[i];
}

/// Rotary embedding (RoPE) at `position`: pair i of a head turns by
/// position * base^(-2i/dim). rope_angles computes cos/sin once per position;
/// every head of every layer then reuses them.
inline void rope_angles(std::int64_t position, std::int64_t dim, float base, float* cos_out, float* sin_out) noexcept {
  for (std::int64_t i = 0; i < dim / 2; ++i) {
    const double theta = double(position) * std::pow(double(base), -2.0 * double(i) / double(dim));
    cos_out[i] = static_cast<float>(std::cos(theta));
    sin_out[i] = static_cast<float>(std::sin(theta));
  }
}

/// Rotates the pairs (x[2i], x[2i+1]) of one head. This is llama.cpp's
/// "normal" RoPE, the one it applies to LLAMA-architecture GGUF files: the
/// converter permutes the Q/K weights so that HF's half-split pairs become
/// adjacent.
inline void rope_adjacent_pairs(float* x, std::int64_t dim, const float* cos, const float* sin) noexcept {
  for (std::int64_t i = 0; i < dim / 2; ++i) {
    const float x0 = x[2 * i], x1 = x[2 * i + 1];
    x[2 * i] = x0 * cos[i] - x1 * sin[i];
    x[2 * i + 1] = x0 * sin[i] + x1 * cos[i];
  }
}

/// gate = silu(gate) * up, the SwiGLU gating of the MLP.
inline void swiglu(float* gate, const float* up, std::int64_t n) noexcept {
  for (std::int64_t i = 0; i < n; ++i) gate[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
}

/// In place softmax over x[0, n); returns the natural log-sum-exp of the input.
inline float softmax(float* x, std::int64_t n) noexcept {
  float max = -INFINITY;
  for (std::int64_t i = 0; i < n; ++i) max = x[i] > max ? x[i] : max;
  double sum = 0.0;
  for (std::int64_t i = 0; i < n; ++i) {
    x[i] = std::exp(x[i] - max);
    sum += x[i];
  }
  const float inv = static_cast<float>(1.0 / sum);
  for (std::int64_t i = 0; i < n; ++i) x[i] *= inv;
  return max + static_cast<float>(std::log(sum));
}

}  // namespace tinyllm
