#pragma once
// Reader for GGUF v2/v3, llama.cpp's model container: a header, typed metadata
// key/values, a tensor table, then tensor data at aligned offsets. The whole
// file is held in memory and tensors point into it. All failures, including
// hostile or truncated input, are format_error naming the key, tensor or byte.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <memory>
#include <string>
#include <system_error>
#include <unordered_map>
#include <utility>
#include <variant>
#include <vector>

#include "tinyllm/error.hpp"
#include "tinyllm/gguf_metadata.hpp"
#include "tinyllm/quant.hpp"

namespace tinyllm {

struct gguf_tensor {
  std::string name;
  std::vector<std::int64_t> dims;  ///< ggml order: dims[0] is the contiguous row length
  ggml_type type = ggml_type::f32;
  std::uint64_t offset = 0;            ///< relative to the data section
  const std::uint8_t* data = nullptr;  ///< into the file buffer
  std::size_t bytes = 0;

  std::int64_t row_length() const { return dims.empty() ? 1 : dims[0]; }
  std::int64_t rows() const {
    std::int64_t r = 1;
    for (std::size_t i = 1; i < dims.size(); ++i) r *= dims[i];
    return r;
  }
  std::int64_t elements() const { return row_length() * rows(); }
  std::size_t row_stride() const { return bytes / static_cast<std::size_t>(rows()); }  ///< bytes per row
  const std::uint8_t* row_data(std::int64_t r) const { return data + static_cast<std::size_t>(r) * row_stride(); }
};

class gguf_file {
 public:
  /// Reads and parses the file at `path`; errors are prefixed with the path.
  static gguf_file load(const std::string& path) {
    std::error_code ec;
    const std::uintmax_t size = std::filesystem::file_size(path, ec);
    if (ec) throw format_error(path + ": cannot read: " + ec.message());
    if (size > std::numeric_limits<std::size_t>::max() / 2) throw format_error(path + ": file too large");
    std::vector<std::uint8_t> bytes(static_cast<std::size_t>(size));
    std::ifstream in(path, std::ios::binary);
    if (!in || !in.read(reinterpret_cast<char*>(bytes.data()), static_cast<std::streamsize>(size)))
      throw format_error(path + ": cannot read " + std::to_string(size) + " bytes");
    try {
      return parse(std::move(bytes));
    } catch (const format_error& e) {
      throw format_error(path + ": " + e.what());
    }
  }

  static gguf_file parse(std::vector<std::uint8_t> bytes) {
    gguf_file f;
    f.buf_ = std::make_shared<const std::vector<std::uint8_t>>(std::move(bytes));
    f.parse_all();
    return f;
  }

  std::uint32_t version() const { return version_; }
  std::size_t alignment() const { return alignment_; }
  std::size_t data_offset() const { return data_offset_; }  ///< file offset of the data section
  const std::vector<std::uint8_t>& file_bytes() const { return *buf_; }

  const std::vector<gguf_kv>& metadata() const { return kvs_; }  ///< in file order
  bool has(const std::string& key) const { return kv_index_.count(key) != 0; }
  const gguf_value* find(const std::string& key) const {
    const auto it = kv_index_.find(key);
    return it == kv_index_.end() ? nullptr : &kvs_[it->second].value;
  }
  const gguf_value& value(const std::string& key) const {
    if (const gguf_value* v = find(key)) return *v;
    throw format_error("gguf: metadata key '" + key + "' is missing");
  }

