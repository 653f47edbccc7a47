#pragma once
// Floating-point arithmetic whose every rounding is fixed, so the host and a
// CUDA kernel that run the same function get the same bits.
//
// Two things normally break that: a compiler that fuses a * b + c into one
// FMA (nvcc does by default, GCC does in GNU modes on targets with FMA), and
// exp(), whose last bit differs between libm and CUDA. Here every product
// and sum goes through add / mul, which use the round-to-nearest intrinsics
// (never fused) in device code, and functions doing arithmetic carry
// KVEVICT_REPRODUCIBLE / KVEVICT_FP_CONTRACT_OFF so host compilers do not
// fuse either. exp() is computed by reproducible_exp below: a Cody-Waite
// reduction and a degree-13 Taylor polynomial in double, within 1.5 ulp.
#include <cstdint>
#include <cstring>

#include "kvevict/config.hpp"

// GCC fuses across statements once FMA exists (__FP_FAST_FMA) and GNU modes
// are on; the optimize attribute turns that off for one function. It also
// stops the function from being inlined, so it is applied only where fusing
// is possible at all.
#if defined(__GNUC__) && !defined(__clang__) && !defined(__CUDA_ARCH__) && defined(__FP_FAST_FMA)
#define KVEVICT_REPRODUCIBLE __attribute__((optimize("fp-contract=off")))
#else
#define KVEVICT_REPRODUCIBLE
#endif

// Clang fuses within an expression by default; its pragma is scoped to the
// enclosing block and keeps inlining.
#if defined(__clang__)
#define KVEVICT_FP_CONTRACT_OFF _Pragma("clang fp contract(off)")
#else
#define KVEVICT_FP_CONTRACT_OFF
#endif

namespace kvevict {
namespace detail {

// Device code: the _rn intrinsics are never contracted into an FMA.
KVEVICT_HOST_DEVICE inline double add(double a, double b) noexcept {
#if defined(__CUDA_ARCH__)
  return __dadd_rn(a, b);
#else
  return a + b;
#endif
}
KVEVICT_HOST_DEVICE inline double sub(double a, double b) noexcept {
#if defined(__CUDA_ARCH__)
  return __dsub_rn(a, b);
#else
  return a - b;
#endif
}
KVEVICT_HOST_DEVICE inline double mul(double a, double b) noexcept {
#if defined(__CUDA_ARCH__)
  return __dmul_rn(a, b);
#else
  return a * b;
#endif
}
KVEVICT_HOST_DEVICE inline double div(double a, double b) noexcept {
#if defined(__CUDA_ARCH__)
  return __ddiv_rn(a, b);
#else
  return a / b;
#endif
}
KVEVICT_HOST_DEVICE inline float add(float a, float b) noexcept {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
KVEVICT_HOST_DEVICE inline float mul(float a, float b) noexcept {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
KVEVICT_HOST_DEVICE inline float div(float a, float b) noexcept {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

KVEVICT_HOST_DEVICE inline double bits_to_double(std::uint64_t bits) noexcept {
  double x;
  std::memcpy(&x, &bits, sizeof x);
  return x;
}

/// +inf without <limits>, which device code cannot call without
/// --expt-relaxed-constexpr.
KVEVICT_HOST_DEVICE inline double infinity() noexcept { return bits_to_double(0x7FF0000000000000ull); }

/// 2^k for k in [-1022, 1023], built from its bits.
KVEVICT_HOST_DEVICE inline double pow2(std::int32_t k) noexcept {
  return bits_to_double(static_cast<std::uint64_t>(k + 1023) << 52);
}

}  // namespace detail

/// exp(x) in double, the same bits on every host compiler and on CUDA.
/// NaN stays NaN; overflow gives +inf and underflow 0 (subnormals in between).
KVEVICT_HOST_DEVICE KVEVICT_REPRODUCIBLE inline double reproducible_exp(double x) noexcept {
  KVEVICT_FP_CONTRACT_OFF
  using detail::add;
  using detail::mul;
  using detail::sub;
  if (x != x) return x;
  if (x > 709.782712893384) return detail::infinity();
  if (x < -745.2) return 0.0;
  // x = k ln2 + r with |r| <= ln2 / 2 (up to rounding). kLn2Hi has 32
  // significant bits, so k * kLn2Hi is exact for |k| < 2^20.
  constexpr double kInvLn2 = 1.44269504088896338700e+00;
  constexpr double kLn2Hi = 6.93147180369123816490e-01;
  constexpr double kLn2Lo = 1.90821492927058770002e-10;
  const double kd = add(mul(x, kInvLn2), x < 0.0 ? -0.5 : 0.5);
  const std::int32_t k = static_cast<std::int32_t>(kd);  // truncation: round half away from zero
  const double r = sub(sub(x, mul(static_cast<double>(k), kLn2Hi)), mul(static_cast<double>(k), kLn2Lo));
  // exp(r) = sum r^n / n!; the first omitted term, r^14 / 14!, is below 5e-18.
  constexpr double kInvFactorial[14] = {1.0,
                                        1.0,
                                        0.5,
                                        1.66666666666666666667e-01,
                                        4.16666666666666666667e-02,
                                        8.33333333333333333333e-03,
                                        1.38888888888888888889e-03,
                                        1.98412698412698412698e-04,
                                        2.48015873015873015873e-05,
                                        2.75573192239858906526e-06,
                                        2.75573192239858906526e-07,
                                        2.50521083854417187751e-08,
                                        2.08767569878680989792e-09,
                                        1.60590438368216145994e-10};
  // exp(r) = 1 + r q(r): adding the 1 last keeps the polynomial's rounding
  // relative to r q(r), below a third of the result.
  double q = kInvFactorial[13];
  for (int n = 12; n >= 1; --n) q = add(mul(q, r), kInvFactorial[n]);
  const double p = add(1.0, mul(r, q));
  // Scale by 2^k in at most two exact steps; only the last can round (into
  // the subnormal range).
  if (k > 1023) return mul(mul(p, detail::pow2(1023)), detail::pow2(k - 1023));
  if (k < -1022) return mul(mul(p, detail::pow2(k + 600)), detail::pow2(-600));
  return mul(p, detail::pow2(k));
}

}  // namespace kvevict
