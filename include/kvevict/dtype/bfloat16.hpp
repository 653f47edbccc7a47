#pragma once
// bfloat16 storage type, bit-compatible with CUDA's __nv_bfloat16.
//
// bfloat16 is the top half of a binary32: same sign and 8-bit exponent, 7
// mantissa bits. No CUDA header is included so host-only builds work.

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kvevict/config.hpp"

namespace kvevict {

struct bfloat16 {
  // Public raw bits and no constructors keep the type trivial (see half).
  std::uint16_t bits;

  KVEVICT_HOST_DEVICE static constexpr bfloat16 from_bits(std::uint16_t b) noexcept {
    return bfloat16{b};
  }
};

static_assert(sizeof(bfloat16) == 2 && alignof(bfloat16) == 2,
              "bfloat16 must match the layout of CUDA's __nv_bfloat16");
static_assert(std::is_trivially_copyable_v<bfloat16>, "bfloat16 must be trivially copyable");
static_assert(std::is_trivially_default_constructible_v<bfloat16>,
              "bfloat16 must be trivially default constructible");
static_assert(std::is_standard_layout_v<bfloat16>, "bfloat16 must be standard layout");

// Exact: a bfloat16 is a binary32 with the low 16 bits zero.
KVEVICT_HOST_DEVICE inline float bfloat16_to_float(bfloat16 h) noexcept {
  const std::uint32_t x = static_cast<std::uint32_t>(h.bits) << 16;
  float f;
  std::memcpy(&f, &x, sizeof f);
  return f;
}

// Round-to-nearest-even on the raw bits, matching CUDA's __float2bfloat16
// (canonical NaN 0x7FFF). Because the encodings share the exponent field,
// the same integer rounding is correct for subnormals, and a carry out of the
// largest finite value lands exactly on inf (0x7F80).
KVEVICT_HOST_DEVICE inline bfloat16 float_to_bfloat16(float f) noexcept {
  std::uint32_t x;
  std::memcpy(&x, &f, sizeof x);
  // NaN must be caught first: rounding a NaN's bits could produce inf.
  if ((x & 0x7FFFFFFFu) > 0x7F800000u) return bfloat16::from_bits(0x7FFFu);
  // Cannot overflow 32 bits: the largest non-NaN input is 0xFF800000.
  x += 0x7FFFu + ((x >> 16) & 1u);
  return bfloat16::from_bits(static_cast<std::uint16_t>(x >> 16));
}

}  // namespace kvevict
