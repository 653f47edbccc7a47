// Tests for layouts, views, owning caches, scatter, compaction and
// tensor_view.
//
// Every expected offset is written by hand from the memory-order definition
// ([B][H][S][D], [B][S][H][D], page table then [P][H][D] or [H][P][D]), and
// every data movement is checked against a reference array maintained
// independently: element by element, bit for bit, over the whole K and V
// storage (so writes outside the expected rows are caught too).

#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "kvevict/compaction.hpp"
#include "kvevict/dtype/convert.hpp"
#include "kvevict/error.hpp"
#include "kvevict/kv_cache.hpp"
#include "kvevict/kv_view.hpp"
#include "kvevict/layout.hpp"
#include "kvevict/policy/recent_window.hpp"
#include "kvevict/scatter.hpp"
#include "kvevict/tensor_view.hpp"

namespace {

using kvevict::bfloat16;
using kvevict::half;
using kvevict::page_order;
using kvevict::paged_layout;
using kvevict::strided_layout;
using i32 = std::int32_t;
using i64 = std::int64_t;
using ref_fn = std::function<i64(i32, i32, i32)>;

i32 rand_below(std::mt19937& g, i32 n) { return static_cast<i32>(g() % static_cast<std::uint32_t>(n)); }

template <class T>
T random_value(std::mt19937& g);
template <>
float random_value<float>(std::mt19937& g) {
  return std::uniform_real_distribution<float>(-4.0f, 4.0f)(g);
}
template <>
half random_value<half>(std::mt19937& g) {
  return half::from_bits(static_cast<std::uint16_t>(g()));
}
template <>
bfloat16 random_value<bfloat16>(std::mt19937& g) {
  return bfloat16::from_bits(static_cast<std::uint16_t>(g()));
}

template <class T>
void fill_random(std::vector<T>& v, std::mt19937& g) {
  for (T& x : v) x = random_value<T>(g);
}

template <class T>
bool same_bits(const T& a, const T& b) {
  return std::memcmp(&a, &b, sizeof(T)) == 0;
}

// Index of the first element whose bits differ, -1 when identical.
template <class T>
i64 first_mismatch(const std::vector<T>& a, const std::vector<T>& b) {
  if (a.size() != b.size()) return -2;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (!same_bits(a[i], b[i])) return static_cast<i64>(i);
  return -1;
}

// ---- the memory orders, written by hand ----
i64 ref_bhsd(i32 H, i32 S, i32 D, i32 b, i32 h, i32 s) { return ((i64{b} * H + h) * S + s) * D; }
i64 ref_bshd(i32 H, i32 S, i32 D, i32 b, i32 h, i32 s) { return ((i64{b} * S + s) * H + h) * D; }
i64 ref_paged(const std::vector<i32>& table, i64 table_stride, i32 P, i32 H, i32 D, page_order order, i32 b, i32 h,
              i32 s) {
  const i64 page = table[static_cast<std::size_t>(b * table_stride + s / P)];
  const i64 in_page = s % P;
  if (order == page_order::nhd) return ((page * P + in_page) * H + h) * D;  // [page][P][H][D]
  return ((page * H + h) * P + in_page) * D;                                 // [page][H][P][D]
}

// Rows of every (b, h, s) lie inside [0, total) and never share an element;
// returns how often each element is covered.
template <class Layout>
std::vector<int> coverage(const Layout& l, i32 B, i32 H, i32 S, i32 D, i64 total, int& out_of_bounds) {
  std::vector<int> cover(static_cast<std::size_t>(total), 0);
  out_of_bounds = 0;
  for (i32 b = 0; b < B; ++b)
    for (i32 h = 0; h < H; ++h)
      for (i32 s = 0; s < S; ++s) {
        const i64 off = l.row_offset(b, h, s);
        if (off < 0 || off + D > total) {
          ++out_of_bounds;
          continue;
        }
        for (i32 d = 0; d < D; ++d) ++cover[static_cast<std::size_t>(off + d)];
      }
  return cover;
}

// Dense: every element exactly once. Otherwise: at most once, and exactly
// B*H*S*D elements covered.
template <class Layout>
void check_disjoint(const Layout& l, i32 B, i32 H, i32 S, i32 D, i64 total, bool dense) {
  int oob = 0;
  const std::vector<int> cover = coverage(l, B, H, S, D, total, oob);
  CHECK(oob == 0);
  const int max_cover = cover.empty() ? 0 : *std::max_element(cover.begin(), cover.end());
  CHECK(max_cover <= 1);
  const i64 covered = std::count(cover.begin(), cover.end(), 1);
  CHECK(covered == i64{B} * H * S * D);
  if (dense) CHECK(covered == total);
}

// A view plus the storage it points into and an independent offset function.
// for_each_layout builds every layout of the suite for dtype T and hands each
// to `f(name, view, k_storage, v_storage, ref_offset)`.
constexpr i32 kB = 2, kH = 3, kS = 7, kD = 5;

template <class T, class F>
void for_each_layout(std::mt19937& g, F&& f) {
  {
    auto c = kvevict::make_bhsd_cache<T>(kB, kH, kS, kD);
    const ref_fn ref = [](i32 b, i32 h, i32 s) { return ref_bhsd(kH, kS, kD, b, h, s); };
    f("bhsd", c.view(), c.k_storage(), c.v_storage(), ref);
  }
  {
    auto c = kvevict::make_bshd_cache<T>(kB, kH, kS, kD);
    const ref_fn ref = [](i32 b, i32 h, i32 s) { return ref_bshd(kH, kS, kD, b, h, s); };
    f("bshd", c.view(), c.k_storage(), c.v_storage(), ref);
  }
  for (page_order order : {page_order::nhd, page_order::hnd}) {
    constexpr i32 P = 3;  // 7 slots: the last page of each sequence is partial
    auto c = kvevict::make_paged_cache<T>(kB, kH, kS, kD, P, order);
    // Engines may rewrite the table: use an arbitrary permutation of the pool.
    std::shuffle(c.page_table().begin(), c.page_table().end(), g);
    const std::vector<i32> table = c.page_table();
    constexpr i64 pages_per_seq = (kS + P - 1) / P;
    const ref_fn ref = [table, order](i32 b, i32 h, i32 s) {
      return ref_paged(table, pages_per_seq, P, kH, kD, order, b, h, s);
    };
    f(order == page_order::nhd ? "paged nhd" : "paged hnd", c.view(), c.k_storage(), c.v_storage(), ref);
  }
  {
    // Padded strided: gaps between slots, heads and sequences.
    const i64 ss = kD + 3, sh = kS * ss + 5, sq = kH * sh + 2;
    std::vector<T> k(static_cast<std::size_t>(kB * sq + 4)), v(static_cast<std::size_t>(kB * sq + 4));
    const strided_layout l{sq, sh, ss};
    const kvevict::kv_view<T, strided_layout> view{k.data(), v.data(), l, kB, kH, kS, kD};
    const ref_fn ref = [=](i32 b, i32 h, i32 s) { return b * sq + h * sh + s * ss; };
    f("padded strided", view, k, v, ref);
  }
  {
    // Paged pool with spare pages, padded page strides and a padded table.
    constexpr i32 P = 2;
    const i32 pages_per_seq = (kS + P - 1) / P;
    const i32 num_pages = kB * pages_per_seq + 3;
    const i64 table_stride = pages_per_seq + 2;
    std::vector<i32> pool(static_cast<std::size_t>(num_pages));
    std::iota(pool.begin(), pool.end(), 0);
    std::shuffle(pool.begin(), pool.end(), g);
    std::vector<i32> table(static_cast<std::size_t>(kB * table_stride), -1);  // unused entries stay -1
    for (i32 b = 0; b < kB; ++b)
      for (i32 i = 0; i < pages_per_seq; ++i)
        table[static_cast<std::size_t>(b * table_stride + i)] = pool[static_cast<std::size_t>(b * pages_per_seq + i)];
    paged_layout l = paged_layout::make(table.data(), pages_per_seq, num_pages, P, kH, kD, page_order::hnd);
    l.page_table_stride = table_stride;
    l.stride_slot = kD + 1;
    l.stride_head = P * l.stride_slot + 2;
    l.stride_page = kH * l.stride_head + 3;
    const i64 total = num_pages * l.stride_page;
    std::vector<T> k(static_cast<std::size_t>(total)), v(static_cast<std::size_t>(total));
    const kvevict::kv_view<T, paged_layout> view{k.data(), v.data(), l, kB, kH, kS, kD};
    const i64 sp = l.stride_page, sh = l.stride_head, ss = l.stride_slot;
    const ref_fn ref = [=](i32 b, i32 h, i32 s) {
      return i64{table[static_cast<std::size_t>(b * table_stride + s / P)]} * sp + h * sh + (s % P) * ss;
    };
    f("padded paged pool", view, k, v, ref);
  }
}

}  // namespace

