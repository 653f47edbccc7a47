#pragma once
// kv_cache: an owning host container for users (tests, demos, small engines)
// who do not bring their own buffers. It owns K, V (and for a paged cache the
// page table) and hands out kv_view values; everything else in kvevict works
// on the views only.
#include <cstdint>
#include <limits>
#include <numeric>
#include <type_traits>
#include <utility>
#include <vector>

#include "kvevict/error.hpp"
#include "kvevict/kv_view.hpp"
#include "kvevict/layout.hpp"
#include "kvevict/limits.hpp"

namespace kvevict {

template <class T, class Layout>
class kv_cache;

namespace detail {
template <class T, class Layout>
kv_cache<T, Layout> make_cache(Layout layout, std::int32_t num_seqs, std::int32_t num_heads, std::int32_t capacity,
                               std::int32_t head_dim, std::size_t elements, std::vector<std::int32_t> page_table);
}  // namespace detail

template <class T, class Layout>
class kv_cache {
 public:
  using view_type = kv_view<T, Layout>;
  using const_view_type = kv_view<const T, Layout>;

  kv_cache(const kv_cache&) = delete;  // large buffers: move, don't copy by accident
  kv_cache& operator=(const kv_cache&) = delete;
  kv_cache(kv_cache&&) noexcept = default;  // vector moves keep their buffers
  kv_cache& operator=(kv_cache&&) noexcept = default;

  view_type view() noexcept {
    return {k_.data(), v_.data(), current_layout(), num_seqs_, num_heads_, capacity_, head_dim_, current_scales()};
  }
  const_view_type view() const noexcept {
    return {k_.data(), v_.data(), current_layout(), num_seqs_, num_heads_, capacity_, head_dim_, current_scales()};
  }

  /// An fp8 cache's K and V scales: one each (per layer) or num_heads each
  /// (per KV head), positive and finite; 1 until set. Float caches have none.
  void set_scales(std::vector<float> k, std::vector<float> v) {
    const char* w = "kv_cache::set_scales";
    if constexpr (!is_fp8_v<std::remove_cv_t<T>>) detail::fail<invalid_argument>(w, "k", "scales belong to fp8 caches");
    if (k.size() != v.size() || (k.size() != 1 && k.size() != std::size_t(num_heads_)))
      detail::fail<invalid_argument>(w, "k", "has ", k.size(), " scales and v ", v.size(),
                                     ": both need 1 (per layer) or num_heads = ", num_heads_, " (per KV head)");
    for (std::size_t i = 0; i < k.size(); ++i) {
      if (!is_valid_kv_scale(k[i]))
        detail::fail<invalid_argument>(w, detail::concat("k[", i, "]"), "= ", k[i], " is not positive and finite");
      if (!is_valid_kv_scale(v[i]))
        detail::fail<invalid_argument>(w, detail::concat("v[", i, "]"), "= ", v[i], " is not positive and finite");
    }
    k_scales_ = std::move(k);
    v_scales_ = std::move(v);
  }

  std::vector<T>& k_storage() noexcept { return k_; }
  std::vector<T>& v_storage() noexcept { return v_; }
  const std::vector<T>& k_storage() const noexcept { return k_; }
  const std::vector<T>& v_storage() const noexcept { return v_; }
  /// Page table of a paged cache ([num_seqs][max_pages_per_seq]); engines may
  /// rewrite it (e.g. to hand pages back to a pool) as long as ids stay valid.
  std::vector<std::int32_t>& page_table() noexcept { return page_table_; }

  std::int32_t num_seqs() const noexcept { return num_seqs_; }
  std::int32_t num_heads() const noexcept { return num_heads_; }
  std::int32_t capacity() const noexcept { return capacity_; }
  std::int32_t head_dim() const noexcept { return head_dim_; }
  /// Bytes held by K and V together.
  std::size_t bytes() const noexcept { return (k_.size() + v_.size()) * sizeof(T); }

 private:
  friend kv_cache detail::make_cache<T, Layout>(Layout, std::int32_t, std::int32_t, std::int32_t, std::int32_t,
                                                std::size_t, std::vector<std::int32_t>);

  kv_cache() = default;

  // A paged view points at page_table_, wherever the vector now keeps it.
  Layout current_layout() const noexcept {
    Layout l = layout_;
    if constexpr (std::is_same_v<Layout, paged_layout>) l.page_table = page_table_.data();
    return l;
  }

  kv_scales current_scales() const noexcept {
    if constexpr (is_fp8_v<std::remove_cv_t<T>>) {
      return {k_scales_.data(), v_scales_.data(), k_scales_.size() > 1 ? 1 : 0};
    } else {
      return {};
    }
  }