  /// Any integer type whose value fits.
  std::uint32_t get_u32(const std::string& key) const { return get_int<std::uint32_t>(key, "a u32"); }
  std::uint64_t get_u64(const std::string& key) const { return get_int<std::uint64_t>(key, "a u64"); }
  std::int32_t get_i32(const std::string& key) const { return get_int<std::int32_t>(key, "an i32"); }
  /// f32 or f64 (narrowed).
  float get_f32(const std::string& key) const {
    const gguf_value& v = value(key);
    if (const auto* d = std::get_if<double>(&v.data)) return static_cast<float>(*d);
    throw wrong_type(key, v, "f32");
  }
  bool get_bool(const std::string& key) const {
    const gguf_value& v = value(key);
    if (const auto* b = std::get_if<bool>(&v.data)) return *b;
    throw wrong_type(key, v, "bool");
  }
  std::string get_string(const std::string& key) const {
    const gguf_value& v = value(key);
    if (const auto* s = std::get_if<std::string>(&v.data)) return *s;
    throw wrong_type(key, v, "string");
  }
  std::vector<std::string> get_string_array(const std::string& key) const {
    return array_of(key, gguf_type::string, "array of string").strings;
  }
  /// Arrays of any integer type whose elements all fit in i32.
  std::vector<std::int32_t> get_i32_array(const std::string& key) const {
    const gguf_value& v = value(key);
    const auto* a = std::get_if<gguf_array>(&v.data);
    if (!a || !detail::is_int_type(a->type)) throw wrong_type(key, v, "array of i32");
    std::vector<std::int32_t> out(static_cast<std::size_t>(a->count));
    for (std::size_t i = 0; i < out.size(); ++i)
      if (!detail::array_int_at(*a, i, out[i]))
        throw format_error("gguf: metadata key '" + key + "' element " + std::to_string(i) + " does not fit in i32");
    return out;
  }
  /// Arrays of f32 (or f64, narrowed).
  std::vector<float> get_f32_array(const std::string& key) const {
    const gguf_value& v = value(key);
    const auto* a = std::get_if<gguf_array>(&v.data);
    if (!a || (a->type != gguf_type::f32 && a->type != gguf_type::f64)) throw wrong_type(key, v, "array of f32");
    std::vector<float> out(static_cast<std::size_t>(a->count));
    for (std::size_t i = 0; i < out.size(); ++i)
      out[i] = a->type == gguf_type::f32 ? detail::load_le<float>(&a->raw[4 * i])
                                         : static_cast<float>(detail::load_le<double>(&a->raw[8 * i]));
    return out;
  }

  // Missing keys give the default; present keys of the wrong type still throw.
  std::uint32_t get_u32_or(const std::string& key, std::uint32_t def) const { return has(key) ? get_u32(key) : def; }
  float get_f32_or(const std::string& key, float def) const { return has(key) ? get_f32(key) : def; }
  bool get_bool_or(const std::string& key, bool def) const { return has(key) ? get_bool(key) : def; }
  std::string get_string_or(const std::string& key, const std::string& def) const {
    return has(key) ? get_string(key) : def;
  }

  const std::vector<gguf_tensor>& tensors() const { return tensors_; }
  const gguf_tensor* find_tensor(const std::string& name) const {
    const auto it = tensor_index_.find(name);
    return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
  }
  const gguf_tensor& tensor(const std::string& name) const {
    if (const gguf_tensor* t = find_tensor(name)) return *t;
    throw format_error("gguf: tensor '" + name + "' is missing");
  }

 private:
  gguf_file() = default;

  static format_error wrong_type(const std::string& key, const gguf_value& v, const char* want) {
    return format_error("gguf: metadata key '" + key + "' is " + detail::describe(v) + ", expected " + want);
  }
  template <class T>
  T get_int(const std::string& key, const char* want) const {
    const gguf_value& v = value(key);
    T out{};
    if (detail::value_to_int(v, out)) return out;
    if (!detail::is_int_type(v.type)) throw wrong_type(key, v, want);
    const auto* u = std::get_if<std::uint64_t>(&v.data);
    throw format_error("gguf: metadata key '" + key + "' = " +
                       (u ? std::to_string(*u) : std::to_string(std::get<std::int64_t>(v.data))) + " (" +
                       gguf_type_name(v.type) + ") does not fit in " + want);
  }
  const gguf_array& array_of(const std::string& key, gguf_type elem, const char* want) const {
    const gguf_value& v = value(key);
    const auto* a = std::get_if<gguf_array>(&v.data);
    if (!a || a->type != elem) throw wrong_type(key, v, want);
    return *a;
  }

  void parse_all();

