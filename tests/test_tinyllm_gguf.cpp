// Tests for tinyllm's GGUF reader (tinyllm/gguf.hpp) and row dequantisation
// (tinyllm/quant.hpp).
//
// Files are built with tests/support/gguf_writer.hpp, which shares no code
// with the reader. Expected offsets are written out by hand; dequantisation is
// checked against the formulas re-implemented here on hand-built block bytes;
// F16 against an arithmetic decoder (ldexp) over all 65536 bit patterns.
// Hostile input: every prefix of a valid file and thousands of random
// mutations must give format_error (never another exception, never a crash:
// run under ASan/UBSan with -DKVEVICT_SANITIZE=ON).
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "support/gguf_writer.hpp"
#include "tinyllm/gguf.hpp"
#include "tinyllm/quant.hpp"

namespace {

using tinyllm::format_error;
using tinyllm::ggml_type;
using tinyllm::gguf_array;
using tinyllm::gguf_file;
using tinyllm::gguf_type;
namespace gw = gguf_test;

// What parse/getter throws: the format_error message, or a marker that makes
// any substring check fail.
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const format_error& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("<not a format_error: ") + e.what() + ">";
  }
  return "<no exception>";
}

#define CHECK_FORMAT_ERROR(expr, needle)                                   \
  do {                                                                     \
    const std::string msg_ = error_of([&] { (void)(expr); });              \
    INFO("message: ", msg_);                                               \
    CHECK(msg_.find(needle) != std::string::npos);                         \
    CHECK(msg_.find("<no exception>") == std::string::npos);               \
  } while (0)

gguf_file parse(const gw::writer& w) { return gguf_file::parse(w.build()); }

std::uint32_t f32_bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

std::vector<std::uint8_t> bytes_of(std::initializer_list<int> v) {
  std::vector<std::uint8_t> out;
  for (int x : v) out.push_back(static_cast<std::uint8_t>(x));
  return out;
}

// Overwrites a little-endian u64/u32 at `pos` in a built file.
void patch_u64(std::vector<std::uint8_t>& b, std::size_t pos, std::uint64_t v) {
  REQUIRE(pos + 8 <= b.size());
  for (int i = 0; i < 8; ++i) b[pos + i] = static_cast<std::uint8_t>(v >> (8 * i));
}
void patch_u32(std::vector<std::uint8_t>& b, std::size_t pos, std::uint32_t v) {
  REQUIRE(pos + 4 <= b.size());
  for (int i = 0; i < 4; ++i) b[pos + i] = static_cast<std::uint8_t>(v >> (8 * i));
}

// A small file using most features: every truncation of it must fail.
gw::writer small_model() {
  gw::writer w;
  w.add("general.architecture", gw::str("llama"))
      .add("llama.block_count", gw::u32(2))
      .add("llama.attention.layer_norm_rms_epsilon", gw::f32(1e-5f))
      .add("tokenizer.ggml.add_bos_token", gw::boolean(true))
      .add("tokenizer.ggml.tokens", gw::strings({"<s>", "a", "\xc4\xa0the"}))
      .add("tokenizer.ggml.token_type", gw::i32s({3, 1, 1}))
      .add("nested", gw::array(gw::t_array, {gw::i32s({1, 2}), gw::strings({"x"})}))
      .tensor_f32("output_norm.weight", {4}, {1.f, 2.f, 3.f, 4.f});
  std::vector<std::uint8_t> q8(2 * 34);
  for (std::size_t i = 0; i < q8.size(); ++i) q8[i] = static_cast<std::uint8_t>(i * 37 + 11);
  w.tensor("token_embd.weight", {32, 2}, gw::g_q8_0, q8);
  return w;
}

}  // namespace

// ---------------------------------------------------------------- metadata

TEST_CASE("gguf: every scalar metadata type round trips") {
  const std::string with_nul("a\0b", 3);
  gw::writer w;
  w.add("u8", gw::u8(255)).add("i8", gw::i8(-128)).add("u16", gw::u16(65535)).add("i16", gw::i16(-32768))
      .add("u32", gw::u32(0xFFFFFFFFu)).add("i32", gw::i32(std::numeric_limits<std::int32_t>::min()))
      .add("f32", gw::f32(-1.25e-3f)).add("true", gw::boolean(true)).add("false", gw::boolean(false))
      .add("str", gw::str("h\xc3\xa9llo")).add("empty", gw::str("")).add("nul", gw::str(with_nul))
      .add("u64", gw::u64(std::numeric_limits<std::uint64_t>::max()))
      .add("i64", gw::i64(std::numeric_limits<std::int64_t>::min())).add("f64", gw::f64(0.1))
      .add("i32pos", gw::i32(7)).add("u64small", gw::u64(123));
  const gguf_file f = parse(w);

  CHECK(f.version() == 3);
  CHECK(f.alignment() == 32);
  CHECK(f.tensors().empty());
  REQUIRE(f.metadata().size() == 17);
  CHECK(f.metadata()[0].key == "u8");  // file order is kept
  CHECK(f.metadata()[16].key == "u64small");

  CHECK(f.value("u8").type == gguf_type::u8);
  CHECK(std::get<std::uint64_t>(f.value("u8").data) == 255);
  CHECK(std::get<std::int64_t>(f.value("i8").data) == -128);
  CHECK(std::get<std::uint64_t>(f.value("u16").data) == 65535);
  CHECK(std::get<std::int64_t>(f.value("i16").data) == -32768);
  CHECK(f.value("i16").type == gguf_type::i16);
  CHECK(std::get<std::int64_t>(f.value("i64").data) == std::numeric_limits<std::int64_t>::min());
  CHECK(f.value("f64").type == gguf_type::f64);
  CHECK(std::get<double>(f.value("f64").data) == 0.1);
  CHECK(f.value("true").type == gguf_type::boolean);

  CHECK(f.get_u32("u8") == 255);
  CHECK(f.get_u32("u16") == 65535);
  CHECK(f.get_u32("u32") == 0xFFFFFFFFu);
  CHECK(f.get_u32("i32pos") == 7);
  CHECK(f.get_u32("u64small") == 123);
  CHECK(f.get_u64("u64") == std::numeric_limits<std::uint64_t>::max());
  CHECK(f.get_i32("i8") == -128);
  CHECK(f.get_i32("i32") == std::numeric_limits<std::int32_t>::min());
  CHECK(f32_bits(f.get_f32("f32")) == f32_bits(-1.25e-3f));  // exact, not approximately
  CHECK(f.get_f32("f64") == 0.1f);
  CHECK(f.get_bool("true") == true);
  CHECK(f.get_bool("false") == false);
  CHECK(f.get_string("str") == "h\xc3\xa9llo");
  CHECK(f.get_string("empty").empty());
  CHECK(f.get_string("nul") == with_nul);
  CHECK(f.get_string("nul").size() == 3);
}