// ============================================================================
// Layouts
// ============================================================================

// Constexpr, and the strides of the memory-order definitions.
static_assert(strided_layout::bhsd(2, 3, 4).stride_seq == 24, "");
static_assert(strided_layout::bhsd(2, 3, 4).stride_head == 12, "");
static_assert(strided_layout::bhsd(2, 3, 4).stride_slot == 4, "");
static_assert(strided_layout::bshd(2, 3, 4).stride_seq == 24, "");
static_assert(strided_layout::bshd(2, 3, 4).stride_head == 4, "");
static_assert(strided_layout::bshd(2, 3, 4).stride_slot == 8, "");

TEST_CASE("layout: strided bhsd and bshd offsets follow [B][H][S][D] and [B][S][H][D]") {
  int bad = 0;
  for (i32 B : {1, 2, 3})
    for (i32 H : {1, 2, 4})
      for (i32 S : {1, 3, 5})
        for (i32 D : {1, 2, 8}) {
          CAPTURE(B);
          CAPTURE(H);
          CAPTURE(S);
          CAPTURE(D);
          const strided_layout hnd = strided_layout::bhsd(H, S, D);
          const strided_layout nhd = strided_layout::bshd(H, S, D);
          for (i32 b = 0; b < B; ++b)
            for (i32 h = 0; h < H; ++h)
              for (i32 s = 0; s < S; ++s) {
                if (hnd.row_offset(b, h, s) != ref_bhsd(H, S, D, b, h, s)) ++bad;
                if (nhd.row_offset(b, h, s) != ref_bshd(H, S, D, b, h, s)) ++bad;
              }
          const i64 total = i64{B} * H * S * D;
          check_disjoint(hnd, B, H, S, D, total, true);
          check_disjoint(nhd, B, H, S, D, total, true);
        }
  CHECK(bad == 0);
  // Offsets are 64-bit: a large cache does not wrap.
  const strided_layout big = strided_layout::bhsd(32, 131072, 128);
  CHECK(big.row_offset(7, 31, 131071) == ref_bhsd(32, 131072, 128, 7, 31, 131071));
  CHECK(big.row_offset(7, 31, 131071) > i64{1} << 31);  // past int32
}

