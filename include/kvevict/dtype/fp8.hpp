#pragma once
// OCP 8-bit floating point storage types (OCP "8-bit Floating Point
// Specification (OFP8)" 1.0), bit-compatible with CUDA's __nv_fp8_e4m3 /
// __nv_fp8_e5m2 and torch's float8_e4m3fn / float8_e5m2:
//   fp8_e4m3: sign, 4 exponent bits (bias 7), 3 mantissa bits; the "fn"
//             variant: no infinities, S.1111.111 is NaN, the largest finite
//             value is 448;
//   fp8_e5m2: sign, 5 exponent bits (bias 15), 2 mantissa bits, IEEE-like:
//             infinities and NaNs, the largest finite value is 57344 (it is
//             the top byte of a binary16).
// Engines keep fp8 K/V with a scale (the value is code x scale); these
// types are the codes only. No CUDA header is included.
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "kvevict/config.hpp"

namespace kvevict {

struct fp8_e4m3 {
  std::uint8_t bits;  // public raw bits, no constructors: trivial, as half
  KVEVICT_HOST_DEVICE static constexpr fp8_e4m3 from_bits(std::uint8_t b) noexcept { return fp8_e4m3{b}; }
};

struct fp8_e5m2 {
  std::uint8_t bits;
  KVEVICT_HOST_DEVICE static constexpr fp8_e5m2 from_bits(std::uint8_t b) noexcept { return fp8_e5m2{b}; }
};

static_assert(sizeof(fp8_e4m3) == 1 && sizeof(fp8_e5m2) == 1, "fp8 types are one byte, as CUDA's __nv_fp8_*");
static_assert(std::is_trivially_copyable_v<fp8_e4m3> && std::is_trivially_copyable_v<fp8_e5m2>,
              "fp8 types must be trivially copyable");
static_assert(std::is_trivially_default_constructible_v<fp8_e4m3> &&
                  std::is_trivially_default_constructible_v<fp8_e5m2>,
              "fp8 types must be trivially default constructible");

template <class T>
inline constexpr bool is_fp8_v = std::is_same_v<T, fp8_e4m3> || std::is_same_v<T, fp8_e5m2>;

namespace detail {

/// The shape of an fp8 format: mantissa bits, exponent bias, and its
/// largest finite code (positive).
struct fp8_format {
  std::uint32_t mantissa_bits;
  std::int32_t bias;
  std::uint8_t max_finite;
  bool e4m3;  // NaN at every S.1111.111; no infinities
};

inline constexpr fp8_format e4m3_format{3, 7, 0x7E, true};
inline constexpr fp8_format e5m2_format{2, 15, 0x7B, false};

KVEVICT_HOST_DEVICE inline float float_of_bits(std::uint32_t x) noexcept {
  float f;
  std::memcpy(&f, &x, sizeof f);
  return f;
}

/// Exact: every fp8 value is a binary32. NaN codes give a quiet NaN of
/// their sign; e5m2's infinities give infinities.
KVEVICT_HOST_DEVICE inline float fp8_to_float(std::uint8_t code, fp8_format f) noexcept {
  const std::uint32_t m_bits = f.mantissa_bits, e_bits = 7 - m_bits;
  const std::uint32_t sign = static_cast<std::uint32_t>(code & 0x80u) << 24;
  const std::uint32_t e_max = (1u << e_bits) - 1;
  const std::uint32_t e = (code >> m_bits) & e_max;
  std::uint32_t m = code & ((1u << m_bits) - 1);
  if (f.e4m3 ? (code & 0x7Fu) == 0x7Fu : (e == e_max && m != 0)) return float_of_bits(sign | 0x7FC00000u);
  if (!f.e4m3 && e == e_max) return float_of_bits(sign | 0x7F800000u);
  if (e == 0) {
    if (m == 0) return float_of_bits(sign);
    // Subnormal: m x 2^(1 - bias - M), normalised with integers (no FTZ).
    std::int32_t exp = 127 + 1 - f.bias;
    while ((m & (1u << m_bits)) == 0) {
      m <<= 1;
      --exp;
    }
    return float_of_bits(sign | (static_cast<std::uint32_t>(exp) << 23) | ((m & ((1u << m_bits) - 1)) << (23 - m_bits)));
  }
  return float_of_bits(sign | ((e + 127 - static_cast<std::uint32_t>(f.bias)) << 23) | (m << (23 - m_bits)));
}

/// Round-to-nearest-even with saturation to the largest finite value (as
/// CUDA's __nv_cvt_float_to_fp8 with __NV_SATFINITE, which vLLM's fp8 cache
/// writes use): |x| at or above it, infinities included, gives it; NaN
/// gives the NaN code 0x7F of its sign.
KVEVICT_HOST_DEVICE inline std::uint8_t float_to_fp8(float value, fp8_format f) noexcept {
  std::uint32_t x;
  std::memcpy(&x, &value, sizeof x);
  const auto sign = static_cast<std::uint8_t>((x >> 24) & 0x80u);
  const std::uint32_t ax = x & 0x7FFFFFFFu;
  if (ax > 0x7F800000u) return static_cast<std::uint8_t>(sign | 0x7Fu);
  float max_value = fp8_to_float(f.max_finite, f);
  std::uint32_t max_bits;
  std::memcpy(&max_bits, &max_value, sizeof max_bits);
  if (ax >= max_bits) return static_cast<std::uint8_t>(sign | f.max_finite);
  const std::uint32_t drop = 23 - f.mantissa_bits;
  const std::uint32_t exp = ax >> 23;
  if (exp >= static_cast<std::uint32_t>(127 + 1 - f.bias)) {
    // Normal result: rebias, then drop the low bits with ties to even; a
    // carry bumps the exponent (never past max_finite: |x| is below it).
    std::uint32_t m = ax - (static_cast<std::uint32_t>(127 - f.bias) << 23);
    m += (1u << (drop - 1)) - 1 + ((m >> drop) & 1u);
    return static_cast<std::uint8_t>(sign | (m >> drop));
  }
  // Subnormal result: |x| / 2^(1 - bias - M) = mant24 >> shift.
  const std::int32_t shift = (151 - f.bias - static_cast<std::int32_t>(f.mantissa_bits)) - static_cast<std::int32_t>(exp);
  if (shift >= 25) return sign;  // below half the smallest subnormal (float zeros and subnormals too)
  const std::uint32_t mant = (ax & 0x7FFFFFu) | 0x800000u;
  std::uint32_t q = mant >> shift;
  const std::uint32_t rem = mant & ((1u << shift) - 1u), half = 1u << (shift - 1);
  if (rem > half || (rem == half && (q & 1u))) ++q;  // may reach the smallest normal
  return static_cast<std::uint8_t>(sign | q);
}

/// The 256 values of a format, computed at compile time from its formula
/// with exact float arithmetic (small integers times powers of two), for
/// the host's decode: one load per code instead of the branches above,
/// which made an fp8 key row several times slower to read than a bf16 one.
struct fp8_values {
  float value[256];
};

constexpr float fp8_power_of_two(std::int32_t k) noexcept {
  float p = 1.0f;
  for (; k > 0; --k) p *= 2.0f;
  for (; k < 0; ++k) p *= 0.5f;
  return p;
}

constexpr fp8_values make_fp8_values(fp8_format f) noexcept {
  fp8_values t{};
  const std::int32_t m_bits = static_cast<std::int32_t>(f.mantissa_bits), e_max = (1 << (7 - m_bits)) - 1;
  for (std::int32_t c = 0; c < 256; ++c) {
    const std::int32_t e = (c >> m_bits) & e_max, m = c & ((1 << m_bits) - 1);
    float v = 0.0f;
    if (f.e4m3 ? (c & 0x7F) == 0x7F : (e == e_max && m != 0)) {
      v = std::numeric_limits<float>::quiet_NaN();
    } else if (!f.e4m3 && e == e_max) {
      v = std::numeric_limits<float>::infinity();
    } else if (e == 0) {
      v = static_cast<float>(m) * fp8_power_of_two(1 - f.bias - m_bits);
    } else {
      v = static_cast<float>((1 << m_bits) + m) * fp8_power_of_two(e - f.bias - m_bits);
    }
    t.value[c] = (c & 0x80) ? -v : v;
  }
  return t;
}

inline constexpr fp8_values e4m3_values = make_fp8_values(e4m3_format);
inline constexpr fp8_values e5m2_values = make_fp8_values(e5m2_format);

}  // namespace detail

// The device decodes with integer operations (its loads of a table would
// diverge); both are exact, so they agree bit for bit.
KVEVICT_HOST_DEVICE inline float fp8_e4m3_to_float(fp8_e4m3 x) noexcept {
#if defined(__CUDA_ARCH__)
  return detail::fp8_to_float(x.bits, detail::e4m3_format);
#else
  return detail::e4m3_values.value[x.bits];
#endif
}
KVEVICT_HOST_DEVICE inline float fp8_e5m2_to_float(fp8_e5m2 x) noexcept {
#if defined(__CUDA_ARCH__)
  return detail::fp8_to_float(x.bits, detail::e5m2_format);
#else
  return detail::e5m2_values.value[x.bits];
#endif
}
KVEVICT_HOST_DEVICE inline fp8_e4m3 float_to_fp8_e4m3(float x) noexcept {
  return fp8_e4m3::from_bits(detail::float_to_fp8(x, detail::e4m3_format));
}
KVEVICT_HOST_DEVICE inline fp8_e5m2 float_to_fp8_e5m2(float x) noexcept {
  return fp8_e5m2::from_bits(detail::float_to_fp8(x, detail::e5m2_format));
}

}  // namespace kvevict