TEST_CASE("gguf: arrays of every type, of strings, and nested arrays round trip") {
  gw::writer w;
  w.add("a_u8", gw::array(gw::t_u8, {gw::u8(0), gw::u8(255)}))
      .add("a_i8", gw::array(gw::t_i8, {gw::i8(-128), gw::i8(127)}))
      .add("a_u16", gw::array(gw::t_u16, {gw::u16(65535)}))
      .add("a_i16", gw::array(gw::t_i16, {gw::i16(-32768), gw::i16(5)}))
      .add("a_u32", gw::array(gw::t_u32, {gw::u32(1), gw::u32(0x7FFFFFFF)}))
      .add("a_u32_big", gw::array(gw::t_u32, {gw::u32(1), gw::u32(0x80000000u)}))
      .add("a_i32", gw::i32s({-1, 0, std::numeric_limits<std::int32_t>::max()}))
      .add("a_u64", gw::array(gw::t_u64, {gw::u64(42)}))
      .add("a_i64", gw::array(gw::t_i64, {gw::i64(-42), gw::i64(std::int64_t{1} << 40)}))
      .add("a_f32", gw::f32s({0.5f, -2.f, 1e-30f}))
      .add("a_f64", gw::array(gw::t_f64, {gw::f64(0.25), gw::f64(-8.0)}))
      .add("a_bool", gw::array(gw::t_bool, {gw::boolean(true), gw::boolean(false), gw::boolean(true)}))
      .add("a_str", gw::strings({"", "hello", std::string("x\0y", 3), "\xc4\xa0the"}))
      .add("a_str_empty", gw::strings({}))
      .add("a_i32_empty", gw::i32s({}))
      .add("nested_i32", gw::array(gw::t_array, {gw::i32s({1, 2}), gw::i32s({}), gw::i32s({3})}))
      .add("nested_str", gw::array(gw::t_array, {gw::strings({"a"}), gw::strings({"b", "c"})}))
      .add("nested3", gw::array(gw::t_array, {gw::array(gw::t_array, {gw::i32s({7})})}))
      .add("after", gw::u32(99));  // parsing resumes correctly after the arrays
  const gguf_file f = parse(w);

  CHECK(f.get_i32_array("a_u8") == std::vector<std::int32_t>{0, 255});
  CHECK(f.get_i32_array("a_i8") == std::vector<std::int32_t>{-128, 127});
  CHECK(f.get_i32_array("a_u16") == std::vector<std::int32_t>{65535});
  CHECK(f.get_i32_array("a_i16") == std::vector<std::int32_t>{-32768, 5});
  CHECK(f.get_i32_array("a_u32") == std::vector<std::int32_t>{1, 0x7FFFFFFF});
  CHECK_FORMAT_ERROR(f.get_i32_array("a_u32_big"), "'a_u32_big' element 1");
  CHECK_FORMAT_ERROR(f.get_i32_array("a_i64"), "'a_i64' element 1");
  CHECK(f.get_i32_array("a_i32") == std::vector<std::int32_t>{-1, 0, std::numeric_limits<std::int32_t>::max()});
  CHECK(f.get_i32_array("a_u64") == std::vector<std::int32_t>{42});
  CHECK(f.get_f32_array("a_f32") == std::vector<float>{0.5f, -2.f, 1e-30f});
  CHECK(f.get_f32_array("a_f64") == std::vector<float>{0.25f, -8.f});
  CHECK(f.get_string_array("a_str") == std::vector<std::string>{"", "hello", std::string("x\0y", 3), "\xc4\xa0the"});
  CHECK(f.get_string_array("a_str_empty").empty());
  CHECK(f.get_i32_array("a_i32_empty").empty());
  CHECK(f.get_u32("after") == 99);

  const auto& b = std::get<gguf_array>(f.value("a_bool").data);
  CHECK(b.type == gguf_type::boolean);
  CHECK(b.count == 3);
  CHECK(b.raw == bytes_of({1, 0, 1}));
  const auto& i64 = std::get<gguf_array>(f.value("a_i64").data);
  CHECK(i64.raw.size() == 16);
  CHECK(i64.raw[0] == 0xD6);  // -42 little-endian
  CHECK(i64.raw[7] == 0xFF);

  const auto& n = std::get<gguf_array>(f.value("nested_i32").data);
  CHECK(f.value("nested_i32").type == gguf_type::array);
  CHECK(n.type == gguf_type::array);
  REQUIRE(n.arrays.size() == 3);
  const auto& n0 = std::get<gguf_array>(n.arrays[0].data);
  CHECK(n0.type == gguf_type::i32);
  CHECK(n0.count == 2);
  CHECK(n0.raw == bytes_of({1, 0, 0, 0, 2, 0, 0, 0}));
  CHECK(std::get<gguf_array>(n.arrays[1].data).count == 0);
  CHECK(std::get<gguf_array>(n.arrays[2].data).raw == bytes_of({3, 0, 0, 0}));

  const auto& s = std::get<gguf_array>(f.value("nested_str").data);
  REQUIRE(s.arrays.size() == 2);
  CHECK(std::get<gguf_array>(s.arrays[1].data).strings == std::vector<std::string>{"b", "c"});

  const auto& t = std::get<gguf_array>(f.value("nested3").data);
  REQUIRE(t.arrays.size() == 1);
  const auto& t1 = std::get<gguf_array>(t.arrays[0].data);
  REQUIRE(t1.arrays.size() == 1);
  CHECK(std::get<gguf_array>(t1.arrays[0].data).raw == bytes_of({7, 0, 0, 0}));

  // Array getters check the element type.
  CHECK_FORMAT_ERROR(f.get_string_array("a_i32"), "'a_i32' is array of i32");
  CHECK_FORMAT_ERROR(f.get_i32_array("a_str"), "'a_str' is array of string");
  CHECK_FORMAT_ERROR(f.get_i32_array("a_f32"), "'a_f32'");
  CHECK_FORMAT_ERROR(f.get_i32_array("a_bool"), "'a_bool'");
  CHECK_FORMAT_ERROR(f.get_f32_array("a_i32"), "'a_i32'");
  CHECK_FORMAT_ERROR(f.get_string_array("nested_str"), "'nested_str' is array of array");
  CHECK_FORMAT_ERROR(f.get_string_array("after"), "'after' is u32");
  CHECK_FORMAT_ERROR(f.get_u32("a_u32"), "'a_u32' is array of u32");
}

