#pragma once
// Decoding the fuzzer's bytes into choices and arrays. Small choices
// (opcodes, indices, sizes) come straight from the bytes; bulk arrays
// (probabilities, K/V rows, queries) come from a per-array seed, so one
// input stays short, plus an optional "poison" value the bytes place at a
// chosen index (NaN, infinities, negatives, values near FLT_MAX).
//
// Every choice is biased so that an exhausted input means "the ordinary,
// valid choice": libFuzzer's short inputs then run valid call sequences,
// and longer ones add the invalid variants.
#include <fuzzer/FuzzedDataProvider.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

#include "kvevict/dtype/convert.hpp"
#include "kvevict/score_inputs.hpp"

namespace kvfuzz {

/// What the values of a generated array look like.
enum class value_kind {
  probability,  ///< multiples of 1/64 in [0, 1]: many exact ties
  signed_score, ///< multiples of 1/16 in [-2, 2]
  logit,        ///< multiples of 1/8 in [-4, 4]
  query,        ///< multiples of 1/16 in [-1, 1]
  kv_row,       ///< multiples of 1/32 in [-2, 2]: exact in half and bfloat16
};

class fuzz_input {
 public:
  fuzz_input(const std::uint8_t* data, std::size_t size) : fdp_(data, size) {}

  bool exhausted() { return fdp_.remaining_bytes() == 0; }

  /// An integer in [lo, hi]; lo when the input is exhausted.
  int range(int lo, int hi) { return fdp_.ConsumeIntegralInRange<int>(lo, hi); }
  /// True about once in n (never for n <= 0); false when exhausted.
  bool one_in(int n) { return n > 0 && fdp_.ConsumeIntegralInRange<int>(0, n - 1) == n - 1; }
  std::uint32_t u32() { return fdp_.ConsumeIntegral<std::uint32_t>(); }
  std::uint64_t u64() { return fdp_.ConsumeIntegral<std::uint64_t>(); }

  /// A value that no valid input holds, or one at the edge of the float range.
  float poison() {
    static const float values[] = {std::numeric_limits<float>::quiet_NaN(),
                                   std::numeric_limits<float>::infinity(),
                                   -std::numeric_limits<float>::infinity(),
                                   -1.0f,
                                   -0.0f,
                                   3e38f,
                                   -3e38f,
                                   std::numeric_limits<float>::max(),
                                   std::numeric_limits<float>::denorm_min(),
                                   1e30f,
                                   -1e-30f};
    return values[range(0, int(sizeof values / sizeof values[0]) - 1)];
  }

  /// n values of `kind` from a seed the bytes give; about one array in
  /// `poison_odds` gets a poison value at an index the bytes choose.
  std::vector<float> floats(std::size_t n, value_kind kind, int poison_odds = 8) {
    std::vector<float> out(n);
    std::uint64_t state = u32() * 0x9E3779B97F4A7C15ull + 1;
    for (float& x : out) x = value(kind, next(state));
    if (n > 0 && one_in(poison_odds)) out[std::size_t(range(0, int(n) - 1))] = poison();
    return out;
  }

  /// The same converted to T (half, bfloat16 or float).
  template <class T>
  std::vector<T> elements(std::size_t n, value_kind kind, int poison_odds = 8) {
    const std::vector<float> f = floats(n, kind, poison_odds);
    std::vector<T> out(n);
    for (std::size_t i = 0; i < n; ++i) out[i] = kvevict::from_float<T>(f[i]);
    return out;
  }

 private:
  static std::uint64_t next(std::uint64_t& s) {  // splitmix64
    std::uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  static float value(value_kind kind, std::uint64_t r) {
    const int k = int(r % 129);  // 0..128
    switch (kind) {
      case value_kind::probability: return float(k % 65) / 64.0f;
      case value_kind::signed_score: return float(k % 65 - 32) / 16.0f;
      case value_kind::logit: return float(k % 65 - 32) / 8.0f;
      case value_kind::query: return float(k % 33 - 16) / 16.0f;
      case value_kind::kv_row: return float(k - 64) / 32.0f;
    }
    return 0.0f;
  }

  FuzzedDataProvider fdp_;
};

/// The `scale` of a logits or queries input: now and then 0, negative, NaN or inf.
inline float scale_value(fuzz_input& in) {
  if (in.one_in(24)) {
    const float bad[] = {0.0f, -1.0f, std::nanf(""), std::numeric_limits<float>::infinity()};
    return bad[in.range(0, 3)];
  }
  return in.one_in(2) ? 1.0f : 0.25f;
}

/// The LSE base of a logits or queries input: now and then out of range.
inline kvevict::lse_base base_value(fuzz_input& in) {
  if (in.one_in(24)) return static_cast<kvevict::lse_base>(in.range(2, 255));
  return in.one_in(2) ? kvevict::lse_base::base2 : kvevict::lse_base::natural;
}

}  // namespace kvfuzz
