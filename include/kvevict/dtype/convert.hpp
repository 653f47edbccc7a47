#pragma once
// One spelling for "convert to/from float" across every KV dtype, so library
// code can be written once as a template over the storage type and compute in
// float regardless of how the cache is stored.

#include <type_traits>

#include "kvevict/config.hpp"
#include "kvevict/dtype/bfloat16.hpp"
#include "kvevict/dtype/half.hpp"

namespace kvevict {

// The storage types a KV cache may use. Exact types only (no cv-qualifiers),
// so a mistaken `const half` template argument is rejected rather than
// silently accepted.
template <class T>
inline constexpr bool is_kv_dtype_v =
    std::is_same_v<T, float> || std::is_same_v<T, half> || std::is_same_v<T, bfloat16>;

KVEVICT_HOST_DEVICE inline float to_float(float x) noexcept { return x; }
KVEVICT_HOST_DEVICE inline float to_float(half x) noexcept { return half_to_float(x); }
KVEVICT_HOST_DEVICE inline float to_float(bfloat16 x) noexcept { return bfloat16_to_float(x); }

// Round-to-nearest-even for the 16-bit types. A single template with
// `if constexpr` (rather than explicit specialisations) keeps one declaration
// for nvcc and gives a readable error for unsupported types.
template <class T>
KVEVICT_HOST_DEVICE inline T from_float(float x) noexcept {
  static_assert(is_kv_dtype_v<T>, "from_float<T>: T must be float, half or bfloat16");
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else if constexpr (std::is_same_v<T, half>) {
    return float_to_half(x);
  } else {
    return float_to_bfloat16(x);
  }
}

// Left undefined for other types so misuse fails at compile time.
template <class T>
struct dtype_traits;

template <>
struct dtype_traits<float> {
  static constexpr const char* name = "float";
};

template <>
struct dtype_traits<half> {
  static constexpr const char* name = "half";
};

template <>
struct dtype_traits<bfloat16> {
  static constexpr const char* name = "bfloat16";
};

}  // namespace kvevict