TEST_CASE("gguf: getters reject missing keys and wrong types, naming the key") {
  gw::writer w;
  w.add("s", gw::str("x")).add("f", gw::f32(1.5f)).add("b", gw::boolean(true)).add("neg", gw::i32(-1))
      .add("big", gw::u64(std::uint64_t{1} << 32)).add("i64big", gw::i64(std::int64_t{1} << 40))
      .add("u", gw::u32(5)).add("arr", gw::strings({"a"}));
  const gguf_file f = parse(w);

  CHECK_FORMAT_ERROR(f.get_u32("nope"), "'nope' is missing");
  CHECK_FORMAT_ERROR(f.get_f32("nope"), "'nope' is missing");
  CHECK_FORMAT_ERROR(f.get_bool("nope"), "'nope' is missing");
  CHECK_FORMAT_ERROR(f.get_string("nope"), "'nope' is missing");
  CHECK_FORMAT_ERROR(f.get_string_array("nope"), "'nope' is missing");
  CHECK_FORMAT_ERROR(f.get_i32_array("nope"), "'nope' is missing");
  CHECK_FORMAT_ERROR(f.value("nope"), "'nope'");
  CHECK(f.find("nope") == nullptr);
  CHECK_FALSE(f.has("nope"));
  CHECK(f.has("s"));

  CHECK_FORMAT_ERROR(f.get_u32("s"), "'s' is string");
  CHECK_FORMAT_ERROR(f.get_u32("f"), "'f' is f32");
  CHECK_FORMAT_ERROR(f.get_u32("b"), "'b' is bool");
  CHECK_FORMAT_ERROR(f.get_u32("arr"), "'arr' is array of string");
  CHECK_FORMAT_ERROR(f.get_u32("neg"), "'neg' = -1");
  CHECK_FORMAT_ERROR(f.get_u32("big"), "'big' = 4294967296");
  CHECK_FORMAT_ERROR(f.get_u32("i64big"), "'i64big'");
  CHECK_FORMAT_ERROR(f.get_i32("big"), "'big'");
  CHECK_FORMAT_ERROR(f.get_f32("u"), "'u' is u32");
  CHECK_FORMAT_ERROR(f.get_f32("s"), "'s' is string");
  CHECK_FORMAT_ERROR(f.get_bool("u"), "'u' is u32");
  CHECK_FORMAT_ERROR(f.get_string("u"), "'u' is u32");
  CHECK_FORMAT_ERROR(f.get_string("arr"), "'arr' is array of string");

  // Defaults apply only to missing keys; a present key of the wrong type throws.
  CHECK(f.get_u32_or("nope", 17) == 17);
  CHECK(f.get_u32_or("u", 17) == 5);
  CHECK(f.get_f32_or("nope", 2.5f) == 2.5f);
  CHECK(f.get_f32_or("f", 2.5f) == 1.5f);
  CHECK(f.get_bool_or("nope", false) == false);
  CHECK(f.get_bool_or("b", false) == true);
  CHECK(f.get_string_or("nope", "d") == "d");
  CHECK_FORMAT_ERROR(f.get_u32_or("s", 1), "'s' is string");
  CHECK_FORMAT_ERROR(f.get_f32_or("u", 1.f), "'u' is u32");
  CHECK_FORMAT_ERROR(f.get_bool_or("u", true), "'u' is u32");
}

// ---------------------------------------------------------------- tensors

