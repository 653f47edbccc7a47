// reproducible_math.hpp: the exp that host and CUDA share, against long
// double expl from the C library, and its special values.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>

#include "kvevict/detail/reproducible_math.hpp"

namespace {

// Distance in units in the last place between two doubles of the same sign.
double ulps(double got, long double want) {
  const double w = static_cast<double>(want);
  if (got == w) return 0.0;
  const double ulp = std::nextafter(std::abs(w), std::numeric_limits<double>::infinity()) - std::abs(w);
  return static_cast<double>(std::abs(static_cast<long double>(got) - want) / static_cast<long double>(ulp));
}

}  // namespace

TEST_CASE("reproducible_exp is within 1.5 ulp of expl over the whole range") {
  std::mt19937_64 rng(5);
  std::uniform_real_distribution<double> wide(-745.0, 709.7), narrow(-40.0, 1.0), tiny(-1e-6, 1e-6);
  double worst = 0.0;
  for (int i = 0; i < 300000; ++i) {
    for (double x : {wide(rng), narrow(rng), tiny(rng)}) {
      const long double want = std::exp(static_cast<long double>(x));
      if (want < static_cast<long double>(std::numeric_limits<double>::min())) continue;  // subnormal results below
      const double e = ulps(kvevict::reproducible_exp(x), want);
      worst = std::max(worst, e);
      CHECK(e <= 1.5);  // the header promises 1.5 ulp
    }
  }
  MESSAGE("largest error: ", worst, " ulp");
}

TEST_CASE("reproducible_exp: special values, the subnormal range and the limits") {
  using kvevict::reproducible_exp;
  const double inf = std::numeric_limits<double>::infinity();
  CHECK(reproducible_exp(0.0) == 1.0);
  CHECK(reproducible_exp(-0.0) == 1.0);
  CHECK(std::isnan(reproducible_exp(std::nan(""))));
  CHECK(reproducible_exp(inf) == inf);
  CHECK(reproducible_exp(-inf) == 0.0);
  CHECK(reproducible_exp(709.78) < inf);
  CHECK(reproducible_exp(709.8) == inf);
  CHECK(reproducible_exp(-746.0) == 0.0);
  // Subnormal results: within one subnormal step of expl.
  for (double x = -744.9; x < -708.5; x += 0.37) {
    const long double want = std::exp(static_cast<long double>(x));
    const double got = reproducible_exp(x);
    CHECK(got > 0.0);
    CHECK(std::abs(static_cast<long double>(got) - want) <=
          static_cast<long double>(std::numeric_limits<double>::denorm_min()) +
              4 * std::numeric_limits<double>::epsilon() * want);
  }
  // Monotone on a fine grid around 0 and across a reduction boundary.
  double prev = reproducible_exp(-1.0);
  for (int i = 1; i <= 20000; ++i) {
    const double x = -1.0 + i * 1e-4;
    const double e = reproducible_exp(x);
    CHECK(e >= prev);
    prev = e;
  }
}