TEST_CASE("layout: paged nhd and hnd offsets follow the page table then [P][H][D] or [H][P][D]") {
  std::mt19937 g(11u);
  int bad = 0;
  for (page_order order : {page_order::nhd, page_order::hnd})
    for (i32 B : {1, 3})
      for (i32 H : {1, 3})
        for (i32 S : {1, 4, 5, 8})
          for (i32 P : {1, 2, 4})
            for (i32 D : {1, 4})
              for (i32 spare : {0, 2})
                for (i32 table_pad : {0, 3}) {
                  CAPTURE(static_cast<int>(order));
                  CAPTURE(B);
                  CAPTURE(H);
                  CAPTURE(S);
                  CAPTURE(P);
                  CAPTURE(D);
                  CAPTURE(spare);
                  CAPTURE(table_pad);
                  i32 pages_per_seq = 0;
                  while (pages_per_seq * P < S) ++pages_per_seq;
                  const i32 max_pages = pages_per_seq + 1;  // one unused entry per sequence
                  const i32 num_pages = B * pages_per_seq + spare;
                  const i64 table_stride = max_pages + table_pad;
                  std::vector<i32> pool(static_cast<std::size_t>(num_pages));
                  std::iota(pool.begin(), pool.end(), 0);
                  std::shuffle(pool.begin(), pool.end(), g);
                  std::vector<i32> table(static_cast<std::size_t>(B * table_stride), -1);
                  for (i32 b = 0; b < B; ++b)
                    for (i32 i = 0; i < pages_per_seq; ++i)
                      table[static_cast<std::size_t>(b * table_stride + i)] =
                          pool[static_cast<std::size_t>(b * pages_per_seq + i)];

                  paged_layout l = paged_layout::make(table.data(), max_pages, num_pages, P, H, D, order);
                  CHECK(l.page_table == table.data());
                  CHECK(l.page_table_stride == max_pages);
                  CHECK(l.max_pages_per_seq == max_pages);
                  CHECK(l.num_pages == num_pages);
                  CHECK(l.page_size == P);
                  l.page_table_stride = table_stride;
                  for (i32 b = 0; b < B; ++b)
                    for (i32 s = 0; s < S; ++s) {
                      if (l.page_id(b, s) != table[static_cast<std::size_t>(b * table_stride + s / P)]) ++bad;
                      for (i32 h = 0; h < H; ++h)
                        if (l.row_offset(b, h, s) != ref_paged(table, table_stride, P, H, D, order, b, h, s)) ++bad;
                    }
                  const bool dense = spare == 0 && S % P == 0;
                  check_disjoint(l, B, H, S, D, i64{num_pages} * P * H * D, dense);
                }
  CHECK(bad == 0);

  for (i32 slots = 0; slots < 20; ++slots)
    for (i32 P = 1; P < 6; ++P) {
      i32 pages = 0;
      while (pages * P < slots) ++pages;
      CHECK(kvevict::pages_for(slots, P) == pages);
    }
}

// ============================================================================
// Owning caches
// ============================================================================

TEST_CASE_TEMPLATE("kv_cache: dense caches have the documented storage and view", T, float, half, bfloat16) {
  constexpr i32 B = 2, H = 3, S = 5, D = 4;
  const std::size_t n = std::size_t{B} * H * S * D;
  for (int bshd = 0; bshd < 2; ++bshd) {
    CAPTURE(bshd);
    auto c = bshd ? kvevict::make_bshd_cache<T>(B, H, S, D) : kvevict::make_bhsd_cache<T>(B, H, S, D);
    CHECK(c.k_storage().size() == n);
    CHECK(c.v_storage().size() == n);
    CHECK(c.bytes() == 2 * n * sizeof(T));
    CHECK(c.num_seqs() == B);
    CHECK(c.num_heads() == H);
    CHECK(c.capacity() == S);
    CHECK(c.head_dim() == D);
    const auto view = c.view();
    static_assert(std::is_same_v<decltype(view.k), T*>, "mutable view");
    CHECK(view.k == c.k_storage().data());
    CHECK(view.v == c.v_storage().data());
    CHECK(view.num_seqs == B);
    CHECK(view.num_heads == H);
    CHECK(view.capacity == S);
    CHECK(view.head_dim == D);
    CHECK_NOTHROW(kvevict::validate("test", view));
    int bad = 0;
    for (i32 b = 0; b < B; ++b)
      for (i32 h = 0; h < H; ++h)
        for (i32 s = 0; s < S; ++s) {
          const i64 off = bshd ? ref_bshd(H, S, D, b, h, s) : ref_bhsd(H, S, D, b, h, s);
          if (view.k_row(b, h, s) != c.k_storage().data() + off) ++bad;
          if (view.v_row(b, h, s) != c.v_storage().data() + off) ++bad;
        }
    CHECK(bad == 0);
    check_disjoint(view.layout, B, H, S, D, static_cast<i64>(n), true);

    const auto& cc = c;
    const auto cview = cc.view();
    static_assert(std::is_same_v<decltype(cview.k), const T*>, "const view of a const cache");
    CHECK(cview.k == c.k_storage().data());
    CHECK(cview.v == c.v_storage().data());
    CHECK(cview.layout.stride_seq == view.layout.stride_seq);
  }
}