namespace {

std::vector<std::uint8_t> pattern(std::size_t n, unsigned seed) {
  std::vector<std::uint8_t> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<std::uint8_t>(i * 131 + seed * 17 + 1);
  return v;
}

struct tensor_spec {
  const char* name;
  std::vector<std::uint64_t> dims;
  std::uint32_t type;
  ggml_type ggml;
  std::size_t bytes;
};

// 20, 204, 24, 40 and 18 bytes: every tensor after the first needs padding.
const std::vector<tensor_spec>& table_specs() {
  static const std::vector<tensor_spec> specs = {
      {"a", {5}, gw::g_f32, ggml_type::f32, 20},
      {"blk.0.b.weight", {64, 3}, gw::g_q8_0, ggml_type::q8_0, 3 * 68},
      {"c", {3, 2, 2}, gw::g_f16, ggml_type::f16, 24},
      {"d", {32, 1, 1, 2}, gw::g_q4_1, ggml_type::q4_1, 40},
      {"e", {32}, gw::g_q4_0, ggml_type::q4_0, 18},
  };
  return specs;
}

void check_table(std::uint32_t alignment, bool write_key, const std::vector<std::uint64_t>& offsets) {
  gw::writer w;
  w.add("general.name", gw::str("t"));
  if (alignment != 32 || write_key) w.alignment(alignment, write_key);
  const auto& specs = table_specs();
  for (std::size_t i = 0; i < specs.size(); ++i)
    w.tensor(specs[i].name, specs[i].dims, specs[i].type, pattern(specs[i].bytes, unsigned(i)));
  const std::vector<std::uint8_t> bytes = w.build();
  const gguf_file f = gguf_file::parse(bytes);

  CHECK(f.alignment() == alignment);
  CHECK(f.data_offset() % alignment == 0);
  CHECK(f.data_offset() + offsets.back() + specs.back().bytes == bytes.size());
  REQUIRE(f.tensors().size() == specs.size());
  for (std::size_t i = 0; i < specs.size(); ++i) {
    const tinyllm::gguf_tensor& t = f.tensors()[i];
    INFO("tensor ", specs[i].name);
    CHECK(t.name == specs[i].name);
    CHECK(&f.tensor(specs[i].name) == &t);
    CHECK(f.find_tensor(specs[i].name) == &t);
    REQUIRE(t.dims.size() == specs[i].dims.size());
    for (std::size_t d = 0; d < t.dims.size(); ++d) CHECK(t.dims[d] == std::int64_t(specs[i].dims[d]));
    CHECK(t.type == specs[i].ggml);
    CHECK(t.offset == offsets[i]);
    CHECK(t.offset % alignment == 0);
    CHECK(t.bytes == specs[i].bytes);
    CHECK(t.data == f.file_bytes().data() + f.data_offset() + t.offset);
    CHECK(std::vector<std::uint8_t>(t.data, t.data + t.bytes) == pattern(specs[i].bytes, unsigned(i)));
  }
  const auto& b = f.tensor("blk.0.b.weight");
  CHECK(b.row_length() == 64);
  CHECK(b.rows() == 3);
  CHECK(b.elements() == 192);
  CHECK(b.row_stride() == 68);
  CHECK(b.row_data(2) == b.data + 136);
  CHECK(f.tensor("c").rows() == 4);
  CHECK(f.tensor("d").rows() == 2);
  CHECK(f.tensor("d").row_stride() == 20);
  CHECK(f.find_tensor("missing") == nullptr);
  CHECK_FORMAT_ERROR(f.tensor("missing"), "'missing'");
}

}  // namespace

TEST_CASE("gguf: tensor table with the default alignment 32") {
  check_table(32, false, {0, 32, 256, 288, 352});
  check_table(32, true, {0, 32, 256, 288, 352});  // explicit general.alignment = 32
}

TEST_CASE("gguf: tensor table with custom alignments") {
  check_table(64, true, {0, 64, 320, 384, 448});
  check_table(1, true, {0, 20, 224, 248, 288});
  check_table(8, true, {0, 24, 232, 256, 296});
  check_table(4096, true, {0, 4096, 8192, 12288, 16384});
}

TEST_CASE("gguf: version 2 is read like version 3, and copies keep tensor data valid") {
  gw::writer w = small_model();
  w.version(2);
  std::vector<gguf_file> copies;
  {
    const gguf_file f = parse(w);
    CHECK(f.version() == 2);
    CHECK(f.get_string("general.architecture") == "llama");
    CHECK(f.get_string_array("tokenizer.ggml.tokens").size() == 3);
    copies.push_back(f);
  }
  const tinyllm::gguf_tensor& t = copies[0].tensor("output_norm.weight");
  float v[4];
  tinyllm::dequantize_row(t.type, t.data, v, 4);  // the original is gone; the buffer is shared
  CHECK(v[3] == 4.f);
}

TEST_CASE("gguf: load() reads a file and names the path in errors") {
  const auto dir = std::filesystem::temp_directory_path();
  const std::string good = (dir / "tinyllm_test_gguf_good.gguf").string();
  const std::string bad = (dir / "tinyllm_test_gguf_bad.gguf").string();
  small_model().write_file(good);
  {
    std::vector<std::uint8_t> b = small_model().build();
    b.resize(b.size() - 1);
    std::FILE* fp = std::fopen(bad.c_str(), "wb");
    REQUIRE(fp != nullptr);
    std::fwrite(b.data(), 1, b.size(), fp);
    std::fclose(fp);
  }
  const gguf_file f = gguf_file::load(good);
  CHECK(f.tensors().size() == 2);
  CHECK(f.get_u32("llama.block_count") == 2);
  CHECK_FORMAT_ERROR(gguf_file::load(bad), bad + ": gguf: tensor 'token_embd.weight'");
  const std::string missing = (dir / "tinyllm_test_gguf_missing.gguf").string();
  CHECK_FORMAT_ERROR(gguf_file::load(missing), missing);
  CHECK_FORMAT_ERROR(gguf_file::load(dir.string()), dir.string());  // a directory
  std::filesystem::remove(good);
  std::filesystem::remove(bad);
}

// ---------------------------------------------------------------- hostile input

