#pragma once
// Layouts map (sequence b, KV head h, slot s) to the element offset where that
// slot's head_dim-long row starts (docs/semantics.md, "Layouts"); the row
// itself is contiguous.
//
// Like mdspan mappings they are small, trivially copyable values. BHSD (HND)
// and BSHD (NHD) are both a strided_layout that differ only in their default
// strides, so one code path serves both, and padded buffers just pass their
// own strides. A paged layout adds one indirection through a page table.
#include <cstdint>
#include <type_traits>

#include "kvevict/config.hpp"

namespace kvevict {

/// Contiguous-per-row layout with explicit strides (in elements).
struct strided_layout {
  std::int64_t stride_seq = 0;
  std::int64_t stride_head = 0;
  std::int64_t stride_slot = 0;

  KVEVICT_HOST_DEVICE std::int64_t row_offset(std::int32_t b, std::int32_t h,
                                              std::int32_t s) const noexcept {
    return b * stride_seq + h * stride_head + s * stride_slot;
  }

  /// [B][H][S][D]: each head's slots adjacent (HND per sequence).
  static constexpr strided_layout bhsd(std::int32_t num_heads, std::int32_t capacity,
                                       std::int32_t head_dim) noexcept {
    return {std::int64_t{num_heads} * capacity * head_dim, std::int64_t{capacity} * head_dim, head_dim};
  }
  /// [B][S][H][D]: the heads of one slot adjacent (NHD per sequence).
  static constexpr strided_layout bshd(std::int32_t num_heads, std::int32_t capacity,
                                       std::int32_t head_dim) noexcept {
    return {std::int64_t{capacity} * num_heads * head_dim, head_dim, std::int64_t{num_heads} * head_dim};
  }
};

/// Order of heads and slots inside one page.
enum class page_order {
  nhd,  ///< [page_size][heads][head_dim], as in vLLM / FlashInfer NHD
  hnd,  ///< [heads][page_size][head_dim], as in FlashInfer HND
};

/// Paged layout: slot s of sequence b lives in page page_table[b][s / page_size]
/// at in-page slot s % page_size. Page ids index a pool of num_pages pages.
struct paged_layout {
  const std::int32_t* page_table = nullptr;  ///< [num_seqs][max_pages_per_seq]
  std::int64_t page_table_stride = 0;        ///< elements between sequences' rows
  std::int32_t max_pages_per_seq = 0;
  std::int32_t num_pages = 0;  ///< pool size; valid page ids are [0, num_pages)
  std::int32_t page_size = 0;  ///< slots per page
  std::int64_t stride_page = 0;
  std::int64_t stride_head = 0;
  std::int64_t stride_slot = 0;  ///< between slots inside a page

  KVEVICT_HOST_DEVICE std::int32_t page_id(std::int32_t b, std::int32_t s) const noexcept {
    return page_table[b * page_table_stride + s / page_size];
  }

  KVEVICT_HOST_DEVICE std::int64_t row_offset(std::int32_t b, std::int32_t h,
                                              std::int32_t s) const noexcept {
    return page_id(b, s) * stride_page + h * stride_head + (s % page_size) * stride_slot;
  }

  /// Default (dense) strides of a page pool in the given in-page order.
  static constexpr paged_layout make(const std::int32_t* page_table, std::int32_t max_pages_per_seq,
                                     std::int32_t num_pages, std::int32_t page_size,
                                     std::int32_t num_heads, std::int32_t head_dim,
                                     page_order order) noexcept {
    paged_layout l;
    l.page_table = page_table;
    l.page_table_stride = max_pages_per_seq;
    l.max_pages_per_seq = max_pages_per_seq;
    l.num_pages = num_pages;
    l.page_size = page_size;
    l.stride_page = std::int64_t{page_size} * num_heads * head_dim;
    if (order == page_order::nhd) {
      l.stride_head = head_dim;
      l.stride_slot = std::int64_t{num_heads} * head_dim;
    } else {
      l.stride_head = std::int64_t{page_size} * head_dim;
      l.stride_slot = head_dim;
    }
    return l;
  }
};

static_assert(std::is_trivially_copyable_v<strided_layout>, "layouts are passed by value to kernels");
static_assert(std::is_trivially_copyable_v<paged_layout>, "layouts are passed by value to kernels");

/// Number of pages that hold `slots` slots.
KVEVICT_HOST_DEVICE constexpr std::int32_t pages_for(std::int32_t slots, std::int32_t page_size) noexcept {
  return static_cast<std::int32_t>((std::int64_t{slots} + page_size - 1) / page_size);
}

}  // namespace kvevict
