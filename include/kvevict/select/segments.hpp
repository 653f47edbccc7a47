#pragma once
// Segmented selection, the problem (docs/semantics.md, "Segmented
// selection"): in each segment of (score, position) keys, select the k
// highest (select_end::top) or the k lowest (select_end::bottom) by the one
// order of order.hpp — lower score first, among equal scores the older
// position first, NaN below every number, -0 == +0. Top-k therefore keeps the
// highest scores and, among ties, the newer tokens: exactly a keep set;
// bottom-k is exactly a set of victims.
//
// The selected elements come out as indices j into their segment, in
// ascending position order (ascending j when positions are implicit), and
// optionally as a mask. Positions should be distinct within a segment; if two
// elements share a key, the one with the lower index is taken first, so the
// result stays deterministic.
//
// These views are trivially copyable and mean the same on every device: the
// host implementation (select/segmented_select.hpp) and the CUDA one
// (cuda/segmented_select.cuh) produce identical indices and masks.
#include <cstdint>
#include <type_traits>

#include "kvevict/config.hpp"
#include "kvevict/order.hpp"

namespace kvevict {

/// Which end of the (score, position) order a selection takes.
enum class select_end : std::uint8_t {
  top,     ///< the k highest: a keep set
  bottom,  ///< the k lowest: victims
};

/// The keys: element j of segment i is (scores[i * stride + j],
/// positions[i * stride + j]) for j in [0, length(i)). Fits the slot arrays
/// of a batched state ([B * H][capacity] with counts as lengths) and
/// per-head prefill scores alike.
struct segment_set {
  const float* scores = nullptr;
  const std::int32_t* positions = nullptr;  ///< null: element j has position j
  std::int64_t stride = 0;                  ///< elements between segment starts (>= max_length)
  const std::int32_t* lengths = nullptr;    ///< [num_segments], each in [0, max_length]; null: all max_length
  std::int32_t max_length = 0;              ///< the longest segment (a bound when lengths are given)
  std::int32_t num_segments = 0;

  KVEVICT_HOST_DEVICE std::int32_t length(std::int32_t i) const noexcept {
    return lengths ? lengths[i] : max_length;
  }
  /// True when ascending index is ascending position (implicit positions):
  /// the output needs no reordering.
  KVEVICT_HOST_DEVICE bool ordered_by_index() const noexcept { return positions == nullptr; }
  KVEVICT_HOST_DEVICE std::int32_t position(std::int32_t i, std::int32_t j) const noexcept {
    return positions ? positions[i * stride + j] : j;
  }
  /// The element's key in the (score, position) order; select_end::top
  /// selects on the complement, so "lowest first" serves both ends.
  KVEVICT_HOST_DEVICE std::uint64_t key(std::int32_t i, std::int32_t j, select_end end) const noexcept {
    const std::uint64_t k = eviction_key(scores[i * stride + j], position(i, j));
    return end == select_end::top ? ~k : k;
  }
};

/// How many to select: k in every segment, or ks[i] in segment i. Each must
/// lie in [0, length(i)].
struct selection_count {
  std::int32_t k = 0;
  const std::int32_t* ks = nullptr;  ///< [num_segments], or null: k everywhere

  KVEVICT_HOST_DEVICE std::int32_t of(std::int32_t i) const noexcept { return ks ? ks[i] : k; }
};

/// Where the result goes. indices: row i holds segment i's k(i) selected
/// indices, ascending by position, in [i * index_stride, i * index_stride +
/// k(i)); the rest of the row is not written. mask (optional): element j of
/// segment i at mask[i * mask_stride + j], 1 when selected, 0 otherwise, for
/// j < length(i). Either may be null, not both.
struct selection_output {
  std::int32_t* indices = nullptr;
  std::int64_t index_stride = 0;  ///< >= the largest k
  std::uint8_t* mask = nullptr;
  std::int64_t mask_stride = 0;   ///< >= max_length
};

static_assert(std::is_trivially_copyable_v<segment_set>, "selection views go to kernels by value");
static_assert(std::is_trivially_copyable_v<selection_count>, "selection views go to kernels by value");
static_assert(std::is_trivially_copyable_v<selection_output>, "selection views go to kernels by value");

}  // namespace kvevict