TEST_CASE("gguf: header errors") {
  std::vector<std::uint8_t> b = small_model().build();
  CHECK_FORMAT_ERROR(gguf_file::parse({}), "truncated magic");
  auto bad_magic = b;
  bad_magic[0] = 'X';
  CHECK_FORMAT_ERROR(gguf_file::parse(bad_magic), "bad magic");
  CHECK_FORMAT_ERROR(gguf_file::parse(bytes_of({'G', 'G', 'M', 'L', 3, 0, 0, 0})), "bad magic");
  for (std::uint32_t v : {0u, 1u, 4u, 0xFFFFFFFFu}) {
    auto bv = b;
    patch_u32(bv, 4, v);
    CHECK_FORMAT_ERROR(gguf_file::parse(bv), "GGUF version " + std::to_string(v) + " is not supported");
  }
  for (std::uint32_t v : {0x02000000u, 0x03000000u}) {  // a big-endian v2/v3 file
    auto bv = b;
    patch_u32(bv, 4, v);
    CHECK_FORMAT_ERROR(gguf_file::parse(bv), "big-endian");
  }
  auto many_kv = b;
  patch_u64(many_kv, 16, std::uint64_t{1} << 60);
  CHECK_FORMAT_ERROR(gguf_file::parse(many_kv), "key/value pairs cannot fit");
  auto many_tensors = b;
  patch_u64(many_tensors, 8, ~std::uint64_t{0});
  CHECK_FORMAT_ERROR(gguf_file::parse(many_tensors), "tensor infos cannot fit");
}

TEST_CASE("gguf: every truncation of a valid file throws format_error") {
  const std::vector<std::uint8_t> b = small_model().build();
  REQUIRE_NOTHROW(gguf_file::parse(b));
  for (std::size_t n = 0; n < b.size(); ++n) {
    INFO("prefix of ", n, " bytes out of ", b.size());
    const std::string msg = error_of([&] { gguf_file::parse(std::vector<std::uint8_t>(b.begin(), b.begin() + n)); });
    CHECK(msg.rfind("gguf: ", 0) == 0);  // a format_error from the reader, not "<no exception>"
  }
}

TEST_CASE("gguf: metadata value errors") {
  CHECK_FORMAT_ERROR(parse(gw::writer().add("k", gw::u32(1)).add("k", gw::u32(2))), "key 'k': duplicate key");
  CHECK_FORMAT_ERROR(parse(gw::writer().add("weird", gw::value{13, {0, 0, 0, 0}})), "key 'weird': unknown value type 13");
  CHECK_FORMAT_ERROR(parse(gw::writer().add("b", gw::value{gw::t_bool, {2}})), "key 'b': bool value 2");
  CHECK_FORMAT_ERROR(parse(gw::writer().add("a", gw::array(gw::t_bool, {gw::boolean(true), gw::value{gw::t_bool, {7}}}))),
                     "key 'a': bool value 7");
  CHECK_FORMAT_ERROR(parse(gw::writer().add("a", gw::array(77, {}))), "key 'a': unknown value type 77");

  // Lengths and counts far beyond the file are rejected before allocating.
  gw::value long_str{gw::t_string, {}};
  gw::detail::put<std::uint64_t>(long_str.bytes, std::uint64_t{1} << 62);
  CHECK_FORMAT_ERROR(parse(gw::writer().add("s", long_str)), "key 's': truncated string");
  for (std::uint32_t elem : {gw::t_u8, gw::t_f64, gw::t_string, gw::t_array}) {
    gw::value huge{gw::t_array, {}};
    gw::detail::put<std::uint32_t>(huge.bytes, elem);
    gw::detail::put<std::uint64_t>(huge.bytes, ~std::uint64_t{0} / 2);
    CHECK_FORMAT_ERROR(parse(gw::writer().add("h", huge)), "key 'h': 9223372036854775807 array elements cannot fit");
  }

  // Nesting is bounded (8 levels are fine, 9 are not).
  gw::value v = gw::i32s({1});
  for (int depth = 1; depth < 8; ++depth) v = gw::array(gw::t_array, {v});
  CHECK_NOTHROW(parse(gw::writer().add("deep", v)));
  v = gw::array(gw::t_array, {v});
  CHECK_FORMAT_ERROR(parse(gw::writer().add("deep", v)), "key 'deep': arrays nested more than 8 deep");

  CHECK_FORMAT_ERROR(parse(gw::writer().alignment(48)), "general.alignment (u32) must be a power of two");
  CHECK_FORMAT_ERROR(parse(gw::writer().add("general.alignment", gw::u32(0))), "general.alignment");
  CHECK_FORMAT_ERROR(parse(gw::writer().add("general.alignment", gw::str("32"))), "general.alignment (string)");
  CHECK_FORMAT_ERROR(parse(gw::writer().add("general.alignment", gw::i32(-32))), "general.alignment");
}

