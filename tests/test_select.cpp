// Tests for the host segmented selection (select/segmented_select.hpp).
//
// Every result is compared with a reference written directly from
// select/segments.hpp and docs/semantics.md ("Order and ties"), with plain
// float comparisons and no radix anything: stable_sort the indices of a
// segment by (score, position) (NaN lowest, -0 == +0; reversed for top-k),
// take the first k, then sort those by (position, index).

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <typeinfo>
#include <utility>
#include <vector>

#include "kvevict/select/segmented_select.hpp"

namespace {

namespace kv = kvevict;
using i32 = std::int32_t;
using i64 = std::int64_t;
using u8 = std::uint8_t;
using u32 = std::uint32_t;
using u64 = std::uint64_t;

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr i32 kIndexSentinel = -777;
constexpr u8 kMaskSentinel = 0xA5;

float bits_f32(u32 u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

std::size_t sz(i64 v) { return static_cast<std::size_t>(v); }

// ---- the reference ----

// "lower score first; NaN below every number; -0 == +0; then older position".
bool ref_before(float sa, i32 pa, float sb, i32 pb) {
  const bool na = std::isnan(sa), nb = std::isnan(sb);
  if (na != nb) return na;
  if (!na && sa != sb) return sa < sb;  // IEEE: -0 == +0
  return pa < pb;
}

// Orders idx (a set of indices) by (position, index).
void ref_by_position(std::vector<i32>& idx, const std::vector<i32>& position) {
  std::vector<std::pair<i32, i32>> by_position;
  for (i32 j : idx) by_position.emplace_back(position[sz(j)], j);
  std::sort(by_position.begin(), by_position.end());
  for (std::size_t t = 0; t < idx.size(); ++t) idx[t] = by_position[t].second;
}

// The indices of one segment in selection order (bottom: lowest first; top:
// highest first), identical keys by index: a sort of whole entries, with the
// index as the last tie-break, so a stable sort by key in effect (and fast
// enough at 1M elements, as it reads no other array).
std::vector<i32> ref_order(const std::vector<float>& score, const std::vector<i32>& position, kv::select_end end) {
  struct entry {
    float score;
    i32 position, index;
  };
  std::vector<entry> e;
  for (i32 j = 0; j < static_cast<i32>(score.size()); ++j) e.push_back({score[sz(j)], position[sz(j)], j});
  std::sort(e.begin(), e.end(), [&](const entry& a, const entry& b) {
    if (end == kv::select_end::bottom && ref_before(a.score, a.position, b.score, b.position)) return true;
    if (end == kv::select_end::top && ref_before(b.score, b.position, a.score, a.position)) return true;
    if (ref_before(a.score, a.position, b.score, b.position) || ref_before(b.score, b.position, a.score, a.position))
      return false;
    return a.index < b.index;  // identical keys
  });
  std::vector<i32> idx;
  for (const entry& x : e) idx.push_back(x.index);
  return idx;
}

std::vector<i32> ref_select(const std::vector<i32>& order, const std::vector<i32>& position, i32 k) {
  std::vector<i32> sel(order.begin(), order.begin() + k);
  ref_by_position(sel, position);
  return sel;
}

// ---- data ----

enum class dist { random, all_equal, few_values, with_nan, signed_zeros, infinities };
constexpr dist kAllDists[] = {dist::random,   dist::all_equal,    dist::few_values,
                              dist::with_nan, dist::signed_zeros, dist::infinities};

const char* name(dist d) {
  switch (d) {
    case dist::random: return "random";
    case dist::all_equal: return "all_equal";
    case dist::few_values: return "few_values";
    case dist::with_nan: return "with_nan";
    case dist::signed_zeros: return "signed_zeros";
    default: return "infinities";
  }
}

std::vector<float> make_scores(dist d, i32 n, std::mt19937& g) {
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  std::vector<float> s(sz(n));
  for (float& x : s) {
    const u32 r = static_cast<u32>(g());
    switch (d) {
      case dist::random: x = uniform(g); break;
      case dist::all_equal: x = 0.25f; break;
      case dist::few_values: x = static_cast<float>(r % 5u) - 2.0f; break;
      case dist::with_nan:  // NaNs of both signs and several payloads among numbers
        x = r % 4u == 0 ? bits_f32(((r & 1u) << 31) | 0x7F800000u | (1u + (r >> 9) % 0x7FFFFFu)) : uniform(g);
        break;
      case dist::signed_zeros: x = r % 3u == 0 ? 0.0f : r % 3u == 1 ? -0.0f : (r & 8u ? 1e-30f : -1e-30f); break;
      default: x = r % 4u == 0 ? kInf : r % 4u == 1 ? -kInf : r % 16u == 2 ? bits_f32(0x7FC00000u) : uniform(g);
    }
  }
  return s;
}

// Distinct positions, shuffled: a permutation of [0, n) or, wide, distinct
// values of both signs far apart (so the reordering needs more radix passes).
std::vector<i32> make_positions(i32 n, bool wide, std::mt19937& g) {
  std::vector<i32> p(sz(n));
  for (i32 j = 0; j < n; ++j) p[sz(j)] = wide ? j * 1999 - 1000000000 : j;
  std::shuffle(p.begin(), p.end(), g);
  return p;
}

std::vector<i32> k_values(i32 n) {
  std::vector<i32> ks{0, 1, n / 5, n / 2, n - 1, n};
  ks.erase(std::remove_if(ks.begin(), ks.end(), [&](i32 k) { return k < 0 || k > n; }), ks.end());
  std::sort(ks.begin(), ks.end());
  ks.erase(std::unique(ks.begin(), ks.end()), ks.end());
  return ks;
}

// One segment through the public API, indices and mask both; checks them
// against the reference order and the untouched ends of the rows.
void check_one_segment(const std::vector<float>& score, const std::vector<i32>* explicit_positions,
                       kv::select_end end, const std::vector<i32>& order, const std::vector<i32>& ks) {
  const i32 n = static_cast<i32>(score.size());
  std::vector<i32> implicit(sz(n));
  std::iota(implicit.begin(), implicit.end(), 0);
  const std::vector<i32>& position = explicit_positions ? *explicit_positions : implicit;
  kv::segment_set keys;
  keys.scores = score.data();
  keys.positions = explicit_positions ? explicit_positions->data() : nullptr;
  keys.stride = n;
  keys.max_length = n;
  keys.num_segments = 1;
  std::vector<unsigned char> workspace(kv::segmented_select_workspace_bytes(keys));
  for (i32 k : ks) {
    INFO("n = " << n << ", k = " << k << (end == kv::select_end::top ? ", top" : ", bottom"));
    std::vector<i32> idx(sz(k) + 2, kIndexSentinel);
    std::vector<u8> mask(sz(n) + 3, kMaskSentinel);
    kv::selection_output out{idx.data(), k + 2, mask.data(), n + 3};
    kv::segmented_select(workspace.data(), workspace.size(), keys, end, kv::selection_count{k, nullptr}, out);
    const std::vector<i32> expected = ref_select(order, position, k);
    CHECK(std::vector<i32>(idx.begin(), idx.begin() + k) == expected);
    CHECK(idx[sz(k)] == kIndexSentinel);
    CHECK(idx[sz(k) + 1] == kIndexSentinel);
    std::vector<u8> expected_mask(sz(n) + 3, 0);
    for (i32 j : expected) expected_mask[sz(j)] = 1;
    std::fill(expected_mask.begin() + n, expected_mask.end(), kMaskSentinel);
    CHECK(mask == expected_mask);
  }
}

void check_sizes(std::initializer_list<i32> sizes, std::initializer_list<dist> dists, u32 seed) {
  std::mt19937 g(seed);
  for (i32 n : sizes) {
    for (dist d : dists) {
      const std::vector<float> score = make_scores(d, n, g);
      for (int positions = 0; positions < 2; ++positions) {
        const std::vector<i32> explicit_positions = make_positions(n, n % 3 != 1, g);
        const std::vector<i32> implicit = [&] {
          std::vector<i32> p(sz(n));
          std::iota(p.begin(), p.end(), 0);
          return p;
        }();
        const std::vector<i32>& position = positions ? explicit_positions : implicit;
        for (kv::select_end end : {kv::select_end::bottom, kv::select_end::top}) {
          INFO("distribution " << name(d) << (positions ? ", shuffled positions" : ", implicit positions"));
          check_one_segment(score, positions ? &explicit_positions : nullptr, end, ref_order(score, position, end),
                            k_values(n));
        }
      }
    }
  }
}

std::vector<i32> select_one(const std::vector<float>& score, kv::select_end end, i32 k,
                            const std::vector<i32>* positions = nullptr) {
  kv::segment_set keys;
  keys.scores = score.data();
  keys.positions = positions ? positions->data() : nullptr;
  keys.stride = keys.max_length = static_cast<i32>(score.size());
  keys.num_segments = 1;
  std::vector<i32> idx(sz(std::max(k, 1)), kIndexSentinel);
  kv::segmented_select(keys, end, kv::selection_count{k, nullptr}, kv::selection_output{idx.data(), k, nullptr, 0});
  idx.resize(sz(k));
  return idx;
}

}  // namespace

TEST_CASE("select: the order's corners, by hand") {
  const float nan = bits_f32(0x7FC00000u);
  // NaN is lowest: bottom-k takes the NaNs first, top-k never.
  const std::vector<float> s{1.0f, nan, 0.0f, bits_f32(0xFFC00001u), -kInf, kInf};
  CHECK(select_one(s, kv::select_end::bottom, 2) == std::vector<i32>{1, 3});
  CHECK(select_one(s, kv::select_end::bottom, 3) == std::vector<i32>{1, 3, 4});
  CHECK(select_one(s, kv::select_end::top, 3) == std::vector<i32>{0, 2, 5});
  CHECK(select_one(s, kv::select_end::top, 4) == std::vector<i32>{0, 2, 4, 5});
  // -0 == +0: the older position goes first at the bottom, the newer is kept at the top.
  const std::vector<float> z{0.0f, -0.0f, -0.0f, 0.0f};
  CHECK(select_one(z, kv::select_end::bottom, 1) == std::vector<i32>{0});
  CHECK(select_one(z, kv::select_end::top, 1) == std::vector<i32>{3});
  const std::vector<i32> pos{40, 10, 30, 20};
  CHECK(select_one(z, kv::select_end::bottom, 2, &pos) == std::vector<i32>{1, 3});  // positions 10, 20
  CHECK(select_one(z, kv::select_end::top, 2, &pos) == std::vector<i32>{2, 0});     // positions 30, 40
  // Identical keys (equal scores, equal positions): the lower index first.
  const std::vector<float> e{2.0f, 1.0f, 1.0f, 1.0f, 1.0f};
  const std::vector<i32> same{5, 7, 7, 7, 7};
  CHECK(select_one(e, kv::select_end::bottom, 2, &same) == std::vector<i32>{1, 2});
  CHECK(select_one(e, kv::select_end::top, 2, &same) == std::vector<i32>{0, 1});
}

TEST_CASE("select: the branch-free score key orders as score_order_key") {
  std::mt19937 g(7);
  std::vector<u32> bits{0x7FC00000u, 0xFFC00000u, 0x7F800001u, 0xFFFFFFFFu, 0x7F800000u, 0xFF800000u,
                        0x00000000u, 0x80000000u, 0x00000001u, 0x80000001u, 0x007FFFFFu, 0x807FFFFFu,
                        0x00800000u, 0x80800000u, 0x7F7FFFFFu, 0xFF7FFFFFu, 0x3F800000u, 0xBF800000u};
  for (int t = 0; t < 2000; ++t) bits.push_back(static_cast<u32>(g()));
  for (u32 a : bits)
    for (u32 b : bits) {
      const u32 ka = kv::score_order_key(bits_f32(a)), kb = kv::score_order_key(bits_f32(b));
      const u32 fa = kv::detail::score_order_key_branchless(bits_f32(a));
      const u32 fb = kv::detail::score_order_key_branchless(bits_f32(b));
      if ((ka < kb) != (fa < fb) || (ka == kb) != (fa == fb)) {
        FAIL_CHECK("order differs for " << std::hex << a << " and " << b);
        return;
      }
    }
}

TEST_CASE("select: small and odd sizes, every distribution, both ends, against the reference") {
  check_sizes({1, 2, 31, 32, 33, 1000}, {dist::random, dist::all_equal, dist::few_values, dist::with_nan,
                                         dist::signed_zeros, dist::infinities},
              11);
}

TEST_CASE("select: 4K and 32K, every distribution, against the reference") {
  check_sizes({4096, 32768}, {dist::random, dist::all_equal, dist::few_values, dist::with_nan, dist::signed_zeros,
                              dist::infinities},
              12);
}

TEST_CASE("select: 128K against the reference") {
  check_sizes({131072}, {dist::random, dist::few_values, dist::with_nan}, 13);
}

TEST_CASE("select: 1M, random scores") {
  std::mt19937 g(14);
  const i32 n = 1 << 20;
  const std::vector<float> score = make_scores(dist::random, n, g);
  std::vector<i32> implicit(sz(n));
  std::iota(implicit.begin(), implicit.end(), 0);
  check_one_segment(score, nullptr, kv::select_end::bottom, ref_order(score, implicit, kv::select_end::bottom),
                    {n / 5});
  check_one_segment(score, nullptr, kv::select_end::top, ref_order(score, implicit, kv::select_end::top), {n / 2});
}

TEST_CASE("select: scores clustered so that a sample misses, and ties at the threshold") {
  // A sample sees a few values spread evenly through the segment; these
  // distributions make the window around the k-th key miss or hold
  // thousands of exact ties, so the histogram fallback and the tie path run.
  std::mt19937 g(15);
  const i32 n = 8192;
  std::vector<std::vector<float>> cases;
  std::vector<float> s(sz(n));
  for (i32 offset : {0, 16, 32, 48}) {  // a sample with a stride dividing 64 sees only the 5.0s of one of them
    for (i32 j = 0; j < n; ++j) s[sz(j)] = j % 64 == offset ? 5.0f : 1.0f + static_cast<float>(j) * 1e-6f;
    cases.push_back(s);
  }
  for (i32 j = 0; j < n; ++j) s[sz(j)] = static_cast<float>(j < n / 2 ? j : n - j);
  cases.push_back(s);  // ramps: every value twice
  for (i32 j = 0; j < n; ++j) s[sz(j)] = (j / 97) % 2 ? 3.0f : bits_f32(0x7FC00000u);
  cases.push_back(s);  // runs of NaN and 3.0
  std::vector<i32> implicit(sz(n));
  std::iota(implicit.begin(), implicit.end(), 0);
  for (const std::vector<float>& score : cases) {
    for (kv::select_end end : {kv::select_end::bottom, kv::select_end::top}) {
      const std::vector<i32> order = ref_order(score, implicit, end);
      check_one_segment(score, nullptr, end, order, {1, 63, 64, 65, 128, n / 3, n / 2, n - 64, n - 1});
      const std::vector<i32> positions = make_positions(n, true, g);
      check_one_segment(score, &positions, end, ref_order(score, positions, end), {7, n / 3, n - 5});
    }
  }
}

TEST_CASE("select: several segments, per-segment lengths and k, stride beyond the longest") {
  std::mt19937 g(16);
  const i32 max_length = 5000;
  const i64 stride = max_length + 37;
  const std::vector<i32> lengths{5000, 0, 1, 4321, 2048, 33, 3000};
  const std::vector<i32> ks{1000, 0, 1, 4320, 2048, 16, 0};
  const i32 segments = static_cast<i32>(lengths.size());
  std::vector<float> scores(sz(stride) * sz(segments), bits_f32(0x7FC00000u));  // gaps: NaN
  std::vector<i32> positions(scores.size(), -5);
  std::vector<std::vector<float>> seg_scores;
  std::vector<std::vector<i32>> seg_positions;
  for (i32 i = 0; i < segments; ++i) {
    const i32 n = lengths[sz(i)];
    seg_scores.push_back(make_scores(i % 2 ? dist::few_values : dist::random, n, g));
    seg_positions.push_back(make_positions(n, i % 3 == 0, g));
    std::copy(seg_scores.back().begin(), seg_scores.back().end(), scores.begin() + i * stride);
    std::copy(seg_positions.back().begin(), seg_positions.back().end(), positions.begin() + i * stride);
  }
  for (int explicit_positions = 0; explicit_positions < 2; ++explicit_positions) {
    for (kv::select_end end : {kv::select_end::bottom, kv::select_end::top}) {
      INFO((explicit_positions ? "explicit positions" : "implicit positions")
           << (end == kv::select_end::top ? ", top" : ", bottom"));
      kv::segment_set keys{scores.data(), explicit_positions ? positions.data() : nullptr, stride, lengths.data(),
                           max_length, segments};
      const i64 index_stride = 4400, mask_stride = max_length + 11;
      std::vector<i32> idx(sz(index_stride) * sz(segments), kIndexSentinel);
      std::vector<u8> mask(sz(mask_stride) * sz(segments), kMaskSentinel);
      kv::segmented_select(keys, end, kv::selection_count{0, ks.data()},
                           kv::selection_output{idx.data(), index_stride, mask.data(), mask_stride});
      for (i32 i = 0; i < segments; ++i) {
        INFO("segment " << i);
        const i32 n = lengths[sz(i)], k = ks[sz(i)];
        std::vector<i32> position(sz(n));
        std::iota(position.begin(), position.end(), 0);
        if (explicit_positions) position = seg_positions[sz(i)];
        const std::vector<i32> expected = ref_select(ref_order(seg_scores[sz(i)], position, end), position, k);
        const auto row = idx.begin() + i * index_stride;
        CHECK(std::vector<i32>(row, row + k) == expected);
        CHECK(std::all_of(row + k, row + index_stride, [](i32 v) { return v == kIndexSentinel; }));
        const auto mrow = mask.begin() + i * mask_stride;
        std::vector<u8> expected_mask(sz(mask_stride), 0);
        for (i32 j : expected) expected_mask[sz(j)] = 1;
        std::fill(expected_mask.begin() + n, expected_mask.end(), kMaskSentinel);
        CHECK(std::vector<u8>(mrow, mrow + mask_stride) == expected_mask);
      }
    }
  }
}

TEST_CASE("select: indices only, mask only, unaligned workspace, empty shapes") {
  std::mt19937 g(17);
  const i32 n = 3000, k = 700;
  const std::vector<float> score = make_scores(dist::random, n, g);
  const std::vector<i32> position = make_positions(n, false, g);
  const std::vector<i32> expected = ref_select(ref_order(score, position, kv::select_end::top), position, k);
  kv::segment_set keys{score.data(), position.data(), n, nullptr, n, 1};
  const std::size_t bytes = kv::segmented_select_workspace_bytes(keys);
  std::vector<unsigned char> storage(bytes + 16);
  for (std::size_t offset = 1; offset < 8; offset += 3) {
    std::vector<i32> idx(sz(k));
    kv::segmented_select(storage.data() + offset, bytes, keys, kv::select_end::top, kv::selection_count{k, nullptr},
                         kv::selection_output{idx.data(), k, nullptr, 0});
    CHECK(idx == expected);
    std::vector<u8> mask(sz(n), kMaskSentinel);
    kv::segmented_select(storage.data() + offset, bytes, keys, kv::select_end::top, kv::selection_count{k, nullptr},
                         kv::selection_output{nullptr, 0, mask.data(), n});
    std::vector<u8> expected_mask(sz(n), 0);
    for (i32 j : expected) expected_mask[sz(j)] = 1;
    CHECK(mask == expected_mask);
  }
  // No segments, and segments of length 0 (scores may then be null).
  std::vector<i32> idx(4, kIndexSentinel);
  kv::segmented_select(kv::segment_set{nullptr, nullptr, 0, nullptr, 0, 0}, kv::select_end::bottom,
                       kv::selection_count{}, kv::selection_output{idx.data(), 0, nullptr, 0});
  kv::segmented_select(kv::segment_set{nullptr, nullptr, 0, nullptr, 0, 4}, kv::select_end::bottom,
                       kv::selection_count{}, kv::selection_output{idx.data(), 0, nullptr, 0});
  CHECK(idx == std::vector<i32>(4, kIndexSentinel));
}

namespace {

// A key source other than scores: hashed 64-bit keys, optionally folded onto
// a few values (so that exact duplicates abound), and reversed positions.
struct hashed_keys {
  i32 num_segments = 0;
  i32 max_length = 0;
  u64 seed = 0;
  u64 fold = ~u64{0};
  bool reversed = false;