TEST_CASE_TEMPLATE("kv_cache: paged caches own a valid page table", T, float, half, bfloat16) {
  for (page_order order : {page_order::nhd, page_order::hnd})
    for (i32 S : {6, 7}) {  // full and partial last page
      constexpr i32 B = 3, H = 2, D = 4, P = 3;
      CAPTURE(static_cast<int>(order));
      CAPTURE(S);
      const i32 pages_per_seq = (S + P - 1) / P;
      const i32 num_pages = B * pages_per_seq;
      auto c = kvevict::make_paged_cache<T>(B, H, S, D, P, order);
      const std::size_t elements = std::size_t(num_pages) * P * H * D;
      CHECK(c.k_storage().size() == elements);
      CHECK(c.v_storage().size() == elements);
      CHECK(c.bytes() == 2 * elements * sizeof(T));
      REQUIRE(c.page_table().size() == std::size_t(B) * pages_per_seq);

      const auto view = c.view();
      CHECK(view.k == c.k_storage().data());
      CHECK(view.v == c.v_storage().data());
      CHECK(view.num_seqs == B);
      CHECK(view.num_heads == H);
      CHECK(view.capacity == S);
      CHECK(view.head_dim == D);
      CHECK(view.layout.page_table == c.page_table().data());
      CHECK(view.layout.page_table_stride == pages_per_seq);
      CHECK(view.layout.max_pages_per_seq == pages_per_seq);
      CHECK(view.layout.num_pages == num_pages);
      CHECK(view.layout.page_size == P);
      CHECK_NOTHROW(kvevict::validate("test", view));

      // A permutation of the pool.
      std::vector<i32> sorted = c.page_table();
      std::sort(sorted.begin(), sorted.end());
      std::vector<i32> pool(static_cast<std::size_t>(num_pages));
      std::iota(pool.begin(), pool.end(), 0);
      CHECK(sorted == pool);
      // As documented: sequence b's own pages, in reverse order.
      for (i32 b = 0; b < B; ++b)
        for (i32 i = 0; i < pages_per_seq; ++i)
          CHECK(c.page_table()[static_cast<std::size_t>(b * pages_per_seq + i)] == b * pages_per_seq + pages_per_seq - 1 - i);

      const std::vector<i32> table = c.page_table();
      int bad = 0;
      for (i32 b = 0; b < B; ++b)
        for (i32 h = 0; h < H; ++h)
          for (i32 s = 0; s < S; ++s) {
            const i64 off = ref_paged(table, pages_per_seq, P, H, D, order, b, h, s);
            if (view.k_row(b, h, s) != c.k_storage().data() + off) ++bad;
            if (view.v_row(b, h, s) != c.v_storage().data() + off) ++bad;
          }
      CHECK(bad == 0);
      check_disjoint(view.layout, B, H, S, D, static_cast<i64>(elements), S % P == 0);

      // Rewriting the table is seen by the next view (and the current one:
      // it points at the same table).
      std::swap(c.page_table()[0], c.page_table()[c.page_table().size() - 1]);
      const std::vector<i32> table2 = c.page_table();
      CHECK(c.view().k_row(0, 1, 0) == c.k_storage().data() + ref_paged(table2, pages_per_seq, P, H, D, order, 0, 1, 0));
      CHECK(view.k_row(B - 1, 0, S - 1) ==
            c.k_storage().data() + ref_paged(table2, pages_per_seq, P, H, D, order, B - 1, 0, S - 1));
    }
}

TEST_CASE_TEMPLATE("kv_cache: moving a paged cache keeps its view valid", T, float, half, bfloat16) {
  constexpr i32 B = 2, H = 2, S = 5, D = 3, P = 2;
  std::mt19937 g(3u);
  using cache_t = kvevict::kv_cache<T, paged_layout>;

  // Writes a random token at slot s of every head of sequence b through
  // scatter on `c`'s view, then reads it back at the hand-computed offset.
  auto roundtrip = [&](cache_t& c) {
    const auto view = c.view();
    REQUIRE(view.layout.page_table == c.page_table().data());
    const std::vector<i32> table = c.page_table();
    const i64 pages_per_seq = (S + P - 1) / P;
    int bad = 0;
    for (i32 b = 0; b < B; ++b)
      for (i32 s = 0; s < S; ++s) {
        std::vector<T> kn(std::size_t{H} * D), vn(std::size_t{H} * D);
        fill_random(kn, g);
        fill_random(vn, g);
        std::vector<i32> slots(std::size_t{H}, s);
        kvevict::scatter(view, b, slots.data(), kvevict::make_tensor_view<const T>(kn.data(), H, D),
                         kvevict::make_tensor_view<const T>(vn.data(), H, D));
        for (i32 h = 0; h < H; ++h) {
          const i64 off = ref_paged(table, pages_per_seq, P, H, D, page_order::hnd, b, h, s);
          for (i32 d = 0; d < D; ++d) {
            if (!same_bits(c.k_storage()[static_cast<std::size_t>(off + d)], kn[static_cast<std::size_t>(h * D + d)])) ++bad;
            if (!same_bits(c.v_storage()[static_cast<std::size_t>(off + d)], vn[static_cast<std::size_t>(h * D + d)])) ++bad;
          }
        }
      }
    CHECK(bad == 0);
  };

  auto c = kvevict::make_paged_cache<T>(B, H, S, D, P, page_order::hnd);
  std::shuffle(c.page_table().begin(), c.page_table().end(), g);
  const i32* table_ptr = c.page_table().data();
  const T* k_ptr = c.k_storage().data();

  // Move construction: the buffers (and the table pointer) follow.
  cache_t moved(std::move(c));
  CHECK(moved.page_table().data() == table_ptr);
  CHECK(moved.view().layout.page_table == table_ptr);
  CHECK(moved.view().k == k_ptr);
  CHECK(moved.num_seqs() == B);
  CHECK(moved.capacity() == S);
  roundtrip(moved);

  // Move assignment over a cache of another shape.
  auto other = kvevict::make_paged_cache<T>(1, 1, 1, 1, 1, page_order::nhd);
  other = std::move(moved);
  CHECK(other.view().layout.page_table == other.page_table().data());
  CHECK(other.view().layout.page_table == table_ptr);
  CHECK(other.view().k == k_ptr);
  CHECK(other.num_heads() == H);
  CHECK(other.view().layout.page_size == P);
  CHECK_NOTHROW(kvevict::validate("test", other.view()));
  roundtrip(other);

  // Caches in a growing vector are moved on every reallocation.
  std::vector<cache_t> caches;
  for (int i = 0; i < 9; ++i) caches.push_back(kvevict::make_paged_cache<T>(B, H, S, D, P, page_order::hnd));
  for (cache_t& x : caches) {
    CHECK(x.view().layout.page_table == x.page_table().data());
    roundtrip(x);
  }
}

// ============================================================================
// validate: padded and overlapping strided layouts
// ============================================================================