  std::shared_ptr<const std::vector<std::uint8_t>> buf_;  // shared: copies keep tensor pointers valid
  std::uint32_t version_ = 0;
  std::size_t alignment_ = 32;
  std::size_t data_offset_ = 0;
  std::vector<gguf_kv> kvs_;
  std::unordered_map<std::string, std::size_t> kv_index_;
  std::vector<gguf_tensor> tensors_;
  std::unordered_map<std::string, std::size_t> tensor_index_;
};

inline void gguf_file::parse_all() {
  const std::vector<std::uint8_t>& buf = *buf_;
  detail::gguf_cursor in(buf.data(), buf.size());
  const std::uint8_t* magic = in.take(4, "magic");
  if (std::memcmp(magic, "GGUF", 4) != 0) in.fail("not a GGUF file (bad magic)");
  version_ = in.read<std::uint32_t>("version");
  // Big-endian GGUF keeps the magic bytes but stores the version byte-swapped.
  if (version_ != 0 && (version_ & 0xFFFFu) == 0)
    in.fail("the file is big-endian (byte-swapped version " + std::to_string(version_) +
            "); only little-endian GGUF is supported");
  if (version_ != 2 && version_ != 3)
    in.fail("GGUF version " + std::to_string(version_) + " is not supported (only versions 2 and 3)");
  const auto n_tensors = in.read<std::uint64_t>("tensor count");
  const auto n_kv = in.read<std::uint64_t>("key/value count");
  in.check_count(n_kv, 13, "key/value pairs");  // 8-byte key length, 4-byte type, >= 1-byte value

  for (std::uint64_t i = 0; i < n_kv; ++i) {
    in.ctx = "key/value #" + std::to_string(i);
    std::string key = in.str("key");
    in.ctx = "key '" + key + "'";
    if (has(key)) in.fail("duplicate key");
    const gguf_type t = in.value_type("value type");
    kv_index_.emplace(key, kvs_.size());
    kvs_.push_back(gguf_kv{std::move(key), in.value(t)});
  }

  if (const gguf_value* a = find("general.alignment")) {
    std::uint32_t al = 0;
    if (!detail::value_to_int(*a, al) || al == 0 || (al & (al - 1)) != 0)
      throw format_error("gguf: general.alignment (" + detail::describe(*a) + ") must be a power of two that fits in u32");
    alignment_ = al;
  }

  in.check_count(n_tensors, 32, "tensor infos");  // name length, n_dims, one dim, type, offset
  for (std::uint64_t i = 0; i < n_tensors; ++i) {
    in.ctx = "tensor info #" + std::to_string(i);
    gguf_tensor t;
    t.name = in.str("tensor name");
    in.ctx = "tensor '" + t.name + "'";
    if (find_tensor(t.name)) in.fail("duplicate tensor name");
    const auto n_dims = in.read<std::uint32_t>("n_dims");
    if (n_dims < 1 || n_dims > 4) in.fail("n_dims " + std::to_string(n_dims) + " is not in 1..4");
    std::int64_t elements = 1;
    for (std::uint32_t d = 0; d < n_dims; ++d) {
      const auto dim = in.read<std::uint64_t>("dimension");
      if (dim == 0 || dim > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max() / elements))
        in.fail("dimension " + std::to_string(d) + " = " + std::to_string(dim) +
                " is zero or makes the element count overflow");
      t.dims.push_back(static_cast<std::int64_t>(dim));
      elements *= static_cast<std::int64_t>(dim);
    }
    const auto type_id = in.read<std::uint32_t>("type");
    try {
      t.type = ggml_type_from_id(type_id, t.name);
    } catch (const format_error& e) {
      throw format_error(std::string("gguf: ") + e.what());
    }
    t.offset = in.read<std::uint64_t>("offset");
    if (t.dims[0] % block_elements(t.type) != 0)
      in.fail("row length " + std::to_string(t.dims[0]) + " is not a multiple of the " + type_name(t.type) +
              " block size " + std::to_string(block_elements(t.type)));
    tensor_index_.emplace(t.name, tensors_.size());
    tensors_.push_back(std::move(t));
  }

  // The data section starts at the next multiple of the alignment.
  const std::size_t pad = (alignment_ - in.pos() % alignment_) % alignment_;
  if (pad > in.left() && !tensors_.empty()) in.fail("truncated before the data section");
  data_offset_ = in.pos() + (pad > in.left() ? in.left() : pad);
  const std::size_t data_size = buf.size() - data_offset_;
  for (gguf_tensor& t : tensors_) {
    const std::string where = "gguf: tensor '" + t.name + "'";
    std::size_t per_row = 0;
    try {
      per_row = row_bytes(t.type, t.row_length());
    } catch (const format_error& e) {
      throw format_error(where + ": " + e.what());
    }
    if (static_cast<std::uint64_t>(t.rows()) > data_size / per_row)
      throw format_error(where + ": " + std::to_string(t.elements()) + " elements do not fit in the " +
                         std::to_string(data_size) + "-byte data section");
    t.bytes = per_row * static_cast<std::size_t>(t.rows());
    if (t.offset % alignment_ != 0)
      throw format_error(where + ": offset " + std::to_string(t.offset) + " is not a multiple of the alignment " +
                         std::to_string(alignment_));
    if (t.offset > data_size || t.bytes > data_size - t.offset)
      throw format_error(where + ": " + std::to_string(t.bytes) + " bytes at offset " + std::to_string(t.offset) +
                         " run past the end of the " + std::to_string(data_size) + "-byte data section (file byte " +
                         std::to_string(data_offset_) + " on)");
    t.data = buf.data() + data_offset_ + t.offset;
  }
}

}  // namespace tinyllm