TEST_CASE("gguf: tensor info errors name the tensor") {
  const auto one = [](const std::vector<std::uint64_t>& dims, std::uint32_t type, std::size_t bytes) {
    gw::writer w;
    w.tensor("blk.3.ffn_up.weight", dims, type, std::vector<std::uint8_t>(bytes));
    return w;
  };
  CHECK_NOTHROW(parse(one({32, 2}, gw::g_q4_1, 40)));
  CHECK_FORMAT_ERROR(parse(one({256}, 14, 210)), "tensor 'blk.3.ffn_up.weight' has ggml type 14 (q6_K), which is not supported");
  CHECK_FORMAT_ERROR(parse(one({32}, 6, 22)), "ggml type 6 (q5_0)");
  CHECK_FORMAT_ERROR(parse(one({32}, 1000, 22)), "ggml type 1000 (unknown)");
  CHECK_FORMAT_ERROR(parse(one({16}, gw::g_q4_0, 18)), "tensor 'blk.3.ffn_up.weight': row length 16 is not a multiple of the q4_0 block size 32");
  CHECK_FORMAT_ERROR(parse(one({33, 2}, gw::g_q8_0, 68)), "row length 33");
  CHECK_FORMAT_ERROR(parse(one({}, gw::g_f32, 4)), "tensor 'blk.3.ffn_up.weight': n_dims 0");
  CHECK_FORMAT_ERROR(parse(one({1, 1, 1, 1, 1}, gw::g_f32, 4)), "n_dims 5");
  CHECK_FORMAT_ERROR(parse(one({4, 0}, gw::g_f32, 0)), "tensor 'blk.3.ffn_up.weight': dimension 1 = 0");
  CHECK_FORMAT_ERROR(parse(one({std::uint64_t{1} << 32, std::uint64_t{1} << 32}, gw::g_f32, 4)), "dimension 1 = 4294967296");
  CHECK_FORMAT_ERROR(parse(one({~std::uint64_t{0}}, gw::g_f32, 4)), "dimension 0");
  // Element counts that fit in int64 but not in the file (or in size_t).
  CHECK_FORMAT_ERROR(parse(one({std::uint64_t{1} << 40}, gw::g_f32, 4)), "tensor 'blk.3.ffn_up.weight'");
  CHECK_FORMAT_ERROR(parse(one({std::uint64_t{1} << 62}, gw::g_f32, 4)), "tensor 'blk.3.ffn_up.weight'");
  CHECK_FORMAT_ERROR(parse(one({4, std::uint64_t{1} << 61}, gw::g_f32, 4)), "tensor 'blk.3.ffn_up.weight'");

  gw::writer dup;
  dup.tensor_f32("x", {1}, {1.f}).tensor_f32("x", {1}, {2.f});
  CHECK_FORMAT_ERROR(parse(dup), "tensor 'x': duplicate tensor name");
}

TEST_CASE("gguf: tensor offsets must be aligned and inside the file") {
  const auto with_offset = [](std::uint64_t off, std::uint32_t alignment = 32) {
    gw::writer w;
    w.alignment(alignment).tensor_f32("first", {8}, std::vector<float>(8, 1.f));
    w.tensor_f32("second", {8}, std::vector<float>(8, 2.f)).override_offset(off);
    return gguf_file::parse(w.build());
  };
  CHECK(with_offset(32).tensor("second").offset == 32);
  {
    const gguf_file f = with_offset(0);  // overlapping tensors are allowed
    CHECK(f.tensor("second").data == f.tensor("first").data);
  }
  CHECK_FORMAT_ERROR(with_offset(4), "tensor 'second': offset 4 is not a multiple of the alignment 32");
  CHECK_FORMAT_ERROR(with_offset(32, 64), "tensor 'second': offset 32 is not a multiple of the alignment 64");
  CHECK_FORMAT_ERROR(with_offset(64), "tensor 'second': 32 bytes at offset 64 run past the end");
  CHECK_FORMAT_ERROR(with_offset(1u << 20), "tensor 'second'");
  CHECK_FORMAT_ERROR(with_offset(~std::uint64_t{31}), "tensor 'second'");  // offset + bytes overflows
  // The data section is missing entirely.
  std::vector<std::uint8_t> b = small_model().build();
  const gguf_file f = gguf_file::parse(b);
  b.resize(f.data_offset() - 1);
  CHECK_FORMAT_ERROR(gguf_file::parse(b), "truncated before the data section");
}

TEST_CASE("gguf: random mutations give format_error or a consistent file") {
  const std::vector<std::uint8_t> base = small_model().build();
  std::mt19937 rng(12345);
  int parsed = 0, rejected = 0;
  for (int iter = 0; iter < 4000; ++iter) {
    std::vector<std::uint8_t> b = base;
    const int edits = 1 + int(rng() % 4);
    for (int e = 0; e < edits; ++e) {
      const std::size_t pos = rng() % b.size();
      // Mostly small changes to lengths/counts/types, sometimes a random byte.
      b[pos] = (rng() % 2) ? static_cast<std::uint8_t>(rng()) : static_cast<std::uint8_t>(b[pos] ^ (1u << (rng() % 8)));
    }
    if (rng() % 8 == 0) b.resize(rng() % b.size());
    const std::uint8_t* lo = nullptr;
    const std::uint8_t* hi = nullptr;
    std::string msg = error_of([&] {
      const gguf_file f = gguf_file::parse(b);
      lo = f.file_bytes().data();
      hi = lo + f.file_bytes().size();
      for (const auto& t : f.tensors()) {
        // Each accepted tensor lies inside the file and decodes without UB.
        CHECK(t.data >= lo + f.data_offset());
        CHECK(t.data + t.bytes <= hi);
        std::vector<float> row(static_cast<std::size_t>(t.row_length()));
        for (std::int64_t r = 0; r < t.rows(); ++r) tinyllm::dequantize_row(t.type, t.row_data(r), row.data(), t.row_length());
      }
    });
    if (msg == "<no exception>") {
      ++parsed;
    } else {
      INFO("iteration ", iter, ": ", msg);
      CHECK(msg.rfind("gguf: ", 0) == 0);
      ++rejected;
    }
  }
  CHECK(parsed > 100);  // the mutations exercise both outcomes
  CHECK(rejected > 100);
}

// ---------------------------------------------------------------- dequantisation