TEST_CASE("validate: padded layouts pass, overlapping ones throw") {
  constexpr i32 B = 2, H = 3, S = 4, D = 5;
  std::vector<float> k(4096), v(4096);
  auto strided_n = [&](i64 sq, i64 sh, i64 ss, i32 cap, i32 seqs) {
    return kvevict::kv_view<float, strided_layout>{k.data(), v.data(), strided_layout{sq, sh, ss}, seqs, H, cap, D};
  };
  auto strided = [&](i64 sq, i64 sh, i64 ss) { return strided_n(sq, sh, ss, S, B); };

  // Padded: slot stride > head_dim, head stride larger than needed.
  {
    const i64 ss = D + 2, sh = S * ss + 9, sq = H * sh + 1;
    const auto view = strided(sq, sh, ss);
    CHECK_NOTHROW(kvevict::validate("test", view));
    check_disjoint(view.layout, B, H, S, D, B * sq, false);
  }
  // Padded NHD-like: heads interleaved inside a padded slot.
  CHECK_NOTHROW(kvevict::validate("test", strided(S * (H * D + 4) + 3, D + 1, H * (D + 1) + 1)));
  // Dense defaults.
  {
    const strided_layout a = strided_layout::bhsd(H, S, D), b = strided_layout::bshd(H, S, D);
    CHECK_NOTHROW(kvevict::validate("test", strided(a.stride_seq, a.stride_head, a.stride_slot)));
    CHECK_NOTHROW(kvevict::validate("test", strided(b.stride_seq, b.stride_head, b.stride_slot)));
  }

  // Slots overlap: stride_slot < head_dim with capacity > 1.
  CHECK_THROWS_AS(kvevict::validate("test", strided(H * S * D, S * D, D - 1)), kvevict::invalid_argument);
  CHECK_THROWS_AS(kvevict::validate("test", strided(H * S * D, S * D, 0)), kvevict::invalid_argument);
  // ... but one slot cannot overlap itself.
  CHECK_NOTHROW(kvevict::validate("test", strided_n(H * D, D, D - 1, 1, B)));
  // Heads overlap the slots of the previous head.
  CHECK_THROWS_AS(kvevict::validate("test", strided(H * S * D, (S - 1) * D, D)), kvevict::invalid_argument);
  // Heads overlap each other inside an NHD slot.
  CHECK_THROWS_AS(kvevict::validate("test", strided(S * H * D, D - 1, H * D)), kvevict::invalid_argument);
  // Sequences overlap.
  CHECK_THROWS_AS(kvevict::validate("test", strided(H * S * D - 1, S * D, D)), kvevict::invalid_argument);
  // ... unless there is only one.
  CHECK_NOTHROW(kvevict::validate("test", strided_n(0, S * D, D, S, 1)));
  // Negative strides.
  CHECK_THROWS_AS(kvevict::validate("test", strided(-H * S * D, S * D, D)), kvevict::invalid_argument);
  // K aliasing V, null buffers.
  {
    auto view = strided(H * S * D, S * D, D);
    view.v = view.k;
    CHECK_THROWS_AS(kvevict::validate("test", view), kvevict::invalid_argument);
    view.v = nullptr;
    CHECK_THROWS_AS(kvevict::validate("test", view), kvevict::invalid_argument);
  }

  // Paged: pages, in-page slots and capacity.
  {
    constexpr i32 P = 2;
    std::vector<i32> table = {0, 1, 2, 3};
    auto paged_n = [&](const paged_layout& l, i32 cap) {
      return kvevict::kv_view<float, paged_layout>{k.data(), v.data(), l, B, H, cap, D};
    };
    auto paged = [&](const paged_layout& l) { return paged_n(l, S); };
    const paged_layout ok = paged_layout::make(table.data(), 2, 4, P, H, D, page_order::hnd);
    CHECK_NOTHROW(kvevict::validate("test", paged(ok)));
    paged_layout bad = ok;
    bad.stride_page = ok.stride_page - 1;
    CHECK_THROWS_AS(kvevict::validate("test", paged(bad)), kvevict::invalid_argument);
    bad = ok;
    bad.stride_slot = D - 1;
    CHECK_THROWS_AS(kvevict::validate("test", paged(bad)), kvevict::invalid_argument);
    CHECK_THROWS_AS(kvevict::validate("test", paged_n(ok, 2 * P + 1)), kvevict::invalid_argument);  // > pages * P
    bad = ok;
    bad.page_table = nullptr;
    CHECK_THROWS_AS(kvevict::validate("test", paged(bad)), kvevict::invalid_argument);
    paged_layout padded = ok;
    padded.stride_slot = D + 1;
    padded.stride_head = P * padded.stride_slot + 1;
    padded.stride_page = H * padded.stride_head + 5;
    CHECK_NOTHROW(kvevict::validate("test", paged(padded)));
  }
}

// ============================================================================
// scatter
// ============================================================================

