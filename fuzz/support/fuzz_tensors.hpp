#pragma once
// Owned input tensors for the calls under test, shaped as the call expects
// or (now and then) not: a dimension one short or one long, strided columns,
// a null pointer, malformed strides. The view describes its own buffer
// truthfully (a negative or zero stride still reads inside it), so any read
// past it is the library's, and AddressSanitizer reports it; the one
// exception is a stride of 2^62, which the library must refuse unread.
#include <array>
#include <cstdint>
#include <vector>

#include "fuzz_input.hpp"
#include "kvevict/tensor_view.hpp"

namespace kvfuzz {

template <class E, int R>
struct owned_tensor {
  std::vector<E> data;
  kvevict::tensor_view<const E, R> view;
  const E& at(const std::array<std::int64_t, R>& index) const {
    std::int64_t off = 0;
    for (int d = 0; d < R; ++d) off += index[d] * view.strides[d];
    return view.data[off];
  }
};

/// A tensor of `expected` extents; dimensions marked in at_least may come
/// one wider. With `bad_odds` > 0, about one in bad_odds tensors is wrong in
/// one way (an extent one short or, for an exact one, one long; a null
/// data pointer), and about one in 2 * bad_odds has a malformed stride on
/// one dimension (negative, 0 or 2^62; the library refuses the first
/// always, the others where the extent is above 1). About one in 8 has
/// strided last-dimension elements.
template <class E, int R>
owned_tensor<E, R> make_tensor(fuzz_input& in, const std::array<std::int32_t, R>& expected,
                               const std::array<bool, R>& at_least, value_kind kind, int bad_odds = 24,
                               int poison_odds = 8) {
  std::array<std::int32_t, R> ext = expected;
  for (int d = 0; d < R; ++d)
    if (at_least[d] && in.one_in(3)) ext[d] += 1;
  bool null_data = false;
  if (bad_odds > 0 && in.one_in(bad_odds)) {
    const int d = in.range(0, R);  // R: a null pointer
    if (d == R) null_data = true;
    else ext[d] += (at_least[d] || in.one_in(2)) && ext[d] > 0 ? -1 : 1;
  }
  for (auto& e : ext)
    if (e < 0) e = 0;
  const std::int64_t inner_stride = in.one_in(8) ? 2 : 1;
  std::array<std::int64_t, R> strides{};
  std::int64_t stride = inner_stride;
  for (int d = R - 1; d >= 0; --d) {
    strides[d] = stride;
    stride *= ext[d];
  }
  owned_tensor<E, R> t;
  const std::size_t total = std::size_t(stride);
  if constexpr (std::is_same_v<E, float>) t.data = in.floats(total, kind, poison_odds);
  else t.data = in.elements<E>(total, kind, poison_odds);
  t.view.data = null_data || total == 0 ? nullptr : t.data.data();
  if (bad_odds > 0 && t.view.data && in.one_in(2 * bad_odds)) {
    const int d = in.range(0, R - 1);
    switch (in.range(0, 2)) {
      case 0:  // the same elements walked backwards from the last index of d
        t.view.data += std::int64_t(ext[d] > 0 ? ext[d] - 1 : 0) * strides[d];
        strides[d] = -strides[d];
        break;
      case 1: strides[d] = 0; break;
      default: strides[d] = std::int64_t{1} << 62; break;
    }
  }
  for (int d = 0; d < R; ++d) {
    t.view.extents[d] = ext[d];
    t.view.strides[d] = strides[d];
  }
  return t;
}

}  // namespace kvfuzz
