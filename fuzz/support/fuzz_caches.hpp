#pragma once
// The K/V caches the policy harness drives: BHSD, BSHD or paged (NHD or HND
// pages), in float, half or bfloat16, kept small. Views handed to the
// library are the cache's own or, now and then, one spoiled in a way the
// library must refuse (null buffers, zero extents, overlapping strides, K
// and V aliased, a null page table) or a smaller view of the same memory.
// None describes memory the cache does not own.
#include <cstdint>
#include <vector>

#include "fuzz_input.hpp"
#include "kvevict/dtype/bfloat16.hpp"
#include "kvevict/dtype/half.hpp"
#include "kvevict/kv_cache.hpp"
#include "kvevict/layout.hpp"

namespace kvfuzz {

enum class layout_kind { bhsd, bshd, paged_nhd, paged_hnd };

struct cache_shape {
  std::int32_t seqs, heads, capacity, head_dim, page_size;
  layout_kind layout;
};

template <class T>
kvevict::kv_cache<T, kvevict::strided_layout> make_cache(const cache_shape& s, kvevict::strided_layout*) {
  return s.layout == layout_kind::bhsd ? kvevict::make_bhsd_cache<T>(s.seqs, s.heads, s.capacity, s.head_dim)
                                       : kvevict::make_bshd_cache<T>(s.seqs, s.heads, s.capacity, s.head_dim);
}
template <class T>
kvevict::kv_cache<T, kvevict::paged_layout> make_cache(const cache_shape& s, kvevict::paged_layout*) {
  return kvevict::make_paged_cache<T>(s.seqs, s.heads, s.capacity, s.head_dim, s.page_size,
                                      s.layout == layout_kind::paged_nhd ? kvevict::page_order::nhd
                                                                         : kvevict::page_order::hnd);
}

/// Whether slot s of sequence b maps to memory of the cache (a paged
/// table entry may have been spoiled on purpose).
template <class T, class Layout>
bool mapped(const kvevict::kv_view<T, Layout>& v, std::int32_t b, std::int32_t s) {
  if constexpr (std::is_same_v<Layout, kvevict::paged_layout>) {
    if (s < 0 || s >= std::int64_t{v.layout.max_pages_per_seq} * v.layout.page_size) return false;
    const std::int32_t page = v.layout.page_id(b, s);
    return page >= 0 && page < v.layout.num_pages;
  } else {
    return s >= 0 && s < v.capacity;
  }
}

/// The cache's view, or about one in `odds` times a spoiled or smaller one.
template <class T, class Layout>
kvevict::kv_view<T, Layout> pick_view(fuzz_input& in, kvevict::kv_cache<T, Layout>& cache, int odds = 12) {
  kvevict::kv_view<T, Layout> v = cache.view();
  if (!in.one_in(odds)) return v;
  switch (in.range(0, 8)) {
    case 0: v.k = nullptr; break;
    case 1: v.v = nullptr; break;
    case 2: v.num_seqs = v.num_seqs > 1 ? v.num_seqs - 1 : 0; break;
    case 3: v.num_heads = v.num_heads > 1 ? v.num_heads - 1 : 0; break;
    case 4: v.capacity -= 1; break;
    case 5: v.head_dim = 0; break;
    case 6: v.v = v.k; break;  // K and V rows alias
    case 7:
      if constexpr (std::is_same_v<Layout, kvevict::paged_layout>) v.layout.page_table = nullptr;
      else v.layout.stride_slot = 0;  // every slot the same row
      break;
    default:
      if constexpr (std::is_same_v<Layout, kvevict::paged_layout>) v.layout.page_size = 0;
      else v.layout.stride_head = -v.layout.stride_head;
      break;
  }
  return v;
}

/// The engine's own action between calls: spoil or restore one page-table
/// entry (an id outside the pool, or another entry's id), so calls meet
/// unmapped and repeated pages.
template <class T>
void mutate_page_table(fuzz_input& in, kvevict::kv_cache<T, kvevict::paged_layout>& cache,
                       const std::vector<std::int32_t>& pristine) {
  std::vector<std::int32_t>& table = cache.page_table();
  if (table.empty()) return;
  const std::size_t i = std::size_t(in.range(0, int(table.size()) - 1));
  switch (in.range(0, 3)) {
    case 0: table = pristine; break;
    case 1: table[i] = pristine[i]; break;
    case 2: table[i] = in.one_in(2) ? -1 : cache.view().layout.num_pages + in.range(0, 3); break;
    default: table[i] = table[std::size_t(in.range(0, int(table.size()) - 1))]; break;
  }
}
template <class T>
void mutate_page_table(fuzz_input&, kvevict::kv_cache<T, kvevict::strided_layout>&, const std::vector<std::int32_t>&) {}

/// Writes generated rows into slot s of every head of sequence b, where
/// mapped (the engine writing a prompt's K/V before prefill).
template <class T, class Layout>
void write_rows(fuzz_input& in, kvevict::kv_cache<T, Layout>& cache, std::int32_t b, std::int32_t first,
                std::int32_t end, int poison_odds) {
  const auto v = cache.view();
  const std::size_t n = std::size_t(v.num_heads) * std::size_t(end - first) * v.head_dim;
  const std::vector<T> k = in.elements<T>(n, value_kind::kv_row, poison_odds);
  const std::vector<T> val = in.elements<T>(n, value_kind::kv_row, poison_odds);
  std::size_t at = 0;
  for (std::int32_t h = 0; h < v.num_heads; ++h)
    for (std::int32_t s = first; s < end; ++s, at += std::size_t(v.head_dim))
      if (mapped(v, b, s))
        for (std::int32_t d = 0; d < v.head_dim; ++d) {
          v.k_row(b, h, s)[d] = k[at + std::size_t(d)];
          v.v_row(b, h, s)[d] = val[at + std::size_t(d)];
        }
}

}  // namespace kvfuzz