TEST_CASE_TEMPLATE("scatter: writes exactly the chosen rows, for every layout", T, float, half, bfloat16) {
  std::mt19937 g(2024u);
  for_each_layout<T>(g, [&](const char* name, auto view, std::vector<T>& ks, std::vector<T>& vs, const ref_fn& ref) {
    CAPTURE(std::string(name));
    const i32 B = view.num_seqs, H = view.num_heads, S = view.capacity, D = view.head_dim;
    fill_random(ks, g);
    fill_random(vs, g);
    std::vector<T> rk = ks, rv = vs;

    auto write = [&](i32 b, const std::vector<i32>& slots, i32 pitch) {
      std::vector<T> kn(static_cast<std::size_t>(H * pitch)), vn(static_cast<std::size_t>(H * pitch));
      fill_random(kn, g);
      fill_random(vn, g);
      const auto kv = kvevict::make_strided_view<const T, 2>(kn.data(), {H, D}, {pitch, 1});
      const auto vv = kvevict::make_strided_view<const T, 2>(vn.data(), {H, D}, {pitch, 1});
      kvevict::scatter(view, b, slots.data(), kv, vv);
      for (i32 h = 0; h < H; ++h)
        for (i32 d = 0; d < D; ++d) {
          const auto dst = static_cast<std::size_t>(ref(b, h, slots[static_cast<std::size_t>(h)]) + d);
          rk[dst] = kn[static_cast<std::size_t>(h * pitch + d)];
          rv[dst] = vn[static_cast<std::size_t>(h * pitch + d)];
        }
      CHECK(first_mismatch(ks, rk) == -1);
      CHECK(first_mismatch(vs, rv) == -1);
    };

    // Every slot of every sequence, heads at different slots.
    for (i32 b = 0; b < B; ++b)
      for (i32 s = 0; s < S; ++s) {
        std::vector<i32> slots(static_cast<std::size_t>(H));
        for (i32 h = 0; h < H; ++h) slots[static_cast<std::size_t>(h)] = (s + 2 * h) % S;
        write(b, slots, (s % 2) ? D : D + 3);
      }
    // Random slots (heads may share a slot index), overwriting earlier rows.
    for (int step = 0; step < 20; ++step) {
      std::vector<i32> slots(static_cast<std::size_t>(H));
      for (i32& s : slots) s = rand_below(g, S);
      write(rand_below(g, B), slots, D + step % 3);
    }

    // Invalid calls throw before writing anything.
    std::vector<T> kn(static_cast<std::size_t>(H * D)), vn(static_cast<std::size_t>(H * D));
    fill_random(kn, g);
    fill_random(vn, g);
    const auto kv = kvevict::make_tensor_view<const T>(kn.data(), H, D);
    const auto vv = kvevict::make_tensor_view<const T>(vn.data(), H, D);
    std::vector<i32> slots(static_cast<std::size_t>(H), 0);
    slots.back() = S;  // the last head's slot is out of range
    CHECK_THROWS_AS(kvevict::scatter(view, 0, slots.data(), kv, vv), kvevict::out_of_range);
    slots.back() = -1;
    CHECK_THROWS_AS(kvevict::scatter(view, 0, slots.data(), kv, vv), kvevict::out_of_range);
    slots.back() = 0;
    CHECK_THROWS_AS(kvevict::scatter(view, B, slots.data(), kv, vv), kvevict::out_of_range);
    const auto wrong = kvevict::make_tensor_view<const T>(kn.data(), H, D - 1);
    CHECK_THROWS_AS(kvevict::scatter(view, 0, slots.data(), wrong, vv), kvevict::invalid_argument);
    CHECK(first_mismatch(ks, rk) == -1);
    CHECK(first_mismatch(vs, rv) == -1);
  });
}

// ============================================================================
// compact
// ============================================================================

TEST_CASE_TEMPLATE("compact: moves rows src[i] to slot i, for every layout", T, float, half, bfloat16) {
  std::mt19937 g(8675309u);
  for_each_layout<T>(g, [&](const char* name, auto view, std::vector<T>& ks, std::vector<T>& vs, const ref_fn& ref) {
    CAPTURE(std::string(name));
    const i32 B = view.num_seqs, H = view.num_heads, S = view.capacity, D = view.head_dim;
    fill_random(ks, g);
    fill_random(vs, g);

    // Runs one compaction of (b, h) and checks it against rows copied before
    // the call. Rows [n, S) of (b, h) are unspecified afterwards; every other
    // element of K and V must be untouched.
    auto run = [&](i32 b, i32 h, const std::vector<i32>& src, bool with_workspace) {
      const i32 n = static_cast<i32>(src.size());
      CAPTURE(b);
      CAPTURE(h);
      CAPTURE(n);
      CAPTURE(with_workspace);
      const std::vector<T> old_k = ks, old_v = vs;
      std::vector<T> exp_k = old_k, exp_v = old_v;
      std::vector<char> care(ks.size(), 1);
      for (i32 j = n; j < S; ++j)
        for (i32 d = 0; d < D; ++d) care[static_cast<std::size_t>(ref(b, h, j) + d)] = 0;
      for (i32 i = 0; i < n; ++i)
        for (i32 d = 0; d < D; ++d) {
          const auto to = static_cast<std::size_t>(ref(b, h, i) + d);
          const auto from = static_cast<std::size_t>(ref(b, h, src[static_cast<std::size_t>(i)]) + d);
          exp_k[to] = old_k[from];
          exp_v[to] = old_v[from];
        }

      std::vector<T> workspace;
      if (with_workspace) {
        const std::size_t need = kvevict::compaction_workspace_elements(n, D);
        CHECK(need == 2 * std::size_t(n) * std::size_t(D));
        workspace.resize(need);  // exactly the documented size: ASan catches overruns
      }
      kvevict::compact(view, b, h, src.empty() ? nullptr : src.data(), n,
                       with_workspace ? workspace.data() : nullptr);

      int bad = 0;
      for (std::size_t e = 0; e < ks.size(); ++e) {
        if (!care[e]) continue;
        if (!same_bits(ks[e], exp_k[e])) ++bad;
        if (!same_bits(vs[e], exp_v[e])) ++bad;
      }
      CHECK(bad == 0);
    };

    auto random_subset = [&](i32 n) {
      std::vector<i32> all(static_cast<std::size_t>(S));
      std::iota(all.begin(), all.end(), 0);
      std::shuffle(all.begin(), all.end(), g);
      all.resize(static_cast<std::size_t>(n));
      return all;
    };

    for (i32 b = 0; b < B; ++b)
      for (i32 h = 0; h < H; ++h) {
        // (a) strictly increasing sources, in place, no workspace.
        run(b, h, {}, false);                                   // n == 0, src == nullptr
        std::vector<i32> identity(static_cast<std::size_t>(S));
        std::iota(identity.begin(), identity.end(), 0);
        run(b, h, identity, false);                             // nothing moves
        run(b, h, {0, 1, 3, 5, 6}, false);                      // a prefix that stays, then gaps
        run(b, h, {2, 3, 4}, false);                            // every row moves, sources overlap targets
        run(b, h, {S - 1}, false);                              // last slot to the first
        for (int rep = 0; rep < 3; ++rep) {
          std::vector<i32> src = random_subset(rand_below(g, S + 1));
          std::sort(src.begin(), src.end());
          run(b, h, src, false);
        }
        // (b) arbitrary orders, with workspace.
        std::vector<i32> reversed(identity.rbegin(), identity.rend());
        run(b, h, reversed, true);                              // every row moves
        run(b, h, {0, 2, 1, 3, 6}, true);                       // fixed points 0, 3 among moved rows
        run(b, h, {4, 1, 0}, true);                             // src[1] == 1 stays
        run(b, h, {}, true);                                    // n == 0 with workspace
        run(b, h, {1, 2, 5}, true);                             // increasing, workspace not needed
        for (int rep = 0; rep < 3; ++rep) {
          std::vector<i32> src = random_subset(2 + rand_below(g, S - 1));
          if (std::is_sorted(src.begin(), src.end())) std::swap(src[0], src[1]);
          run(b, h, src, true);
        }
      }

    // Invalid calls throw before moving anything.
    const std::vector<T> before_k = ks, before_v = vs;
    std::vector<T> workspace(kvevict::compaction_workspace_elements(S, D));
    const std::vector<i32> repeated = {1, 3, 1};
    CHECK_THROWS_AS(kvevict::compact(view, 0, 0, repeated.data(), 3, workspace.data()), kvevict::invalid_argument);
    const std::vector<i32> unsorted = {2, 1};
    CHECK_THROWS_AS(kvevict::compact(view, 0, 0, unsorted.data(), 2), kvevict::invalid_argument);  // no workspace
    const std::vector<i32> outside = {0, S};
    CHECK_THROWS_AS(kvevict::compact(view, 0, 0, outside.data(), 2), kvevict::out_of_range);
    std::vector<i32> too_many(static_cast<std::size_t>(S + 1));
    std::iota(too_many.begin(), too_many.end(), 0);
    CHECK_THROWS_AS(kvevict::compact(view, 0, 0, too_many.data(), S + 1), kvevict::out_of_range);
    CHECK_THROWS_AS(kvevict::compact(view, 0, H, too_many.data(), 1), kvevict::out_of_range);
    CHECK_THROWS_AS(kvevict::compact(view, B, 0, too_many.data(), 1), kvevict::out_of_range);
    CHECK(first_mismatch(ks, before_k) == -1);
    CHECK(first_mismatch(vs, before_v) == -1);
  });
}

