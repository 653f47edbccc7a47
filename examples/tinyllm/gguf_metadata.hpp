#pragma once
// GGUF metadata values and the bounds-checked byte cursor that decodes them
// (used by gguf.hpp). Files come from anywhere: every read is checked against
// the bytes left, and every count before anything is allocated for it.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "tinyllm/error.hpp"
#include "tinyllm/quant.hpp"  // little-endian host check

namespace tinyllm {

/// Metadata value type ids as stored in GGUF.
enum class gguf_type : std::uint32_t {
  u8 = 0, i8 = 1, u16 = 2, i16 = 3, u32 = 4, i32 = 5, f32 = 6, boolean = 7,
  string = 8, array = 9, u64 = 10, i64 = 11, f64 = 12
};

inline const char* gguf_type_name(gguf_type t) noexcept {
  static const char* const names[] = {"u8",  "i8",  "u16",    "i16",   "u32", "i32", "f32",
                                      "bool", "string", "array", "u64", "i64", "f64"};
  const auto i = static_cast<std::uint32_t>(t);
  return i < 13 ? names[i] : "unknown";
}

struct gguf_value;

/// An array. Fixed-size elements stay packed as in the file (one allocation
/// for a 49152-entry table); strings and nested arrays are decoded.
struct gguf_array {
  gguf_type type = gguf_type::u8;    ///< element type
  std::uint64_t count = 0;
  std::vector<std::uint8_t> raw;     ///< count * element size bytes, for numbers and bools
  std::vector<std::string> strings;  ///< for type == string
  std::vector<gguf_value> arrays;    ///< for type == array (each holds a gguf_array)
};

/// One metadata value. Unsigned integers are held as uint64, signed as int64,
/// f32/f64 as double (exact for f32); `type` keeps the stored type.
struct gguf_value {
  gguf_type type = gguf_type::u8;
  std::variant<std::uint64_t, std::int64_t, double, bool, std::string, gguf_array> data;
};

struct gguf_kv {
  std::string key;
  gguf_value value;
};

namespace detail {

template <class T>
T load_le(const std::uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// Range-checked integer conversions (false when v does not fit in T).
template <class T>
bool fit_int(std::uint64_t v, T& out) {
  if (v > static_cast<std::uint64_t>(std::numeric_limits<T>::max())) return false;
  out = static_cast<T>(v);
  return true;
}
template <class T>
bool fit_int(std::int64_t v, T& out) {
  if (v >= 0) return fit_int(static_cast<std::uint64_t>(v), out);
  if constexpr (std::is_signed_v<T>) {
    if (v < static_cast<std::int64_t>(std::numeric_limits<T>::min())) return false;
    out = static_cast<T>(v);
    return true;
  }
  return false;
}

inline bool is_int_type(gguf_type t) {
  return t == gguf_type::u8 || t == gguf_type::i8 || t == gguf_type::u16 || t == gguf_type::i16 ||
         t == gguf_type::u32 || t == gguf_type::i32 || t == gguf_type::u64 || t == gguf_type::i64;
}

template <class T>
bool value_to_int(const gguf_value& v, T& out) {
  if (const auto* u = std::get_if<std::uint64_t>(&v.data)) return fit_int(*u, out);
  if (const auto* s = std::get_if<std::int64_t>(&v.data)) return fit_int(*s, out);
  return false;
}

// Size of a fixed-size element, or 0 for string/array.
inline std::size_t gguf_scalar_size(gguf_type t) {
  switch (t) {
    case gguf_type::u8: case gguf_type::i8: case gguf_type::boolean: return 1;
    case gguf_type::u16: case gguf_type::i16: return 2;
    case gguf_type::u32: case gguf_type::i32: case gguf_type::f32: return 4;
    case gguf_type::u64: case gguf_type::i64: case gguf_type::f64: return 8;
    default: return 0;
  }
}

template <class T>
bool array_int_at(const gguf_array& a, std::size_t i, T& out) {
  const std::uint8_t* p = a.raw.data() + i * gguf_scalar_size(a.type);
  switch (a.type) {
    case gguf_type::u8: return fit_int(std::uint64_t{load_le<std::uint8_t>(p)}, out);
    case gguf_type::u16: return fit_int(std::uint64_t{load_le<std::uint16_t>(p)}, out);
    case gguf_type::u32: return fit_int(std::uint64_t{load_le<std::uint32_t>(p)}, out);
    case gguf_type::u64: return fit_int(load_le<std::uint64_t>(p), out);
    case gguf_type::i8: return fit_int(std::int64_t{load_le<std::int8_t>(p)}, out);
    case gguf_type::i16: return fit_int(std::int64_t{load_le<std::int16_t>(p)}, out);
    case gguf_type::i32: return fit_int(std::int64_t{load_le<std::int32_t>(p)}, out);
    case gguf_type::i64: return fit_int(load_le<std::int64_t>(p), out);
    default: return false;
  }
}

inline std::string describe(const gguf_value& v) {
  if (const auto* a = std::get_if<gguf_array>(&v.data)) return std::string("array of ") + gguf_type_name(a->type);
  return gguf_type_name(v.type);
}

// Bounds-checked little-endian cursor over the file. `ctx` says what is being
// read (e.g. "key 'general.name'") for error messages.
class gguf_cursor {
 public:
  gguf_cursor(const std::uint8_t* p, std::size_t n) : p_(p), n_(n) {}
  std::string ctx = "header";
  std::size_t pos() const { return pos_; }
  std::size_t left() const { return n_ - pos_; }

  [[noreturn]] void fail(const std::string& what) const {
    throw format_error("gguf: " + ctx + ": " + what + " (at byte " + std::to_string(pos_) + ")");
  }
  const std::uint8_t* take(std::uint64_t k, const char* what) {
    if (k > left())
      fail(std::string("truncated ") + what + ": needs " + std::to_string(k) + " bytes, " +
           std::to_string(left()) + " left");
    const std::uint8_t* q = p_ + pos_;
    pos_ += static_cast<std::size_t>(k);
    return q;
  }
  template <class T>
  T read(const char* what) { return load_le<T>(take(sizeof(T), what)); }
  std::string str(const char* what) {
    const auto len = read<std::uint64_t>(what);
    const auto* q = take(len, what);
    return std::string(reinterpret_cast<const char*>(q), static_cast<std::size_t>(len));
  }
  // Rejects `count` items of at least `min_bytes` each when fewer bytes are left.
  void check_count(std::uint64_t count, std::size_t min_bytes, const char* what) {
    if (count > left() / min_bytes)
      fail(std::to_string(count) + " " + what + " cannot fit in the " + std::to_string(left()) + " bytes left");
  }
  gguf_type value_type(const char* what) {
    const auto id = read<std::uint32_t>(what);
    if (id > 12) fail("unknown value type " + std::to_string(id));
    return static_cast<gguf_type>(id);
  }

  gguf_value value(gguf_type t) {
    gguf_value v;
    v.type = t;
    switch (t) {
      case gguf_type::u8: v.data = std::uint64_t{read<std::uint8_t>("u8")}; break;
      case gguf_type::u16: v.data = std::uint64_t{read<std::uint16_t>("u16")}; break;
      case gguf_type::u32: v.data = std::uint64_t{read<std::uint32_t>("u32")}; break;
      case gguf_type::u64: v.data = read<std::uint64_t>("u64"); break;
      case gguf_type::i8: v.data = std::int64_t{read<std::int8_t>("i8")}; break;
      case gguf_type::i16: v.data = std::int64_t{read<std::int16_t>("i16")}; break;
      case gguf_type::i32: v.data = std::int64_t{read<std::int32_t>("i32")}; break;
      case gguf_type::i64: v.data = read<std::int64_t>("i64"); break;
      case gguf_type::f32: v.data = double{read<float>("f32")}; break;
      case gguf_type::f64: v.data = read<double>("f64"); break;
      case gguf_type::boolean: v.data = read_bool(*take(1, "bool")); break;
      case gguf_type::string: v.data = str("string"); break;
      case gguf_type::array: v.data = array(0); break;
    }
    return v;
  }

 private:
  static constexpr int max_depth = 8;  // bounds recursion on hostile nested arrays

  bool read_bool(std::uint8_t b) const {
    if (b > 1) fail("bool value " + std::to_string(b) + " is neither 0 nor 1");
    return b != 0;
  }
  gguf_array array(int depth) {
    if (depth >= max_depth) fail("arrays nested more than " + std::to_string(max_depth) + " deep");
    gguf_array a;
    a.type = value_type("array element type");
    a.count = read<std::uint64_t>("array length");
    const std::size_t size = gguf_scalar_size(a.type);
    // Smallest encodings: a string is its 8-byte length, an array its type and length.
    check_count(a.count, size ? size : a.type == gguf_type::string ? 8 : 12, "array elements");
    const auto n = static_cast<std::size_t>(a.count);
    if (size) {
      const std::uint8_t* q = take(a.count * size, "array");
      a.raw.assign(q, q + n * size);
      if (a.type == gguf_type::boolean)
        for (std::uint8_t b : a.raw) read_bool(b);
    } else if (a.type == gguf_type::string) {
      a.strings.reserve(n);
      for (std::size_t i = 0; i < n; ++i) a.strings.push_back(str("string array element"));
    } else {
      for (std::size_t i = 0; i < n; ++i) {
        gguf_value e;
        e.type = gguf_type::array;
        e.data = array(depth + 1);
        a.arrays.push_back(std::move(e));
      }
    }
    return a;
  }

  const std::uint8_t* p_;
  std::size_t n_;
  std::size_t pos_ = 0;
};

}  // namespace detail

}  // namespace tinyllm
