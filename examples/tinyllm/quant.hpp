#pragma once
// ggml tensor element types and the dequantisation of one row to float.
// Block layouts and formulas mirror ggml (ggml-common.h, ggml-quants.c), so a
// GGUF file written by llama.cpp decodes to exactly the values llama.cpp sees.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <limits>
#include <string>

#include "kvevict/dtype/half.hpp"
#include "tinyllm/error.hpp"

// GGUF data is little-endian and we copy it straight into host integers/floats.
#if defined(__BYTE_ORDER__) && defined(__ORDER_LITTLE_ENDIAN__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "tinyllm reads little-endian GGUF data directly and needs a little-endian host"
#endif

namespace tinyllm {

/// The ggml type ids tinyllm can decode (values are the ids stored in GGUF).
enum class ggml_type : std::uint32_t { f32 = 0, f16 = 1, q4_0 = 2, q4_1 = 3, q8_0 = 8 };

// Blocks as stored in the file. d and m are IEEE binary16 bits.
struct block_q4_0 {
  std::uint16_t d;
  std::uint8_t qs[16];  // element j in the low nibble of qs[j], element j+16 in the high nibble
};
struct block_q4_1 {
  std::uint16_t d, m;
  std::uint8_t qs[16];
};
struct block_q8_0 {
  std::uint16_t d;
  std::int8_t qs[32];
};
static_assert(sizeof(block_q4_0) == 18 && sizeof(block_q4_1) == 20 && sizeof(block_q8_0) == 34,
              "block structs must match ggml's packed layout");

/// ggml's name for the type ("f32", "q4_0", ...), or "unknown" for an invalid value.
inline const char* type_name(ggml_type t) noexcept {
  switch (t) {
    case ggml_type::f32: return "f32";
    case ggml_type::f16: return "f16";
    case ggml_type::q4_0: return "q4_0";
    case ggml_type::q4_1: return "q4_1";
    case ggml_type::q8_0: return "q8_0";
  }
  return "unknown";
}

namespace detail {

// ggml's names for all type ids (ggml.h), so an error can say which
// unsupported type a file uses (e.g. a Q6_K model).
inline const char* ggml_id_name(std::uint32_t id) noexcept {
  static const char* const names[] = {
      "f32",     "f16",    "q4_0",    "q4_1",  "q4_2 (removed)", "q4_3 (removed)", "q5_0", "q5_1",
      "q8_0",    "q8_1",   "q2_K",    "q3_K",  "q4_K",           "q5_K",           "q6_K", "q8_K",
      "iq2_xxs", "iq2_xs", "iq3_xxs", "iq1_s", "iq4_nl",         "iq3_s",          "iq2_s", "iq4_xs",
      "i8",      "i16",    "i32",     "i64",   "f64",            "iq1_m",          "bf16"};
  return id < std::size(names) ? names[id] : "unknown";
}

[[noreturn]] inline void invalid_type(ggml_type t) {
  throw format_error("invalid ggml_type value " + std::to_string(static_cast<std::uint32_t>(t)));
}

inline float half_bits_to_float(std::uint16_t bits) noexcept {
  return kvevict::half_to_float(kvevict::half::from_bits(bits));
}

}  // namespace detail

/// Validates a type id read from a file; `tensor` names the tensor in the error.
inline ggml_type ggml_type_from_id(std::uint32_t id, const std::string& tensor) {
  switch (id) {
    case 0: case 1: case 2: case 3: case 8: return static_cast<ggml_type>(id);
    default: break;
  }
  throw format_error("tensor '" + tensor + "' has ggml type " + std::to_string(id) + " (" +
                     detail::ggml_id_name(id) + "), which is not supported (supported: f32, f16, q4_0, q4_1, q8_0)");
}

/// Elements per block: 1 for f32/f16, 32 for the quantised types.
inline std::int64_t block_elements(ggml_type t) {
  switch (t) {
    case ggml_type::f32: case ggml_type::f16: return 1;
    case ggml_type::q4_0: case ggml_type::q4_1: case ggml_type::q8_0: return 32;
  }
  detail::invalid_type(t);
}

/// Bytes per block.
inline std::size_t block_bytes(ggml_type t) {
  switch (t) {
    case ggml_type::f32: return 4;
    case ggml_type::f16: return 2;
    case ggml_type::q4_0: return sizeof(block_q4_0);
    case ggml_type::q4_1: return sizeof(block_q4_1);
    case ggml_type::q8_0: return sizeof(block_q8_0);
  }
  detail::invalid_type(t);
}

/// Bytes of a row of n elements. Throws format_error unless n >= 0 is a
/// multiple of the block size and the byte count fits in size_t.
inline std::size_t row_bytes(ggml_type t, std::int64_t n) {
  const std::int64_t per_block = block_elements(t);
  if (n < 0 || n % per_block != 0)
    throw format_error("a row of " + std::to_string(n) + " " + type_name(t) +
                       " elements is not a whole number of blocks of " + std::to_string(per_block));
  const auto blocks = static_cast<std::uint64_t>(n / per_block);
  if (blocks > std::numeric_limits<std::size_t>::max() / block_bytes(t))
    throw format_error("a row of " + std::to_string(n) + " " + type_name(t) + " elements does not fit in memory");
  return static_cast<std::size_t>(blocks) * block_bytes(t);
}

/// Decodes n elements stored as type t at src (no alignment needed) into dst.
/// Throws format_error if n is not a whole number of blocks.
inline void dequantize_row(ggml_type t, const void* src, float* dst, std::int64_t n) {
  const std::size_t total = row_bytes(t, n);
  const auto* p = static_cast<const std::uint8_t*>(src);
  // Blocks are memcpy'd into locals: src may be unaligned, and the compiler
  // turns the copies into plain loads.
  switch (t) {
    case ggml_type::f32:
      if (total != 0) std::memcpy(dst, p, total);
      return;
    case ggml_type::f16:
      for (std::int64_t i = 0; i < n; ++i, p += 2) {
        std::uint16_t bits;
        std::memcpy(&bits, p, 2);
        dst[i] = detail::half_bits_to_float(bits);
      }
      return;
    case ggml_type::q4_0:
      for (std::int64_t b = 0; b < n / 32; ++b, p += sizeof(block_q4_0), dst += 32) {
        block_q4_0 blk;
        std::memcpy(&blk, p, sizeof blk);
        const float d = detail::half_bits_to_float(blk.d);
        for (int j = 0; j < 16; ++j) {
          dst[j] = static_cast<float>((blk.qs[j] & 0x0F) - 8) * d;
          dst[j + 16] = static_cast<float>((blk.qs[j] >> 4) - 8) * d;
        }
      }
      return;
    case ggml_type::q4_1:
      for (std::int64_t b = 0; b < n / 32; ++b, p += sizeof(block_q4_1), dst += 32) {
        block_q4_1 blk;
        std::memcpy(&blk, p, sizeof blk);
        const float d = detail::half_bits_to_float(blk.d);
        const float m = detail::half_bits_to_float(blk.m);
        for (int j = 0; j < 16; ++j) {
          dst[j] = static_cast<float>(blk.qs[j] & 0x0F) * d + m;
          dst[j + 16] = static_cast<float>(blk.qs[j] >> 4) * d + m;
        }
      }
      return;
    case ggml_type::q8_0:
      for (std::int64_t b = 0; b < n / 32; ++b, p += sizeof(block_q8_0), dst += 32) {
        block_q8_0 blk;
        std::memcpy(&blk, p, sizeof blk);
        const float d = detail::half_bits_to_float(blk.d);
        for (int j = 0; j < 32; ++j) dst[j] = static_cast<float>(blk.qs[j]) * d;
      }
      return;
  }
  detail::invalid_type(t);
}

}  // namespace tinyllm