// ============================================================================
// tensor_view
// ============================================================================

TEST_CASE("tensor_view: row-major views, strided views, sub-views and offsets") {
  std::vector<int> buf(200);
  std::iota(buf.begin(), buf.end(), 0);

  const auto t = kvevict::make_tensor_view(buf.data(), 2, 3, 4);
  static_assert(decltype(t)::rank == 3, "rank from the number of extents");
  static_assert(std::is_same_v<decltype(t), const kvevict::tensor_view<int, 3>>, "");
  CHECK(t.data == buf.data());
  CHECK(t.extent(0) == 2);
  CHECK(t.extent(1) == 3);
  CHECK(t.extent(2) == 4);
  CHECK(t.stride(0) == 12);
  CHECK(t.stride(1) == 4);
  CHECK(t.stride(2) == 1);
  int bad = 0;
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 3; ++j)
      for (int l = 0; l < 4; ++l) {
        if (t.offset(i, j, l) != i * 12 + j * 4 + l) ++bad;
        if (&t(i, j, l) != &buf[static_cast<std::size_t>(i * 12 + j * 4 + l)]) ++bad;
      }
  CHECK(bad == 0);
  t(1, 2, 3) = -5;  // writes through
  CHECK(buf[23] == -5);
  buf[23] = 23;

  // Sub-views drop the first index.
  const auto sub = t[1];
  static_assert(std::is_same_v<decltype(sub), const kvevict::tensor_view<int, 2>>, "");
  CHECK(sub.data == buf.data() + 12);
  CHECK(sub.extent(0) == 3);
  CHECK(sub.extent(1) == 4);
  CHECK(sub.stride(0) == 4);
  CHECK(sub.stride(1) == 1);
  CHECK(sub(2, 1) == 1 * 12 + 2 * 4 + 1);
  const auto row = t[1][2];
  static_assert(std::is_same_v<decltype(row), const kvevict::tensor_view<int, 1>>, "");
  CHECK(row.data == buf.data() + 20);
  CHECK(row.extent(0) == 4);
  CHECK(row.stride(0) == 1);
  CHECK(row(3) == 23);
  CHECK(row.offset(3) == 3);

  // Rank 1 and a 64-bit offset that does not wrap.
  const auto v1 = kvevict::make_tensor_view(buf.data(), 200);
  CHECK(v1.stride(0) == 1);
  CHECK(v1.extent(0) == 200);
  const auto big = kvevict::make_tensor_view(static_cast<const float*>(nullptr), 70000, 70000);
  CHECK(big.stride(0) == 70000);
  CHECK(big.offset(69999, 69999) == i64{69999} * 70000 + 69999);

  // Explicit strides: a padded, column-interleaved [3][4] view over a pitch-9 buffer.
  const auto s = kvevict::make_strided_view<const int, 2>(buf.data() + 1, {3, 4}, {9, 2});
  CHECK(s.data == buf.data() + 1);
  CHECK(s.extent(0) == 3);
  CHECK(s.extent(1) == 4);
  CHECK(s.stride(0) == 9);
  CHECK(s.stride(1) == 2);
  bad = 0;
  for (int i = 0; i < 3; ++i)
    for (int j = 0; j < 4; ++j) {
      if (s.offset(i, j) != i * 9 + j * 2) ++bad;
      if (s(i, j) != 1 + i * 9 + j * 2) ++bad;
    }
  CHECK(bad == 0);
  const auto srow = s[2];
  CHECK(srow.data == buf.data() + 1 + 18);
  CHECK(srow.extent(0) == 4);
  CHECK(srow.stride(0) == 2);
  CHECK(srow(3) == 1 + 18 + 6);

  // A 3-D strided view with a permuted (column-major) order.
  const auto cm = kvevict::make_strided_view<int, 3>(buf.data(), {2, 3, 4}, {1, 2, 6});
  bad = 0;
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 3; ++j)
      for (int l = 0; l < 4; ++l)
        if (cm(i, j, l) != i + 2 * j + 6 * l) ++bad;
  CHECK(bad == 0);
  CHECK(cm[1].data == buf.data() + 1);
  CHECK(cm[1].stride(0) == 2);
  CHECK(cm[1].stride(1) == 6);
  CHECK(cm[1](2, 3) == 1 + 4 + 18);
}