TEST_CASE("quant: type table and row_bytes") {
  static_assert(sizeof(tinyllm::block_q4_0) == 18 && sizeof(tinyllm::block_q4_1) == 20 &&
                sizeof(tinyllm::block_q8_0) == 34);
  const ggml_type all[] = {ggml_type::f32, ggml_type::f16, ggml_type::q4_0, ggml_type::q4_1, ggml_type::q8_0};
  const char* names[] = {"f32", "f16", "q4_0", "q4_1", "q8_0"};
  const std::int64_t elems[] = {1, 1, 32, 32, 32};
  const std::size_t bytes[] = {4, 2, 18, 20, 34};
  const std::uint32_t ids[] = {0, 1, 2, 3, 8};
  for (int i = 0; i < 5; ++i) {
    CHECK(std::string(tinyllm::type_name(all[i])) == names[i]);
    CHECK(tinyllm::block_elements(all[i]) == elems[i]);
    CHECK(tinyllm::block_bytes(all[i]) == bytes[i]);
    CHECK(static_cast<std::uint32_t>(all[i]) == ids[i]);
    CHECK(tinyllm::ggml_type_from_id(ids[i], "t") == all[i]);
  }
  const auto bogus = static_cast<ggml_type>(14);
  CHECK(std::string(tinyllm::type_name(bogus)) == "unknown");
  CHECK_FORMAT_ERROR(tinyllm::block_bytes(bogus), "14");
  CHECK_FORMAT_ERROR(tinyllm::block_elements(bogus), "14");
  CHECK_FORMAT_ERROR(tinyllm::row_bytes(bogus, 32), "14");
  CHECK_FORMAT_ERROR(tinyllm::ggml_type_from_id(4, "w"), "tensor 'w' has ggml type 4 (q4_2 (removed))");

  CHECK(tinyllm::row_bytes(ggml_type::f32, 5) == 20);
  CHECK(tinyllm::row_bytes(ggml_type::f16, 3) == 6);
  CHECK(tinyllm::row_bytes(ggml_type::q4_0, 64) == 36);
  CHECK(tinyllm::row_bytes(ggml_type::q4_1, 32) == 20);
  CHECK(tinyllm::row_bytes(ggml_type::q8_0, 96) == 102);
  CHECK(tinyllm::row_bytes(ggml_type::q8_0, 0) == 0);
  CHECK_FORMAT_ERROR(tinyllm::row_bytes(ggml_type::q4_0, 16), "a row of 16 q4_0 elements is not a whole number of blocks of 32");
  CHECK_FORMAT_ERROR(tinyllm::row_bytes(ggml_type::q4_1, 33), "33");
  CHECK_FORMAT_ERROR(tinyllm::row_bytes(ggml_type::q8_0, 31), "31");
  CHECK_FORMAT_ERROR(tinyllm::row_bytes(ggml_type::f32, -1), "-1");
  CHECK_FORMAT_ERROR(tinyllm::row_bytes(ggml_type::f32, std::numeric_limits<std::int64_t>::max()), "does not fit");
  float out[32];
  const std::uint8_t zeros[34] = {};
  CHECK_FORMAT_ERROR(tinyllm::dequantize_row(ggml_type::q8_0, zeros, out, 16), "16");
  CHECK_FORMAT_ERROR(tinyllm::dequantize_row(bogus, zeros, out, 1), "14");
}

TEST_CASE("quant: f32 rows are copied bit for bit from unaligned data") {
  const float in[] = {1.f, -0.f, std::numeric_limits<float>::infinity(), std::numeric_limits<float>::denorm_min(),
                      -3.4e38f, std::numeric_limits<float>::quiet_NaN()};
  std::vector<std::uint8_t> buf(1 + sizeof in);
  std::memcpy(buf.data() + 1, in, sizeof in);
  float out[6];
  tinyllm::dequantize_row(ggml_type::f32, buf.data() + 1, out, 6);
  for (int i = 0; i < 6; ++i) CHECK(f32_bits(out[i]) == f32_bits(in[i]));
}

TEST_CASE("quant: f16 rows decode all 65536 bit patterns") {
  std::vector<std::uint8_t> buf(1 + 2 * 65536);  // odd start: unaligned
  for (std::uint32_t h = 0; h < 65536; ++h) {
    buf[1 + 2 * h] = static_cast<std::uint8_t>(h & 0xFF);
    buf[2 + 2 * h] = static_cast<std::uint8_t>(h >> 8);
  }
  std::vector<float> out(65536);
  tinyllm::dequantize_row(ggml_type::f16, buf.data() + 1, out.data(), 65536);
  int bad = 0;
  for (std::uint32_t h = 0; h < 65536; ++h) {
    const int sign = (h >> 15) ? -1 : 1;
    const int e = int((h >> 10) & 31);
    const int m = int(h & 1023);
    const float x = out[h];
    bool ok;
    if (e == 31) {
      ok = m == 0 ? (std::isinf(x) && std::signbit(x) == (sign < 0)) : std::isnan(x);
    } else {
      const double ref = e == 0 ? sign * std::ldexp(double(m), -24) : sign * std::ldexp(1.0 + m / 1024.0, e - 15);
      ok = double(x) == ref && std::signbit(x) == (sign < 0);
    }
    if (!ok && ++bad <= 5) {
      INFO("f16 bits ", h, " decoded to ", x);
      CHECK(ok);
    }
  }
  CHECK(bad == 0);
}

namespace {

// Blocks written byte by byte (little-endian half, then the quants), not
// through the library's block structs.
void put_half(std::vector<std::uint8_t>& out, std::uint16_t bits) {
  out.push_back(static_cast<std::uint8_t>(bits & 0xFF));
  out.push_back(static_cast<std::uint8_t>(bits >> 8));
}

// Half bit patterns of exactly representable values.
constexpr std::uint16_t h_0_5 = 0x3800, h_neg_0_25 = 0xB400, h_3 = 0x4200, h_1_5 = 0x3E00, h_neg_1 = 0xBC00,
                        h_0_125 = 0x3000, h_2 = 0x4000, h_neg_0_75 = 0xBA00;

// 16 bytes whose low nibbles run through 0..15 and high nibbles through
// every value too (in another order), shifted per block.
std::vector<std::uint8_t> nibble_bytes(int block) {
  std::vector<std::uint8_t> qs(16);
  for (int j = 0; j < 16; ++j) qs[j] = static_cast<std::uint8_t>(((j + block) & 15) | (((15 - j + 5 * block) & 15) << 4));
  return qs;
}

std::vector<float> decode(ggml_type t, const std::vector<std::uint8_t>& blocks, std::int64_t n) {
  std::vector<std::uint8_t> buf(1 + blocks.size());  // odd start: unaligned
  std::memcpy(buf.data() + 1, blocks.data(), blocks.size());
  std::vector<float> out(static_cast<std::size_t>(n), -999.f);
  tinyllm::dequantize_row(t, buf.data() + 1, out.data(), n);
  return out;
}

}  // namespace

