#pragma once
// A non-owning, trivially copyable strided view of an engine's array
// (probabilities, column sums, queries, LSE, token rows), in the spirit of
// mdspan with layout_stride: extents and strides in elements.
#include <array>
#include <cstdint>
#include <type_traits>

#include "kvevict/config.hpp"

namespace kvevict {

template <class T, int Rank>
struct tensor_view {
  static_assert(Rank >= 1, "a tensor_view has at least one dimension");
  using element_type = T;
  static constexpr int rank = Rank;

  T* data = nullptr;
  std::int32_t extents[Rank] = {};
  std::int64_t strides[Rank] = {};

  template <class... I>
  KVEVICT_HOST_DEVICE std::int64_t offset(I... index) const noexcept {
    static_assert(sizeof...(I) == Rank, "one index per dimension");
    const std::int64_t idx[Rank] = {static_cast<std::int64_t>(index)...};
    std::int64_t off = 0;
    for (int d = 0; d < Rank; ++d) off += idx[d] * strides[d];
    return off;
  }

  template <class... I>
  KVEVICT_HOST_DEVICE T& operator()(I... index) const noexcept {
    return data[offset(index...)];
  }

  KVEVICT_HOST_DEVICE std::int32_t extent(int d) const noexcept { return extents[d]; }
  KVEVICT_HOST_DEVICE std::int64_t stride(int d) const noexcept { return strides[d]; }

  /// The view with the first index fixed (rank - 1 dimensions).
  template <int R = Rank, class = std::enable_if_t<(R > 1)>>
  KVEVICT_HOST_DEVICE tensor_view<T, Rank - 1> operator[](std::int64_t i) const noexcept {
    tensor_view<T, Rank - 1> sub;
    sub.data = data + i * strides[0];
    for (int d = 1; d < Rank; ++d) {
      sub.extents[d - 1] = extents[d];
      sub.strides[d - 1] = strides[d];
    }
    return sub;
  }
};

/// A row-major (C order) view of contiguous memory.
template <class T, class... E>
tensor_view<T, static_cast<int>(sizeof...(E))> make_tensor_view(T* data, E... extents) noexcept {
  constexpr int rank = static_cast<int>(sizeof...(E));
  tensor_view<T, rank> view;
  view.data = data;
  const std::int32_t ext[rank] = {static_cast<std::int32_t>(extents)...};
  std::int64_t stride = 1;
  for (int d = rank - 1; d >= 0; --d) {
    view.extents[d] = ext[d];
    view.strides[d] = stride;
    stride *= ext[d];
  }
  return view;
}

/// A view with explicit strides (elements), for padded or interleaved buffers.
template <class T, int Rank>
tensor_view<T, Rank> make_strided_view(T* data, const std::array<std::int32_t, Rank>& extents,
                                       const std::array<std::int64_t, Rank>& strides) noexcept {
  tensor_view<T, Rank> view;
  view.data = data;
  for (int d = 0; d < Rank; ++d) {
    view.extents[d] = extents[d];
    view.strides[d] = strides[d];
  }
  return view;
}

static_assert(std::is_trivially_copyable_v<tensor_view<const float, 3>>,
              "views are passed by value to kernels");

}  // namespace kvevict
