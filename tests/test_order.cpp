// Tests for the eviction order (order.hpp) and the counter-based generator
// behind the random policy (philox.hpp).
//
// The order is checked against a comparator written directly from
// docs/semantics.md ("Order and ties")
// with plain float comparisons; Philox4x32-10 against the Random123
// known-answer vectors and against an independent transcription of the
// round function from the paper.

#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <ios>
#include <limits>
#include <random>
#include <set>
#include <utility>
#include <vector>

#include "kvevict/order.hpp"
#include "kvevict/philox.hpp"
#include "support/random_reference.hpp"

namespace {

using i32 = std::int32_t;
using u32 = std::uint32_t;
using u64 = std::uint64_t;

float bits_f32(u32 u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

u32 f32_bits(float f) {
  u32 u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

u32 draw32(std::mt19937& g) { return static_cast<u32>(g()); }

// ---- the specification, written the obvious way ----

// "lower score first; NaN below everything; -0.0 == +0.0".
bool ref_score_less(float a, float b) {
  const bool na = std::isnan(a);
  const bool nb = std::isnan(b);
  if (na || nb) return na && !nb;
  return a < b;  // IEEE: -0.0 < +0.0 is false both ways
}

bool ref_score_equal(float a, float b) { return !ref_score_less(a, b) && !ref_score_less(b, a); }

// "lower score first; equal score -> smaller position first".
bool ref_evicts_before(float sa, i32 pa, float sb, i32 pb) {
  if (ref_score_less(sa, sb)) return true;
  if (ref_score_less(sb, sa)) return false;
  return pa < pb;
}

struct entry {
  float score;
  i32 position;
};

bool ref_entry_less(const entry& a, const entry& b) {
  return ref_evicts_before(a.score, a.position, b.score, b.position);
}
bool lib_entry_less(const entry& a, const entry& b) {
  return kvevict::evicts_before(a.score, a.position, b.score, b.position);
}

// Scores drawn to hit every corner of the order often.
float draw_score(std::mt19937& g) {
  static const u32 special[] = {
      0x7FC00000u, 0xFFC00000u, 0x7F800001u, 0xFF800001u, 0x7FFFFFFFu, 0xFFFFFFFFu,  // NaNs, both signs
      0x7FA5A5A5u, 0xFFD00001u, 0x7FBFFFFFu,                                      // more payloads
      0x7F800000u, 0xFF800000u,                                                    // +-inf
      0x00000000u, 0x80000000u,                                                    // +-0
      0x00000001u, 0x80000001u, 0x007FFFFFu, 0x807FFFFFu, 0x00400000u, 0x80400000u,  // subnormals
      0x00800000u, 0x80800000u, 0x7F7FFFFFu, 0xFF7FFFFFu,                          // min normal, max
      0x3F800000u, 0xBF800000u, 0x3F800001u, 0xBF800001u, 0x3F7FFFFFu,             // around +-1
  };
  constexpr u32 n_special = sizeof special / sizeof special[0];
  switch (draw32(g) % 7u) {
    case 0:
      return bits_f32(special[draw32(g) % n_special]);
    case 1:
      return bits_f32(draw32(g));  // any pattern, NaNs included
    case 2:
      return bits_f32((draw32(g) & 0x807FFFFFu));  // subnormal or zero, either sign
    case 3:
      return static_cast<float>(static_cast<int>(draw32(g) % 7u) - 3);  // small integers: many ties
    case 4: {
      const u32 payload = 1u + draw32(g) % 0x7FFFFFu;  // never 0, so never inf
      return bits_f32((draw32(g) & 0x80000000u) | 0x7F800000u | payload);
    }
    case 5:
      return std::uniform_real_distribution<float>(-2.0f, 2.0f)(g);
    default:
      return std::ldexp(static_cast<float>(static_cast<int>(draw32(g) % 2001u) - 1000), -140);  // tiny, ties
  }
}

i32 draw_position(std::mt19937& g) {
  constexpr i32 kMax = std::numeric_limits<i32>::max();
  switch (draw32(g) % 4u) {
    case 0:
      return static_cast<i32>(draw32(g) % 4u);
    case 1:
      return kMax - static_cast<i32>(draw32(g) % 3u);
    case 2:
      return static_cast<i32>(draw32(g) & 0x7FFFFFFFu);
    default:
      return static_cast<i32>(draw32(g) % 1000u);
  }
}

// ---- Philox4x32-10, transcribed independently from Salmon et al. (SC'11) ----
using ctr4 = std::array<u32, 4>;
using key2 = std::array<u32, 2>;

ctr4 ref_philox4x32_10(ctr4 c, key2 k) {
  constexpr u64 M0 = 0xD2511F53u, M1 = 0xCD9E8D57u;
  constexpr u32 W0 = 0x9E3779B9u, W1 = 0xBB67AE85u;
  for (u32 r = 0; r < 10; ++r) {
    // The key of round r is the user key plus r Weyl increments (mod 2^32).
    const u32 k0 = k[0] + r * W0;
    const u32 k1 = k[1] + r * W1;
    const u64 p0 = M0 * c[0];
    const u64 p1 = M1 * c[2];
    const u32 hi0 = static_cast<u32>(p0 >> 32), lo0 = static_cast<u32>(p0 & 0xFFFFFFFFu);
    const u32 hi1 = static_cast<u32>(p1 >> 32), lo1 = static_cast<u32>(p1 & 0xFFFFFFFFu);
    c = ctr4{hi1 ^ c[1] ^ k0, lo1, hi0 ^ c[3] ^ k1, lo0};
  }
  return c;
}

ctr4 lib_philox(const ctr4& c, const key2& k) {
  const kvevict::philox4x32_counter out =
      kvevict::philox4x32_10(kvevict::philox4x32_counter{{c[0], c[1], c[2], c[3]}}, kvevict::philox4x32_key{{k[0], k[1]}});
  return ctr4{out.v[0], out.v[1], out.v[2], out.v[3]};
}

struct kat {
  ctr4 counter;
  key2 key;
  ctr4 expected;
};

// Random123 kat_vectors, philox4x32 with 10 rounds.
const kat kKats[] = {
    {{0u, 0u, 0u, 0u}, {0u, 0u}, {0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u}},
    {{0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu},
     {0xffffffffu, 0xffffffffu},
     {0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu}},
    {{0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u},
     {0xa4093822u, 0x299f31d0u},
     {0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u}},
};

}  // namespace

// ============================================================================
// Order
// ============================================================================

TEST_CASE("order: hand-picked corners of the specification") {
  const float nan_q = bits_f32(0x7FC00000u), nan_neg = bits_f32(0xFFC00000u), nan_s = bits_f32(0x7F800001u);
  const float inf = std::numeric_limits<float>::infinity();
  const float den = std::numeric_limits<float>::denorm_min();

  // Every NaN (any payload, either sign) has the same key, below -inf.
  CHECK(kvevict::score_order_key(nan_q) == kvevict::score_order_key(nan_neg));
  CHECK(kvevict::score_order_key(nan_q) == kvevict::score_order_key(nan_s));
  CHECK(kvevict::score_order_key(nan_q) == kvevict::score_order_key(bits_f32(0xFFFFFFFFu)));
  CHECK(kvevict::score_order_key(nan_q) < kvevict::score_order_key(-inf));
  CHECK(kvevict::evicts_before(nan_neg, 1000, -inf, 0));
  CHECK_FALSE(kvevict::evicts_before(-inf, 0, nan_neg, 1000));
  // Two NaNs tie on score, so position decides.
  CHECK(kvevict::evicts_before(nan_q, 1, nan_neg, 2));
  CHECK_FALSE(kvevict::evicts_before(nan_q, 2, nan_neg, 1));
  // -0.0 == +0.0: the position decides, in both directions.
  CHECK(kvevict::score_order_key(-0.0f) == kvevict::score_order_key(0.0f));
  CHECK(kvevict::evicts_before(0.0f, 3, -0.0f, 4));
  CHECK(kvevict::evicts_before(-0.0f, 3, 0.0f, 4));
  CHECK_FALSE(kvevict::evicts_before(-0.0f, 4, 0.0f, 3));
  // Subnormals sit strictly between the zeros and the normals.
  CHECK(kvevict::evicts_before(-den, 100, 0.0f, 0));
  CHECK(kvevict::evicts_before(0.0f, 100, den, 0));
  CHECK(kvevict::evicts_before(den, 100, std::numeric_limits<float>::min(), 0));
  CHECK(kvevict::evicts_before(-std::numeric_limits<float>::max(), 5, -1.0f, 0));
  CHECK(kvevict::evicts_before(std::numeric_limits<float>::max(), 5, inf, 0));
  // Lower score first regardless of position; equal scores: older first.
  CHECK(kvevict::evicts_before(1.0f, 1000000, 2.0f, 0));
  CHECK(kvevict::evicts_before(1.0f, 7, 1.0f, 8));
  CHECK_FALSE(kvevict::evicts_before(1.0f, 8, 1.0f, 7));
  CHECK_FALSE(kvevict::evicts_before(1.0f, 7, 1.0f, 7));  // irreflexive
  CHECK(kvevict::evicts_before(2.0f, 0, 2.0f, std::numeric_limits<i32>::max()));
}

TEST_CASE("order: keys and evicts_before match the reference comparator on random pairs") {
  std::mt19937 g(20240611u);
  constexpr int kPairs = 300000;
  int bad_before = 0, bad_key_less = 0, bad_key_eq = 0, bad_score_less = 0, bad_score_eq = 0;
  int nan_pairs = 0, equal_score_pairs = 0, equal_pos_pairs = 0;
  for (int i = 0; i < kPairs; ++i) {
    const float sa = draw_score(g);
    float sb = draw_score(g);
    const i32 pa = draw_position(g);
    i32 pb = draw_position(g);
    const u32 tie = draw32(g) % 8u;
    if (tie == 0) sb = sa;
    if (tie == 1) sb = bits_f32(f32_bits(sa) ^ 0x80000000u);  // opposite sign: -0/+0, NaN sign flip
    if (tie == 2 || tie == 3) pb = pa;

    nan_pairs += (std::isnan(sa) || std::isnan(sb)) ? 1 : 0;
    equal_score_pairs += ref_score_equal(sa, sb) ? 1 : 0;
    equal_pos_pairs += (pa == pb) ? 1 : 0;

    const bool ref = ref_evicts_before(sa, pa, sb, pb);
    const bool ref_eq = ref_score_equal(sa, sb) && pa == pb;
    const bool lib = kvevict::evicts_before(sa, pa, sb, pb);
    const std::uint64_t ka = kvevict::eviction_key(sa, pa), kb = kvevict::eviction_key(sb, pb);
    const u32 oa = kvevict::score_order_key(sa), ob = kvevict::score_order_key(sb);

    auto report = [&](int& counter, const char* what) {
      if (counter++ < 5) {
        INFO(what << ": a = (0x" << std::hex << f32_bits(sa) << ", " << std::dec << pa << "), b = (0x" << std::hex
                  << f32_bits(sb) << ", " << std::dec << pb << ")");
        FAIL_CHECK("order mismatch");
      }
    };
    if (lib != ref) report(bad_before, "evicts_before");
    if ((ka < kb) != ref) report(bad_key_less, "eviction_key <");
    if ((ka == kb) != ref_eq) report(bad_key_eq, "eviction_key ==");
    if ((oa < ob) != ref_score_less(sa, sb)) report(bad_score_less, "score_order_key <");
    if ((oa == ob) != ref_score_equal(sa, sb)) report(bad_score_eq, "score_order_key ==");
  }
  CHECK(bad_before == 0);
  CHECK(bad_key_less == 0);
  CHECK(bad_key_eq == 0);
  CHECK(bad_score_less == 0);
  CHECK(bad_score_eq == 0);
  // The generator really exercised the corners.
  CHECK(nan_pairs > kPairs / 10);
  CHECK(equal_score_pairs > kPairs / 10);
  CHECK(equal_pos_pairs > kPairs / 10);
}

TEST_CASE("order: sorting with the library and with the reference gives the same sequence") {
  std::mt19937 g(777u);
  std::vector<entry> v(20000);
  for (entry& e : v) e = {draw_score(g), draw_position(g)};
  // Plenty of exact duplicates, so equivalent elements meet in the sort.
  for (std::size_t i = 0; i < v.size(); i += 13) v[i] = v[(i * 7919u) % v.size()];

  std::vector<entry> by_ref = v, by_lib = v, by_key = v;
  std::stable_sort(by_ref.begin(), by_ref.end(), ref_entry_less);
  std::stable_sort(by_lib.begin(), by_lib.end(), lib_entry_less);
  std::stable_sort(by_key.begin(), by_key.end(), [](const entry& a, const entry& b) {
    return kvevict::eviction_key(a.score, a.position) < kvevict::eviction_key(b.score, b.position);
  });

  // Stable sorts under two comparators agree bit for bit exactly when the
  // comparators induce the same strict weak order on these elements.
  int mismatches = 0;
  for (std::size_t i = 0; i < v.size(); ++i) {
    const bool same_lib = f32_bits(by_ref[i].score) == f32_bits(by_lib[i].score) && by_ref[i].position == by_lib[i].position;
    const bool same_key = f32_bits(by_ref[i].score) == f32_bits(by_key[i].score) && by_ref[i].position == by_key[i].position;
    if (!same_lib || !same_key) ++mismatches;
  }
  CHECK(mismatches == 0);

  // The library-sorted sequence is sorted for the reference, and consecutive
  // elements are never inverted (totality / no cycles).
  CHECK(std::is_sorted(by_lib.begin(), by_lib.end(), ref_entry_less));
  int inversions = 0;
  for (std::size_t i = 1; i < by_lib.size(); ++i)
    if (lib_entry_less(by_lib[i], by_lib[i - 1])) ++inversions;
  CHECK(inversions == 0);

  // An unstable sort with the library comparator lands on an order that is
  // equivalent to the reference one at every index.
  std::vector<entry> fast = v;
  std::sort(fast.begin(), fast.end(), lib_entry_less);
  int not_equivalent = 0;
  for (std::size_t i = 0; i < v.size(); ++i)
    if (ref_entry_less(fast[i], by_ref[i]) || ref_entry_less(by_ref[i], fast[i])) ++not_equivalent;
  CHECK(not_equivalent == 0);
}

TEST_CASE("order: transitivity and trichotomy on random triples") {
  std::mt19937 g(99u);
  int bad_transitive = 0, bad_trichotomy = 0;
  for (int i = 0; i < 100000; ++i) {
    entry a{draw_score(g), draw_position(g)}, b{draw_score(g), draw_position(g)}, c{draw_score(g), draw_position(g)};
    if (draw32(g) % 4u == 0) b.score = a.score;
    if (draw32(g) % 4u == 0) c.score = b.score;
    if (draw32(g) % 4u == 0) c.position = a.position;
    if (lib_entry_less(a, b) && lib_entry_less(b, c) && !lib_entry_less(a, c)) ++bad_transitive;
    const int relations = int(lib_entry_less(a, b)) + int(lib_entry_less(b, a)) +
                          int(kvevict::eviction_key(a.score, a.position) == kvevict::eviction_key(b.score, b.position));
    if (relations != 1) ++bad_trichotomy;
  }
  CHECK(bad_transitive == 0);
  CHECK(bad_trichotomy == 0);
}

// ============================================================================
// Philox4x32-10
// ============================================================================

TEST_CASE("philox: Random123 known-answer vectors") {
  for (const kat& k : kKats) {
    CAPTURE(k.counter[0]);
    const ctr4 lib = lib_philox(k.counter, k.key);
    const ctr4 ref = ref_philox4x32_10(k.counter, k.key);
    for (int i = 0; i < 4; ++i) {
      CAPTURE(i);
      CHECK(ref[i] == k.expected[i]);  // the independent transcription reproduces the vectors
      CHECK(lib[i] == k.expected[i]);
    }
  }
}

TEST_CASE("philox: library matches an independent transcription on random inputs") {
  std::mt19937 g(4242u);
  int mismatches = 0;
  for (int i = 0; i < 20000; ++i) {
    const ctr4 c{draw32(g), draw32(g), draw32(g), draw32(g)};
    const key2 k{draw32(g), draw32(g)};
    if (lib_philox(c, k) != ref_philox4x32_10(c, k)) ++mismatches;
  }
  CHECK(mismatches == 0);
}

TEST_CASE("random_draw: a pure function whose every argument matters") {
  using kvevict::random_draw;
  using kvevict::random_use;
  std::mt19937 g(31337u);
  int impure = 0, same_seed_lo = 0, same_seed_hi = 0, same_stream = 0, same_seq = 0, same_head = 0, same_index = 0;
  for (int i = 0; i < 5000; ++i) {
    const u64 seed = (u64{draw32(g)} << 32) | draw32(g);
    const random_use st = (draw32(g) & 1u) ? random_use::prefill_priority : random_use::decode_victim;
    const random_use other_st =
        st == random_use::decode_victim ? random_use::prefill_priority : random_use::decode_victim;
    const i32 b = static_cast<i32>(draw32(g) % 64u);
    const i32 h = static_cast<i32>(draw32(g) % 64u);
    const i32 idx = static_cast<i32>(draw32(g) & 0x7FFFFFFFu);
    const u32 d = random_draw(seed, st, b, h, idx);
    // Interleave another call so hidden state would show.
    (void)random_draw(seed + 1, other_st, b + 1, h + 1, idx ^ 1);
    if (random_draw(seed, st, b, h, idx) != d) ++impure;
    if (random_draw(seed ^ 0x1u, st, b, h, idx) == d) ++same_seed_lo;
    if (random_draw(seed ^ (u64{1} << 40), st, b, h, idx) == d) ++same_seed_hi;
    if (random_draw(seed, other_st, b, h, idx) == d) ++same_stream;
    if (random_draw(seed, st, b ^ 1, h, idx) == d) ++same_seq;
    if (random_draw(seed, st, b, h ^ 1, idx) == d) ++same_head;
    if (random_draw(seed, st, b, h, idx ^ 1) == d) ++same_index;
  }
  CHECK(impure == 0);
  CHECK(same_seed_lo == 0);
  CHECK(same_seed_hi == 0);
  CHECK(same_stream == 0);
  CHECK(same_seq == 0);
  CHECK(same_head == 0);
  CHECK(same_index == 0);

  // A grid of (seed, stream, sequence, head, index) gives distinct draws
  // (a birthday collision among 8192 32-bit values has probability ~0.8%,
  // and the inputs are fixed, so this never flakes).
  std::set<u32> seen;
  int count = 0;
  for (u64 seed : {u64{1}, u64{0x100000000ull}})
    for (random_use st : {random_use::decode_victim, random_use::prefill_priority})
      for (i32 b = 0; b < 4; ++b)
        for (i32 h = 0; h < 8; ++h)
          for (i32 idx = 0; idx < 64; ++idx) {
            seen.insert(random_draw(seed, st, b, h, idx));
            ++count;
          }
  CHECK(static_cast<int>(seen.size()) == count);

  // Every output bit is balanced over many draws.
  std::array<int, 32> ones{};
  constexpr int kDraws = 50000;
  for (i32 idx = 0; idx < kDraws; ++idx) {
    const u32 d = random_draw(12345u, random_use::decode_victim, idx % 3, idx % 5, idx);
    for (int bit = 0; bit < 32; ++bit) ones[static_cast<std::size_t>(bit)] += static_cast<int>((d >> bit) & 1u);
  }
  for (int bit = 0; bit < 32; ++bit) {
    CAPTURE(bit);
    CHECK(std::abs(ones[static_cast<std::size_t>(bit)] - kDraws / 2) < kDraws / 50);  // 2% of draws; sigma ~0.45%
  }
}

TEST_CASE("random decode priorities: the definition, every argument matters, uniform victims") {
  std::mt19937 g(2024u);
  int wrong = 0, same_seed = 0, same_stream_hi = 0, same_head = 0, same_newest = 0, same_position = 0;
  for (int i = 0; i < 5000; ++i) {
    const u64 seed = (u64{draw32(g)} << 32) | draw32(g);
    const u64 stream = ((u64{draw32(g)} << 32) | draw32(g)) & kvevict::max_random_stream;
    const i32 h = static_cast<i32>(draw32(g) % 64u), newest = static_cast<i32>(draw32(g) & 0x7FFFFFFFu);
    const i32 p = static_cast<i32>(draw32(g) & 0x7FFFFFFFu);
    const auto lib = [](u64 sd, u64 st, i32 hd, i32 nw, i32 ps) {
      return kvevict::random_priority(kvevict::random_step_key(sd, st, hd, nw), ps);
    };
    const u32 d = lib(seed, stream, h, newest, p);
    wrong += d != kvtest::decode_priority(seed, stream, h, newest, p);
    same_seed += lib(seed ^ (u64{1} << 37), stream, h, newest, p) == d;
    same_stream_hi += lib(seed, stream ^ (u64{1} << 50), h, newest, p) == d;
    same_head += lib(seed, stream, h ^ 1, newest, p) == d;
    same_newest += lib(seed, stream, h, newest ^ 1, p) == d;
    same_position += lib(seed, stream, h, newest, p ^ 1) == d;
  }
  CHECK(wrong == 0);
  CHECK(same_seed == 0);  // 32-bit collisions: expected 5000 / 2^32 per line
  CHECK(same_stream_hi == 0);
  CHECK(same_head == 0);
  CHECK(same_newest == 0);
  CHECK(same_position == 0);

  // The victim (lowest priority) of 7 candidates over 70k steps is uniform:
  // chi-square with df = 6; P(chi2 > 40) ~ 5e-7, and the inputs are fixed.
  constexpr int kN = 7, kSteps = 70000;
  std::array<int, kN> counts{};
  for (i32 step = 0; step < kSteps; ++step) {
    const kvevict::philox4x32_key key = kvevict::random_step_key(0xC0FFEEu, u64(step % 5), step % 8, 100 + step);
    int best = 0;
    for (int c = 1; c < kN; ++c)
      if (kvevict::random_priority(key, 10 + c) < kvevict::random_priority(key, 10 + best)) best = c;
    ++counts[static_cast<std::size_t>(best)];
  }
  const double expected = double(kSteps) / kN;
  double chi2 = 0.0;
  for (int c : counts) chi2 += (c - expected) * (c - expected) / expected;
  CAPTURE(chi2);
  CHECK(chi2 < 40.0);
}