  std::vector<T> k_, v_;
  std::vector<std::int32_t> page_table_;
  std::vector<float> k_scales_{1.0f}, v_scales_{1.0f};  // fp8 only
  Layout layout_{};
  std::int32_t num_seqs_ = 0, num_heads_ = 0, capacity_ = 0, head_dim_ = 0;
};

namespace detail {
template <class T, class Layout>
kv_cache<T, Layout> make_cache(Layout layout, std::int32_t num_seqs, std::int32_t num_heads, std::int32_t capacity,
                               std::int32_t head_dim, std::size_t elements, std::vector<std::int32_t> page_table) {
  kv_cache<T, Layout> cache;
  cache.k_.assign(elements, T{});
  cache.v_.assign(elements, T{});
  cache.page_table_ = std::move(page_table);
  cache.layout_ = layout;
  cache.num_seqs_ = num_seqs;
  cache.num_heads_ = num_heads;
  cache.capacity_ = capacity;
  cache.head_dim_ = head_dim;
  return cache;
}

inline void require_cache_shape(const char* where, std::int32_t num_seqs, std::int32_t num_heads,
                                std::int32_t capacity, std::int32_t head_dim, std::size_t element_bytes) {
  require_positive(where, "num_seqs", num_seqs);
  require_positive(where, "num_heads", num_heads);
  require_positive(where, "capacity", capacity);
  require_positive(where, "head_dim", head_dim);
  const long double elements = static_cast<long double>(num_seqs) * num_heads * capacity * head_dim;
  require_allocation(where, "num_seqs * num_heads * capacity * head_dim", 2.0L * elements * element_bytes);  // K and V
}
}  // namespace detail

/// Contiguous cache in BHSD order: [num_seqs][num_heads][capacity][head_dim].
template <class T>
kv_cache<T, strided_layout> make_bhsd_cache(std::int32_t num_seqs, std::int32_t num_heads,
                                            std::int32_t capacity, std::int32_t head_dim) {
  detail::require_cache_shape("make_bhsd_cache", num_seqs, num_heads, capacity, head_dim, sizeof(T));
  return detail::make_cache<T>(strided_layout::bhsd(num_heads, capacity, head_dim), num_seqs, num_heads, capacity,
                            head_dim, std::size_t(num_seqs) * num_heads * capacity * head_dim, {});
}

/// Contiguous cache in BSHD order: [num_seqs][capacity][num_heads][head_dim].
template <class T>
kv_cache<T, strided_layout> make_bshd_cache(std::int32_t num_seqs, std::int32_t num_heads,
                                            std::int32_t capacity, std::int32_t head_dim) {
  detail::require_cache_shape("make_bshd_cache", num_seqs, num_heads, capacity, head_dim, sizeof(T));
  return detail::make_cache<T>(strided_layout::bshd(num_heads, capacity, head_dim), num_seqs, num_heads, capacity,
                            head_dim, std::size_t(num_seqs) * num_heads * capacity * head_dim, {});
}

/// Paged cache: a pool of exactly enough pages for every sequence's capacity.
/// Sequence b gets pages [b * pages_per_seq, (b + 1) * pages_per_seq) in
/// reverse order, so that tests exercise a page table that is not the
/// identity; rewrite page_table() for any other assignment.
template <class T>
kv_cache<T, paged_layout> make_paged_cache(std::int32_t num_seqs, std::int32_t num_heads, std::int32_t capacity,
                                           std::int32_t head_dim, std::int32_t page_size, page_order order) {
  detail::require_cache_shape("make_paged_cache", num_seqs, num_heads, capacity, head_dim, sizeof(T));
  detail::require_positive("make_paged_cache", "page_size", page_size);
  const std::int32_t pages_per_seq = pages_for(capacity, page_size);
  if (std::int64_t{num_seqs} * pages_per_seq > std::numeric_limits<std::int32_t>::max())
    detail::fail<invalid_argument>("make_paged_cache", "num_seqs * pages per sequence", "= ",
                                   std::int64_t{num_seqs} * pages_per_seq, " exceeds int32 page ids");
  std::vector<std::int32_t> table(std::size_t(num_seqs) * pages_per_seq);
  for (std::int32_t b = 0; b < num_seqs; ++b)
    for (std::int32_t i = 0; i < pages_per_seq; ++i)
      table[std::size_t(b) * pages_per_seq + i] = b * pages_per_seq + (pages_per_seq - 1 - i);
  const std::int32_t num_pages = num_seqs * pages_per_seq;
  // Whole pages: a page_size far above the capacity allocates more than the shape says.
  detail::require_allocation("make_paged_cache", "the page pool",
                             2.0L * num_pages * page_size * num_heads * head_dim * sizeof(T));
  const paged_layout layout =
      paged_layout::make(nullptr, pages_per_seq, num_pages, page_size, num_heads, head_dim, order);
  return detail::make_cache<T>(layout, num_seqs, num_heads, capacity, head_dim,
                            std::size_t(num_pages) * page_size * num_heads * head_dim, std::move(table));
}

}  // namespace kvevict
