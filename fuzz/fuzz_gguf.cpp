// libFuzzer harness of the tinyllm example's file readers, fed hostile
// files: the GGUF reader (gguf.hpp: header, metadata of every type, nested
// arrays, tensor table, alignment, data offsets), every metadata getter,
// the model loader (llama_model.hpp: config and weights, dequantizing the
// vectors it reads) and the byte-level BPE tokenizer (tokenizer.hpp) built
// from the file's vocabulary and merges. The same bytes are also tokenized
// as text by a fixed tokenizer, whose encode/decode must be stable
// (decoding what an encoding of a decoded text gives returns that text).
//
// The readers' one exception is tinyllm::format_error; anything else (a
// crash, a sanitizer report, std::bad_alloc, std::length_error, ...) is a
// finding.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <string>
#include <string_view>
#include <vector>

#include "support/finding.hpp"
#include "tinyllm/gguf.hpp"
#include "tinyllm/llama_model.hpp"
#include "tinyllm/tokenizer.hpp"

namespace {

using kvfuzz::finding;
using kvfuzz::require;

/// Calls every getter on every key; mismatched types must be format_errors.
void read_all_metadata(const tinyllm::gguf_file& f) {
  for (const tinyllm::gguf_kv& kv : f.metadata()) {
    const std::string& k = kv.key;
    const auto attempt = [](auto get) {
      try {
        get();
      } catch (const tinyllm::format_error&) {
      }
    };
    attempt([&] { (void)f.get_u32(k); });
    attempt([&] { (void)f.get_u64(k); });
    attempt([&] { (void)f.get_i32(k); });
    attempt([&] { (void)f.get_f32(k); });
    attempt([&] { (void)f.get_bool(k); });
    attempt([&] { (void)f.get_string(k); });
    attempt([&] { (void)f.get_string_array(k); });
    attempt([&] { (void)f.get_i32_array(k); });
    attempt([&] { (void)f.get_f32_array(k); });
    (void)tinyllm::detail::describe(kv.value);
  }
}

/// Dequantizes the first and last row of every tensor the reader accepted;
/// its data must lie inside the file.
void read_all_tensors(const tinyllm::gguf_file& f) {
  const std::uint8_t* begin = f.file_bytes().data();
  const std::uint8_t* end = begin + f.file_bytes().size();
  for (const tinyllm::gguf_tensor& t : f.tensors()) {
    require(t.data >= begin && t.data + t.bytes <= end, "gguf: tensor " + t.name + " lies outside the file");
    const std::int64_t n = t.row_length(), rows = t.rows();
    if (n <= 0 || rows <= 0 || n > (1 << 16)) continue;
    std::vector<float> row(static_cast<std::size_t>(n));
    try {
      tinyllm::dequantize_row(t.type, t.row_data(0), row.data(), n);
      tinyllm::dequantize_row(t.type, t.row_data(rows - 1), row.data(), n);
    } catch (const tinyllm::format_error&) {
    }
  }
}

void load_model(const tinyllm::gguf_file& f) {
  try {
    const tinyllm::llama_config c = tinyllm::llama_config::from_gguf(f);
    (void)tinyllm::llama_weights::from_gguf(f, c);
  } catch (const tinyllm::format_error&) {
  }
}

/// decode(encode(decode(encode(text)))) == decode(encode(text)).
void check_round_trip(const tinyllm::bpe_tokenizer& tok, std::string_view text) {
  const std::string once = tok.decode(tok.encode(text));
  const std::string twice = tok.decode(tok.encode(once));
  require(once == twice, "tokenizer: decoding is not stable under a second encode/decode (" +
                             std::to_string(once.size()) + " vs " + std::to_string(twice.size()) + " bytes)");
}

void tokenize_with_file_vocabulary(const tinyllm::gguf_file& f, std::string_view text) {
  if (!f.has("tokenizer.ggml.tokens")) return;
  try {
    std::vector<std::string> merges;
    if (f.has("tokenizer.ggml.merges")) merges = f.get_string_array("tokenizer.ggml.merges");
    const tinyllm::bpe_tokenizer tok(f.get_string_array("tokenizer.ggml.tokens"), merges,
                                     tinyllm::pretokenizer_from_name(f.get_string_or("tokenizer.ggml.pre", "default")));
    const std::vector<std::int32_t> ids = tok.encode(text);
    (void)tok.decode(ids);
  } catch (const tinyllm::format_error&) {
  }
}

/// Every byte as a token, plus merges that build a few multi-byte tokens:
/// a vocabulary where every text has an encoding.
const tinyllm::bpe_tokenizer& fixed_tokenizer(tinyllm::pretokenizer pre) {
  static const auto make = [](tinyllm::pretokenizer p) {
    const auto& bl = tinyllm::tokenizer_detail::byte_level();
    std::vector<std::string> tokens;
    for (std::uint32_t b = 0; b < 256; ++b) {
      std::string s;
      tinyllm::tokenizer_detail::append_utf8(s, bl.cp_of_byte[b]);
      tokens.push_back(s);
    }
    const std::vector<std::string> merges = {"Ġ t", "h e", "Ġt he", "i n", "e r", "Ġ a", "o n", "1 2", "Ã ©"};
    for (const std::string& m : merges) tokens.push_back(m.substr(0, m.find(' ')) + m.substr(m.find(' ') + 1));
    return tinyllm::bpe_tokenizer(tokens, merges, p);
  };
  static const tinyllm::bpe_tokenizer gpt2 = make(tinyllm::pretokenizer::gpt2);
  static const tinyllm::bpe_tokenizer smollm = make(tinyllm::pretokenizer::smollm);
  return pre == tinyllm::pretokenizer::gpt2 ? gpt2 : smollm;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  try {
    const tinyllm::gguf_file f = tinyllm::gguf_file::parse(std::vector<std::uint8_t>(data, data + size));
    read_all_metadata(f);
    read_all_tensors(f);
    load_model(f);
    tokenize_with_file_vocabulary(f, text.substr(0, 256));
  } catch (const tinyllm::format_error&) {
  } catch (const std::exception& e) {
    finding(std::string("gguf: an exception outside tinyllm::format_error: ") + e.what());
  }
  try {
    check_round_trip(fixed_tokenizer(tinyllm::pretokenizer::gpt2), text);
    check_round_trip(fixed_tokenizer(tinyllm::pretokenizer::smollm), text);
  } catch (const std::exception& e) {
    finding(std::string("tokenizer: an exception on text input: ") + e.what());
  }
  return 0;
}