// Engines' real buffers: K and V interleaved in one allocation, and sequence
// strides that are not the outermost. Rows are disjoint, so views must be
// accepted and scatter must write K and V without touching each other.
TEST_CASE("interleaved K/V buffers and SBHD strides are valid views") {
  using namespace kvevict;
  const std::int32_t H = 2, D = 4, P = 3, pages = 4, S = 5, B = 2;
  SUBCASE("FlashInfer single-tensor paged cache [pages][2][P][H][D]") {
    std::vector<float> pool(std::size_t(pages) * 2 * P * H * D, 0.0f);
    std::vector<std::int32_t> table = {3, 1, 0, 2};  // one sequence, 4 pages
    paged_layout l = paged_layout::make(table.data(), 4, pages, P, H, D, page_order::nhd);
    l.stride_page = std::int64_t{2} * P * H * D;
    kv_view<float, paged_layout> view{pool.data(), pool.data() + P * H * D, l, 1, H, 12, D};
    CHECK_NOTHROW(validate("test", view));
    const std::vector<float> k(std::size_t(H) * D, 1.0f), v(std::size_t(H) * D, 2.0f);
    for (std::int32_t s = 0; s < 12; ++s) {
      const std::int32_t slots[2] = {s, s};
      scatter(view, 0, slots, make_tensor_view<const float>(k.data(), H, D), make_tensor_view<const float>(v.data(), H, D));
    }
    // Every K element is 1 and every V element is 2: the halves never alias.
    for (std::int32_t page = 0; page < pages; ++page)
      for (std::int32_t i = 0; i < P * H * D; ++i) {
        CHECK(pool[std::size_t(page) * 2 * P * H * D + i] == 1.0f);
        CHECK(pool[std::size_t(page) * 2 * P * H * D + P * H * D + i] == 2.0f);
      }
  }
  SUBCASE("strided [B][S][2][H][D] and SBHD [S][B][H][D]") {
    std::vector<float> buf(std::size_t(B) * S * 2 * H * D);
    strided_layout kv_inner{std::int64_t{S} * 2 * H * D, D, std::int64_t{2} * H * D};
    kv_view<float, strided_layout> interleaved{buf.data(), buf.data() + H * D, kv_inner, B, H, S, D};
    CHECK_NOTHROW(validate("test", interleaved));
    std::vector<float> k(std::size_t(S) * B * H * D), v(k.size());
    strided_layout sbhd{std::int64_t{H} * D, D, std::int64_t{B} * H * D};
    kv_view<float, strided_layout> seq_inner{k.data(), v.data(), sbhd, B, H, S, D};
    CHECK_NOTHROW(validate("test", seq_inner));
  }
  SUBCASE("K and V rows that do overlap are rejected") {
    std::vector<float> buf(std::size_t(B) * S * 2 * H * D);
    strided_layout l{std::int64_t{S} * 2 * H * D, D, std::int64_t{2} * H * D};
    kv_view<float, strided_layout> half_row{buf.data(), buf.data() + 2, l, B, H, S, D};
    CHECK_THROWS_AS(validate("test", half_row), invalid_argument);
    kv_view<float, strided_layout> same_slot{buf.data(), buf.data() + D, l, B, H, S, D};  // V of head 0 = K of head 1
    CHECK_THROWS_AS(validate("test", same_slot), invalid_argument);
  }
}

// A page table that names one page twice would make compaction overwrite
// rows it has yet to read: prefill and compact refuse it and move nothing.
TEST_CASE("duplicate page ids are rejected before any row moves") {
  using namespace kvevict;
  auto cache = make_paged_cache<float>(1, 1, 8, 2, 2, page_order::nhd);
  cache.page_table() = {0, 1, 2, 0};  // page 0 twice
  for (std::size_t i = 0; i < cache.k_storage().size(); ++i) cache.k_storage()[i] = float(i);
  const std::vector<float> before = cache.k_storage();
  const std::int32_t src[3] = {1, 5, 6};
  CHECK_THROWS_AS(compact(cache.view(), 0, 0, src, 3), invalid_argument);
  recent_window_policy policy({1, 1, 1, 8}, recent_window_config{0, 3});
  CHECK_THROWS_AS(policy.prefill(0, 8, cache.view()), invalid_argument);
  CHECK(policy.length(0) == 0);
  CHECK(cache.k_storage() == before);
  const std::int32_t low[2] = {1, 2};  // pages 0 and 1 only: distinct, accepted
  CHECK_NOTHROW(compact(cache.view(), 0, 0, low, 2));
}