  static u64 mix(u64 x) {  // splitmix64
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
  }
  i32 length(i32 i) const { return max_length - 3 * i; }
  u64 raw(i32 i, i32 j) const { return mix(seed ^ (u64(u32(i)) << 32) ^ u64(u32(j))) & fold; }
  u64 key(i32 i, i32 j, kv::select_end end) const { return end == kv::select_end::top ? ~raw(i, j) : raw(i, j); }
  i32 position(i32, i32 j) const { return reversed ? max_length - j : j; }
  bool ordered_by_index() const { return !reversed; }
};

}  // namespace

TEST_CASE("select: the generic core on another key source") {
  for (u64 fold : {~u64{0}, u64{0x3}, u64{0xF000000000000000ull}, u64{0xFFFF}}) {
    for (bool reversed : {false, true}) {
      hashed_keys keys;
      keys.num_segments = 4;
      keys.max_length = 6000;
      keys.seed = fold * 31 + 7;
      keys.fold = fold;
      keys.reversed = reversed;
      for (kv::select_end end : {kv::select_end::bottom, kv::select_end::top}) {
        INFO("fold " << std::hex << fold << std::dec << (reversed ? ", reversed positions" : "")
                     << (end == kv::select_end::top ? ", top" : ", bottom"));
        const std::vector<i32> ks{1, 1500, 2997, 5990};
        const i64 index_stride = 6000;
        std::vector<i32> idx(sz(index_stride) * 4, kIndexSentinel);
        std::vector<u8> mask(sz(6000) * 4, kMaskSentinel);
        std::vector<unsigned char> workspace(kv::detail::select_workspace_bytes(keys));
        kv::detail::select_segments(workspace.data(), workspace.size(), keys, end, kv::selection_count{0, ks.data()},
                                    kv::selection_output{idx.data(), index_stride, mask.data(), 6000});
        for (i32 i = 0; i < keys.num_segments; ++i) {
          const i32 n = keys.length(i), k = ks[sz(i)];
          std::vector<i32> order(sz(n)), position(sz(n));
          std::iota(order.begin(), order.end(), 0);
          for (i32 j = 0; j < n; ++j) position[sz(j)] = keys.position(i, j);
          std::stable_sort(order.begin(), order.end(), [&](i32 a, i32 b) { return keys.key(i, a, end) < keys.key(i, b, end); });
          const std::vector<i32> expected = ref_select(order, position, k);
          const auto row = idx.begin() + i * index_stride;
          CHECK(std::vector<i32>(row, row + k) == expected);
          CHECK(row[k] == kIndexSentinel);
          std::vector<u8> expected_mask(sz(6000), 0);
          for (i32 j : expected) expected_mask[sz(j)] = 1;
          std::fill(expected_mask.begin() + n, expected_mask.end(), kMaskSentinel);
          CHECK(std::vector<u8>(mask.begin() + i * 6000, mask.begin() + (i + 1) * 6000) == expected_mask);
        }
      }
    }
  }
}

namespace {

// A valid problem of 4 segments and its outputs, filled with sentinels; each
// error case breaks one thing.
struct problem {
  std::vector<float> scores = std::vector<float>(4 * 50, 1.0f);
  std::vector<i32> lengths{50, 40, 0, 50};
  std::vector<i32> ks{3, 40, 0, 50};
  std::vector<i32> idx = std::vector<i32>(4 * 50, kIndexSentinel);
  std::vector<u8> mask = std::vector<u8>(4 * 50, kMaskSentinel);
  kv::segment_set keys{scores.data(), nullptr, 50, lengths.data(), 50, 4};
  kv::selection_count count{0, ks.data()};
  kv::selection_output out{idx.data(), 50, mask.data(), 50};
  std::vector<unsigned char> workspace = std::vector<unsigned char>(kv::segmented_select_workspace_bytes(keys));
};

// Both overloads throw exactly E naming `arg`, and leave the outputs as they were.
template <class E>
void check_rejected(const std::string& arg, void (*mutate)(problem&)) {
  for (int overload = 0; overload < 2; ++overload) {
    problem p;
    mutate(p);
    const std::vector<i32> idx_before = p.idx;
    const std::vector<u8> mask_before = p.mask;
    std::string what;
    bool right_type = false;
    try {
      if (overload == 0)
        kv::segmented_select(p.keys, kv::select_end::top, p.count, p.out);
      else
        kv::segmented_select(p.workspace.data(), p.workspace.size(), p.keys, kv::select_end::top, p.count, p.out);
    } catch (const kv::error& e) {
      what = e.what();
      right_type = typeid(e) == typeid(E);
    }
    INFO("argument " << arg << ", overload " << overload << ": " << what);
    CHECK(right_type);
    CHECK(what.find("kvevict::segmented_select: argument '" + arg + "'") != std::string::npos);
    CHECK(p.idx == idx_before);
    CHECK(p.mask == mask_before);
  }
}

}  // namespace

TEST_CASE("select: bad arguments are rejected before anything is written") {
  {
    problem p;  // the valid problem really is valid
    kv::segmented_select(p.keys, kv::select_end::top, p.count, p.out);
    CHECK(p.idx[0] != kIndexSentinel);
  }
  check_rejected<kv::invalid_argument>("keys.scores", [](problem& p) { p.keys.scores = nullptr; });
  check_rejected<kv::invalid_argument>("keys.num_segments", [](problem& p) { p.keys.num_segments = -1; });
  check_rejected<kv::invalid_argument>("keys.max_length", [](problem& p) { p.keys.max_length = -1; });
  check_rejected<kv::invalid_argument>("keys.stride", [](problem& p) { p.keys.stride = 49; });
  check_rejected<kv::out_of_range>("keys.lengths[3]", [](problem& p) { p.lengths[3] = 51; });
  check_rejected<kv::out_of_range>("keys.lengths[2]", [](problem& p) { p.lengths[2] = -1; });
  check_rejected<kv::out_of_range>("count.ks[3]", [](problem& p) { p.ks[3] = -1; });
  check_rejected<kv::out_of_range>("count.ks[1]", [](problem& p) { p.ks[1] = 41; });
  check_rejected<kv::out_of_range>("count.k", [](problem& p) {
    p.count = kv::selection_count{41, nullptr};  // above lengths[1] = 40
  });
  check_rejected<kv::out_of_range>("count.k", [](problem& p) { p.count = kv::selection_count{-1, nullptr}; });
  check_rejected<kv::invalid_argument>("out", [](problem& p) { p.out = kv::selection_output{}; });
  check_rejected<kv::invalid_argument>("out.index_stride", [](problem& p) { p.out.index_stride = 49; });
  check_rejected<kv::invalid_argument>("out.mask_stride", [](problem& p) { p.out.mask_stride = 49; });
  // The workspace, with the overload that takes one.
  for (int c = 0; c < 2; ++c) {
    problem p;
    std::string what;
    bool right_type = false;
    try {
      if (c == 0)
        kv::segmented_select(nullptr, p.workspace.size(), p.keys, kv::select_end::bottom, p.count, p.out);
      else
        kv::segmented_select(p.workspace.data(), p.workspace.size() - 1, p.keys, kv::select_end::bottom, p.count,
                             p.out);
    } catch (const kv::error& e) {
      what = e.what();
      right_type = typeid(e) == typeid(kv::invalid_argument);
    }
    INFO(what);
    CHECK(right_type);
    CHECK(what.find(c == 0 ? "argument 'workspace'" : "argument 'workspace_bytes'") != std::string::npos);
    CHECK(p.idx == std::vector<i32>(4 * 50, kIndexSentinel));
    CHECK(p.mask == std::vector<u8>(4 * 50, kMaskSentinel));
  }
}
