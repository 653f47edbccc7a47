#pragma once
// Test support: build a kv_cache of any dtype in any layout kind at run time
// and hand it to a generic lambda, so one test body covers dtype x layout.
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "kvevict/dtype/convert.hpp"
#include "kvevict/kv_cache.hpp"

namespace kvtest {

enum class layout_kind { bhsd, bshd, bshd_padded, paged_nhd, paged_hnd };
inline constexpr layout_kind all_layouts[] = {layout_kind::bhsd, layout_kind::bshd, layout_kind::bshd_padded,
                                              layout_kind::paged_nhd, layout_kind::paged_hnd};

inline const char* name(layout_kind k) {
  switch (k) {
    case layout_kind::bhsd: return "bhsd";
    case layout_kind::bshd: return "bshd";
    case layout_kind::bshd_padded: return "bshd_padded";
    case layout_kind::paged_nhd: return "paged_nhd";
    case layout_kind::paged_hnd: return "paged_hnd";
  }
  return "?";
}

/// The scales an fp8 test cache carries: K 0.75 + 0.5 h and V 1.25 + 0.25 h
/// for KV head h (one per layer when there is one head), none for a float
/// cache. Not powers of two, so a path that skips one is seen.
inline std::vector<float> fp8_test_scales(std::int32_t heads, bool values) {
  std::vector<float> out(static_cast<std::size_t>(heads));
  for (std::int32_t h = 0; h < heads; ++h)
    out[std::size_t(h)] = values ? 1.25f + 0.25f * float(h) : 0.75f + 0.5f * float(h);
  return out;
}

template <class T, class Cache>
Cache&& with_test_scales(Cache&& c) {
  if constexpr (kvevict::is_fp8_v<T>)
    c.set_scales(fp8_test_scales(c.num_heads(), false), fp8_test_scales(c.num_heads(), true));
  return std::forward<Cache>(c);
}

/// Calls f(view) with a zero-initialised cache of dtype T in layout `kind`
/// (fp8: with fp8_test_scales).
template <class T, class F>
void with_cache(layout_kind kind, std::int32_t seqs, std::int32_t heads, std::int32_t capacity,
                std::int32_t head_dim, std::int32_t page_size, F&& f) {
  using namespace kvevict;
  switch (kind) {
    case layout_kind::bhsd: {
      auto c = with_test_scales<T>(make_bhsd_cache<T>(seqs, heads, capacity, head_dim));
      f(c.view());
      return;
    }
    case layout_kind::bshd: {
      auto c = with_test_scales<T>(make_bshd_cache<T>(seqs, heads, capacity, head_dim));
      f(c.view());
      return;
    }
    case layout_kind::bshd_padded: {
      // An engine buffer with padded rows and gaps: BSHD with 3 spare
      // elements per row, 5 per slot and 7 per sequence.
      strided_layout l;
      l.stride_head = head_dim + 3;
      l.stride_slot = std::int64_t{heads} * l.stride_head + 5;
      l.stride_seq = capacity * l.stride_slot + 7;
      std::vector<T> k(std::size_t(seqs * l.stride_seq)), v(k.size());
      kv_view<T, strided_layout> view{k.data(), v.data(), l, seqs, heads, capacity, head_dim};
      const std::vector<float> k_scales = fp8_test_scales(heads, false), v_scales = fp8_test_scales(heads, true);
      if constexpr (is_fp8_v<T>) view.scales = kv_scales{k_scales.data(), v_scales.data(), heads > 1 ? 1 : 0};
      f(view);
      return;
    }
    case layout_kind::paged_nhd:
    case layout_kind::paged_hnd: {
      auto c = with_test_scales<T>(make_paged_cache<T>(seqs, heads, capacity, head_dim, page_size,
                                                       kind == layout_kind::paged_nhd ? page_order::nhd
                                                                                       : page_order::hnd));
      f(c.view());
      return;
    }
  }
}

/// A value of T drawn from a small grid, so K/V bytes are exactly
/// representable in every dtype and comparisons can be bit exact.
template <class T>
T random_value(std::mt19937& rng) {
  std::uniform_int_distribution<int> d(-64, 64);
  return kvevict::from_float<T>(static_cast<float>(d(rng)) / 32.0f);
}

template <class T>
bool same_bits(const T* a, const T* b, std::int32_t n) {
  return std::memcmp(a, b, sizeof(T) * std::size_t(n)) == 0;
}

}  // namespace kvtest
