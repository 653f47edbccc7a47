#pragma once
// One spelling for "convert to/from float" across every KV dtype, so library
// code can be written once as a template over the storage type and compute in
// float regardless of how the cache is stored. fp8 codes are values only
// with their scale: kv_value(code, scale); their to_float is refused.

#include <type_traits>

#include "kvevict/config.hpp"
#include "kvevict/detail/reproducible_math.hpp"
#include "kvevict/dtype/bfloat16.hpp"
#include "kvevict/dtype/fp8.hpp"
#include "kvevict/dtype/half.hpp"

namespace kvevict {

// The storage types a KV cache may use. Exact types only (no cv-qualifiers),
// so a mistaken `const half` template argument is rejected rather than
// silently accepted.
template <class T>
inline constexpr bool is_kv_dtype_v =
    std::is_same_v<T, float> || std::is_same_v<T, half> || std::is_same_v<T, bfloat16> || is_fp8_v<T>;

KVEVICT_HOST_DEVICE inline float to_float(float x) noexcept { return x; }
KVEVICT_HOST_DEVICE inline float to_float(half x) noexcept { return half_to_float(x); }
KVEVICT_HOST_DEVICE inline float to_float(bfloat16 x) noexcept { return bfloat16_to_float(x); }

/// An fp8 K/V code is a value only with its scale (vLLM's and TensorRT-LLM's
/// k_scale / v_scale): cached keys and values are read with kv_value, and
/// an fp8 tensor anywhere a number is read without a scale (queries,
/// scores) is refused at compile time.
template <class T, std::enable_if_t<is_fp8_v<T>, int> = 0>
KVEVICT_HOST_DEVICE float to_float(T) noexcept {
  static_assert(!is_fp8_v<T>,
                "kvevict: an fp8 tensor is read as numbers here, which needs its scales (code x scale): fp8 is a "
                "K/V cache format, read through a kv_view with its scales; queries and scores are float, half or "
                "bfloat16");
  return 0.0f;
}

/// code x scale, as the engine's attention computes it: the code (exactly,
/// in float) times its scale, one float product, never fused.
template <class T>
KVEVICT_HOST_DEVICE inline float dequantize(T x, float scale) noexcept {
  static_assert(is_kv_dtype_v<T>, "dequantize<T>: T must be a KV dtype");
  if constexpr (std::is_same_v<T, fp8_e4m3>) {
    return detail::mul(fp8_e4m3_to_float(x), scale);
  } else if constexpr (std::is_same_v<T, fp8_e5m2>) {
    return detail::mul(fp8_e5m2_to_float(x), scale);
  } else {
    return detail::mul(to_float(x), scale);
  }
}

/// A cached K/V element's value: an fp8 code times its scale (the view's
/// k_scale / v_scale), any other element as it is (its view has no scales,
/// and `scale` is 1). Every path that reads keys or values reads them so.
template <class T>
KVEVICT_HOST_DEVICE inline float kv_value(T x, float scale) noexcept {
  if constexpr (is_fp8_v<T>) {
    return dequantize(x, scale);
  } else {
    (void)scale;
    return to_float(x);
  }
}

// Round-to-nearest-even for the 16-bit and fp8 types. A single template with
// `if constexpr` (rather than explicit specialisations) keeps one declaration
// for nvcc and gives a readable error for unsupported types.
template <class T>
KVEVICT_HOST_DEVICE inline T from_float(float x) noexcept {
  static_assert(is_kv_dtype_v<T>, "from_float<T>: T must be float, half, bfloat16 or an fp8 type");
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else if constexpr (std::is_same_v<T, half>) {
    return float_to_half(x);
  } else if constexpr (std::is_same_v<T, fp8_e4m3>) {
    return float_to_fp8_e4m3(x);  // saturating, as CUDA's __NV_SATFINITE
  } else if constexpr (std::is_same_v<T, fp8_e5m2>) {
    return float_to_fp8_e5m2(x);
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

template <>
struct dtype_traits<fp8_e4m3> {
  static constexpr const char* name = "fp8_e4m3";
};

template <>
struct dtype_traits<fp8_e5m2> {
  static constexpr const char* name = "fp8_e5m2";
};

}  // namespace kvevict
