// The fp8 storage types (dtype/fp8.hpp) against the OCP 8-bit floating
// point specification (OFP8 1.0): every one of the 256 codes of each format
// decodes to the value the specification's formula gives (computed here in
// double with std::ldexp) and to the values of its table of special and
// boundary codes; every finite code round-trips; midpoints between adjacent
// values round to even; random floats encode as a brute-force nearest-even
// search over all codes with saturation to the largest finite value (CUDA's
// __NV_SATFINITE) does.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kvevict/dtype/convert.hpp"
#include "kvevict/dtype/fp8.hpp"

namespace {

using kvevict::fp8_e4m3;
using kvevict::fp8_e5m2;

struct format {
  const char* name;
  int exponent_bits, mantissa_bits, bias;
  bool has_infinity;  // e5m2; e4m3 ("fn") has none and one NaN code per sign
  double max_finite;
  float (*decode)(std::uint8_t);
  std::uint8_t (*encode)(float);
};

const format e4m3{"e4m3", 4, 3, 7, false, 448.0,
                  [](std::uint8_t c) { return kvevict::fp8_e4m3_to_float(fp8_e4m3::from_bits(c)); },
                  [](float x) { return kvevict::float_to_fp8_e4m3(x).bits; }};
const format e5m2{"e5m2", 5, 2, 15, true, 57344.0,
                  [](std::uint8_t c) { return kvevict::fp8_e5m2_to_float(fp8_e5m2::from_bits(c)); },
                  [](float x) { return kvevict::float_to_fp8_e5m2(x).bits; }};

enum class kind { finite, infinity, nan };

/// The specification's value of a code: (-1)^s 2^(e - bias) (1 + m / 2^M),
/// subnormals (-1)^s 2^(1 - bias) (m / 2^M); e4m3: S.1111.111 is NaN;
/// e5m2: exponent all ones is infinity (m = 0) or NaN.
kind reference(const format& f, std::uint8_t code, double& value) {
  const int s = code >> 7, e = (code >> f.mantissa_bits) & ((1 << f.exponent_bits) - 1);
  const int m = code & ((1 << f.mantissa_bits) - 1);
  const int e_max = (1 << f.exponent_bits) - 1;
  if (f.has_infinity && e == e_max) {
    value = s ? -INFINITY : INFINITY;
    return m == 0 ? kind::infinity : kind::nan;
  }
  if (!f.has_infinity && e == e_max && m == (1 << f.mantissa_bits) - 1) return kind::nan;
  const double frac = double(m) / double(1 << f.mantissa_bits);
  value = e == 0 ? std::ldexp(frac, 1 - f.bias) : std::ldexp(1.0 + frac, e - f.bias);
  if (s) value = -value;
  return kind::finite;
}

std::uint32_t bits_of(float x) {
  std::uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}

/// Nearest-even by search: the finite code closest to |x| (the even code
/// on a tie), saturated to the largest finite, with x's sign; NaN: 0x7F.
std::uint8_t reference_encode(const format& f, float x) {
  const std::uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
  if (std::isnan(x)) return std::uint8_t(sign | 0x7F);
  const double a = std::fabs(double(x));
  std::uint8_t best = 0;
  double best_distance = INFINITY;
  for (int c = 0; c < 0x80; ++c) {
    double v = 0;
    if (reference(f, std::uint8_t(c), v) != kind::finite) continue;
    const double d = std::fabs(v - a);
    if (d < best_distance || (d == best_distance && (c & 1) == 0)) {
      best = std::uint8_t(c);
      best_distance = d;
    }
  }
  return std::uint8_t(sign | best);
}

void check_decodes_exactly(const format& f) {
  int finite = 0;
  for (int c = 0; c < 256; ++c) {
    CAPTURE(c);
    double want = 0;
    const kind k = reference(f, std::uint8_t(c), want);
    const float got = f.decode(std::uint8_t(c));
    if (k == kind::nan) {
      CHECK(std::isnan(got));
      CHECK(std::signbit(got) == bool(c & 0x80));
    } else {
      CHECK(bits_of(got) == bits_of(float(want)));  // exact, -0 included
      CHECK(double(got) == want);
      finite += k == kind::finite;
    }
  }
  CHECK(finite == (f.has_infinity ? 256 - 8 : 256 - 2));
}

}  // namespace

TEST_CASE("fp8: the specification's table of special and boundary values") {
  // OFP8 1.0, table 1.
  CHECK(e4m3.decode(0x7E) == 448.0f);                      // max normal S.1111.110
  CHECK(e4m3.decode(0xFE) == -448.0f);
  CHECK(e4m3.decode(0x08) == std::ldexp(1.0f, -6));       // min normal S.0001.000
  CHECK(e4m3.decode(0x07) == 0.875f * std::ldexp(1.0f, -6));  // max subnormal S.0000.111
  CHECK(e4m3.decode(0x01) == std::ldexp(1.0f, -9));       // min subnormal S.0000.001
  CHECK(std::isnan(e4m3.decode(0x7F)));
  CHECK(std::isnan(e4m3.decode(0xFF)));
  CHECK(e4m3.decode(0x78) == 256.0f);  // S.1111.000 is a number in the fn variant
  CHECK(bits_of(e4m3.decode(0x80)) == bits_of(-0.0f));
  CHECK(e5m2.decode(0x7B) == 57344.0f);                    // max normal S.11110.11
  CHECK(e5m2.decode(0x04) == std::ldexp(1.0f, -14));      // min normal
  CHECK(e5m2.decode(0x03) == 0.75f * std::ldexp(1.0f, -14));  // max subnormal
  CHECK(e5m2.decode(0x01) == std::ldexp(1.0f, -16));      // min subnormal
  CHECK(e5m2.decode(0x7C) == INFINITY);
  CHECK(e5m2.decode(0xFC) == -INFINITY);
  for (int c : {0x7D, 0x7E, 0x7F, 0xFD, 0xFE, 0xFF}) CHECK(std::isnan(e5m2.decode(static_cast<std::uint8_t>(c))));
  CHECK(e4m3.encode(1.0f) == 0x38);
  CHECK(e5m2.encode(1.0f) == 0x3C);
  CHECK(e5m2.encode(-2.0f) == 0xC0);
}

