// Tests for the half / bfloat16 storage types and the generic conversions.
//
// Every expectation comes from an independent reference: an arithmetic
// decoder (sign * mantissa * 2^exp via std::ldexp in double), a nearest-even
// encoder that picks the closest representable value by comparing distances
// in double, and, where the compiler has it, GCC's native _Float16.

#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "kvevict/dtype/bfloat16.hpp"
#include "kvevict/dtype/convert.hpp"
#include "kvevict/dtype/half.hpp"

namespace {

using kvevict::bfloat16;
using kvevict::half;

std::uint32_t f32_bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

float bits_f32(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Description of a 16-bit binary floating-point format: 1 sign bit,
// `exp_bits` exponent bits, `mant_bits` stored mantissa bits.
struct Format {
  int exp_bits;
  int mant_bits;

  int bias() const { return (1 << (exp_bits - 1)) - 1; }
  std::uint16_t exp_mask() const {
    return static_cast<std::uint16_t>(((1u << exp_bits) - 1u) << mant_bits);
  }
  std::uint16_t mant_mask() const { return static_cast<std::uint16_t>((1u << mant_bits) - 1u); }
  // Bit pattern of +inf; also one past the largest finite positive pattern.
  std::uint16_t inf_bits() const { return exp_mask(); }
};

constexpr Format kHalf{5, 10};
constexpr Format kBf16{8, 7};

// Magnitude of a non-negative pattern, treating the all-ones exponent as an
// ordinary exponent. For the +inf pattern this yields 2^(emax+1), the value
// IEEE rounding uses as the "next" number above the largest finite one
// (rounding with unbounded exponent, then overflowing to inf).
double ref_magnitude_unbounded(std::uint16_t bits, Format fmt) {
  const int e = (bits & fmt.exp_mask()) >> fmt.mant_bits;
  const int m = bits & fmt.mant_mask();
  if (e == 0) return std::ldexp(static_cast<double>(m), 1 - fmt.bias() - fmt.mant_bits);
  return std::ldexp(static_cast<double>((1 << fmt.mant_bits) + m), e - fmt.bias() - fmt.mant_bits);
}

// Arithmetic decoder: the real value of a 16-bit pattern, as a double.
double ref_decode(std::uint16_t bits, Format fmt) {
  const bool neg = (bits & 0x8000u) != 0;
  const std::uint16_t mag = bits & 0x7FFFu;
  const int e = (mag & fmt.exp_mask()) >> fmt.mant_bits;
  const int m = mag & fmt.mant_mask();
  double v;
  if (e == (1 << fmt.exp_bits) - 1) {
    v = (m == 0) ? std::numeric_limits<double>::infinity()
                 : std::numeric_limits<double>::quiet_NaN();
  } else {
    v = ref_magnitude_unbounded(mag, fmt);
  }
  return neg ? -v : v;
}

// Table of magnitudes for patterns 0 .. inf_bits (inclusive), strictly
// increasing, used by the reference encoder's binary search.
std::vector<double> magnitude_table(Format fmt) {
  std::vector<double> t(static_cast<std::size_t>(fmt.inf_bits()) + 1);
  for (std::size_t i = 0; i < t.size(); ++i)
    t[i] = ref_magnitude_unbounded(static_cast<std::uint16_t>(i), fmt);
  return t;
}

// Reference encoder: nearest representable value by distance, ties to the
// pattern with an even mantissa; >= the pseudo-value 2^(emax+1) rounds to inf.
// All differences below are exact in double (operands have <= 24 significant
// bits and are within a factor of two of each other, or one is zero).
std::uint16_t ref_encode(float f, const std::vector<double>& mags) {
  if (std::isnan(f)) return 0x7FFF;
  const std::uint16_t sign = std::signbit(f) ? 0x8000 : 0;
  const double v = std::fabs(static_cast<double>(f));
  const std::size_t inf_idx = mags.size() - 1;
  std::size_t p;
  if (v >= mags[inf_idx]) {
    p = inf_idx;
  } else {
    // Largest p with mags[p] <= v.
    std::size_t lo = 0, hi = inf_idx;  // invariant: mags[lo] <= v < mags[hi]
    while (hi - lo > 1) {
      const std::size_t mid = lo + (hi - lo) / 2;
      if (mags[mid] <= v) lo = mid; else hi = mid;
    }
    p = lo;
    if (mags[p] != v) {
      const double below = v - mags[p];
      const double above = mags[p + 1] - v;
      if (above < below || (above == below && (p & 1u) != 0)) p = p + 1;
    }
  }
  return static_cast<std::uint16_t>(sign | p);
}

const std::vector<double>& half_mags() {
  static const std::vector<double> t = magnitude_table(kHalf);
  return t;
}

const std::vector<double>& bf16_mags() {
  static const std::vector<double> t = magnitude_table(kBf16);
  return t;
}

// Bit-exact float comparison (distinguishes -0 from +0); NaN compared by kind.
bool same_float(float got, double want) {
  if (std::isnan(want)) return std::isnan(got);
  return f32_bits(got) == f32_bits(static_cast<float>(want));
}

#if defined(__FLT16_MANT_DIG__)
float native_half_to_float(std::uint16_t bits) {
  _Float16 h;
  std::memcpy(&h, &bits, sizeof h);
  return static_cast<float>(h);
}

std::uint16_t native_float_to_half(float f) {
  const _Float16 h = static_cast<_Float16>(f);
  std::uint16_t bits;
  std::memcpy(&bits, &h, sizeof bits);
  return bits;
}
#endif

std::uint16_t enc_half(float f) { return kvevict::float_to_half(f).bits; }
std::uint16_t enc_bf16(float f) { return kvevict::float_to_bfloat16(f).bits; }
float dec_half(std::uint16_t b) { return kvevict::half_to_float(half::from_bits(b)); }
float dec_bf16(std::uint16_t b) { return kvevict::bfloat16_to_float(bfloat16::from_bits(b)); }

bool is_nan_pattern(std::uint16_t bits, Format fmt) {
  return (bits & fmt.exp_mask()) == fmt.exp_mask() && (bits & fmt.mant_mask()) != 0;
}

// Midpoint checks for every pair of adjacent positive patterns p, p+1 below
// `last` (exclusive of `last` itself as the lower element), both signs.
template <class Enc>
void check_midpoints(const std::vector<double>& mags, std::uint16_t last, Enc enc) {
  long failures = 0;
  for (std::uint32_t p = 0; p < last; ++p) {
    const double mid_d = 0.5 * (mags[p] + mags[p + 1]);
    const float mid = static_cast<float>(mid_d);
    // The midpoint needs one more bit than the format has: exact in float.
    if (static_cast<double>(mid) != mid_d) {
      ++failures;
      continue;
    }
    const auto lo = static_cast<std::uint16_t>(p);
    const auto hi = static_cast<std::uint16_t>(p + 1);
    const std::uint16_t even = (p & 1u) == 0 ? lo : hi;
    const float above = std::nextafter(mid, std::numeric_limits<float>::infinity());
    const float below = std::nextafter(mid, 0.0f);
    for (const std::uint16_t sign : {std::uint16_t{0}, std::uint16_t{0x8000}}) {
      const float s = sign ? -1.0f : 1.0f;
      if (enc(s * mid) != (sign | even)) ++failures;
      if (enc(s * above) != (sign | hi)) ++failures;
      if (enc(s * below) != (sign | lo)) ++failures;
    }
  }
  CHECK(failures == 0);
}

}  // namespace

// ---------------------------------------------------------------- static --

TEST_CASE("dtype: static properties") {
  static_assert(sizeof(half) == 2 && alignof(half) == 2);
  static_assert(sizeof(bfloat16) == 2 && alignof(bfloat16) == 2);
  static_assert(std::is_trivially_copyable_v<half> && std::is_trivially_copyable_v<bfloat16>);
  static_assert(std::is_trivial_v<half> && std::is_trivial_v<bfloat16>);
  static_assert(std::is_standard_layout_v<half> && std::is_standard_layout_v<bfloat16>);
  static_assert(half::from_bits(0x3C00).bits == 0x3C00);
  static_assert(bfloat16::from_bits(0x3F80).bits == 0x3F80);

  static_assert(kvevict::is_kv_dtype_v<float>);
  static_assert(kvevict::is_kv_dtype_v<half>);
  static_assert(kvevict::is_kv_dtype_v<bfloat16>);
  static_assert(!kvevict::is_kv_dtype_v<double>);
  static_assert(!kvevict::is_kv_dtype_v<int>);
  static_assert(!kvevict::is_kv_dtype_v<std::uint16_t>);

  static_assert(std::is_same_v<decltype(kvevict::from_float<half>(1.0f)), half>);
  static_assert(std::is_same_v<decltype(kvevict::to_float(half{})), float>);

  CHECK(std::string(kvevict::dtype_traits<float>::name) == "float");
  CHECK(std::string(kvevict::dtype_traits<half>::name) == "half");
  CHECK(std::string(kvevict::dtype_traits<bfloat16>::name) == "bfloat16");
}

TEST_CASE("dtype: generic to_float/from_float agree with the named conversions") {
  std::mt19937 rng(12345);
  for (int i = 0; i < 20000; ++i) {
    const float f = bits_f32(static_cast<std::uint32_t>(rng()));
    const auto b = static_cast<std::uint16_t>(rng());
    REQUIRE(kvevict::from_float<half>(f).bits == enc_half(f));
    REQUIRE(kvevict::from_float<bfloat16>(f).bits == enc_bf16(f));
    REQUIRE(f32_bits(kvevict::from_float<float>(f)) == f32_bits(f));
    REQUIRE(f32_bits(kvevict::to_float(f)) == f32_bits(f));
    REQUIRE(f32_bits(kvevict::to_float(half::from_bits(b))) == f32_bits(dec_half(b)));
    REQUIRE(f32_bits(kvevict::to_float(bfloat16::from_bits(b))) == f32_bits(dec_bf16(b)));
  }
  CHECK(kvevict::to_float(kvevict::from_float<half>(1.5f)) == 1.5f);
  CHECK(kvevict::to_float(kvevict::from_float<bfloat16>(-2.25f)) == -2.25f);
}

// ------------------------------------------------------------------ half --

TEST_CASE("half: all 65536 patterns decode exactly") {
  long mismatches = 0;
  long native_mismatches = 0;
  for (std::uint32_t b = 0; b <= 0xFFFFu; ++b) {
    const auto bits = static_cast<std::uint16_t>(b);
    const float got = dec_half(bits);
    if (!same_float(got, ref_decode(bits, kHalf))) ++mismatches;
#if defined(__FLT16_MANT_DIG__)
    const float native = native_half_to_float(bits);
    if (std::isnan(native) ? !std::isnan(got) : f32_bits(native) != f32_bits(got))
      ++native_mismatches;
#endif
  }
  CHECK(mismatches == 0);
  CHECK(native_mismatches == 0);

  // A few anchors, spelled out.
  CHECK(dec_half(0x3C00) == 1.0f);
  CHECK(dec_half(0xC000) == -2.0f);
  CHECK(dec_half(0x7BFF) == 65504.0f);
  CHECK(dec_half(0x0001) == std::ldexp(1.0f, -24));
  CHECK(dec_half(0x0400) == std::ldexp(1.0f, -14));
  CHECK(f32_bits(dec_half(0x8000)) == 0x80000000u);
  CHECK(std::isinf(dec_half(0x7C00)));
  CHECK(dec_half(0xFC00) < 0.0f);
  CHECK(std::isnan(dec_half(0x7E00)));
  CHECK(std::isnan(dec_half(0xFC01)));
}

TEST_CASE("half: all 65536 patterns round-trip") {
  long failures = 0;
  for (std::uint32_t b = 0; b <= 0xFFFFu; ++b) {
    const auto bits = static_cast<std::uint16_t>(b);
    const std::uint16_t want = is_nan_pattern(bits, kHalf) ? 0x7FFF : bits;
    if (enc_half(dec_half(bits)) != want) ++failures;
  }
  CHECK(failures == 0);
}

TEST_CASE("half: midpoints between adjacent values round to even") {
  // Pairs up to (0x7BFE, 0x7BFF); the (0x7BFF, inf) boundary is tested below.
  check_midpoints(half_mags(), 0x7BFF, enc_half);
}

TEST_CASE("half: special values") {
  CHECK(enc_half(65520.0f) == 0x7C00);  // tie between 65504 and 2^16 -> even -> inf
  CHECK(enc_half(-65520.0f) == 0xFC00);
  CHECK(enc_half(65519.99f) == 0x7BFF);
  CHECK(enc_half(std::nextafter(65520.0f, 0.0f)) == 0x7BFF);
  CHECK(enc_half(65504.0f) == 0x7BFF);
  CHECK(enc_half(65536.0f) == 0x7C00);
  CHECK(enc_half(1e30f) == 0x7C00);
  CHECK(enc_half(std::numeric_limits<float>::max()) == 0x7C00);
  CHECK(enc_half(-std::numeric_limits<float>::max()) == 0xFC00);

  const float tiny = std::ldexp(1.0f, -24);  // smallest half subnormal
  CHECK(enc_half(tiny) == 0x0001);
  CHECK(enc_half(-tiny) == 0x8001);
  CHECK(enc_half(tiny / 2) == 0x0000);  // exact tie with 0 -> even -> 0
  CHECK(enc_half(-tiny / 2) == 0x8000);
  CHECK(enc_half(std::nextafter(tiny / 2, 1.0f)) == 0x0001);
  CHECK(enc_half(std::nextafter(tiny / 2, 0.0f)) == 0x0000);
  CHECK(enc_half(1.5f * tiny) == 0x0002);  // tie 1 vs 2 -> even
  CHECK(enc_half(2.5f * tiny) == 0x0002);  // tie 2 vs 3 -> even
  // Rounding up from the largest subnormal into the smallest normal.
  CHECK(enc_half(std::ldexp(1.0f, -14) - std::ldexp(1.0f, -26)) == 0x0400);
  CHECK(enc_half(std::ldexp(1.0f, -14) - std::ldexp(1.0f, -25)) == 0x0400);  // tie -> even
  CHECK(enc_half(std::nextafter(std::ldexp(1.0f, -14) - std::ldexp(1.0f, -25), 0.0f)) ==
        0x03FF);

  CHECK(enc_half(std::numeric_limits<float>::denorm_min()) == 0x0000);
  CHECK(enc_half(-std::numeric_limits<float>::denorm_min()) == 0x8000);
  CHECK(enc_half(bits_f32(0x007FFFFFu)) == 0x0000);  // largest float subnormal
  CHECK(enc_half(bits_f32(0x807FFFFFu)) == 0x8000);
  CHECK(enc_half(std::numeric_limits<float>::min()) == 0x0000);
  CHECK(enc_half(0.0f) == 0x0000);
  CHECK(enc_half(-0.0f) == 0x8000);

  CHECK(enc_half(std::numeric_limits<float>::infinity()) == 0x7C00);
  CHECK(enc_half(-std::numeric_limits<float>::infinity()) == 0xFC00);
  CHECK(enc_half(std::numeric_limits<float>::quiet_NaN()) == 0x7FFF);
  CHECK(enc_half(-std::numeric_limits<float>::quiet_NaN()) == 0x7FFF);
  CHECK(enc_half(bits_f32(0x7F800001u)) == 0x7FFF);  // signalling NaN, tiny payload
  CHECK(enc_half(bits_f32(0xFFFFFFFFu)) == 0x7FFF);

  CHECK(enc_half(1.0f) == 0x3C00);
  CHECK(enc_half(-2.0f) == 0xC000);
  CHECK(enc_half(0.1f) == 0x2E66);
  CHECK(enc_half(1.0f + std::ldexp(1.0f, -11)) == 0x3C00);  // tie -> even
  CHECK(enc_half(1.0f + 3 * std::ldexp(1.0f, -11)) == 0x3C02);  // tie -> even (up)
}

TEST_CASE("half: random floats vs reference encoders") {
  std::mt19937 rng(20240611);
  const auto& mags = half_mags();
  long ref_mismatches = 0;
  long native_mismatches = 0;
  long native_checked = 0;
  constexpr int kSamples = 1500000;
  for (int i = 0; i < kSamples; ++i) {
    std::uint32_t u = static_cast<std::uint32_t>(rng());
    // Every other sample: force the exponent into (a bit beyond) the half
    // range so most samples exercise real rounding rather than 0 or inf.
    if (i & 1) {
      const std::uint32_t exp = 98u + static_cast<std::uint32_t>(rng() % 48u);  // 2^-29 .. 2^18
      u = (u & 0x807FFFFFu) | (exp << 23);
    }
    const float f = bits_f32(u);
    const std::uint16_t got = enc_half(f);
    if (got != ref_encode(f, mags)) ++ref_mismatches;
#if defined(__FLT16_MANT_DIG__)
    if (!std::isnan(f)) {
      ++native_checked;
      if (got != native_float_to_half(f)) ++native_mismatches;
    }
#endif
  }
  CHECK(ref_mismatches == 0);
  CHECK(native_mismatches == 0);
#if defined(__FLT16_MANT_DIG__)
  CHECK(native_checked > kSamples / 2);
#else
  (void)native_checked;
#endif
}

// -------------------------------------------------------------- bfloat16 --

TEST_CASE("bfloat16: all 65536 patterns decode exactly") {
  long mismatches = 0;
  for (std::uint32_t b = 0; b <= 0xFFFFu; ++b) {
    const auto bits = static_cast<std::uint16_t>(b);
    if (!same_float(dec_bf16(bits), ref_decode(bits, kBf16))) ++mismatches;
  }
  CHECK(mismatches == 0);

  CHECK(dec_bf16(0x3F80) == 1.0f);
  CHECK(dec_bf16(0xC000) == -2.0f);
  CHECK(dec_bf16(0x7F7F) == std::ldexp(255.0f, 120));  // largest finite: (2 - 2^-7) * 2^127
  CHECK(dec_bf16(0x0001) == std::ldexp(1.0f, -133));   // smallest subnormal
  CHECK(f32_bits(dec_bf16(0x8000)) == 0x80000000u);
  CHECK(std::isinf(dec_bf16(0x7F80)));
  CHECK(std::isnan(dec_bf16(0x7FC0)));
}

TEST_CASE("bfloat16: all 65536 patterns round-trip") {
  long failures = 0;
  for (std::uint32_t b = 0; b <= 0xFFFFu; ++b) {
    const auto bits = static_cast<std::uint16_t>(b);
    const std::uint16_t want = is_nan_pattern(bits, kBf16) ? 0x7FFF : bits;
    if (enc_bf16(dec_bf16(bits)) != want) ++failures;
  }
  CHECK(failures == 0);
}

TEST_CASE("bfloat16: midpoints between adjacent values round to even") {
  check_midpoints(bf16_mags(), 0x7F7F, enc_bf16);
}

TEST_CASE("bfloat16: special values and overflow") {
  const float max_bf16 = dec_bf16(0x7F7F);
  // Midpoint between the largest finite bf16 and 2^128 is a float (0x7F7F8000):
  // it ties to the even pattern, which is inf.
  CHECK(enc_bf16(bits_f32(0x7F7F8000u)) == 0x7F80);
  CHECK(enc_bf16(bits_f32(0xFF7F8000u)) == 0xFF80);
  CHECK(enc_bf16(bits_f32(0x7F7F7FFFu)) == 0x7F7F);
  CHECK(enc_bf16(std::numeric_limits<float>::max()) == 0x7F80);
  CHECK(enc_bf16(-std::numeric_limits<float>::max()) == 0xFF80);
  CHECK(enc_bf16(max_bf16) == 0x7F7F);

  CHECK(enc_bf16(std::numeric_limits<float>::infinity()) == 0x7F80);
  CHECK(enc_bf16(-std::numeric_limits<float>::infinity()) == 0xFF80);
  CHECK(enc_bf16(std::numeric_limits<float>::quiet_NaN()) == 0x7FFF);
  CHECK(enc_bf16(-std::numeric_limits<float>::quiet_NaN()) == 0x7FFF);
  // A NaN whose set payload bits all lie in the low half would become inf if
  // rounded naively.
  CHECK(enc_bf16(bits_f32(0x7F800001u)) == 0x7FFF);
  CHECK(enc_bf16(bits_f32(0xFF80FFFFu)) == 0x7FFF);
  CHECK(enc_bf16(bits_f32(0x7FFFFFFFu)) == 0x7FFF);

  CHECK(enc_bf16(0.0f) == 0x0000);
  CHECK(enc_bf16(-0.0f) == 0x8000);
  CHECK(enc_bf16(std::numeric_limits<float>::denorm_min()) == 0x0000);
  CHECK(enc_bf16(bits_f32(0x00008000u)) == 0x0000);  // tie with 0 -> even
  CHECK(enc_bf16(bits_f32(0x00018000u)) == 0x0002);  // tie 1 vs 2 -> even
  CHECK(enc_bf16(bits_f32(0x00008001u)) == 0x0001);
  CHECK(enc_bf16(bits_f32(0x007FFFFFu)) == 0x0080);  // largest float subnormal -> min normal
  CHECK(enc_bf16(1.0f) == 0x3F80);
  CHECK(enc_bf16(3.14159265f) == 0x4049);
}

TEST_CASE("bfloat16: random floats vs reference encoder") {
  std::mt19937 rng(777);
  const auto& mags = bf16_mags();
  long mismatches = 0;
  constexpr int kSamples = 1500000;
  for (int i = 0; i < kSamples; ++i) {
    std::uint32_t u = static_cast<std::uint32_t>(rng());
    // Every fourth sample: low 16 bits at or near the 0x8000 tie.
    if ((i & 3) == 3) u = (u & 0xFFFF0000u) | (0x7FFEu + static_cast<std::uint32_t>(rng() % 5u));
    const float f = bits_f32(u);
    if (enc_bf16(f) != ref_encode(f, mags)) ++mismatches;
  }
  CHECK(mismatches == 0);
}
