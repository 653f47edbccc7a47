#pragma once
// Test support: build a GGUF file in memory. Independent of the reader
// (tinyllm/gguf.hpp) so that round trips test it; nothing is validated, so
// tests can also write malformed files (wrong type ids, bad offsets, ...).
//
//   gguf_test::writer w;
//   w.add("general.architecture", gguf_test::str("llama"))
//    .add("tokenizer.ggml.tokens", gguf_test::strings({"a", "b"}))
//    .tensor_f32("output_norm.weight", {4}, {1, 2, 3, 4});
//   std::vector<std::uint8_t> bytes = w.build();
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace gguf_test {

/// GGUF metadata value type ids.
enum vtype : std::uint32_t {
  t_u8 = 0, t_i8 = 1, t_u16 = 2, t_i16 = 3, t_u32 = 4, t_i32 = 5, t_f32 = 6, t_bool = 7,
  t_string = 8, t_array = 9, t_u64 = 10, t_i64 = 11, t_f64 = 12
};
/// ggml tensor type ids.
enum ttype : std::uint32_t { g_f32 = 0, g_f16 = 1, g_q4_0 = 2, g_q4_1 = 3, g_q8_0 = 8 };

/// An encoded metadata value: its type id and the bytes that follow the id.
/// For an array, `bytes` is element type, count, elements, which is also how
/// an array is encoded as an element of another array.
struct value {
  std::uint32_t type = t_u8;
  std::vector<std::uint8_t> bytes;
};

namespace detail {
template <class T>
void put(std::vector<std::uint8_t>& out, T v) {  // little-endian host assumed, as in the reader
  const std::size_t at = out.size();
  out.resize(at + sizeof v);  // not insert(): GCC 12 -O3 gives a false -Wstringop-overflow for it
  std::memcpy(out.data() + at, &v, sizeof v);
}
inline void put_str(std::vector<std::uint8_t>& out, const std::string& s) {
  put<std::uint64_t>(out, s.size());
  out.insert(out.end(), s.begin(), s.end());
}
template <class T>
value scalar(std::uint32_t type, T v) {
  value r{type, {}};
  put(r.bytes, v);
  return r;
}
}  // namespace detail

inline value u8(std::uint8_t v) { return detail::scalar(t_u8, v); }
inline value i8(std::int8_t v) { return detail::scalar(t_i8, v); }
inline value u16(std::uint16_t v) { return detail::scalar(t_u16, v); }
inline value i16(std::int16_t v) { return detail::scalar(t_i16, v); }
inline value u32(std::uint32_t v) { return detail::scalar(t_u32, v); }
inline value i32(std::int32_t v) { return detail::scalar(t_i32, v); }
inline value f32(float v) { return detail::scalar(t_f32, v); }
inline value boolean(bool v) { return detail::scalar(t_bool, static_cast<std::uint8_t>(v ? 1 : 0)); }
inline value u64(std::uint64_t v) { return detail::scalar(t_u64, v); }
inline value i64(std::int64_t v) { return detail::scalar(t_i64, v); }
inline value f64(double v) { return detail::scalar(t_f64, v); }
inline value str(const std::string& s) {
  value r{t_string, {}};
  detail::put_str(r.bytes, s);
  return r;
}

/// An array of `elem_type`; the elements' own types are not checked.
inline value array(std::uint32_t elem_type, const std::vector<value>& elems) {
  value r{t_array, {}};
  detail::put<std::uint32_t>(r.bytes, elem_type);
  detail::put<std::uint64_t>(r.bytes, elems.size());
  for (const value& e : elems) r.bytes.insert(r.bytes.end(), e.bytes.begin(), e.bytes.end());
  return r;
}
inline value strings(const std::vector<std::string>& v) {
  std::vector<value> e;
  for (const std::string& s : v) e.push_back(str(s));
  return array(t_string, e);
}
inline value i32s(const std::vector<std::int32_t>& v) {
  std::vector<value> e;
  for (std::int32_t x : v) e.push_back(i32(x));
  return array(t_i32, e);
}
inline value f32s(const std::vector<float>& v) {
  std::vector<value> e;
  for (float x : v) e.push_back(f32(x));
  return array(t_f32, e);
}

/// Raw bytes of a float tensor, for writer::tensor.
inline std::vector<std::uint8_t> f32_bytes(const std::vector<float>& v) {
  std::vector<std::uint8_t> out;
  for (float x : v) detail::put(out, x);
  return out;
}

class writer {
 public:
  writer& version(std::uint32_t v) {
    version_ = v;
    return *this;
  }
  /// Lays the data section out at multiples of a and, if write_key, adds
  /// general.alignment = a (u32) at this point of the key list.
  writer& alignment(std::uint32_t a, bool write_key = true) {
    if (a == 0) throw std::invalid_argument("gguf_test::writer: alignment 0");
    alignment_ = a;
    if (write_key) add("general.alignment", u32(a));
    return *this;
  }
  writer& add(const std::string& key, const value& v) {
    kvs_.push_back({key, v});
    return *this;
  }
  /// A tensor with ggml dims (dims[0] contiguous), ggml type id and raw data,
  /// placed at the next multiple of the alignment in the data section.
  writer& tensor(const std::string& name, const std::vector<std::uint64_t>& dims, std::uint32_t type,
                 const std::vector<std::uint8_t>& data) {
    tensors_.push_back({name, dims, type, data, false, 0});
    return *this;
  }
  writer& tensor_f32(const std::string& name, const std::vector<std::uint64_t>& dims, const std::vector<float>& v) {
    return tensor(name, dims, g_f32, f32_bytes(v));
  }
  /// Writes `offset` in the last tensor's info instead of its real offset.
  writer& override_offset(std::uint64_t offset) {
    if (tensors_.empty()) throw std::logic_error("gguf_test::writer: override_offset before any tensor");
    tensors_.back().override = true;
    tensors_.back().offset = offset;
    return *this;
  }

  /// The file: header, keys, tensor infos, padding, data. The last tensor's
  /// data is not padded, so any shorter prefix is truncated.
  std::vector<std::uint8_t> build() const {
    std::vector<std::uint8_t> out = {'G', 'G', 'U', 'F'};
    detail::put<std::uint32_t>(out, version_);
    detail::put<std::uint64_t>(out, tensors_.size());
    detail::put<std::uint64_t>(out, kvs_.size());
    for (const kv& e : kvs_) {
      detail::put_str(out, e.key);
      detail::put<std::uint32_t>(out, e.v.type);
      out.insert(out.end(), e.v.bytes.begin(), e.v.bytes.end());
    }
    std::vector<std::uint64_t> offsets;
    std::uint64_t end = 0;
    for (const tensor_entry& t : tensors_) {
      end = align(end);
      offsets.push_back(end);
      end += t.data.size();
    }
    for (std::size_t i = 0; i < tensors_.size(); ++i) {
      const tensor_entry& t = tensors_[i];
      detail::put_str(out, t.name);
      detail::put<std::uint32_t>(out, static_cast<std::uint32_t>(t.dims.size()));
      for (std::uint64_t d : t.dims) detail::put<std::uint64_t>(out, d);
      detail::put<std::uint32_t>(out, t.type);
      detail::put<std::uint64_t>(out, t.override ? t.offset : offsets[i]);
    }
    const std::size_t data_start = static_cast<std::size_t>(align(out.size()));
    for (std::size_t i = 0; i < tensors_.size(); ++i) {
      out.resize(data_start + static_cast<std::size_t>(offsets[i]), 0);
      out.insert(out.end(), tensors_[i].data.begin(), tensors_[i].data.end());
    }
    if (tensors_.empty()) out.resize(data_start, 0);
    return out;
  }

  void write_file(const std::string& path) const {
    const std::vector<std::uint8_t> bytes = build();
    std::ofstream f(path, std::ios::binary);
    f.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
    if (!f) throw std::runtime_error("gguf_test::writer: cannot write " + path);
  }

 private:
  struct kv {
    std::string key;
    value v;
  };
  struct tensor_entry {
    std::string name;
    std::vector<std::uint64_t> dims;
    std::uint32_t type;
    std::vector<std::uint8_t> data;
    bool override;
    std::uint64_t offset;
  };
  std::uint64_t align(std::uint64_t n) const { return (n + alignment_ - 1) / alignment_ * alignment_; }

  std::uint32_t version_ = 3;
  std::uint32_t alignment_ = 32;
  std::vector<kv> kvs_;
  std::vector<tensor_entry> tensors_;
};

}  // namespace gguf_test