TEST_CASE("fp8: all 256 codes of each format decode exactly") {
  check_decodes_exactly(e4m3);
  check_decodes_exactly(e5m2);
}

TEST_CASE("fp8: every finite code round-trips, midpoints round to even, beyond the largest saturates") {
  for (const format* f : {&e4m3, &e5m2}) {
    CAPTURE(f->name);
    std::vector<double> values;  // the non-negative finite values, ascending with the code
    for (int c = 0; c < 0x80; ++c) {
      double v = 0;
      if (reference(*f, std::uint8_t(c), v) != kind::finite) continue;
      CHECK(f->encode(float(v)) == c);
      CHECK(f->encode(float(-v)) == (c | 0x80));
      values.push_back(v);
    }
    for (std::size_t i = 0; i + 1 < values.size(); ++i) {
      const double mid = (values[i] + values[i + 1]) / 2;  // exact in float: few significant bits
      CAPTURE(mid);
      REQUIRE(double(float(mid)) == mid);
      const std::uint8_t even = (i % 2 == 0) ? std::uint8_t(i) : std::uint8_t(i + 1);
      CHECK(f->encode(float(mid)) == even);
      CHECK(f->encode(std::nextafter(float(mid), 0.0f)) == std::uint8_t(i));
      CHECK(f->encode(std::nextafter(float(mid), INFINITY)) == std::uint8_t(i + 1));
    }
    const std::uint8_t max_code = f == &e4m3 ? 0x7E : 0x7B;
    for (float x : {float(f->max_finite), float(f->max_finite) * 1.06f, float(f->max_finite) * 4, 1e30f, INFINITY}) {
      CHECK(f->encode(x) == max_code);
      CHECK(f->encode(-x) == (max_code | 0x80));
    }
    CHECK(f->encode(std::numeric_limits<float>::quiet_NaN()) == 0x7F);
    CHECK(f->encode(-std::numeric_limits<float>::quiet_NaN()) == 0xFF);
    CHECK(f->encode(std::numeric_limits<float>::denorm_min()) == 0x00);
    CHECK(f->encode(-0.0f) == 0x80);
  }
}

TEST_CASE("fp8: random floats encode as the brute-force nearest-even search") {
  std::mt19937 rng(8);
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-22, 18);
  for (int i = 0; i < 40000; ++i) {
    const float x = (unit(rng) < 0.5f ? -1.0f : 1.0f) * std::ldexp(1.0f + unit(rng), exponent(rng));
    CAPTURE(x);
    CHECK(e4m3.encode(x) == reference_encode(e4m3, x));
    CHECK(e5m2.encode(x) == reference_encode(e5m2, x));
  }
}

TEST_CASE("fp8: the generic conversions and traits") {
  static_assert(kvevict::is_kv_dtype_v<fp8_e4m3> && kvevict::is_kv_dtype_v<fp8_e5m2>);
  static_assert(kvevict::is_fp8_v<fp8_e4m3> && !kvevict::is_fp8_v<kvevict::half>);
  CHECK(std::string(kvevict::dtype_traits<fp8_e4m3>::name) == "fp8_e4m3");
  CHECK(std::string(kvevict::dtype_traits<fp8_e5m2>::name) == "fp8_e5m2");
  CHECK(kvevict::from_float<fp8_e4m3>(-1.5f).bits == 0xBC);
  CHECK(kvevict::from_float<fp8_e5m2>(-1.5f).bits == 0xBE);
  CHECK(kvevict::dequantize(fp8_e4m3::from_bits(0x3C), 0.5f) == 0.75f);  // 1.5 x 0.5
  CHECK(kvevict::dequantize(fp8_e5m2::from_bits(0x3E), 4.0f) == 6.0f);
  CHECK(kvevict::dequantize(kvevict::half::from_bits(0x3C00), 2.0f) == 2.0f);
}

TEST_CASE("fp8: the host's table and the integer decode a GPU runs agree on every code, bit for bit") {
  // fp8_e4m3_to_float reads detail::e4m3_values on the host and runs
  // detail::fp8_to_float on a device: both must be the same exact values.
  for (int c = 0; c < 256; ++c) {
    CAPTURE(c);
    const auto code = static_cast<std::uint8_t>(c);
    const float e4m3 = kvevict::fp8_e4m3_to_float(fp8_e4m3::from_bits(code));
    const float e5m2 = kvevict::fp8_e5m2_to_float(fp8_e5m2::from_bits(code));
    const float e4m3_int = kvevict::detail::fp8_to_float(code, kvevict::detail::e4m3_format);
    const float e5m2_int = kvevict::detail::fp8_to_float(code, kvevict::detail::e5m2_format);
    CHECK(std::memcmp(&e4m3, &e4m3_int, sizeof(float)) == 0);
    CHECK(std::memcmp(&e5m2, &e5m2_int, sizeof(float)) == 0);
  }
}
