#pragma once
// IEEE 754 binary16 storage type, bit-compatible with CUDA's __half.
//
// We deliberately do not include <cuda_fp16.h>: the library must build with a
// plain host compiler. Because the layout matches __half (one 16-bit word),
// device buffers can be reinterpreted between the two types at a kernel
// boundary. Arithmetic is done in float; this type only stores and converts.

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kvevict/config.hpp"

namespace kvevict {

struct half {
  // Public raw bits and no constructors keep the type trivial, so arrays of
  // it can be memcpy'd, zero-initialised and placed in device memory freely.
  std::uint16_t bits;

  KVEVICT_HOST_DEVICE static constexpr half from_bits(std::uint16_t b) noexcept {
    return half{b};
  }
};

static_assert(sizeof(half) == 2 && alignof(half) == 2,
              "half must match the layout of CUDA's __half");
static_assert(std::is_trivially_copyable_v<half>, "half must be trivially copyable");
static_assert(std::is_trivially_default_constructible_v<half>,
              "half must be trivially default constructible");
static_assert(std::is_standard_layout_v<half>, "half must be standard layout");

// Exact: every binary16 value (including subnormals, infinities and NaN
// payloads) is representable in binary32.
KVEVICT_HOST_DEVICE inline float half_to_float(half h) noexcept {
  const std::uint32_t sign = static_cast<std::uint32_t>(h.bits & 0x8000u) << 16;
  std::uint32_t exp = (h.bits >> 10) & 0x1Fu;
  std::uint32_t mant = h.bits & 0x3FFu;

  std::uint32_t out;
  if (exp == 0x1Fu) {
    // Inf or NaN: keep the payload so NaN stays NaN.
    out = sign | 0x7F800000u | (mant << 13);
  } else if (exp == 0) {
    if (mant == 0) {
      out = sign;  // signed zero
    } else {
      // Subnormal half becomes a normal float: shift the leading one into the
      // implicit-bit position, lowering the exponent once per shift. Done with
      // integers so the result does not depend on FTZ/DAZ modes.
      exp = 127 - 14;
      while ((mant & 0x400u) == 0) {
        mant <<= 1;
        --exp;
      }
      out = sign | (exp << 23) | ((mant & 0x3FFu) << 13);
    }
  } else {
    out = sign | ((exp + (127 - 15)) << 23) | (mant << 13);
  }

  float f;
  std::memcpy(&f, &out, sizeof f);
  return f;
}

// Round-to-nearest-even, matching CUDA's __float2half_rn (including its
// canonical NaN 0x7FFF).
KVEVICT_HOST_DEVICE inline half float_to_half(float f) noexcept {
  std::uint32_t x;
  std::memcpy(&x, &f, sizeof x);
  const auto sign = static_cast<std::uint16_t>((x >> 16) & 0x8000u);
  const std::uint32_t ax = x & 0x7FFFFFFFu;

  if (ax > 0x7F800000u) return half::from_bits(0x7FFFu);  // any NaN
  // |f| >= 65536 (incl. inf) is always inf; [65520, 65536) reaches inf below
  // through the rounding carry.
  if (ax >= 0x47800000u) return half::from_bits(static_cast<std::uint16_t>(sign | 0x7C00u));

  if (ax >= 0x38800000u) {
    // Normal result (|f| >= 2^-14): rebias the exponent, then drop 13 mantissa
    // bits with round-half-to-even. A carry out of the mantissa correctly
    // bumps the exponent (and turns 65520..65535 into inf, 0x7C00).
    std::uint32_t m = ax - ((127u - 15u) << 23);
    m += 0x0FFFu + ((m >> 13) & 1u);
    return half::from_bits(static_cast<std::uint16_t>(sign | (m >> 13)));
  }

  const std::uint32_t exp = ax >> 23;
  // Below 2^-25 (half the smallest subnormal) everything rounds to zero; this
  // also covers float zeros and float subnormals.
  if (exp < 102u) return half::from_bits(sign);

  // Subnormal result: value / 2^-24 = mant24 >> (126 - exp), shift in [14, 24].
  const std::uint32_t mant = (ax & 0x7FFFFFu) | 0x800000u;
  const std::uint32_t shift = 126u - exp;
  std::uint32_t q = mant >> shift;
  const std::uint32_t rem = mant & ((1u << shift) - 1u);
  const std::uint32_t halfway = 1u << (shift - 1u);
  if (rem > halfway || (rem == halfway && (q & 1u))) ++q;  // may reach 0x400 = min normal
  return half::from_bits(static_cast<std::uint16_t>(sign | q));
}

}  // namespace kvevict