TEST_CASE("quant: q4_0 rows") {
  const float d[] = {0.5f, -0.25f, 3.f};
  const std::uint16_t dh[] = {h_0_5, h_neg_0_25, h_3};
  std::vector<std::uint8_t> blocks;
  std::vector<float> want;
  for (int b = 0; b < 3; ++b) {
    put_half(blocks, dh[b]);
    const auto qs = nibble_bytes(b);
    blocks.insert(blocks.end(), qs.begin(), qs.end());
    std::vector<float> x(32);
    for (int j = 0; j < 16; ++j) {
      x[j] = float((qs[j] & 15) - 8) * d[b];
      x[j + 16] = float((qs[j] >> 4) - 8) * d[b];
    }
    want.insert(want.end(), x.begin(), x.end());
  }
  REQUIRE(blocks.size() == 3 * 18);
  const std::vector<float> got = decode(ggml_type::q4_0, blocks, 96);
  CHECK(got == want);
  CHECK(got[0] == -4.f);    // block 0, nibble 0: (0 - 8) * 0.5
  CHECK(got[16] == 3.5f);   // block 0, high nibble 15: (15 - 8) * 0.5
  CHECK(got[32] == 1.75f);  // block 1, nibble 1: (1 - 8) * -0.25
  CHECK(got[64 + 6] == 0.f);  // block 2, nibble 8
}

TEST_CASE("quant: q4_1 rows") {
  const float d[] = {0.5f, -0.25f, 1.5f};
  const float m[] = {-1.f, 0.125f, 2.f};
  const std::uint16_t dh[] = {h_0_5, h_neg_0_25, h_1_5};
  const std::uint16_t mh[] = {h_neg_1, h_0_125, h_2};
  std::vector<std::uint8_t> blocks;
  std::vector<float> want;
  for (int b = 0; b < 3; ++b) {
    put_half(blocks, dh[b]);
    put_half(blocks, mh[b]);
    const auto qs = nibble_bytes(b);
    blocks.insert(blocks.end(), qs.begin(), qs.end());
    std::vector<float> x(32);
    for (int j = 0; j < 16; ++j) {
      x[j] = float(qs[j] & 15) * d[b] + m[b];
      x[j + 16] = float(qs[j] >> 4) * d[b] + m[b];
    }
    want.insert(want.end(), x.begin(), x.end());
  }
  REQUIRE(blocks.size() == 3 * 20);
  const std::vector<float> got = decode(ggml_type::q4_1, blocks, 96);
  CHECK(got == want);
  CHECK(got[0] == -1.f);         // 0 * 0.5 - 1
  CHECK(got[16] == 6.5f);        // 15 * 0.5 - 1
  CHECK(got[32] == -0.125f);     // 1 * -0.25 + 0.125
  CHECK(got[64 + 13] == 24.5f);  // 15 * 1.5 + 2
}

TEST_CASE("quant: q8_0 rows") {
  const float d[] = {0.5f, -0.75f, 2.f};
  const std::uint16_t dh[] = {h_0_5, h_neg_0_75, h_2};
  std::vector<std::uint8_t> blocks;
  std::vector<float> want;
  for (int b = 0; b < 3; ++b) {
    put_half(blocks, dh[b]);
    for (int j = 0; j < 32; ++j) {
      int q = (j * 37 + b * 11) % 256 - 128;  // spread over the range
      if (j == 0) q = -128;
      if (j == 1) q = 127;
      if (j == 2) q = -1;
      if (j == 3) q = 0;
      blocks.push_back(static_cast<std::uint8_t>(q & 0xFF));  // two's complement byte
      want.push_back(float(q) * d[b]);
    }
  }
  REQUIRE(blocks.size() == 3 * 34);
  const std::vector<float> got = decode(ggml_type::q8_0, blocks, 96);
  CHECK(got == want);
  CHECK(got[0] == -64.f);
  CHECK(got[1] == 63.5f);
  CHECK(got[32] == 96.f);  // -128 * -0.75
  CHECK(got[33] == -95.25f);
  CHECK(got[66] == -2.f);
}

TEST_CASE("quant: rows of a parsed tensor decode through row_data") {
  std::vector<std::uint8_t> q;  // two q8_0 rows of 64: row r, block b has d = 0.5, quants r*64 + b*32 + j - 64
  for (int r = 0; r < 2; ++r)
    for (int b = 0; b < 2; ++b) {
      put_half(q, h_0_5);
      for (int j = 0; j < 32; ++j) q.push_back(static_cast<std::uint8_t>((r * 64 + b * 32 + j - 64) & 0xFF));
    }
  gw::writer w;
  w.tensor("w", {64, 2}, gw::g_q8_0, q);
  const gguf_file f = parse(w);
  const auto& t = f.tensor("w");
  std::vector<float> row(64);
  for (int r = 0; r < 2; ++r) {
    tinyllm::dequantize_row(t.type, t.row_data(r), row.data(), t.row_length());
    for (int i = 0; i < 64; ++i) CHECK(row[i] == float(r * 64 + i - 64) * 0.5f);
  }
}
